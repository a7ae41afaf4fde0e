"""``barrier`` and ``join``.

A rank inside :func:`join` keeps taking part in the global set's cycles
(:mod:`._cycles`) as "joined", and in every allreduce the working
ranks agree on with zeros, until every rank has joined.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist

from . import _basics
from ._exceptions import HorovodInternalError
from ._handles import complete, mark, name_of, submit
from ._headers import Call
from ._negotiation import exchange_joined, schedule
from ._process_sets import ProcessSet, global_process_set, resolve

__all__ = ["barrier", "join"]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of the set has entered it."""
    process_set = resolve(process_set)
    name = name_of("barrier", None)
    mark(name, "BARRIER", "negotiate")
    if len(process_set.ranks) == 1:
        mark(name, "BARRIER", "done")
        return
    issue = lambda: [dist.barrier(group=process_set.group, async_op=True)]  # noqa: E731
    call = Call("barrier", name, False, process_set)
    complete(schedule(call, lambda _: submit(name, "BARRIER", issue, lambda: None)))


_join_rounds = itertools.count()


def join(device: int = -1) -> int:
    """Says this rank has finished its work; returns the rank that finished last.

    Every rank of the job calls it. Until every rank has, the ranks inside
    ``join()`` take part in the allreduces (and grouped allreduces) the
    others still run on the global set, with zeros, as in Horovod: a sum
    is the sum over the ranks still working, an average that sum divided
    by the job's size, Adasum that of the working ranks (a zero vector
    changes nothing), Min/Max/Product include the zeros. Any other
    operation on the global set raises :class:`HorovodInternalError` on the
    working ranks while a rank has joined; operations on other process sets
    cannot see the joined ranks and must not include them.

    Args:
        device: accepted for Horovod's signature; unused.

    Returns:
        The global rank that joined last, on every rank.
    """
    _basics.check_initialized()
    name = f"join.{next(_join_rounds)}"
    mark(name, "JOIN", "negotiate")
    size = _basics.size()
    if size == 1:
        mark(name, "JOIN", "done")
        return 0
    store = dist.distributed_c10d._get_default_store()
    key = f"tiacc_training/horovod/{name}"
    mark(name, "JOIN", "queue")
    arrived = store.add(f"{key}/count", 1)
    if arrived == size:
        store.set(f"{key}/last", str(_basics.rank()))
    mark(name, "JOIN", "communicate")
    exchange_joined()
    try:
        last = int(store.get(f"{key}/last"))
    except RuntimeError as error:
        raise HorovodInternalError(f"join: not every rank joined in time ({error})") from error
    mark(name, "JOIN", "done")
    return last

"""Process sets: collectives among a subset of the ranks.

A :class:`ProcessSet` is a list of global ranks; registering it
(``add_process_set`` in :mod:`._set_changes`, or
``hvd.init(process_sets=[...])``) creates a
torch.distributed group of those ranks with ``dist.new_group``, so its CPU
collectives run on the "tiacc" backend's engine of that group and its CUDA
collectives on an NCCL communicator of its own. As in Horovod, every rank of
the job registers and removes every set, in the same order (the group's
creation is collective), including ranks outside the set.

Before a set is registered the ranks compare what they were asked to add
(:mod:`._set_changes`), so a refusal (a rank out of range, a set already
registered) or ranks that name different sets raise ``ValueError`` on
every rank and leave nothing registered anywhere.

``HOROVOD_DYNAMIC_PROCESS_SETS``: Horovod only lets sets be added or
removed after ``init()`` with that variable set. Here groups can be made and
destroyed at any time, so sets can always be added and removed after
``init()``; the variable is accepted and changes nothing.

Root ranks (``broadcast(root_rank=...)``) are global ranks, as in Horovod;
:meth:`ProcessSet.rank` is the rank within the set. ``hvd.join()`` concerns
the global set: ranks inside it serve the global set's allreduces only, so
an operation on another set must not include a rank that has joined.

The small exchange of integers among a set's ranks (:func:`gather_ints`,
or :func:`start_gather_ints` to wait later, on the device
:func:`small_device` picks) lives here too: the cycles that match every
operation across ranks use it (:mod:`._cycles`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _basics
from ._exceptions import as_ours, wait

__all__ = ["ProcessSet", "global_process_set", "remove_process_set"]

_lock = threading.RLock()


class ProcessSet:
    """A set of ranks that run collectives among themselves.

    Args:
        ranks: the global ranks of the set (any order; kept sorted).

    Attributes:
        ranks: the set's global ranks, sorted.
        process_set_id: its id once registered (0 is the global set), else ``None``.

    Raises:
        ValueError: ``ranks`` repeats a rank or holds a negative number.
        TypeError: ``ranks`` is not a sequence of integers (an MPI communicator).
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        if not isinstance(ranks, (list, tuple, range)):
            raise TypeError(
                f"ProcessSet(ranks=...) takes a list of ranks, not {type(ranks).__name__} "
                "(MPI communicators are not supported)"
            )
        values = [int(r) for r in ranks]
        if len(set(values)) != len(values):
            raise ValueError(f"ProcessSet(ranks={list(ranks)}) repeats a rank")
        if any(r < 0 for r in values):
            raise ValueError(f"ProcessSet(ranks={list(ranks)}) holds a negative rank")
        self.ranks: list[int] = sorted(values)
        self.process_set_id: int | None = None
        self.group: Any = None

    def _registered(self) -> bool:
        return self.process_set_id is not None and _basics.is_initialized()

    def size(self) -> int | None:
        """The number of ranks in the set; ``None`` before it is registered."""
        if not self._registered():
            return None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set.

        Returns:
            The index of ``hvd.rank()`` in :attr:`ranks`, ``-1`` when this
            process is not in the set, ``None`` before it is registered.
        """
        if not self._registered():
            return None
        me = _basics.rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool | None:
        """Whether this process is in the set; ``None`` before it is registered."""
        if not self._registered():
            return None
        return _basics.rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

# Registered sets by id (the global set included once initialised).
_sets: dict[int, ProcessSet] = {}
_next_id = 1


def reset_global(ranks: list[int]) -> None:
    """``init()``: the global set holds every rank, on the default group."""
    global _next_id
    with _lock:
        global_process_set.ranks = ranks
        global_process_set.group = dist.GroupMember.WORLD
        _sets.clear()
        _sets[0] = global_process_set
        _next_id = 1


def register(process_set: ProcessSet, world: int) -> None:
    """Gives ``process_set`` its group and the next id (the ranks agreed on it already)."""
    global _next_id
    with _lock:
        if process_set.ranks == list(range(world)):
            group = dist.GroupMember.WORLD
        else:
            group = dist.new_group(process_set.ranks)
        process_set.group = group
        process_set.process_set_id = _next_id
        _sets[_next_id] = process_set
        _next_id += 1


def refusal_of(process_set: ProcessSet, world: int) -> ValueError | None:
    """Why this rank cannot add ``process_set``, or ``None``."""
    with _lock:
        if process_set.process_set_id is not None and process_set.process_set_id in _sets:
            return ValueError(f"{process_set} is already registered")
        if not process_set.ranks:
            return ValueError("a process set needs at least one rank")
        bad = [r for r in process_set.ranks if r >= world]
        if bad:
            return ValueError(
                f"process set ranks {bad} are not below the job's size {world} "
                f"(ranks {process_set.ranks})"
            )
        for other in _sets.values():
            if other.ranks == process_set.ranks:
                return ValueError(
                    f"a process set with ranks {process_set.ranks} is already registered "
                    f"(id {other.process_set_id})"
                )
    return None


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes a registered set and its group; every rank calls it.

    Args:
        process_set: the set to remove.

    Returns:
        Whether it was removed (``False`` for the global set or a set that
        is not registered).
    """
    _basics.check_initialized()
    with _lock:
        if process_set is global_process_set or process_set.process_set_id in (None, 0):
            return False
        if _sets.get(process_set.process_set_id) is not process_set:
            return False
        del _sets[process_set.process_set_id]
        _destroy(process_set)
        return True


def _destroy(process_set: ProcessSet) -> None:
    group = process_set.group
    process_set.group = None
    process_set.process_set_id = None
    member = group not in (None, dist.GroupMember.WORLD, dist.GroupMember.NON_GROUP_MEMBER)
    if member and dist.is_initialized():
        dist.destroy_process_group(group)


def remove_all() -> None:
    """``shutdown()``: every set but the global one removed, their groups destroyed."""
    with _lock:
        for set_id, process_set in sorted(_sets.items()):
            if set_id != 0:
                _destroy(process_set)
        _sets.clear()
        global_process_set.group = None


def resolve(process_set: ProcessSet | None) -> ProcessSet:
    """The registered set an op runs on, checked for this rank.

    Args:
        process_set: the op's ``process_set=`` (``None``: the global set).

    Returns:
        The set, registered and holding this rank.

    Raises:
        ValueError: Horovod is not initialised, the set is not registered,
            or this rank is not in it.
    """
    _basics.check_initialized()
    if process_set is None:
        return global_process_set
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, not {type(process_set).__name__}")
    if process_set.process_set_id is None or _sets.get(process_set.process_set_id) is not (
        process_set
    ):
        raise ValueError(f"{process_set} is not registered: call hvd.add_process_set() first")
    me = _basics.rank()
    if me not in process_set.ranks:
        raise ValueError(
            f"rank {me} is not in the process set {process_set.ranks} "
            f"(id {process_set.process_set_id}): only its ranks may run its collectives"
        )
    return process_set


def small_device(process_set: ProcessSet, like: torch.Tensor | None = None) -> torch.device:
    """Where small control tensors of this set go: the CPU unless the group has none."""
    try:
        backend = str(dist.get_backend(process_set.group))
    except Exception:
        return torch.device("cpu")
    text = backend.strip().lower()
    if text != "nccl" and (":" not in text or "cpu:" in text):  # a group with a CPU backend
        return torch.device("cpu")
    if like is not None and like.is_cuda:
        return like.device
    return torch.device("cuda", torch.cuda.current_device())


@dataclass
class Gathering:
    """An allgather of every rank's integers, issued; :meth:`rows` waits for it."""

    work: Any
    out: torch.Tensor
    shape: tuple[int, int]
    what: str

    def rows(self) -> list[list[int]]:
        """Every rank's values, in set order.

        Raises:
            HorovodInternalError: the exchange failed (a peer left or timed out).
        """
        wait(self.work, self.what)
        return self.out.view(*self.shape).tolist()


def start_gather_ints(
    values: list[int], process_set: ProcessSet, what: str, like: torch.Tensor | None = None
) -> Gathering:
    """Issues the allgather of every rank's ``values`` (the same length everywhere).

    Args:
        values: this rank's integers.
        process_set: the ranks exchanging them (more than one).
        what: the exchange, for the message of its error.
        like: a tensor whose device a CUDA-only group's exchange uses.

    Raises:
        HorovodInternalError: the allgather could not be issued.
    """
    n = len(process_set.ranks)
    mine = torch.tensor(values, dtype=torch.int64, device=small_device(process_set, like))
    out = torch.empty(n * len(values), dtype=torch.int64, device=mine.device)
    with as_ours(what):
        work = dist.all_gather_into_tensor(out, mine, group=process_set.group, async_op=True)
    return Gathering(work, out, (n, len(values)), what)


def gather_ints(
    values: list[int], process_set: ProcessSet, like: torch.Tensor | None = None
) -> list[list[int]]:
    """Every rank's ``values`` (the same length everywhere), in set order.

    Raises:
        HorovodInternalError: the exchange failed (a peer left or timed out).
    """
    if len(process_set.ranks) == 1:
        return [list(values)]
    return start_gather_ints(values, process_set, "exchanging tensor shapes", like).rows()

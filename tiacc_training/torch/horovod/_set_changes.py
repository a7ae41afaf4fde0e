"""Adding a process set: the ranks agree on it, then every rank registers it.

Every rank of the job calls :func:`add_process_set` with the same set, in
the same order (the group's creation is collective). The ranks first
compare what they were asked to add, through the global set's queue of
operations (:mod:`._negotiation`), so a rank's call pairs with the others'
whatever operations are still in flight; when a rank refuses (its own
error) or the ranks name different sets, every rank raises ``ValueError``
and nothing is registered anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import _basics
from ._negotiation import exchange_ints
from ._process_sets import ProcessSet, global_process_set, refusal_of, register

__all__ = ["add_process_set"]


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a process set; every rank of the job calls it, in the same order.

    Args:
        process_set: a :class:`ProcessSet`, or a list of global ranks.

    Returns:
        The registered set (the one passed in, now with an id).

    Raises:
        ValueError: Horovod is not initialised, a rank is not below
            ``hvd.size()``, the set is already registered, a registered
            set holds the same ranks, or another rank refused or named
            other ranks.
    """
    _basics.check_initialized()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    world = _basics.size()
    _agree(process_set, world, refusal_of(process_set, world))
    register(process_set, world)
    return process_set


def _agree(process_set: ProcessSet, world: int, refusal: ValueError | None) -> None:
    """Raises on every rank unless every rank can add the same set."""
    row = [int(refusal is not None), len(process_set.ranks)]
    row += (process_set.ranks + [-1] * world)[:world]
    every = exchange_ints("process_set", row, global_process_set)
    refused = [r for r, theirs in enumerate(every) if theirs[0]]
    if refusal is not None:
        raise refusal
    if refused:
        raise ValueError(f"rank(s) {refused} could not add the process set {process_set.ranks}")
    if any(theirs != every[0] for theirs in every):
        named = "; ".join(
            f"rank {r}: {theirs[2 : 2 + theirs[1]]}" for r, theirs in enumerate(every)
        )
        raise ValueError(f"the ranks asked to add different process sets ({named})")

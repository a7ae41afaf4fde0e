"""What every rank concludes from a cycle's blocks: what is ready, in what order, and its verdict.

An operation is *ready* once every rank of the set that has not joined
queued one under the same key (:func:`._headers.row_key`). The ready ones
run in the order the lowest such rank queued them, so every rank issues
the same collectives in the same order, whatever order the ranks submitted
them in (Horovod's coordinator does the same). Every rank judges the same
headers and reaches the same verdict:

* headers that differ (shapes, dtypes, devices, op, root, scale factors,
  the kind of operation at one place) raise :class:`HorovodInternalError`
  on every rank, as Horovod's coordinator fails the operation on every
  rank (a ``RuntimeError``);
* a rank whose own arguments are wrong (splits that do not add up, ...)
  gets its own error (``ValueError`` and the like) and the other ranks
  :class:`HorovodInternalError` naming it;
* otherwise the operation runs.

When every rank waits and nothing is ready, nothing can change any more;
:func:`stall_reason` says how the ranks' calls differ (where Horovod's
coordinator stalls). A second operation of one kind under a name still in
flight on a rank is that rank's own error (:func:`duplicate_name`).

Nothing here talks to the other ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

from . import _basics
from ._common import show
from ._exceptions import HorovodInternalError
from ._headers import (
    ACTIVE,
    ALLREDUCE_KIND,
    BUFFERS,
    COUNT,
    FIRST,
    JOINED,
    KIND,
    KIND_NAMES,
    NAME,
    NAMED,
    OP,
    POST,
    PRE,
    REFUSED,
    ROOT,
    STATUS,
    Block,
    Call,
    Key,
    row_key,
    to_float,
)

# Each rank taking part in an operation, with its header.
Rows = list[tuple[int, list[int]]]


def active_of(blocks: Sequence[Block]) -> list[int]:
    """The places (in set order) of the ranks that have not joined."""
    return [i for i, block in enumerate(blocks) if block.state == ACTIVE]


def joined_of(blocks: Sequence[Block], ranks: Sequence[int]) -> list[int]:
    """The ranks inside ``join()``."""
    return [ranks[i] for i, block in enumerate(blocks) if block.state == JOINED]


def find_row(rows: list[list[int]], key: Key) -> list[int] | None:
    """The header of ``key`` among a rank's headers, if it queued one."""
    return next((row for row in rows if row_key(row) == key), None)


def ready(blocks: Sequence[Block], ranks: Sequence[int]) -> list[tuple[Key, Rows]]:
    """The operations every active rank queued, in the order the lowest active rank queued them.

    Args:
        blocks: every rank's block, in set order (some rank is active).
        ranks: the set's ranks, in set order.

    Returns:
        Each ready operation's key and every active rank's header.
    """
    active = active_of(blocks)
    found: list[tuple[Key, Rows]] = []
    for row in blocks[active[0]].rows:
        key = row_key(row)
        rows = [find_row(blocks[i].rows, key) for i in active]
        if all(r is not None for r in rows):
            found.append(
                (key, [(ranks[i], r) for i, r in zip(active, rows, strict=True) if r is not None])
            )
    return found


def everyone_waits(blocks: Sequence[Block]) -> bool:
    """Whether every rank waits for an operation or is inside ``join()``."""
    return all(block.waiting or block.state == JOINED for block in blocks)


def matches(blocks: Sequence[Block], row: list[int]) -> bool:
    """Whether every active rank queued exactly ``row`` under its key."""
    key = row_key(row)
    return all(find_row(blocks[i].rows, key) == row for i in active_of(blocks))


def stall_reason(blocks: Sequence[Block], ranks: Sequence[int]) -> str:
    """Why no rank can go on when every rank waits and nothing is ready."""
    heads = [(ranks[i], blocks[i].rows[0]) for i in active_of(blocks) if blocks[i].rows]
    reason = difference(heads) if heads else None
    if reason is None:
        reason = "each rank waits for an operation another rank has not submitted"
    return f"no rank can go on, the ranks' calls differ: {reason}"


def verdict(
    what: str, rows: Rows, joined: list[int], refusal: BaseException | None
) -> BaseException | None:
    """The error of a ready operation (the same on every rank), or ``None`` when it runs.

    Args:
        what: the operation, for the message.
        rows: each active rank and its header.
        joined: the ranks inside ``join()``.
        refusal: this rank's own refusal, raised when some rank refused.
    """
    if joined and rows[0][1][KIND] != ALLREDUCE_KIND:
        return HorovodInternalError(
            f"{what}: rank(s) {joined} called hvd.join(); after a join only allreduce runs "
            "until every rank has joined"
        )
    refused = [rank for rank, row in rows if row[STATUS] == REFUSED]
    if refused:
        if refusal is not None:
            return refusal
        return HorovodInternalError(
            f"{what}: rank(s) {refused} refused the operation (their own error says why); "
            "no data moved"
        )
    reason = difference(rows)
    if reason is not None:
        return HorovodInternalError(f"{what}: the ranks' calls differ: {reason}")
    return None


def difference(active: Rows) -> str | None:
    """How the active ranks' headers differ, in words; ``None`` when they agree."""
    first = active[0][1]
    if all(row[KIND:] == first[KIND:] for _, row in active):
        return None

    def each(show_field: Callable[[list[int]], str]) -> str:
        return "; ".join(f"rank {r}: {show_field(row)}" for r, row in active)

    def differs(lo: int, hi: int) -> bool:
        return any(row[lo:hi] != first[lo:hi] for _, row in active)

    if differs(KIND, KIND + 1):
        return "different operations (" + each(lambda row: KIND_NAMES[row[KIND]]) + ")"
    if differs(NAMED, NAME + 1):
        return "different names for the same operation (a name is matched across ranks)"
    if differs(OP, OP + 1):
        return "different reductions (" + each(lambda row: f"op {row[OP]}") + ")"
    if differs(ROOT, ROOT + 1):
        return "different root ranks (" + each(lambda row: f"root_rank={row[ROOT]}") + ")"
    if differs(PRE, POST + 1):
        return (
            "different prescale/postscale factors ("
            + each(lambda row: f"{to_float(row[PRE])}/{to_float(row[POST])}")
            + ")"
        )
    if differs(COUNT, COUNT + 1):
        return "different numbers of tensors (" + each(lambda row: str(row[COUNT])) + ")"
    if differs(FIRST, BUFFERS):
        return (
            "tensors that differ in dtype, shape or device ("
            + each(lambda row: show(row[FIRST:BUFFERS]))
            + ")"
        )
    return "tensors that differ in dtype, shape or device"


def duplicate_name(call: Call) -> ValueError:
    """The error of a named call whose name is still in flight on this rank.

    Every operation with a name comes through :func:`._negotiation.schedule`,
    so this is the one place Horovod's duplicate-name rule is enforced, for
    every kind of operation and their grouped forms. Only the rank that
    finds the duplicate raises; nothing is queued, so the other ranks see
    nothing.
    """
    where = ""
    if call.process_set.process_set_id not in (None, 0):
        where = f" on process set {call.process_set.process_set_id}"
    return ValueError(
        f"{call.what} on rank {_basics.rank()}: an operation of this kind with "
        f"this name is still in flight{where} (submitted and not yet synchronized); names "
        "must be unique among concurrent operations: synchronize the first handle or use "
        "another name"
    )

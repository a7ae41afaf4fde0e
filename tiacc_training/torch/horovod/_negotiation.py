"""The ranks agree on an operation before any of its data moves.

Every operation on a process set of more than one rank starts with one
allgather of a fixed-size header per rank: the kind of operation, its name,
reduction, root, scale factors, the dtype, shape and device of each tensor
(a digest, and the first tensor in full for the message), whether this rank
refused its own arguments, and, on the global set, whether it is inside
``hvd.join()`` and which fused buffers an allreduce will reduce (so joined
ranks can take part with zeros). Every rank then judges the same headers
and reaches the same verdict:

* headers that differ (shapes, dtypes, devices, op, root, scale factors,
  the kind of operation under one name, a name given on one rank and not
  another) raise :class:`HorovodInternalError` on every rank, as Horovod's
  coordinator fails the operation on every rank (a ``RuntimeError``);
* a rank whose own arguments are wrong (splits that do not add up, a name
  still in flight, ...) raises its own error (``ValueError`` and the like,
  as Horovod raises them when the operation is enqueued) and the other
  ranks raise :class:`HorovodInternalError` naming it;
* otherwise, when the operation needs per-rank numbers (allgather's first
  dimensions, alltoall's splits), a second allgather carries them.

Either way every rank issued the same exchanges, so the next operation
starts in step. A named allreduce whose header was agreed before queues the
header exchange ahead of its data without waiting for it and judges it
before its result is handed out; a rank whose call does not match that
header (changed, refused, another operation, inside ``join()``) waits for
the exchange, sees that a rank went ahead, and takes part in its allreduce
with zeros before it raises.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from tiacc_training.errors import CommError

from . import _basics, _handles, _reduce
from ._common import DESCRIPTION, DTYPES, OPS, describe, show
from ._exceptions import HorovodInternalError, wait
from ._process_sets import ProcessSet, gather_ints, small_device

ACTIVE, JOINED = 0, 1
_OK, _REFUSED = 0, 1
KINDS = {
    "allreduce": 1,
    "grouped_allreduce": 1,
    "allgather": 2,
    "grouped_allgather": 2,
    "broadcast": 3,
    "alltoall": 4,
    "reducescatter": 5,
    "grouped_reducescatter": 5,
    "barrier": 6,
}
_KIND_NAMES = {1: "allreduce", 2: "allgather", 3: "broadcast", 4: "alltoall",
               5: "reducescatter", 6: "barrier"}  # fmt: skip
ALLREDUCE_KIND = 1
MAX_BUFFERS = 6
# Header fields.
FLAG, STATUS, KIND, OP, ROOT, PRE, POST, COUNT, DIGEST, NAME, PAYLOAD = range(11)
FIRST = 11
BUFFERS = FIRST + DESCRIPTION
WIDTH = BUFFERS + 1 + 4 * MAX_BUFFERS

# (process set id, kind code, name digest) -> the header the ranks agreed on.
_agreed: dict[tuple[int, int, int], tuple[int, ...]] = {}


def forget() -> None:
    """``shutdown()``: drops the headers agreed on."""
    _agreed.clear()


@dataclass
class Call:
    """One rank's side of an operation, as the ranks compare it."""

    kind: str
    name: str
    named: bool
    process_set: ProcessSet
    tensors: Sequence[torch.Tensor] = ()
    skip_first: bool = False
    op: int = 0
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    # Numbers every rank needs from every other (first dimensions, splits).
    payload: list[int] = field(default_factory=list)
    # An allreduce's fused buffers: (dtype code, elements, tensors, on cuda).
    buffers: Sequence[Sequence[int]] = ()
    # This rank's own error with its arguments, raised after the exchange.
    refusal: BaseException | None = None


@dataclass
class Agreement:
    """What the exchange returned: every rank's payload, and a check for later."""

    payloads: list[list[int]]
    later: Callable[[], None] | None = None


def _bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def key_of(call: Call) -> tuple[int, str, str]:
    """The key of a named operation in flight."""
    return (int(call.process_set.process_set_id or 0), call.kind, call.name)


def keyed(pending: _handles.Pending, call: Call) -> _handles.Pending:
    """``pending``, under ``call``'s key (in flight once registered) when the call is named."""
    if call.named:
        pending.key = key_of(call)
    return pending


def agreed_key(set_id: int, row: Sequence[int]) -> tuple[int, int, int]:
    """The key of a header agreed on: its set, kind and name digest."""
    return (set_id, row[KIND], row[NAME])


def remember(key: tuple[int, int, int], row: Sequence[int]) -> None:
    """Keeps ``row`` as the header agreed on under ``key``."""
    _agreed[key] = tuple(row)


def duplicate_name(call: Call) -> ValueError:
    """The error of a named call whose name is still in flight on this rank.

    Every operation with a name comes through :func:`header`, so this is
    the one place Horovod's duplicate-name rule is enforced, for every kind
    of operation and their grouped forms. The rank that finds the duplicate
    raises this error; the set's other ranks learn of it in the exchange and
    raise :class:`HorovodInternalError` naming that rank.
    """
    where = ""
    if call.process_set.process_set_id not in (None, 0):
        where = f" on process set {call.process_set.process_set_id}"
    return ValueError(
        f"{call.kind} {call.name!r} on rank {_basics.rank()}: an operation of this kind with "
        f"this name is still in flight{where} (submitted and not yet synchronized); names "
        "must be unique among concurrent operations: synchronize the first handle or use "
        "another name"
    )


def header(call: Call, flag: int = ACTIVE) -> list[int]:
    """This rank's header for ``call`` (``call.refusal`` is set when it cannot be described)."""
    descriptions: list[int] = []
    if call.refusal is None:
        try:
            for tensor in call.tensors:
                descriptions.extend(describe(tensor, call.skip_first))
            if len(call.buffers) > MAX_BUFFERS:
                raise ValueError(
                    f"{call.kind} {call.name!r}: tensors of more than {MAX_BUFFERS} "
                    "dtypes/devices in one operation"
                )
        except (TypeError, ValueError) as error:
            call.refusal = error
    if call.refusal is None and call.named and _handles.in_flight(key_of(call)):
        call.refusal = duplicate_name(call)
    if call.refusal is not None:
        row = [flag, _REFUSED, KINDS[call.kind]]
        return row + [0] * (WIDTH - len(row))
    digest = zlib.crc32(struct.pack(f"<{len(descriptions)}q", *descriptions))
    name = zlib.crc32(call.name.encode()) if call.named else 0
    row = [flag, _OK, KINDS[call.kind], call.op, call.root, _bits(call.prescale),
           _bits(call.postscale), len(call.tensors), digest, name, len(call.payload)]  # fmt: skip
    first = descriptions[:DESCRIPTION]
    row += first + [0] * (DESCRIPTION - len(first))
    row.append(len(call.buffers))
    for buffer in call.buffers:
        row.extend(buffer)
    return row + [0] * (WIDTH - len(row))


def joined_row() -> list[int]:
    """The header a rank inside ``join()`` sends."""
    return [JOINED] + [0] * (WIDTH - 1)


def negotiate(call: Call, defer: bool = False) -> Agreement:
    """Exchanges ``call``'s header (and payload) with the set's other ranks.

    Args:
        call: this rank's side.
        defer: an allreduce that may queue its exchange without waiting
            for it (when named and agreed before).

    Returns:
        Every rank's payload, and, for a deferred exchange, the check to
        run before the result is handed out.

    Raises:
        HorovodInternalError: the ranks' calls differ, another rank refused
            its arguments, a rank has joined and this is not an allreduce,
            or the exchange failed.
        BaseException: this rank's own refusal (``call.refusal``).
    """
    process_set = call.process_set
    like = call.tensors[0] if call.tensors and call.refusal is None else None
    mine = header(call)
    if len(process_set.ranks) == 1:
        if call.refusal is not None:
            raise call.refusal
        return Agreement([list(call.payload)])
    set_id = int(process_set.process_set_id or 0)
    key = (set_id, KINDS[call.kind], zlib.crc32(call.name.encode()))
    known = _agreed.get(key) if defer and call.named else None
    if known is not None and known == tuple(mine):
        return Agreement([list(call.payload)], _queue(mine, call, like))
    every = gather_ints(mine, process_set, like)
    went_ahead = deferred_row(every, set_id)
    if went_ahead is not None:
        # Some ranks' calls matched an allreduce agreed before and issued
        # it without waiting for this exchange: take part with zeros.
        serve_zeros(went_ahead, f"{call.name}.changed", process_set)
    judge(call, every)
    if call.named:
        _agreed[key] = tuple(mine)
    payloads = [list(call.payload)]
    if call.payload:
        payloads = gather_ints(call.payload, process_set, like)
    return Agreement(payloads)


def deferred_row(every: list[list[int]], set_id: int) -> list[int] | None:
    """The header of the ranks that issued an agreed allreduce without waiting.

    A rank whose named allreduce matches the header the ranks agreed on
    before under its name queues the exchange and the allreduce itself
    (:func:`negotiate`); its row is that agreed header. Every other rank of
    the exchange (a changed or refused call, another operation, a rank
    inside ``join()``) must then take part in that allreduce with zeros,
    and only then, so that whatever each rank called, every rank issued the
    same collectives and the next operation starts in step.

    Returns:
        The first such row, or ``None`` when no rank went ahead.
    """
    for row in every:
        if row[FLAG] == ACTIVE and row[STATUS] == _OK and row[KIND] == ALLREDUCE_KIND:
            if _agreed.get(agreed_key(set_id, row)) == tuple(row):
                return row
    return None


def serve_zeros(row: list[int], name: str, process_set: ProcessSet) -> None:
    """Takes part with zeros in the allreduce a header describes (its fused buffers).

    A rank inside ``join()``, or one whose call did not match an allreduce
    other ranks issued without waiting (:func:`deferred_row`), reduces
    zeros of the same fused lengths; the header exchange already ran.
    """
    tensors: list[torch.Tensor] = []
    for b in range(row[BUFFERS]):
        first = BUFFERS + 1 + 4 * b
        code, numel, count, cuda = row[first : first + 4]
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype = DTYPES[code]
        # The same fused length and number of tensors (Adasum's dot products are per tensor).
        tensors.append(torch.zeros(numel, dtype=dtype, device=device))
        tensors.extend(torch.zeros(0, dtype=dtype, device=device) for _ in range(count - 1))
    _handles.mark(name, "ALLREDUCE", "negotiate")
    pending = _reduce.start(
        tensors,
        tensors,
        OPS[row[OP]],
        prescale_of(row),
        postscale_of(row),
        process_set,
        name,
        _reduce.fuse(tensors),
    )
    _handles.complete(pending)


def _queue(mine: list[int], call: Call, like: torch.Tensor | None) -> Callable[[], None]:
    """Issues the header exchange without waiting; returns its check."""
    process_set = call.process_set
    n = len(process_set.ranks)
    row = torch.tensor(mine, dtype=torch.int64, device=small_device(process_set, like))
    out = torch.empty(n * len(mine), dtype=torch.int64, device=row.device)
    try:
        work = dist.all_gather_into_tensor(out, row, group=process_set.group, async_op=True)
    except (CommError, RuntimeError) as error:
        raise HorovodInternalError(f"{call.kind} {call.name!r} failed: {error}") from error

    def later() -> None:
        wait(work, f"{call.kind} {call.name!r}")
        judge(call, out.view(n, len(mine)).tolist())

    return later


def judge(call: Call, every: list[list[int]]) -> None:
    """Raises, the same way on every rank, unless the headers say the call can run."""
    ranks = call.process_set.ranks
    what = f"{call.kind} {call.name!r}"
    joined = [ranks[i] for i, row in enumerate(every) if row[FLAG] == JOINED]
    if joined and KINDS[call.kind] != ALLREDUCE_KIND:
        raise HorovodInternalError(
            f"{what}: rank(s) {joined} called hvd.join(); after a join only allreduce runs "
            "until every rank has joined"
        )
    refused = [ranks[i] for i, row in enumerate(every) if row[STATUS] == _REFUSED]
    if refused:
        if call.refusal is not None:
            raise call.refusal
        raise HorovodInternalError(
            f"{what}: rank(s) {refused} refused the operation (their own error says why); "
            "no data moved"
        )
    active = [(ranks[i], row) for i, row in enumerate(every) if row[FLAG] == ACTIVE]
    reason = difference(active)
    if reason is not None:
        raise HorovodInternalError(f"{what}: the ranks' calls differ: {reason}")


def difference(active: list[tuple[int, list[int]]]) -> str | None:
    """How the active ranks' headers differ, in words; ``None`` when they agree."""
    first = active[0][1]
    if all(row[KIND:] == first[KIND:] for _, row in active):
        return None

    def each(show_field: Callable[[list[int]], str]) -> str:
        return "; ".join(f"rank {r}: {show_field(row)}" for r, row in active)

    def differs(lo: int, hi: int) -> bool:
        return any(row[lo:hi] != first[lo:hi] for _, row in active)

    if differs(KIND, KIND + 1):
        return "different operations (" + each(lambda row: _KIND_NAMES[row[KIND]]) + ")"
    if differs(NAME, NAME + 1):
        return "different names for the same operation (a name is matched across ranks)"
    if differs(OP, OP + 1):
        return "different reductions (" + each(lambda row: f"op {row[OP]}") + ")"
    if differs(ROOT, ROOT + 1):
        return "different root ranks (" + each(lambda row: f"root_rank={row[ROOT]}") + ")"
    if differs(PRE, POST + 1):
        return (
            "different prescale/postscale factors ("
            + each(lambda row: f"{_float(row[PRE])}/{_float(row[POST])}")
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


def is_served(every: list[list[int]]) -> list[int] | None:
    """The allreduce header the active ranks agree on, for ranks inside ``join()``."""
    active = [row for row in every if row[FLAG] == ACTIVE]
    if not active or active[0][KIND] != ALLREDUCE_KIND:
        return None
    if any(row[STATUS] != _OK for row in active) or any(row != active[0] for row in active):
        return None
    return active[0]


def postscale_of(row: list[int]) -> float:
    """The postscale factor in a header."""
    return _float(row[POST])


def prescale_of(row: list[int]) -> float:
    """The prescale factor in a header."""
    return _float(row[PRE])


def refuse(
    kind: str, name: str, process_set: ProcessSet, error: BaseException, named: bool = False
) -> None:
    """Tells the set's other ranks this rank refused its arguments; raises ``error``."""
    call = Call(kind, name, named, process_set, refusal=error)
    negotiate(call, defer=KINDS[kind] == ALLREDUCE_KIND)
    raise error  # negotiate raised it already; for the type checker


def guard(call: Call, check: Callable[[], Any]) -> Any:
    """Runs a local argument check; its error becomes ``call.refusal``."""
    if call.refusal is not None:
        return None
    try:
        return check()
    except (TypeError, ValueError, HorovodInternalError) as error:
        call.refusal = error
        return None


def attempt(check: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """``check()``'s value, or its argument error (to be refused after the exchange)."""
    try:
        return check(), None
    except (TypeError, ValueError, HorovodInternalError) as error:
        return None, error

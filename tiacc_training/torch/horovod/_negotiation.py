"""The ranks agree on which operation runs next: operations are matched by name.

Each rank queues the operations it submits on a process set. A *cycle* is
one allgather among the set's ranks of a block per rank: whether it is
inside ``hvd.join()``, whether it waits, how many operations it queued,
and a fixed-size header for each of them (the kind of operation, its name,
reduction, root, scale factors, the dtype, shape and device of each tensor
(a digest, and the first tensor in full for the message), whether this
rank refused its own arguments, and which fused buffers an allreduce will
reduce, so joined ranks can take part with zeros).

An operation is *ready* once every rank of the set that has not joined
queued one under the same key: its kind and name, or, for an operation
without a name, its place among the set's unnamed operations. The ready
ones run in the order the lowest such rank queued them, so every rank
issues the same collectives in the same order, whatever order the ranks
submitted them in (Horovod's coordinator does the same). Every rank judges
the same headers and reaches the same verdict:

* headers that differ (shapes, dtypes, devices, op, root, scale factors,
  the kind of operation at one place) raise :class:`HorovodInternalError`
  on every rank, as Horovod's coordinator fails the operation on every
  rank (a ``RuntimeError``);
* a rank whose own arguments are wrong (splits that do not add up, ...)
  gets its own error (``ValueError`` and the like) and the other ranks
  :class:`HorovodInternalError` naming it;
* otherwise, when the operation needs per-rank numbers (allgather's first
  dimensions, alltoall's splits), one more allgather carries them, and the
  operation's collectives are issued.

A second operation of one kind under a name still in flight on this rank
raises ``ValueError`` at once, on this rank only (Horovod's rule); nothing
is queued.

Cycles are driven by the calls: each submission runs one cycle (so a job
whose ranks submit the same operations runs each one at once), and a call
that must wait for an operation (``synchronize``, a blocking operation,
``barrier``, ``join``) runs cycles until it is issued. When every rank
waits and no queued operation can run, nothing can change any more:
every rank fails its queued operations with :class:`HorovodInternalError`
saying how the ranks' calls differ (where Horovod's coordinator stalls).

A named allreduce whose header was agreed before, submitted while its
rank's queue is empty, goes ahead: its rank issues the cycle's allgather
and the allreduce without waiting, and judges the cycle before the result
is handed out. Every other rank takes part in that allreduce right after
the cycle: with its own data when it queued the same call, otherwise with
zeros, and then the call fails on every rank (it is not waited for).
"""

from __future__ import annotations

import struct
import threading
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
from ._process_sets import ProcessSet, gather_ints, global_process_set, small_device

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
    "process_set": 7,
}
_KIND_NAMES = {1: "allreduce", 2: "allgather", 3: "broadcast", 4: "alltoall",
               5: "reducescatter", 6: "barrier", 7: "process_set"}  # fmt: skip
ALLREDUCE_KIND = 1
MAX_BUFFERS = 6
# Header fields (NAME: the name's digest, or the unnamed operation's number).
STATUS, KIND, OP, ROOT, PRE, POST, COUNT, DIGEST, NAMED, NAME, PAYLOAD = range(11)
FIRST = 11
BUFFERS = FIRST + DESCRIPTION
WIDTH = BUFFERS + 1 + 4 * MAX_BUFFERS
# A cycle's block per rank: its state, whether it waits, whether it went
# ahead, how many operations it queued, its next unnamed number, then the
# headers of its first ROWS operations (the rest in a second allgather,
# only when some rank queued more).
STATE, WAITING, AHEAD, QUEUED, NEXT = range(5)
LEAD = 5
ROWS = 2

Key = tuple[int, int, int]

# (process set id, key) -> the header the ranks agreed on (named allreduces).
_agreed: dict[tuple[int, Key], tuple[int, ...]] = {}
# Every set's queue and cycles, by set id.
_coordinators: dict[int, _Coordinator] = {}
_lock = threading.RLock()


def forget() -> None:
    """``shutdown()``: drops the headers agreed on and every queue."""
    with _lock:
        _agreed.clear()
        for coordinator in _coordinators.values():
            coordinator.fail_all("Horovod was shut down before the operation ran")
        _coordinators.clear()


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
    # This rank's own error with its arguments, raised once the ranks met.
    refusal: BaseException | None = None


@dataclass
class Agreement:
    """What the ranks agreed on: every rank's payload (first dimensions, splits)."""

    payloads: list[list[int]]


# What issues an operation's collectives once the ranks agreed on it.
Prepare = Callable[[Agreement], _handles.Pending]


@dataclass
class _Entry:
    """A queued operation: its call, header and key, and the handle's pending."""

    call: Call
    row: list[int]
    key: Key
    shell: _handles.Pending
    prepare: Prepare | None
    inner: _handles.Pending | None = None


@dataclass
class _Block:
    """One rank's block of a cycle."""

    state: int
    waiting: bool
    ahead: bool
    next: int
    rows: list[list[int]]


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


def row_key(row: Sequence[int]) -> Key:
    """The key operations are matched by: kind and name, or the unnamed number."""
    if row[NAMED]:
        return (1, row[KIND], row[NAME])
    return (0, 0, row[NAME])


def duplicate_name(call: Call) -> ValueError:
    """The error of a named call whose name is still in flight on this rank.

    Every operation with a name comes through :func:`schedule`, so this is
    the one place Horovod's duplicate-name rule is enforced, for every kind
    of operation and their grouped forms. Only the rank that finds the
    duplicate raises; nothing is queued, so the other ranks see nothing.
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


def header(call: Call, number: int) -> list[int]:
    """This rank's header for ``call`` (``call.refusal`` is set when it cannot be described).

    Args:
        call: this rank's side.
        number: the call's place among the set's unnamed operations (unused when named).
    """
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
    name = zlib.crc32(call.name.encode()) if call.named else number
    if call.refusal is not None:
        row = [_REFUSED, KINDS[call.kind], 0, 0, 0, 0, 0, 0, int(call.named), name]
        return row + [0] * (WIDTH - len(row))
    digest = zlib.crc32(struct.pack(f"<{len(descriptions)}q", *descriptions))
    row = [_OK, KINDS[call.kind], call.op, call.root, _bits(call.prescale),
           _bits(call.postscale), len(call.tensors), digest, int(call.named), name,
           len(call.payload)]  # fmt: skip
    first = descriptions[:DESCRIPTION]
    row += first + [0] * (DESCRIPTION - len(first))
    row.append(len(call.buffers))
    for buffer in call.buffers:
        row.extend(buffer)
    return row + [0] * (WIDTH - len(row))


def schedule(call: Call, prepare: Prepare | None, defer: bool = False) -> _handles.Pending:
    """Queues ``call`` on its set and runs one cycle; returns its pending operation.

    The pending operation's collectives are issued once every rank has the
    call (maybe in this very cycle); ``synchronize`` on it runs cycles until
    then, and raises the error the ranks' verdict gave it.

    Args:
        call: this rank's side.
        prepare: issues the operation's collectives, given what the ranks
            agreed on (``None`` for a call refused here, which only reports).
        defer: an allreduce that may go ahead without waiting for the cycle
            (when named and agreed before).

    Raises:
        ValueError: a named call whose name is still in flight on this rank.
        HorovodInternalError: the cycle's exchange failed.
    """
    if call.refusal is None and call.named and _handles.in_flight(key_of(call)):
        raise duplicate_name(call)
    shell = _handles.Pending([], lambda: None, call.name, call.kind.upper(), issued=False)
    with _lock:
        coordinator = _coordinator(call.process_set)
        number = -1
        if not call.named:
            number = coordinator.next
            coordinator.next += 1
        row = header(call, number)
        entry = _Entry(call, row, row_key(row), shell, prepare)
        shell.finish = lambda: entry.inner.finish() if entry.inner is not None else None
        shell.drive = lambda: coordinator.drive(entry)
        if len(call.process_set.ranks) == 1:
            coordinator.run_alone(entry)
            return shell
        agreed = _agreed.get((coordinator.set_id, entry.key))
        if defer and agreed == tuple(row) and coordinator.can_go_ahead(entry.key):
            coordinator.go_ahead(entry)
            return shell
        coordinator.queue.append(entry)
        coordinator.cycle(waiting=False)
    return shell


def exchange_ints(kind: str, values: list[int], process_set: ProcessSet) -> list[list[int]]:
    """Every rank's ``values`` (one length everywhere), matched like an operation.

    Queued behind this rank's operations on the set, so it pairs with the
    other ranks' call of the same kind at the same place whatever they
    still have in flight (``add_process_set`` compares the ranks' sets so).
    """
    name = _handles.name_of(kind, None)
    call = Call(kind, name, False, process_set, payload=list(values))

    def prepare(agreed: Agreement) -> _handles.Pending:
        return _handles.Pending([], lambda: agreed.payloads, name, kind.upper())

    return _handles.complete(schedule(call, prepare))


def exchange_joined() -> None:
    """``join()``'s part: serves the global set's allreduces with zeros until every rank joined.

    This rank's own operations on the global set run first (their handles
    stay valid).
    """
    coordinator = _coordinator(global_process_set)
    if len(coordinator.process_set.ranks) == 1:
        return
    while coordinator.queue:
        with _lock:
            if coordinator.queue:
                coordinator.cycle(waiting=True)
    coordinator.joined, coordinator.all_joined = True, False
    try:
        while not coordinator.all_joined:
            with _lock:
                coordinator.cycle(waiting=True)
    finally:
        coordinator.joined = False


def _coordinator(process_set: ProcessSet) -> _Coordinator:
    set_id = int(process_set.process_set_id or 0)
    coordinator = _coordinators.get(set_id)
    if coordinator is None or coordinator.process_set is not process_set:
        if coordinator is not None:
            coordinator.fail_all("its process set was removed before the operation ran")
        coordinator = _coordinators[set_id] = _Coordinator(process_set)
    return coordinator


class _Coordinator:
    """One process set's queue of operations and the cycles that match them."""

    def __init__(self, process_set: ProcessSet) -> None:
        self.process_set = process_set
        self.set_id = int(process_set.process_set_id or 0)
        self.queue: list[_Entry] = []
        self.next = 0
        self.joined = False
        self.all_joined = False
        # A cycle issued by an allreduce that went ahead, not judged yet.
        self.unsettled: tuple[Any, torch.Tensor, _Entry] | None = None
        # The last operation that ran here, and which ran after each named one
        # last time: the same on every rank (see can_go_ahead).
        self.last: Key | None = None
        self.after: dict[Key, Key] = {}

    # -- running operations ------------------------------------------------------

    def run_alone(self, entry: _Entry) -> None:
        """A set of one rank: the call runs (or fails) at once."""
        if entry.call.refusal is not None:
            entry.shell.error = entry.call.refusal
            return
        self._issue(entry, Agreement([list(entry.call.payload)]))

    def _issue(self, entry: _Entry, agreement: Agreement) -> None:
        """Issues ``entry``'s collectives; a failure becomes its handle's error."""
        shell = entry.shell
        try:
            assert entry.prepare is not None  # a refused call never gets here
            inner = entry.prepare(agreement)
        except (HorovodInternalError, CommError, RuntimeError, ValueError, TypeError) as error:
            if not isinstance(error, HorovodInternalError):
                error = HorovodInternalError(f"{entry.call.kind} {entry.call.name!r}: {error}")
            shell.error = error
            return
        entry.inner = inner
        shell.works, shell.sizes, shell.issued = inner.works, inner.sizes, True

    def fail_all(self, why: str) -> None:
        """Fails every queued operation (their handles raise ``why``)."""
        for entry in self.queue:
            entry.shell.error = HorovodInternalError(
                f"{entry.call.kind} {entry.call.name!r}: {why}"
            )
        self.queue.clear()

    def drive(self, entry: _Entry) -> None:
        """Runs cycles until ``entry`` is issued or failed."""
        while not entry.shell.issued and entry.shell.error is None:
            with _lock:
                if entry.shell.issued or entry.shell.error is not None:
                    return
                if entry not in self.queue:  # its set was replaced meanwhile
                    entry.shell.error = HorovodInternalError(
                        f"{entry.call.kind} {entry.call.name!r}: its queue is gone"
                    )
                    return
                self.cycle(waiting=True)

    # -- cycles ------------------------------------------------------------------

    def _block(self, waiting: bool) -> list[int]:
        rows = [] if self.joined else [e.row for e in self.queue]
        lead = [JOINED if self.joined else ACTIVE, int(waiting), 0, len(rows), self.next]
        first = [v for row in rows[:ROWS] for v in row]
        return lead + first + [0] * (ROWS * WIDTH - len(first))

    def cycle(self, waiting: bool) -> None:
        """One cycle: exchange every rank's queue, then run what is ready."""
        self.settle()
        every = gather_ints(self._block(waiting), self.process_set)
        blocks = [_parse(values) for values in every]
        most = max(values[QUEUED] for values in every)
        if most > ROWS and not any(b.ahead for b in blocks):
            mine = [] if self.joined else [e.row for e in self.queue[ROWS:]]
            extra = [v for row in mine for v in row]
            extra += [0] * ((most - ROWS) * WIDTH - len(extra))
            for block, values, more in zip(
                blocks, every, gather_ints(extra, self.process_set), strict=True
            ):
                rest = values[QUEUED] - ROWS
                block.rows += [more[i * WIDTH : (i + 1) * WIDTH] for i in range(max(0, rest))]
        self.process(blocks)

    def can_go_ahead(self, key: Key) -> bool:
        """Whether the agreed allreduce of ``key`` may go ahead without waiting.

        Only when nothing else of this rank is queued or unjudged, and when
        it is the operation that ran after the last one the last time: every
        rank holds the same history, so ranks that go ahead in one cycle go
        ahead with the same allreduce (whose header they agreed on), and
        their data pair up whatever the other ranks submitted.
        """
        if self.queue or self.unsettled is not None or self.joined:
            return False
        return self.last is not None and self.after.get(self.last) == key

    def _ran(self, key: Key) -> None:
        """Notes that the operation of ``key`` ran next (the history of :meth:`can_go_ahead`)."""
        if self.last is not None and self.last[0]:
            self.after[self.last] = key
        self.last = key

    def go_ahead(self, entry: _Entry) -> None:
        """Issues the cycle and ``entry``'s allreduce without waiting; judged later."""
        group = self.process_set.group
        n = len(self.process_set.ranks)
        block = [ACTIVE, 0, 1, 1, self.next] + entry.row + [0] * ((ROWS - 1) * WIDTH)
        like = entry.call.tensors[0] if entry.call.tensors else None
        mine = torch.tensor(block, dtype=torch.int64, device=small_device(self.process_set, like))
        out = torch.empty(n * len(block), dtype=torch.int64, device=mine.device)
        what = f"{entry.call.kind} {entry.call.name!r}"
        try:
            work = dist.all_gather_into_tensor(out, mine, group=group, async_op=True)
        except (CommError, RuntimeError) as error:
            raise HorovodInternalError(f"{what} failed: {error}") from error
        self.unsettled = (work, out, entry)
        self._issue(entry, Agreement([[]]))
        if entry.shell.error is not None:
            raise entry.shell.error
        entry.shell.settle = lambda: self._settle_for(entry)

    def _settle_for(self, entry: _Entry) -> None:
        with _lock:
            if self.unsettled is not None and self.unsettled[2] is entry:
                self.settle()

    def settle(self) -> None:
        """Judges the cycle an allreduce that went ahead issued, if any."""
        if self.unsettled is None:
            return
        work, out, entry = self.unsettled
        self.unsettled = None
        wait(work, f"{entry.call.kind} {entry.call.name!r}")
        n = len(self.process_set.ranks)
        self.process([_parse(values) for values in out.view(n, -1).tolist()], entry)

    def process(self, blocks: list[_Block], went: _Entry | None = None) -> None:
        """Runs what a cycle's blocks make ready; the same verdicts on every rank.

        Args:
            blocks: every rank's block, in set order.
            went: this rank's allreduce that went ahead in this cycle, if any.
        """
        ranks = self.process_set.ranks
        active = [i for i, b in enumerate(blocks) if b.state == ACTIVE]
        if not active:
            self.all_joined = True
            self.next = max(b.next for b in blocks)
            return
        ahead = [blocks[i].rows[0] for i in active if blocks[i].ahead]
        if ahead:
            self._follow(blocks, active, ahead[0], went)
            return
        joined = [ranks[i] for i, b in enumerate(blocks) if b.state == JOINED]
        ran = False
        for row in list(blocks[active[0]].rows):
            key = row_key(row)
            rows = [_find(blocks[i].rows, key) for i in active]
            if any(r is None for r in rows):
                continue
            ran = True
            self._run(key, [(ranks[i], r) for i, r in zip(active, rows, strict=True)], joined)
        if not ran and all(b.waiting or b.state == JOINED for b in blocks):
            self._stalled(blocks, active)

    def _take(self, key: Key) -> _Entry | None:
        for index, entry in enumerate(self.queue):
            if entry.key == key:
                return self.queue.pop(index)
        return None

    def _run(self, key: Key, rows: list[tuple[int, list[int]]], joined: list[int]) -> None:
        """Runs (or fails, on every rank) the ready operation of ``key``."""
        mine = None if self.joined else self._take(key)
        first = rows[0][1]
        what = (
            f"{mine.call.kind} {mine.call.name!r}"
            if mine is not None
            else f"{_KIND_NAMES.get(first[KIND], 'operation')} of another rank"
        )
        error = verdict(what, rows, joined, mine.call.refusal if mine is not None else None)
        agreed = (self.set_id, key)
        self._ran(key)
        if error is not None:
            _agreed.pop(agreed, None)
            if mine is not None:
                mine.shell.error = error
            return
        payloads: list[list[int]] = [[]]
        if first[PAYLOAD]:
            payloads = gather_ints(mine.call.payload if mine else [], self.process_set)
        if mine is not None:
            self._issue(mine, Agreement(payloads))
        else:
            serve_zeros(first, f"join.{what}", self.process_set)
        if first[NAMED] and first[KIND] == ALLREDUCE_KIND:
            _agreed[agreed] = tuple(first)

    def _follow(self, blocks: list[_Block], active: list[int], row: list[int],
                went: _Entry | None) -> None:  # fmt: skip
        """Takes part in the allreduce a rank issued without waiting (see the module).

        When some active rank's call at that point differs (changed, another
        operation, none yet), the allreduce does not count: the ranks that
        went ahead queue it again (or, when it reduced into its own input,
        fail it and queue a refusal in its place), and the others keep
        theirs queued, so the calls are matched again by name.
        """
        key = row_key(row)
        ok = all(_find(blocks[i].rows, key) == row for i in active)
        if ok:
            self._ran(key)
        else:
            _agreed.pop((self.set_id, key), None)
        if went is not None:
            if not ok:
                self._again(went)
            return
        mine = None if self.joined else next((e for e in self.queue if e.key == key), None)
        if mine is not None and ok:
            self.queue.remove(mine)
            self._issue(mine, Agreement([[]]))
            return
        serve_zeros(row, f"{mine.call.name if mine else 'allreduce'}.zeros", self.process_set)

    def _again(self, entry: _Entry) -> None:
        """An allreduce that went ahead did not count: queued again, or failed."""
        shell = entry.shell
        if entry.inner is not None and entry.inner.intact:
            shell.works, shell.issued, entry.inner = [], False, None
            self.queue.insert(0, entry)
            return
        call = entry.call
        shell.error = HorovodInternalError(
            f"{call.kind} {call.name!r}: issued without waiting, as agreed before, while "
            "another rank's call at that point differed, and reduced into its own input, "
            "so it cannot run again"
        )
        stand_in = Call(call.kind, call.name, call.named, call.process_set, refusal=shell.error)
        row = header(stand_in, -1)
        done = _handles.Pending([], lambda: None, call.name, call.kind.upper(), issued=False)
        self.queue.insert(0, _Entry(stand_in, row, row_key(row), done, None))

    def _stalled(self, blocks: list[_Block], active: list[int]) -> None:
        """Every rank waits and nothing can run: every queued operation fails."""
        ranks = self.process_set.ranks
        heads = [(ranks[i], blocks[i].rows[0]) for i in active if blocks[i].rows]
        reason = difference(heads) if heads else None
        if reason is None:
            reason = "each rank waits for an operation another rank has not submitted"
        self.fail_all(f"no rank can go on, the ranks' calls differ: {reason}")
        self.next = max(b.next for b in blocks)


def _parse(values: list[int]) -> _Block:
    count = min(values[QUEUED], ROWS)
    rows = [values[LEAD + i * WIDTH : LEAD + (i + 1) * WIDTH] for i in range(count)]
    return _Block(values[STATE], bool(values[WAITING]), bool(values[AHEAD]), values[NEXT], rows)


def _find(rows: list[list[int]], key: Key) -> list[int] | None:
    return next((row for row in rows if row_key(row) == key), None)


def serve_zeros(row: list[int], name: str, process_set: ProcessSet) -> None:
    """Takes part with zeros in the allreduce a header describes (its fused buffers).

    A rank inside ``join()``, or one whose call did not match an allreduce
    another rank issued without waiting, reduces zeros of the same fused
    lengths.
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
        _float(row[PRE]),
        _float(row[POST]),
        process_set,
        name,
        _reduce.fuse(tensors),
    )
    _handles.complete(pending)


def verdict(
    what: str, rows: list[tuple[int, list[int]]], joined: list[int], refusal: BaseException | None
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
    refused = [rank for rank, row in rows if row[STATUS] == _REFUSED]
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
    if differs(NAMED, NAME + 1):
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


def refuse(
    kind: str, name: str, process_set: ProcessSet, error: BaseException, named: bool = False
) -> None:
    """Tells the set's other ranks this rank refused its arguments; raises ``error``.

    The refusal is queued as the call would have been and raised once the
    other ranks' calls met it (they raise :class:`HorovodInternalError`).
    """
    call = Call(kind, name, named, process_set, refusal=error)
    _handles.complete(schedule(call, None))
    raise error  # the verdict raised it already; for the type checker


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

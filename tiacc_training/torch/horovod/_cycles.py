"""Each process set's queue of submitted operations and the cycles that run them.

A :class:`Coordinator` holds one set's queue. A cycle exchanges every
rank's block (:mod:`._headers`), then runs what the blocks make ready, with
the verdicts of :mod:`._verdicts`: the same on every rank. When an
operation needs per-rank numbers (allgather's first dimensions, alltoall's
splits), one more allgather carries them before its collectives are
issued.

Cycles are driven by the calls: each submission runs one cycle (so a job
whose ranks submit the same operations runs each one at once), and a call
that must wait for an operation (``synchronize``, a blocking operation,
``barrier``, ``join``) runs cycles until it is issued. When every rank
waits and no queued operation can run, nothing can change any more: every
rank fails its queued operations with :class:`HorovodInternalError` saying
how the ranks' calls differ.

A named allreduce whose header was agreed before, submitted while its
rank's queue is empty, goes ahead: its rank issues the cycle's allgather
and the allreduce without waiting, and judges the cycle before the result
is handed out. Every other rank takes part in that allreduce right after
the cycle: with its own data when it queued the same call, otherwise with
zeros, and then the call fails on every rank (it is not waited for).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from tiacc_training.errors import CommError

from . import _handles, _reduce
from ._common import DTYPES, OPS
from ._exceptions import HorovodInternalError
from ._headers import (
    ALLREDUCE_KIND,
    KIND,
    KIND_NAMES,
    NAMED,
    OP,
    PAYLOAD,
    POST,
    PRE,
    QUEUED,
    ROWS,
    Agreement,
    Block,
    Call,
    Key,
    add_rest,
    buffers_of,
    header,
    pack_block,
    pack_rest,
    parse_block,
    row_key,
    to_float,
)
from ._process_sets import Gathering, ProcessSet, gather_ints, start_gather_ints
from ._verdicts import (
    active_of,
    everyone_waits,
    joined_of,
    matches,
    ready,
    stall_reason,
    verdict,
)

# What issues an operation's collectives once the ranks agreed on it.
Prepare = Callable[[Agreement], _handles.Pending]

# Every set's cycles run under this lock.
lock = threading.RLock()
# (process set id, key) -> the header the ranks agreed on (named allreduces).
_agreed: dict[tuple[int, Key], tuple[int, ...]] = {}
# Every set's queue and cycles, by set id.
_coordinators: dict[int, Coordinator] = {}


def forget() -> None:
    """``shutdown()``: drops the headers agreed on and every queue."""
    with lock:
        _agreed.clear()
        for coordinator in _coordinators.values():
            coordinator.fail_all("Horovod was shut down before the operation ran")
        _coordinators.clear()


def coordinator_of(process_set: ProcessSet) -> Coordinator:
    """The set's coordinator (a new one when the set under its id was replaced)."""
    set_id = int(process_set.process_set_id or 0)
    coordinator = _coordinators.get(set_id)
    if coordinator is None or coordinator.process_set is not process_set:
        if coordinator is not None:
            coordinator.fail_all("its process set was removed before the operation ran")
        coordinator = _coordinators[set_id] = Coordinator(process_set)
    return coordinator


@dataclass
class Entry:
    """A queued operation: its call, header and key, and the handle's pending."""

    call: Call
    row: list[int]
    key: Key
    shell: _handles.Pending
    prepare: Prepare | None
    inner: _handles.Pending | None = None


class Coordinator:
    """One process set's queue of operations and the cycles that match them."""

    def __init__(self, process_set: ProcessSet) -> None:
        self.process_set = process_set
        self.set_id = int(process_set.process_set_id or 0)
        self.queue: list[Entry] = []
        self.next = 0
        self.joined = False
        self.all_joined = False
        # A cycle issued by an allreduce that went ahead, not judged yet.
        self.unsettled: tuple[Gathering, Entry] | None = None
        # The last operation that ran here, and which ran after each named one
        # last time: the same on every rank (see can_go_ahead).
        self.last: Key | None = None
        self.after: dict[Key, Key] = {}

    def entry_of(self, call: Call, prepare: Prepare | None, number: int = -1) -> Entry:
        """``call`` as an entry of this queue (not queued yet), its handle's pending not issued.

        Args:
            call: this rank's side.
            prepare: issues its collectives (``None`` for a refused call).
            number: its place among the set's unnamed operations (unused when named).
        """
        shell = _handles.Pending([], lambda: None, call.name, call.kind.upper(), issued=False)
        row = header(call, number)
        entry = Entry(call, row, row_key(row), shell, prepare)
        shell.finish = lambda: entry.inner.finish() if entry.inner is not None else None
        shell.drive = lambda: self.drive(entry)
        return entry

    # -- running operations ------------------------------------------------------

    def run_alone(self, entry: Entry) -> None:
        """A set of one rank: the call runs (or fails) at once."""
        if entry.call.refusal is not None:
            entry.shell.error = entry.call.refusal
            return
        self._issue(entry, Agreement([list(entry.call.payload)]))

    def _issue(self, entry: Entry, agreement: Agreement) -> None:
        """Issues ``entry``'s collectives; a failure becomes its handle's error."""
        shell = entry.shell
        try:
            assert entry.prepare is not None  # a refused call never gets here
            inner = entry.prepare(agreement)
        except (HorovodInternalError, CommError, RuntimeError, ValueError, TypeError) as error:
            if not isinstance(error, HorovodInternalError):
                error = HorovodInternalError(f"{entry.call.what}: {error}")
            shell.error = error
            return
        entry.inner = inner
        shell.works, shell.sizes, shell.issued = inner.works, inner.sizes, True

    def fail_all(self, why: str) -> None:
        """Fails every queued operation (their handles raise ``why``)."""
        for entry in self.queue:
            entry.shell.error = HorovodInternalError(f"{entry.call.what}: {why}")
        self.queue.clear()

    def drive(self, entry: Entry) -> None:
        """Runs cycles until ``entry`` is issued or failed."""
        while not entry.shell.issued and entry.shell.error is None:
            with lock:
                if entry.shell.issued or entry.shell.error is not None:
                    return
                if entry not in self.queue:  # its set was replaced meanwhile
                    entry.shell.error = HorovodInternalError(
                        f"{entry.call.what}: its queue is gone"
                    )
                    return
                self.cycle(waiting=True)

    def serve_joined(self) -> None:
        """``join()``'s part: runs this rank's queue, then serves zeros until every rank joined."""
        while self.queue:
            with lock:
                if self.queue:
                    self.cycle(waiting=True)
        self.joined, self.all_joined = True, False
        try:
            while not self.all_joined:
                with lock:
                    self.cycle(waiting=True)
        finally:
            self.joined = False

    # -- cycles ------------------------------------------------------------------

    def cycle(self, waiting: bool) -> None:
        """One cycle: exchange every rank's queue, then run what is ready."""
        self.settle()
        rows = [] if self.joined else [e.row for e in self.queue]
        block = pack_block(self.joined, waiting, False, self.next, rows)
        every = gather_ints(block, self.process_set)
        blocks = [parse_block(values) for values in every]
        most = max(values[QUEUED] for values in every)
        if most > ROWS and not any(b.ahead for b in blocks):
            rests = gather_ints(pack_rest(rows, most), self.process_set)
            for found, values, rest in zip(blocks, every, rests, strict=True):
                add_rest(found, values[QUEUED], rest)
        self.process(blocks)

    def can_go_ahead(self, entry: Entry) -> bool:
        """Whether ``entry``, an allreduce, may go ahead without waiting.

        Only when the ranks agreed on its header before, when nothing else
        of this rank is queued or unjudged, and when it is the operation
        that ran after the last one the last time: every rank holds the
        same history, so ranks that go ahead in one cycle go ahead with the
        same allreduce (whose header they agreed on), and their data pair up
        whatever the other ranks submitted.
        """
        if _agreed.get((self.set_id, entry.key)) != tuple(entry.row):
            return False
        if self.queue or self.unsettled is not None or self.joined:
            return False
        return self.last is not None and self.after.get(self.last) == entry.key

    def _ran(self, key: Key) -> None:
        """Notes that the operation of ``key`` ran next (the history of :meth:`can_go_ahead`)."""
        if self.last is not None and self.last[0]:
            self.after[self.last] = key
        self.last = key

    def go_ahead(self, entry: Entry) -> None:
        """Issues the cycle and ``entry``'s allreduce without waiting; judged later."""
        block = pack_block(False, False, True, self.next, [entry.row])
        like = entry.call.tensors[0] if entry.call.tensors else None
        gathering = start_gather_ints(block, self.process_set, entry.call.what, like)
        self.unsettled = (gathering, entry)
        self._issue(entry, Agreement([[]]))
        if entry.shell.error is not None:
            raise entry.shell.error
        entry.shell.settle = lambda: self._settle_for(entry)

    def _settle_for(self, entry: Entry) -> None:
        with lock:
            if self.unsettled is not None and self.unsettled[1] is entry:
                self.settle()

    def settle(self) -> None:
        """Judges the cycle an allreduce that went ahead issued, if any."""
        if self.unsettled is None:
            return
        gathering, entry = self.unsettled
        self.unsettled = None
        self.process([parse_block(values) for values in gathering.rows()], entry)

    def process(self, blocks: list[Block], went: Entry | None = None) -> None:
        """Runs what a cycle's blocks make ready; the same verdicts on every rank.

        Args:
            blocks: every rank's block, in set order.
            went: this rank's allreduce that went ahead in this cycle, if any.
        """
        ranks = self.process_set.ranks
        active = active_of(blocks)
        if not active:
            self.all_joined = True
            self.next = max(b.next for b in blocks)
            return
        ahead = [blocks[i].rows[0] for i in active if blocks[i].ahead]
        if ahead:
            self._follow(blocks, ahead[0], went)
            return
        joined = joined_of(blocks, ranks)
        runs = ready(blocks, ranks)
        for key, rows in runs:
            self._run(key, rows, joined)
        if not runs and everyone_waits(blocks):
            self.fail_all(stall_reason(blocks, ranks))
            self.next = max(b.next for b in blocks)

    def _queued(self, key: Key) -> Entry | None:
        """This rank's queued entry of ``key`` (``None`` when joined or not queued)."""
        if self.joined:
            return None
        return next((entry for entry in self.queue if entry.key == key), None)

    def _run(self, key: Key, rows: list[tuple[int, list[int]]], joined: list[int]) -> None:
        """Runs (or fails, on every rank) the ready operation of ``key``."""
        mine = self._queued(key)
        if mine is not None:
            self.queue.remove(mine)
        first = rows[0][1]
        what = (
            mine.call.what
            if mine is not None
            else f"{KIND_NAMES.get(first[KIND], 'operation')} of another rank"
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

    def _follow(self, blocks: list[Block], row: list[int], went: Entry | None) -> None:
        """Takes part in the allreduce a rank issued without waiting (see the module).

        When some active rank's call at that point differs (changed, another
        operation, none yet), the allreduce does not count: the ranks that
        went ahead queue it again (or, when it reduced into its own input,
        fail it and queue a refusal in its place), and the others keep
        theirs queued, so the calls are matched again by name.
        """
        key = row_key(row)
        ok = matches(blocks, row)
        if ok:
            self._ran(key)
        else:
            _agreed.pop((self.set_id, key), None)
        if went is not None:
            if not ok:
                self._again(went)
            return
        mine = self._queued(key)
        if mine is not None and ok:
            self.queue.remove(mine)
            self._issue(mine, Agreement([[]]))
            return
        serve_zeros(row, f"{mine.call.name if mine else 'allreduce'}.zeros", self.process_set)

    def _again(self, entry: Entry) -> None:
        """An allreduce that went ahead did not count: queued again, or failed."""
        shell = entry.shell
        if entry.inner is not None and entry.inner.intact:
            shell.works, shell.issued, entry.inner = [], False, None
            self.queue.insert(0, entry)
            return
        call = entry.call
        shell.error = HorovodInternalError(
            f"{call.what}: issued without waiting, as agreed before, while another rank's call "
            "at that point differed, and reduced into its own input, so it cannot run again"
        )
        stand_in = Call(call.kind, call.name, call.named, call.process_set, refusal=shell.error)
        self.queue.insert(0, self.entry_of(stand_in, None))


def serve_zeros(row: list[int], name: str, process_set: ProcessSet) -> None:
    """Takes part with zeros in the allreduce a header describes (its fused buffers).

    A rank inside ``join()``, or one whose call did not match an allreduce
    another rank issued without waiting, reduces zeros of the same fused
    lengths.
    """
    tensors: list[torch.Tensor] = []
    for code, numel, count, cuda in buffers_of(row):
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
        to_float(row[PRE]),
        to_float(row[POST]),
        process_set,
        name,
        _reduce.fuse(tensors),
    )
    _handles.complete(pending)

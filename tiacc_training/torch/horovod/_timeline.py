"""The Horovod timeline: a Chrome trace of every operation, per tensor name.

Each collective marks its phases with :func:`mark`: ``negotiate`` (the user
called it), ``queue`` (handed to the backend), ``communicate`` (submitted to
the engine) and ``done`` (completed). While a timeline runs, the file holds
one row (a trace "process") per tensor name and, for each operation, up to
three duration events: ``NEGOTIATE_<OP>`` (negotiate to queue), ``QUEUE``
(queue to communicate) and ``<OP>`` (communicate to done), in microseconds
since the timeline started. Open it in ``chrome://tracing`` or
https://ui.perfetto.dev.

As in Horovod, only rank 0 writes; the other ranks accept
:func:`start_timeline` and :func:`stop_timeline` and record nothing.
:func:`mark` takes a timestamp and puts it on a queue; a writer thread turns
the marks into events and writes them as they complete, so a long job holds
only its operations in flight. The file is valid JSON after
:func:`stop_timeline`, or when the process exits.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from typing import IO, Any, Callable

try:
    from . import _basics
except ImportError:  # this file loaded alone, outside the package (a unit test does)
    _basics = None  # type: ignore[assignment]

__all__ = ["mark", "start_from_env", "start_timeline", "stop_timeline"]

OPS = frozenset(
    {"ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "BARRIER", "JOIN"}
)
PHASES = ("negotiate", "queue", "communicate", "done")
_PHASE_INDEX = {phase: i for i, phase in enumerate(PHASES)}

# Seconds between flushes of the file while marks keep coming.
FLUSH_INTERVAL = 1.0

_log = logging.getLogger(__name__)
_lock = threading.Lock()
# The running timeline of this process; None when none runs (every rank but
# 0, or before start_timeline). mark() reads it without the lock.
_active: _Timeline | None = None
# Whether start_timeline was called and stop_timeline was not (on every rank).
_started = False
_atexit_registered = False


def _horovod_state() -> tuple[bool, int]:
    """Whether ``hvd.init()`` has run, and this process's rank."""
    if _basics is None or not _basics.is_initialized():
        return False, 0
    return True, _basics.rank()


# Replaced in the unit tests, which run without hvd.init().
_state_source: Callable[[], tuple[bool, int]] = _horovod_state


class _Op:
    """One operation of a tensor name, its phases' timestamps as they arrive."""

    __slots__ = ("op", "times", "slot")

    def __init__(self, op: str, slot: int) -> None:
        self.op = op
        self.slot = slot
        self.times: list[float | None] = [None, None, None, None]


class _Timeline:
    """A trace file being written: the queue of marks and its writer thread."""

    def __init__(self, file_path: str) -> None:
        self.path = file_path
        self.origin = time.perf_counter()
        self.marks: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        # Opened here so that a bad path fails in start_timeline, not later.
        self.file: IO[str] = open(file_path, "w", encoding="utf-8")  # noqa: SIM115
        self.file.write("[\n")
        self.first = True
        # The writer thread's state: a row per tensor name, the operations in
        # flight per name, oldest first.
        self.rows: dict[str, int] = {}
        self.in_flight: dict[str, deque[_Op]] = {}
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name="hvd-timeline", daemon=True)
        self.thread.start()

    # -- any thread --

    def put(self, name: str, op: str, phase: str) -> None:
        self.marks.put((time.perf_counter(), name, op, phase))

    def close(self) -> None:
        """Writes what is queued and in flight, ends the JSON array."""
        self.marks.put(None)
        self.thread.join()

    # -- writer thread --

    def _run(self) -> None:
        last_flush = time.monotonic()
        try:
            while True:
                try:
                    item = self.marks.get(timeout=FLUSH_INTERVAL)
                except queue.Empty:
                    self.file.flush()
                    last_flush = time.monotonic()
                    continue
                if item is None:
                    break
                self._handle(*item)
                if time.monotonic() - last_flush > FLUSH_INTERVAL:
                    self.file.flush()
                    last_flush = time.monotonic()
            self._finish()
        except Exception:  # a full disk, say
            _log.exception("timeline %s: writing failed; the timeline is stopped", self.path)
            self._detach()
        finally:
            self.file.close()

    def _detach(self) -> None:
        # Marks stop queueing for a writer that no longer runs.
        global _active
        if _active is self:
            _active = None

    def _event(self, event: dict[str, Any]) -> None:
        text = json.dumps(event, separators=(",", ":"))
        if self.first:
            self.first = False
            self.file.write(text)
        else:
            self.file.write(",\n" + text)

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def _row(self, name: str) -> int:
        row = self.rows.get(name)
        if row is None:
            row = len(self.rows) + 1
            self.rows[name] = row
            self._event({"name": "process_name", "ph": "M", "pid": row, "args": {"name": name}})
            self._event(
                {"name": "process_sort_index", "ph": "M", "pid": row, "args": {"sort_index": row}}
            )
        return row

    def _handle(self, t: float, name: str, op: str, phase: str) -> None:
        index = _PHASE_INDEX[phase]
        ops = self.in_flight.setdefault(name, deque())
        # The oldest operation of this name that has not reached this phase
        # (operations of one name go through their phases in order).
        target = next((o for o in ops if o.times[index] is None and o.op == op), None)
        if target is None:
            # A negotiate mark, or an operation whose first marks were not
            # made: a new operation starts here.
            target = _Op(op, len(ops))
            ops.append(target)
        target.times[index] = t
        if phase == "done":
            ops.remove(target)
            if not ops:
                del self.in_flight[name]
            self._emit(name, target, finished=True)

    def _emit(self, name: str, entry: _Op, finished: bool) -> None:
        """Writes an operation's phases: each lasts until the next one marked.

        An unfinished operation (the timeline stopped first) ends with its
        current phase lasting until now, flagged ``"unfinished"``.
        """
        row = self._row(name)
        labels = (f"NEGOTIATE_{entry.op}", "QUEUE", entry.op)
        known = [(i, t) for i, t in enumerate(entry.times) if t is not None]
        spans = [(i, start, end) for (i, start), (_, end) in zip(known, known[1:])]
        if not finished and known and known[-1][0] < 3:
            spans.append((known[-1][0], known[-1][1], time.perf_counter()))
        for i, start, end in spans:
            event: dict[str, Any] = {
                "name": labels[i],
                "ph": "X",
                "pid": row,
                "tid": entry.slot,
                "ts": self._us(start),
                "dur": max(0.0, round((end - start) * 1e6, 3)),
            }
            if not finished:
                event["args"] = {"unfinished": True}
            self._event(event)

    def _finish(self) -> None:
        for name, ops in list(self.in_flight.items()):
            for entry in ops:
                self._emit(name, entry, finished=False)
        self.in_flight.clear()
        self.file.write("\n]\n")
        self.file.flush()


def mark(name: str, op: str, phase: str) -> None:
    """Marks a phase of an operation on the running timeline.

    Costs one global read when no timeline runs. Thread-safe: ``done`` is
    marked from the engine's completion callbacks.

    Args:
        name: The tensor name of the operation (its row in the trace).
        op: ``ALLREDUCE``, ``ALLGATHER``, ``BROADCAST``, ``ALLTOALL``,
            ``REDUCESCATTER``, ``BARRIER`` or ``JOIN``.
        phase: ``negotiate`` (the user called the operation), ``queue``
            (handed to the backend), ``communicate`` (submitted to the
            engine) or ``done`` (completed).

    Raises:
        ValueError: ``op`` or ``phase`` is not one of those (checked only
            while a timeline runs).
    """
    timeline = _active
    if timeline is None:
        return
    if op not in OPS:
        raise ValueError(f"timeline mark: op {op!r} is not one of {sorted(OPS)}")
    if phase not in _PHASE_INDEX:
        raise ValueError(f"timeline mark: phase {phase!r} is not one of {list(PHASES)}")
    timeline.put(name, op, phase)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Creates a timeline file at ``file_path`` and starts recording into it.

    Only rank 0 writes the file; on the other ranks this records that a
    timeline runs and writes nothing. Starting again while one runs closes
    the running file (valid JSON) and continues in ``file_path``.

    Args:
        file_path: Where to write the Chrome trace (JSON).
        mark_cycles: Accepted for Horovod's signature. Horovod marks each
            cycle of its background loop; this engine has no such loop (an
            operation goes out when it is called), so there is nothing to
            mark.

    Raises:
        ValueError: ``hvd.init()`` has not run, or ``file_path`` is empty.
        OSError: the file cannot be created.
    """
    global _active, _started, _atexit_registered
    if not isinstance(file_path, (str, os.PathLike)) or not os.fspath(file_path):
        raise ValueError(f"start_timeline: file_path must be a non-empty path, got {file_path!r}")
    initialized, rank = _state_source()
    if not initialized:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    with _lock:
        previous = _active
        _active = None
        if previous is not None:
            previous.close()
        if rank == 0:
            _active = _Timeline(os.fspath(file_path))
        _started = True
        if not _atexit_registered:
            atexit.register(close)
            _atexit_registered = True


def stop_timeline() -> None:
    """Stops the running timeline and closes its file (valid JSON).

    Stopping when no timeline runs does nothing (it logs that it was not
    started).

    Raises:
        ValueError: ``hvd.init()`` has not run.
    """
    global _active, _started
    initialized, _ = _state_source()
    if not initialized:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    with _lock:
        if not _started:
            _log.info("stop_timeline: no timeline is running; start one with start_timeline()")
            return
        timeline = _active
        _active = None
        _started = False
        if timeline is not None:
            timeline.close()


def close() -> None:
    """Stops the running timeline, if any, without a word (``hvd.shutdown()``, exit)."""
    global _active, _started
    with _lock:
        timeline, _active, _started = _active, None, False
    if timeline is not None:
        timeline.close()


def start_from_env() -> None:
    """Starts a timeline when ``HOROVOD_TIMELINE`` names a file.

    Called at the end of ``hvd.init()``. ``HOROVOD_TIMELINE_MARK_CYCLES``
    is checked and passed on as ``mark_cycles``. ``HOROVOD_TIMELINE=DYNAMIC`` (which
    Horovod needs before ``start_timeline`` can be used) starts nothing: here
    ``start_timeline`` works without it.

    Raises:
        ValueError: ``HOROVOD_TIMELINE_MARK_CYCLES`` is not a boolean.
    """
    path = os.environ.get("HOROVOD_TIMELINE", "").strip()
    if not path or path == "DYNAMIC":
        return
    start_timeline(path, mark_cycles=_env_flag("HOROVOD_TIMELINE_MARK_CYCLES"))


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1/0, true/false, yes/no or on/off")


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker, say) must not write into the
    # parent's file: its copy of the writer thread does not run.
    global _active, _lock, _started
    _active = None
    _started = False
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

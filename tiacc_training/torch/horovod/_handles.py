"""Operations in flight: their handles, names, timeline marks and completion.

An asynchronous operation is a :class:`Pending`: the torch.distributed
works it issued and the function that turns them into its result.
``*_async`` functions register it and return an integer handle, as
Horovod's do (``sparse_allreduce_async`` returns a callable, as Horovod's
does); :func:`synchronize` waits for it and returns the result, :func:`poll`
says whether it is done.

An operation's collectives are issued once every rank of its set has
submitted it (:mod:`._cycles`); until then its :class:`Pending` holds
no works, and :func:`synchronize` runs the ranks' exchanges until it is
issued or failed.

A name given to an operation is in flight from the call until its handle is
synchronised: a second operation of the same kind with the same name on the
same process set meanwhile raises ``ValueError`` (Horovod's duplicate-name
error).
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from tiacc_training.errors import CommError

from ._exceptions import HorovodInternalError, wait

try:
    from . import _timeline
except ImportError:  # pragma: no cover - the timeline module ships with the package
    _timeline = None  # type: ignore[assignment]

__all__ = ["poll", "synchronize"]


@dataclass
class Pending:
    """An operation in flight: its works, and what turns them into the result."""

    works: list[Any]
    finish: Callable[[], Any]
    name: str
    op: str
    result: Any = None
    finished: bool = False
    # An allgather's first dimensions per tensor and rank (set order).
    sizes: list[list[int]] | None = None
    # (process set id, kind, name) while a named operation is in flight.
    key: tuple[int, str, str] | None = None
    # Whether its collectives were issued (the ranks may not have agreed yet).
    issued: bool = True
    # The error the ranks' verdict gave it, raised by synchronize.
    error: BaseException | None = None
    # Runs the ranks' exchanges until it is issued or failed.
    drive: Callable[[], None] | None = None
    # Judges an operation issued before the ranks agreed (it may be issued again).
    settle: Callable[[], None] | None = None
    # Whether the inputs stay untouched until finish (so it can be issued again).
    intact: bool = False


class SparseHandle:
    """What ``sparse_allreduce_async`` returns: call it for the result.

    Horovod returns a function here; this one is also accepted by
    :func:`synchronize` and :func:`poll`.
    """

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __call__(self) -> Any:
        """Waits for the reduction and returns the sparse result."""
        return synchronize(self.handle)

    def __repr__(self) -> str:
        return f"SparseHandle({self.handle})"


_handles: dict[int, Pending] = {}
_handle_ids = itertools.count(1)
_names: Counter[str] = Counter()
_in_flight: set[tuple[int, str, str]] = set()
_lock = threading.Lock()


def forget() -> None:
    """``shutdown()``: drops the handles, the names in flight and the unnamed counts.

    Unnamed operations are numbered from 0 again after ``init()`` on every
    rank, so that a worker that joins an elastic job names them as the
    workers that were there before.
    """
    with _lock:
        _handles.clear()
        _in_flight.clear()
        _names.clear()


def in_flight(key: tuple[int, str, str]) -> bool:
    """Whether a named operation with this key waits for ``synchronize``."""
    with _lock:
        return key in _in_flight


def register(pending: Pending) -> int:
    """Keeps ``pending`` under a new handle (its name now in flight)."""
    with _lock:
        handle = next(_handle_ids)
        _handles[handle] = pending
        if pending.key is not None:
            _in_flight.add(pending.key)
    return handle


def single(pending: Pending) -> Pending:
    """``pending``, its result the first (only) tensor of the list it computes."""
    inner = pending.finish
    pending.finish = lambda: inner()[0]
    return pending


def mark(name: str, op: str, phase: str) -> None:
    """A timeline mark (nothing when no timeline runs)."""
    if _timeline is not None:
        _timeline.mark(name, op, phase)


def name_of(kind: str, name: str | None) -> str:
    """The operation's name: the given one, or ``<kind>.noname.<n>``.

    Raises:
        TypeError: ``name`` is not a string.
    """
    if name is None:
        with _lock:
            number = _names[kind]
            _names[kind] += 1
        return f"{kind}.noname.{number}"
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    return name


def submit(
    name: str, op: str, start: Callable[[], list[Any]], finish: Callable[[], Any]
) -> Pending:
    """Runs ``start`` (which issues the works) with the timeline's marks around it."""
    mark(name, op, "queue")
    try:
        works = [w for w in start() if w is not None]
    except HorovodInternalError:
        raise
    except CommError as error:
        raise HorovodInternalError(f"{name} failed: {error}") from error
    mark(name, op, "communicate")
    _on_done(works, lambda: mark(name, op, "done"))
    return Pending(works, finish, name, op)


def _on_done(works: list[Any], callback: Callable[[], None]) -> None:
    if _timeline is None:
        return
    if not works:
        callback()
        return
    try:
        works[-1].get_future().then(lambda _: callback())
    except Exception:  # a work without a future: the mark comes at synchronize
        pass


def complete(pending: Pending) -> Any:
    """Waits for ``pending``'s works and returns its result (once computed, kept)."""
    try:
        while not pending.finished:
            if not pending.issued and pending.error is None and pending.drive is not None:
                pending.drive()
            if pending.error is not None:
                raise pending.error
            for work in pending.works:
                wait(work, pending.name)
            if pending.settle is not None:
                settle, pending.settle = pending.settle, None
                settle()
                continue
            pending.result = pending.finish()
            pending.finished = True
    finally:
        if pending.key is not None:
            with _lock:
                _in_flight.discard(pending.key)
    return pending.result


def _pending_of(handle: Any, pop: bool) -> Pending:
    if isinstance(handle, SparseHandle):
        handle = handle.handle
    with _lock:
        pending = _handles.pop(handle, None) if pop else _handles.get(handle)
    if pending is None:
        raise ValueError(f"handle {handle!r} is unknown: already synchronized, or never issued")
    return pending


def synchronize(handle: Any) -> Any:
    """Waits for an asynchronous operation and returns its result.

    Args:
        handle: what an ``*_async`` function returned.

    Returns:
        The output tensor (a list of them for grouped operations; for
        ``alltoall_async`` the output and the received splits).

    Raises:
        ValueError: ``handle`` is unknown (already synchronised, or never issued).
        HorovodInternalError: the collective failed, or the ranks' calls
            did not match.
    """
    return complete(_pending_of(handle, pop=True))


def poll(handle: Any) -> bool:
    """Whether the operation of ``handle`` has finished (``synchronize`` will not wait).

    Raises:
        ValueError: ``handle`` is unknown.
    """
    pending = _pending_of(handle, pop=False)
    if not pending.issued:
        return pending.error is not None
    return all(_done(work) for work in pending.works)


def _done(work: Any) -> bool:
    """Whether a work finished (works made from a future say so only through it)."""
    if work.is_completed():
        return True
    try:
        return work.get_future().done()
    except Exception:  # a work without a future
        return False

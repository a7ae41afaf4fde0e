"""The exceptions of Horovod's API.

``HorovodInternalError`` is what a Horovod script catches around a
collective that failed because a peer died or timed out (elastic scripts
restore their state on it); ours wraps the engine's
:class:`~tiacc_training.errors.CommError` (and torch's own backend errors)
so that the same ``except`` clauses work.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tiacc_training.errors import CommError

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "wait"]


class HorovodInternalError(RuntimeError):
    """A collective failed: a peer left, timed out or reported an error.

    The engine's error (a :class:`~tiacc_training.errors.CommError`, or the
    error torch's backend raised) is the ``__cause__``.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """The driver of an elastic job added or removed workers.

    Raised by ``State.commit()`` / ``State.check_host_updates()`` on every
    worker at the same call (see :mod:`tiacc_training.torch.horovod.elastic`).

    Args:
        skip_sync: whether the new round only removed workers, so every
            remaining worker already holds the committed state and
            ``hvd.elastic.run`` need not sync it from rank 0.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of the job changed")
        self.skip_sync = skip_sync


@contextmanager
def as_ours(what: str) -> Iterator[None]:
    """Issuing or waiting for a collective: its failure raises :class:`HorovodInternalError`.

    Args:
        what: the operation, for the message.

    Raises:
        HorovodInternalError: the engine's ``CommError`` or torch's backend
            error (its cause) was raised inside; ours passes through as it is.
    """
    try:
        yield
    except HorovodInternalError:
        raise
    except (CommError, RuntimeError) as error:
        raise HorovodInternalError(f"{what} failed: {error}") from error


def wait(work: Any, what: str) -> None:
    """Waits for a torch.distributed work; a failed collective raises ours.

    A work made from a future (the "tiacc" backend's) can finish with the
    engine's error held in its future rather than raised by ``wait()``, so
    the future's value is checked too.

    Args:
        work: what a collective with ``async_op=True`` returned, or a
            callable that issues it: a collective can fail while it is
            issued, too (the "tiacc" backend on a torch whose C++ code
            cannot wait on work written in Python finishes each collective
            in the call).
        what: the operation, for the message.

    Raises:
        HorovodInternalError: the collective failed (its cause: the engine's
            ``CommError`` or torch's backend error).
    """
    with as_ours(what):
        if callable(work) and not hasattr(work, "wait"):
            work = work()
        work.wait()
    try:
        future = work.get_future()
    except (AttributeError, RuntimeError):  # works without a future (send, recv)
        return
    try:
        value = future.value()
    except (CommError, RuntimeError) as error:
        raise HorovodInternalError(f"{what} failed: {error}") from error
    if isinstance(value, BaseException):
        raise HorovodInternalError(f"{what} failed: {value}") from value

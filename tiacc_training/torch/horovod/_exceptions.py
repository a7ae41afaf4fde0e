"""The exceptions of Horovod's API.

``HorovodInternalError`` is what a Horovod script catches around a
collective that failed because a peer died or timed out (elastic scripts
restore their state on it); ours wraps the engine's
:class:`~tiacc_training.errors.CommError` (and torch's own backend errors)
so that the same ``except`` clauses work.
"""

from __future__ import annotations

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]


class HorovodInternalError(RuntimeError):
    """A collective failed: a peer left, timed out or reported an error.

    The engine's error (a :class:`~tiacc_training.errors.CommError`, or the
    error torch's backend raised) is the ``__cause__``.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed while training (Horovod's elastic mode).

    We run no elastic driver, so nothing here raises it; it exists so that
    scripts which catch it import and run unchanged.

    Args:
        skip_sync: whether the state can be restored without a sync
            (Horovod's meaning: only hosts were added, none removed).
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of the job changed")
        self.skip_sync = skip_sync

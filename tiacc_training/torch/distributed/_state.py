"""The integration's process-wide state (one training process, one state).

``_runtime`` is its one writer: every other module reads it, or calls a
``_runtime`` function that writes it. What belongs to one module lives
there: warnings queued and given (``_startup``, ``_hook``), the engine
state held for an engine not yet built (``_engine_state.pending``).
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from tiacc_training import _engine

logger = logging.getLogger("tiacc_training")
PREFIX = "tiacc_training: "


_NAME_FIELD = re.compile(r"%\(name\)|\{name[}!:]|\$\{?name\b")


def _shows_name(handler: logging.Handler) -> bool:
    """Whether ``handler``'s format puts the logger's name on each line."""
    style = getattr(handler.formatter, "_style", None)
    return bool(_NAME_FIELD.search(getattr(style, "_fmt", None) or ""))


def _reached(from_logger: logging.Logger) -> list[logging.Handler]:
    """The handlers a record of ``from_logger`` reaches, as logging walks them."""
    handlers: list[logging.Handler] = []
    current: logging.Logger | None = from_logger
    while current is not None:
        handlers += current.handlers
        current = current.parent if current.propagate else None
    return handlers


class _Prefixed(logging.Filter):
    """Puts ``tiacc_training: `` in front of each of the package's log lines.

    In the message itself, so that the lines keep it under any handler:
    ours, one that logs the message alone (Ray's workers, logging's last
    resort). Not where every handler the line reaches already shows the
    logger's name (``logging.basicConfig()``'s default format), which
    would say it twice.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and not record.msg.startswith(PREFIX):
            handlers = _reached(logging.getLogger(record.name))
            if not handlers or not all(_shows_name(h) for h in handlers):
                record.msg = PREFIX + record.msg
        return True


logger.addFilter(_Prefixed())


@dataclass
class State:
    """What ``init_tiacc_training`` set up, and the engines built since.

    Written by ``_runtime`` alone (tests set fields in their fixtures).
    """

    lock: threading.Lock = field(default_factory=threading.Lock)
    initialized: bool = False
    # The effective configuration (``_engine.CommConfig``).
    config: Any = None
    # How the job was launched (``_engine.launch_env()``'s dict).
    launch: dict[str, Any] | None = None
    # The engine of CPU buckets (``_engine.CommEngine``), once built.
    engine: Any = None
    # Transport of CUDA buckets: "nccl" or "tcp" (host staging), and why
    # when it is not what was asked for.
    cuda_transport: str = "tcp"
    cuda_reason: str | None = None
    # CUDA buckets: ``_cuda.NcclChannels`` or ``_cuda.HostStaging``.
    cuda: Any = None
    # Counters that keep the store keys of successive rendezvous of the
    # default group apart (engines, GPU placement checks, configuration
    # checks); they start again with a new elastic round's group.
    generation: int = 0
    placement_round: int = 0
    config_round: int = 0
    # Whether rank 0 gave its start-up report.
    logged: bool = False
    # The default group (``_runtime``): torch.distributed's functions wrapped;
    # whether the set-up finished for the current group; whether the group
    # is created from the launcher on first use (the script never called
    # init_process_group); the launch of a group being created that way;
    # ``init_tiacc_training``'s ``backend`` argument.
    group_patched: bool = False
    finished: bool = False
    create_on_use: bool = False
    pending_launch: dict[str, Any] | None = None
    backend_arg: str | None = None
    # The generation the ranks of this torchrun attempt agreed on, where
    # the group's store is one every attempt shares (``_runtime``).
    attempt: str | None = None
    # What the engines stopped or replaced so far counted themselves, per
    # (path, codec) (``stats()["engine"]`` adds the engines in use): an
    # engine's counters are folded in here when ``set_engine`` or
    # ``set_cuda`` replaces it, so the summary at exit still has them after
    # ``destroy_process_group``.
    retired_counters: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    def set_engine(self, engine: Any) -> None:
        """Makes ``engine`` the CPU engine; the one it replaces is retired."""
        if self.engine is not None and self.engine is not engine:
            add_counters(self.retired_counters, engine_counters_of(self.engine))
        self.engine = engine

    def set_cuda(self, cuda: Any) -> None:
        """Makes ``cuda`` the path of CUDA buckets; the one it replaces is retired.

        The NCCL path's device engine is retired with it. Host staging runs
        on a CPU engine, which is counted when it leaves ``engine``.
        """
        old = self.cuda
        if old is not None and old is not cuda:
            engine = getattr(old, "engine", None)
            staging = engine is self.engine or isinstance(engine, (_engine.CommEngine, type(None)))
            if not staging:
                add_counters(self.retired_counters, engine_counters_of(engine))
        self.cuda = cuda


def engine_counters_of(engine: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """An engine's own counters (``counters()``).

    Empty for an object without them (a test's stand-in).
    """
    counters = getattr(engine, "counters", None)
    return counters() if callable(counters) else {}


def add_counters(
    total: dict[tuple[str, str], dict[str, Any]], counters: dict[tuple[str, str], dict[str, Any]]
) -> None:
    """Adds ``counters`` (an engine's, per (path, codec)) into ``total``."""
    for key, row in counters.items():
        empty = {"buckets": 0, "bytes_in": 0, "wire_bytes": 0}
        into = total.setdefault(key, {**empty, "wire": dict.fromkeys(row["wire"], 0)})
        for name in ("buckets", "bytes_in", "wire_bytes"):
            into[name] += row[name]
        for group, n in row["wire"].items():
            into["wire"][group] = into["wire"].get(group, 0) + n


state = State()

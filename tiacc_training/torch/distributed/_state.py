"""The integration's process-wide state (one training process, one state)."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("tiacc_training")


@dataclass
class State:
    """What ``init_tiacc_training`` set up, and the engines built since."""

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
    # Counters that keep store keys of successive rendezvous apart.
    generation: int = 0
    placement_round: int = 0
    # The slow-rank check (``_perf.PerfCheck``), when it is on.
    perf: Any = None
    # Counts start-up configuration checks (keeps their store keys apart).
    config_round: int = 0
    patched: bool = False
    logged: bool = False
    # The default group (``_group``): torch.distributed's functions wrapped;
    # whether the set-up finished for the current group; whether the group
    # is created from the launcher on first use (the script never called
    # init_process_group); the launch of a group being created that way;
    # ``init_tiacc_training``'s ``backend`` argument.
    group_patched: bool = False
    finished: bool = False
    create_on_use: bool = False
    pending_launch: dict[str, Any] | None = None
    backend_arg: str | None = None
    # Conflicts between the script's init_process_group and our settings,
    # waiting for rank 0 to warn; the warnings given (once per process).
    conflicts: list[str] = field(default_factory=list)
    # Gradient buckets this process handed to an engine (CPU or CUDA path).
    engine_buckets: int = 0
    # What the DDP hook did in this process (``stats()``): backward passes,
    # buckets and bytes per path through the engine, buckets handed to
    # torch per reason.
    steps: int = 0
    carried: Counter[str] = field(default_factory=Counter)
    carried_bytes: Counter[str] = field(default_factory=Counter)
    native: Counter[str] = field(default_factory=Counter)
    accumulated: int = 0
    warned: set[str] = field(default_factory=set)


state = State()

"""What the set-up says once the default group exists: the report and the warnings.

``_runtime.finish`` finishes the set-up (the settings compared, the CUDA
device chosen, the slow-rank check started), then rank 0 logs the start-up
report here (:func:`report`). Conflicts the script's own call met (its
backend, timeout or ranks against ours) wait here for rank 0 to warn once
the group exists; each is warned about once per process.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch.distributed as dist

from . import _backend, _config
from ._nccl import nccl_version
from ._state import logger, state


def report(config: Any, world: int, launch: dict[str, Any]) -> None:
    """Rank 0's start-up report: settings, transports, group, collectives, attempt."""
    version = None
    if state.cuda_transport == "nccl":
        version = nccl_version(config.nccl_library)
    _config.log_startup(
        config,
        world,
        launch,
        state.cuda_transport,
        state.cuda_reason,
        version,
    )
    if launch.get("group"):
        logger.info("  process group: %s (backend %s)", launch["group"], dist.get_backend())
    logger.info(
        "  %s",
        _backend.describe_cpu_collectives(config, made_before=bool(launch.get("before"))),
    )
    cuda = _backend.describe_cuda_collectives()
    if cuda:
        logger.info("  %s", cuda)
    if attempt_text():
        logger.info("  %s", attempt_text())


def attempt_text() -> str | None:
    """Which attempt of a restarting job this process is, for the log lines.

    ``torchrun attempt 2 of at most 3 (its keys: generation 5)`` under
    torchrun (from ``TORCHELASTIC_RESTART_COUNT``, and the generation the
    attempt's ranks agreed on where they share the agent's store); ``None``
    outside torchrun.
    """
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if count is None or not count.isdigit():
        return None
    text = f"torchrun attempt {int(count) + 1}"
    most = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "")
    if most.isdigit():
        text += f" of at most {int(most) + 1}"
    if state.attempt is not None:
        text += f" (its keys: generation {state.attempt})"
    return text


# Conflicts between the script's init_process_group and our settings,
# waiting for rank 0 to warn; the ones warned about (once per process).
_conflicts: list[str] = []
_warned: set[str] = set()


def later_warn(message: str) -> None:
    """Queues a warning for rank 0 to give once the group exists."""
    if message not in _conflicts:
        _conflicts.append(message)


def give_warnings(rank: int) -> None:
    """Rank 0 warns once per job about each conflict the script's call met."""
    messages = list(_conflicts)
    _conflicts.clear()
    if rank != 0:
        return
    for message in messages:
        if message not in _warned:
            _warned.add(message)
            warnings.warn(f"tiacc_training: {message}", RuntimeWarning, stacklevel=2)

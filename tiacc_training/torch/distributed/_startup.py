"""The set-up that needs the default group, and the warnings it gives.

``init_tiacc_training`` configures; the set-up finishes here once the
default group exists (at once when it already does, else when the
script's ``init_process_group`` or the launcher's group creates it,
through ``_runtime``'s wraps): the ranks' settings are compared, the CUDA
device is chosen, the slow-rank check starts, and rank 0 logs the start-up
report. Conflicts the script's own call met (its backend, timeout or ranks
against ours) wait here for rank 0 to warn once the group exists.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from . import _backend, _config, _perf
from ._nccl import nccl_version, resolve_cuda_transport
from ._rendezvous import check_same_config, default_store
from ._state import logger, state


def finish(launch: dict[str, Any], device_given: bool, check_round: bool = True) -> None:
    """The set-up that needs the group: agreement, device, report.

    Args:
        launch: how the job was launched (``launch_env``'s dict, or the
            script's own call's view).
        device_given: the script chose the CUDA device (``device_id=``).
        check_round: compare the settings every rank must share (every
            rank finishes the same number of times, so the rounds pair up).
    """
    config = state.config
    state.cuda_transport, state.cuda_reason = resolve_cuda_transport(config, launch)
    state.launch = launch
    rank, world = dist.get_rank(), dist.get_world_size()
    if world > 1 and check_round:
        # Every rank takes part in every call, so the rounds pair up.
        state.config_round += 1
        prefix = f"tiacc_training/config{state.config_round}"
        check_same_config(config, default_store(), prefix, rank, world)
    _perf.start(config, rank, world)
    local_rank = launch.get("local_rank")
    if torch.cuda.is_available() and local_rank is not None and not device_given:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    state.finished = True
    give_warnings(rank)
    if not state.logged and rank == 0:
        state.logged = True
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


def later_warn(message: str) -> None:
    """Queues a warning for rank 0 to give once the group exists."""
    if message not in state.conflicts:
        state.conflicts.append(message)


def give_warnings(rank: int) -> None:
    """Rank 0 warns once per job about each conflict the script's call met."""
    messages, state.conflicts = state.conflicts, []
    if rank != 0:
        return
    for message in messages:
        if message not in state.warned:
            state.warned.add(message)
            warnings.warn(f"tiacc_training: {message}", RuntimeWarning, stacklevel=2)

"""The effective configuration and the start-up report.

The schema, the parsers and the report's wording live in the engine
(``rust/tiacc-core/src/config``); this module only feeds them the
arguments and the job, and logs what comes back.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch

from tiacc_training import _engine

from ._state import logger, state


def current() -> Any:
    """The configuration ``init_tiacc_training`` set (``None`` before it ran)."""
    return state.config


def effective_config(**arguments: Any) -> Any:
    """The environment's configuration with ``arguments`` on top.

    Each argument is parsed by its variable's parser; ``None`` means unset.

    Raises:
        ConfigError: an environment variable does not parse (names it).
        ValueError: an argument's value does not parse (names it).
        TypeError: an argument has the wrong type.
    """
    config = _engine.CommConfig.from_env().with_overrides(arguments)
    if config.nccl_socket_ifname is not None:
        # AIACC's NCCL interface, for NCCL, which reads only its own name.
        os.environ.setdefault("NCCL_SOCKET_IFNAME", config.nccl_socket_ifname)
    return config


def log_startup(
    config: Any,
    world: int,
    launch: dict[str, Any] | None,
    cuda_transport: str,
    cuda_reason: str | None,
    nccl_version: tuple[int, int, int] | None,
) -> None:
    """Logs (rank 0) which transport each kind of bucket takes and what applies.

    Every setting that cannot apply in this job is a warning naming its
    variable.
    """
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))  # the prefix is in it
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    launch = launch or {}
    cuda = None
    if torch.cuda.is_available():
        cuda = (cuda_transport, nccl_version if cuda_transport == "nccl" else None, cuda_reason)
    lines, warnings = config.startup(
        world, launch.get("launcher", "user"), launch.get("local_size"), cuda
    )
    for line in lines:
        logger.info("%s", line)
    for variable, message in warnings:
        logger.warning("%s %s", variable, message)

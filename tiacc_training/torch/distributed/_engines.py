"""How every engine is built: the default group's and each "tiacc" group's.

The builders the runtime (``_runtime``: the default group's CPU engine and
CUDA path) and the "tiacc" backend's groups (``_collectives``,
``_device_collectives``) share: the device engine over NCCL, a group's
engine over its own store, what every engine is built with (failure board,
local size, ranks per node) and the address peers reach this rank on. It
builds, it keeps nothing: what is built is kept by its caller.
"""

from __future__ import annotations

from typing import Any

import torch

from tiacc_training import _engine
from tiacc_training.errors import ConfigError

from ._addresses import advertised_host
from ._kernels import TorchKernels
from ._nccl import nccl_search_dirs
from ._rendezvous import (
    FailureBoard,
    board_store,
    default_store,
    exchange,
    node_intra_size,
)
from ._state import logger, state


def job_launch() -> dict[str, Any]:
    """How the job of the current group was launched (empty before the set-up)."""
    return state.launch or {}


def next_prefix(kind: str) -> str:
    state.generation += 1
    return f"tiacc_training/{kind}{state.generation}"


def nccl_engine(
    config: Any,
    device: torch.device,
    rank: int,
    world: int,
    store: Any = None,
    prefix: str | None = None,
    shared: dict[str, Any] | None = None,
) -> Any:
    """A device engine over NCCL for ``device``.

    The unique ids go through the store (by default the default group's),
    then every communicator is joined on ``device``. Under
    ``TIACC_TRAINING_ALGORITHM=auto`` on whole nodes of several ranks the
    2D communicators are joined too, and the engine keeps whichever of
    flat and 2D its start-up probe measured faster (rank 0 logs the line).

    Args:
        config: the engine configuration.
        device: the CUDA device its communicators live on.
        rank: this rank in the group.
        world: the group's size.
        store: where its rendezvous goes (default: the default group's
            store, under a new prefix).
        prefix: the key prefix of that rendezvous.
        shared: what :func:`_engine_arguments` gave for that rendezvous.
    """
    if store is None or prefix is None:
        store, prefix = default_store(), next_prefix("nccl")
    if shared is None:
        shared = engine_arguments(config, store, prefix, rank, world)
    engine = _engine.DeviceEngine(config, rank, world, TorchKernels(device), "nccl", **shared)
    with torch.cuda.device(device):
        engine.connect_store(
            store,
            prefix,
            config.timeout,
            search_dirs=nccl_search_dirs(),
            library=config.nccl_library,
        )
    if rank == 0 and engine.auto_choice is not None:
        logger.info("%s (CUDA buckets, over NCCL)", engine.auto_choice)
    return engine


def group_engine(
    config: Any, store: Any, prefix: str, rank: int, size: int, device: Any = None
) -> Any:
    """The engine of one group on the "tiacc" backend, connected over its store.

    One channel for CPU tensors, so collectives run in the order they are
    issued (as gloo runs them); the 2D groups when the group's ranks form
    whole nodes and the configuration goes 2D (its reduce-scatters and
    all-gathers then cross nodes once per block), flat otherwise.

    Args:
        config: the engine configuration.
        store: the store torch handed the backend (the group's own).
        prefix: the key prefix of this engine's board and exchanges.
        rank: this rank in the group.
        size: the group's size.
        device: ``None``: the CPU engine (shared memory or TCP). A device:
            the device engine on it, over NCCL for a CUDA device, over TCP
            for the CPU (how the tests run the CUDA side's code).
    """
    # The 2D groups only when every rank of the group asks for them: a rank
    # alone asking would wait for peers that never join. Settings that
    # differ are init_tiacc_training's ConfigError, after the group exists.
    launch = job_launch()
    mine = "1" if config.two_d_groups(size, launch.get("local_size")) else "0"
    wanted = exchange(store, f"{prefix}/two-d", rank, size, mine, config.timeout)
    shared = engine_arguments(
        config, store, prefix, rank, size, group=True, two_d=all(w == "1" for w in wanted)
    )
    if device is not None and torch.device(device).type == "cuda":
        return nccl_engine(config, torch.device(device), rank, size, store, prefix, shared)
    host = advertised_host(config, store)
    if device is None:
        engine = _engine.CommEngine(config, rank, size, host, channels=1, **shared)
    else:
        kernels = TorchKernels(torch.device(device))
        engine = _engine.DeviceEngine(config, rank, size, kernels, "tcp", host=host, **shared)
    engine.connect_store(store, "tiacc", max(config.timeout, 60.0))
    return engine


def engine_arguments(
    config: Any,
    store: Any,
    prefix: str,
    rank: int,
    world: int,
    group: bool = False,
    two_d: bool = True,
) -> dict[str, Any]:
    """What every engine is built with, besides its own.

    Its failure board (a store client under ``prefix``), the launcher's
    local size and the ranks per node (a store exchange under ``prefix``,
    so every rank calls this in the same order). A backend's ``group``
    whose ranks do not form whole nodes (a subgroup across hosts) runs
    flat, where the default group's engines raise: every member reaches
    the same verdict from the same hosts, and rank 0 says why.
    """
    client, address = board_store(store)
    launch = job_launch()
    try:
        intra_size = node_intra_size(config, launch, store, prefix, rank, world) if two_d else None
    except ConfigError as err:
        if not group:
            raise
        if rank == 0:
            logger.info("  a group of %d ranks runs its collectives flat: %s", world, err)
        intra_size = None
    return {
        "board": FailureBoard(client, prefix, address),
        "local_size": launch.get("local_size"),
        "intra_size": intra_size,
    }

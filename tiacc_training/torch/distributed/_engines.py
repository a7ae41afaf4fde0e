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

from ._addresses import advertised_host
from ._kernels import TorchKernels
from ._nccl import nccl_search_dirs
from ._rendezvous import FailureBoard, board_store
from ._state import logger, state


def job_launch() -> dict[str, Any]:
    """How the job of the current group was launched (empty before the set-up)."""
    return state.launch or {}


def nccl_engine(
    config: Any,
    device: torch.device,
    rank: int,
    world: int,
    store: Any,
    prefix: str,
    shared: dict[str, Any] | None = None,
) -> Any:
    """A device engine over NCCL for ``device``.

    The unique ids go through ``store`` under ``prefix``, then every
    communicator is joined on ``device``. Under
    ``TIACC_TRAINING_ALGORITHM=auto`` on whole nodes of several ranks the
    2D communicators are joined too, and the engine keeps whichever of
    flat and 2D its start-up probe measured faster (rank 0 logs the line).

    Args:
        config: the engine configuration.
        device: the CUDA device its communicators live on.
        rank: this rank in the group.
        world: the group's size.
        store: where its rendezvous goes (the default group's store, or a
            "tiacc" group's own).
        prefix: the key prefix of that rendezvous (``_runtime.next_prefix``
            for the default group's).
        shared: what :func:`engine_arguments` gave for that rendezvous.
    """
    if shared is None:
        shared = engine_arguments(store, prefix)
    engine = _engine.DeviceEngine(config, rank, world, TorchKernels(device), "nccl", **shared)
    say_layout(engine, rank)
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
    shared = engine_arguments(store, prefix, group=True)
    if device is not None and torch.device(device).type == "cuda":
        return nccl_engine(config, torch.device(device), rank, size, store, prefix, shared)
    host = advertised_host(config, store)
    if device is None:
        engine = _engine.CommEngine(config, rank, size, host, channels=1, **shared)
    else:
        kernels = TorchKernels(torch.device(device))
        engine = _engine.DeviceEngine(config, rank, size, kernels, "tcp", host=host, **shared)
    say_layout(engine, rank)
    engine.connect_store(store, "tiacc", max(config.timeout, 60.0))
    return engine


def engine_arguments(store: Any, prefix: str, group: bool = False) -> dict[str, Any]:
    """What every engine is built with, besides its own.

    Its failure board (a store client under ``prefix``), where the launcher
    put this rank, and the store and prefix under which the engine's
    constructor agrees the 2D layout with the other ranks (so every rank
    builds its engines in the same order). A backend's ``group`` whose
    ranks do not form whole nodes (a subgroup across hosts) runs flat,
    where the default group's engines raise ``ConfigError``: every member
    reaches the same verdict from the same hosts, and rank 0 says why
    (:func:`say_layout`).
    """
    client, address = board_store(store)
    launch = job_launch()
    return {
        "board": FailureBoard(client, prefix, address),
        "local_size": launch.get("local_size"),
        "local_rank": launch.get("local_rank"),
        "store": store,
        "prefix": prefix,
        "group": group,
    }


def say_layout(engine: Any, rank: int) -> None:
    """Rank 0 logs why a group runs flat where its configuration asked for 2D."""
    if rank == 0 and engine.layout_note is not None:
        logger.info("%s", engine.layout_note)

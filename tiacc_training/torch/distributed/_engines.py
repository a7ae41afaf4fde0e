"""Building the engines of the default group, on first use.

DDP construction is collective, so every rank reaches these functions in
the same order and their rendezvous pair up. An engine is kept while the
configuration stays the same and rebuilt when it changes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tiacc_training import _engine

from ._cuda import HostStaging, NcclChannels
from ._kernels import TorchKernels
from ._launch import DEFAULT_MASTER_PORT
from ._nccl import check_gpu_placement, nccl_search_dirs
from ._rendezvous import (
    FailureBoard,
    board_store,
    connect_tcp,
    default_store,
    nccl_ids,
    node_intra_size,
)
from ._state import logger, state


def _next_prefix(kind: str) -> str:
    state.generation += 1
    return f"tiacc_training/{kind}{state.generation}"


def world_engine(config: Any) -> Any:
    """The CPU engine (TCP) of the default group, connected on first use."""
    engine = state.engine
    if engine is not None and engine.connected and engine.config.same_settings(config):
        return engine
    if engine is not None:
        engine.shutdown()
    rank, world = dist.get_rank(), dist.get_world_size()
    store = default_store()
    prefix = _next_prefix("engine")
    launch = state.launch or {}
    engine = _engine.CommEngine(
        config,
        rank,
        world,
        advertised_host(config),
        board=FailureBoard(*_board_args(store, prefix)),
        local_size=launch.get("local_size"),
        intra_size=node_intra_size(config, launch, store, prefix, rank, world),
    )
    connect_tcp(engine, store, prefix, rank, world, config.timeout)
    if rank == 0:
        carried = ", ".join(f"{group} over {how}" for group, how in engine.transports.items())
        logger.info("  CPU buckets connected: %s", carried or "nothing to carry (a world of one)")
        if engine.auto_choice is not None:
            logger.info("%s", engine.auto_choice)
    state.engine = engine
    return engine


def cuda_path(config: Any, device: torch.device) -> Any:
    """What carries the CUDA buckets of models on ``device``.

    NCCL channels of the device engine, or host staging over the CPU engine
    (see ``_nccl`` for the choice; ranks that turn out to share a GPU NCCL
    cannot share make ``auto`` fall back to staging here).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if state.cuda_transport == "nccl":
        check_gpu_placement(config, device, rank, world)
    existing = state.cuda
    nccl = state.cuda_transport == "nccl"
    if nccl:
        reusable = isinstance(existing, NcclChannels) and existing.matches(config, device)
    else:
        engine = world_engine(config)
        reusable = isinstance(existing, HostStaging) and existing.matches(engine, device)
    if reusable:
        return existing
    if existing is not None:
        existing.close()
        state.cuda = None
    if nccl:
        state.cuda = NcclChannels(_nccl_engine(config, device, rank, world), device)
    else:
        state.cuda = HostStaging(engine, device)
    return state.cuda


def _nccl_engine(config: Any, device: torch.device, rank: int, world: int) -> Any:
    """A device engine over NCCL for ``device``.

    The unique ids go through the store, then every communicator is joined
    on ``device`` (whose context exists: DDP's parameters already live there).
    Under ``TIACC_TRAINING_ALGORITHM=auto`` on whole nodes of several ranks
    the 2D communicators are joined too, and the engine keeps whichever of
    flat and 2D its start-up probe measured faster (rank 0 logs the line).
    """
    store = default_store()
    prefix = _next_prefix("nccl")
    launch = state.launch or {}
    engine = _engine.DeviceEngine(
        config,
        rank,
        world,
        TorchKernels(device),
        "nccl",
        board=FailureBoard(*_board_args(store, prefix)),
        local_size=launch.get("local_size"),
        intra_size=node_intra_size(config, launch, store, prefix, rank, world),
    )
    dirs = nccl_search_dirs()

    def new_id() -> bytes:
        return _engine.nccl_unique_id(dirs, config.nccl_library)

    ids = nccl_ids(engine, store, prefix, rank, config.timeout, new_id)
    with torch.cuda.device(device):
        engine.connect_nccl(*ids, search_dirs=dirs, library=config.nccl_library)
    if rank == 0 and engine.auto_choice is not None:
        logger.info("%s (CUDA buckets, over NCCL)", engine.auto_choice)
    return engine


def _board_args(store: Any, prefix: str) -> tuple[Any, str, Any]:
    """A failure board's store client, key prefix and store address."""
    client, address = board_store(store)
    return client, prefix, address


def advertised_host(config: Any, store: Any = None) -> str:
    """The IP peers reach this rank on.

    The configured one, else the local address that routes to the
    rendezvous host (the launcher's, or that of ``store``: by default the
    default group's).
    """
    if config.socket_addr:
        return config.socket_addr
    launch = state.launch or {}
    host, port = launch.get("master_addr"), launch.get("master_port")
    if host is None:
        store = default_store() if store is None else store
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        host, port = getattr(store, "host", None), getattr(store, "port", None)
    if host is None:
        return "127.0.0.1"
    return _engine.local_addr_towards(host, int(port or DEFAULT_MASTER_PORT))


def close_all() -> None:
    """Stops every engine (CUDA paths first: staging feeds the CPU engine)."""
    cuda, state.cuda = state.cuda, None
    if cuda is not None:
        cuda.close()
    engine, state.engine = state.engine, None
    if engine is not None:
        engine.shutdown()

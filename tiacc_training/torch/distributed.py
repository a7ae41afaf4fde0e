"""DDP communication through the tiacc-training engine.

Add two lines at the top of an ordinary DistributedDataParallel script::

    import tiacc_training.torch.distributed as tdist
    tdist.init_tiacc_training()

``init_tiacc_training`` initialises the default process group when the
script has not (from torchrun, Open MPI's mpirun or SLURM), then patches
``torch.nn.parallel.DistributedDataParallel`` so that every model wrapped
afterwards takes its bucket size from ``TIACC_TRAINING_FUSION_THRESHOLD``
and sends its gradient buckets through the engine: several channels
(``TIACC_TRAINING_NUM_NCCL_STREAMS``) running ring allreduces concurrently,
with the GIL released, while backward goes on.

Environment variables (parsed by the engine; a bad value raises
``ConfigError`` naming it):

* ``TIACC_TRAINING_FUSION_THRESHOLD``: largest bucket in bytes (default
  26214400, DDP's 25 MiB).
* ``TIACC_TRAINING_NUM_NCCL_STREAMS``: number of channels (default 2).
* ``TIACC_TRAINING_TIMEOUT``: seconds a collective may wait for a peer
  before raising ``CommTimeoutError`` (default 300).
* ``TIACC_TRAINING_DISABLE``: ``1`` leaves DDP's communication native.
* ``TIACC_TRAINING_SOCKET_ADDR``: the IP address this rank listens on
  (default: the local address that routes to ``MASTER_ADDR``).
* ``TIACC_TRAINING_TRANSPORT``: ``auto`` (default), ``nccl`` or ``tcp``:
  which transport carries CUDA gradients. ``auto`` uses NCCL when CUDA is
  available, the NCCL library loads and no two ranks share a GPU, else TCP
  with the gradients staged through pinned host memory. CPU gradients
  always use TCP.
* ``TIACC_TRAINING_NCCL_LIBRARY``: the NCCL library file to load (default:
  the copy torch loaded, else the ``nvidia-nccl`` wheel's, else the system's).

A comm hook the user registers on a model (``register_comm_hook`` or a
built-in hook) replaces the engine for that model.
"""

from __future__ import annotations

import atexit
import datetime
import importlib.util
import inspect
import logging
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from tiacc_training import _engine
from tiacc_training.errors import CommError, ConfigError

__all__ = [
    "CommError",
    "ConfigError",
    "comm_config",
    "cuda_transport",
    "get_engine",
    "init_tiacc_training",
    "is_initialized",
    "nccl_search_dirs",
    "nccl_version",
    "shutdown",
]

_MIB = 1024 * 1024
_DEFAULT_MASTER_PORT = 29500
_SUPPORTED_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
_COMPRESSIONS = {"none", "fp16", "bf16"}
_TRANSPORTS = {"auto", "nccl", "tcp"}
_WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

logger = logging.getLogger("tiacc_training")


@dataclass
class _Config:
    """The effective engine configuration (arguments over environment)."""

    enabled: bool
    fusion_threshold: int
    num_streams: int
    timeout: float
    socket_addr: str | None
    transport: str
    nccl_library: str | None
    compression: str
    compression_inter_only: bool
    compression_scale: float
    nan_check: bool
    two_d: bool
    intra_size: int | None
    hierarchical_threshold: int
    topk: bool
    topk_ratio: float
    topk_threshold: int
    topk_fp16: bool


@dataclass
class _State:
    """Process-wide state of the integration."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    initialized: bool = False
    config: _Config | None = None
    launch: dict[str, Any] | None = None
    engine: Any = None
    cuda_transport: str = "tcp"
    nccl: Any = None
    staging: Any = None
    generation: int = 0
    placement_round: int = 0
    patched: bool = False
    logged: bool = False


_state = _State()


def comm_config() -> dict[str, Any]:
    """The engine configuration from the environment.

    Returns:
        A dict with ``enabled``, ``fusion_threshold``, ``num_streams``,
        ``timeout`` and ``socket_addr``.

    Raises:
        ConfigError: an environment variable has a value that does not parse.
    """
    return dict(_engine.comm_config())


def init_tiacc_training(
    *,
    backend: str | None = None,
    fusion_threshold: int | None = None,
    num_streams: int | None = None,
    timeout: float | None = None,
    enable: bool | None = None,
    compression: str | None = None,
    nan_check: bool | None = None,
    transport: str | None = None,
) -> None:
    """Initialise distributed training and route DDP through the engine.

    Safe to call more than once; later calls update the configuration used
    by DDP models built afterwards. Works whether or not the script already
    called ``torch.distributed.init_process_group``.

    Args:
        backend: process-group backend when this call creates the group
            (default ``nccl`` when CUDA is available, else ``gloo``).
        fusion_threshold: largest gradient bucket in bytes; overrides
            ``TIACC_TRAINING_FUSION_THRESHOLD``.
        num_streams: number of communication channels; overrides
            ``TIACC_TRAINING_NUM_NCCL_STREAMS``.
        timeout: seconds a collective may wait for a peer; overrides
            ``TIACC_TRAINING_TIMEOUT``.
        enable: ``False`` leaves DDP's communication native; overrides
            ``TIACC_TRAINING_DISABLE``.
        compression: ``"none"``, ``"fp16"`` or ``"bf16"`` on the wire for
            float32/float64 gradients; overrides ``TIACC_TRAINING_COMPRESSION``.
        nan_check: raise before sending a bucket that holds NaN or infinity;
            overrides ``TIACC_TRAINING_NAN_CHECK``.
        transport: ``"auto"``, ``"nccl"`` or ``"tcp"``: the transport of
            CUDA gradients; overrides ``TIACC_TRAINING_TRANSPORT``.

    Raises:
        ConfigError: an environment variable or the launcher's variables
            are invalid.
        CommError: ``transport="nccl"`` but CUDA is not available or the
            NCCL library cannot be loaded, or ``TIACC_TRAINING_NCCL_LIBRARY``
            names a file that is not a usable NCCL.
        ValueError: an argument is out of range.
        TypeError: an argument has the wrong type.
    """
    config = _effective_config(
        fusion_threshold, num_streams, timeout, enable, compression, nan_check, transport
    )
    with _state.lock:
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this PyTorch build")
        _state.cuda_transport = _resolve_cuda_transport(config) if config.enabled else "tcp"
        _state.config = config
        if not dist.is_initialized():
            _state.launch = _init_process_group(backend, config.timeout)
        elif _state.launch is None:
            _state.launch = _engine.launch_env()
        local_rank = (_state.launch or {}).get("local_rank")
        if torch.cuda.is_available() and local_rank is not None:
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        _patch_ddp()
        _state.initialized = True
        if not _state.logged and dist.get_rank() == 0:
            _state.logged = True
            _log_config(config)


def cuda_transport() -> str:
    """The transport CUDA gradients use: ``"nccl"`` or ``"tcp"``.

    Resolved by :func:`init_tiacc_training` from ``transport`` /
    ``TIACC_TRAINING_TRANSPORT``; ``"tcp"`` before it ran. Under ``auto``
    it turns to ``"tcp"`` when the first CUDA model is wrapped and ranks
    turn out to share a GPU.
    """
    return _state.cuda_transport


def nccl_search_dirs() -> list[str]:
    """Directories holding the NCCL library of the ``nvidia-nccl`` wheel.

    torch's CUDA wheels depend on that package; its ``lib`` directory is
    where the engine looks after the copy already loaded in the process.

    Returns:
        Existing ``lib`` directories of the ``nvidia.nccl`` package (empty
        when it is not installed).
    """
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    dirs = [os.path.join(p, "lib") for p in spec.submodule_search_locations]
    return [d for d in dirs if os.path.isdir(d)]


def nccl_version(library: str | None = None) -> tuple[int, int, int]:
    """The version of the NCCL library the engine would use.

    Args:
        library: an NCCL library file to load; defaults to
            ``TIACC_TRAINING_NCCL_LIBRARY``, else the usual search.

    Returns:
        ``(major, minor, patch)``.

    Raises:
        CommError: no usable NCCL was found (the message says what was tried).
        ConfigError: an environment variable is invalid.
    """
    if library is not None and not isinstance(library, (str, os.PathLike)):
        raise TypeError(f"library must be a path, got {library!r}")
    if library is None:
        library = _engine.comm_config()["nccl_library"]
    return _engine.nccl_version(nccl_search_dirs(), None if library is None else str(library))


def is_initialized() -> bool:
    """Whether :func:`init_tiacc_training` has run in this process."""
    return _state.initialized


def get_engine() -> Any:
    """The connected engine of the default group.

    Returns:
        The engine, or ``None`` before the first DDP model was built (or when
        the engine is disabled).
    """
    return _state.engine


def shutdown() -> None:
    """Stops the engine's channel threads (also run at interpreter exit)."""
    staging, _state.staging = _state.staging, None
    if staging is not None:
        staging.close()
    nccl, _state.nccl = _state.nccl, None
    if nccl is not None:
        nccl.close()
    engine, _state.engine = _state.engine, None
    if engine is not None:
        engine.shutdown()


atexit.register(shutdown)


def _effective_config(
    fusion_threshold: int | None,
    num_streams: int | None,
    timeout: float | None,
    enable: bool | None,
    compression: str | None = None,
    nan_check: bool | None = None,
    transport: str | None = None,
) -> _Config:
    env = _engine.comm_config()
    if fusion_threshold is not None:
        if isinstance(fusion_threshold, bool) or not isinstance(fusion_threshold, int):
            raise TypeError(f"fusion_threshold must be an int (bytes), got {fusion_threshold!r}")
        if fusion_threshold <= 0:
            raise ValueError(f"fusion_threshold must be positive, got {fusion_threshold}")
    if num_streams is not None:
        _engine.check_num_streams(str(num_streams))
    if timeout is not None and not (float(timeout) > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if compression is not None and str(compression).lower() not in _COMPRESSIONS:
        raise ValueError(f"compression must be one of {sorted(_COMPRESSIONS)}, got {compression!r}")
    if transport is not None:
        if not isinstance(transport, str):
            raise TypeError(f"transport must be a str, got {transport!r}")
        if transport.strip().lower() not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(_TRANSPORTS)}, got {transport!r}")
    return _Config(
        enabled=env["enabled"] if enable is None else bool(enable),
        fusion_threshold=fusion_threshold or env["fusion_threshold"],
        num_streams=int(num_streams) if num_streams is not None else env["num_streams"],
        timeout=float(timeout) if timeout is not None else env["timeout"],
        socket_addr=env["socket_addr"],
        transport=env["transport"] if transport is None else transport.strip().lower(),
        nccl_library=env["nccl_library"],
        compression=env["compression"] if compression is None else str(compression),
        compression_inter_only=env["compression_inter_only"],
        compression_scale=env["compression_scale"],
        nan_check=env["nan_check"] if nan_check is None else bool(nan_check),
        two_d=env["two_d"],
        intra_size=env["intra_size"],
        hierarchical_threshold=env["hierarchical_threshold"],
        topk=env["topk"],
        topk_ratio=env["topk_ratio"],
        topk_threshold=env["topk_threshold"],
        topk_fp16=env["topk_fp16"],
    )


def _resolve_cuda_transport(config: _Config) -> str:
    """Which transport CUDA gradients use, checked now rather than mid-training.

    ``tcp`` is always possible. ``nccl`` needs CUDA and a loadable NCCL; when
    asked for explicitly, its absence is a ``CommError`` here. ``auto`` picks
    NCCL when both are there. A ``TIACC_TRAINING_NCCL_LIBRARY`` that does not
    load is an error even under ``auto``: an explicit setting is not ignored.
    """
    if config.transport == "tcp":
        return "tcp"
    version = None
    if config.transport == "nccl" or config.nccl_library is not None:
        version = _engine.nccl_version(nccl_search_dirs(), config.nccl_library)
    if config.transport == "nccl":
        if not torch.cuda.is_available():
            raise CommError(
                f"transport 'nccl' (TIACC_TRAINING_TRANSPORT or the transport argument) needs "
                f"a CUDA device, but torch.cuda.is_available() is False (NCCL "
                f"{'.'.join(map(str, version or ()))} loaded); use transport 'tcp' or 'auto'"
            )
        return "nccl"
    if not torch.cuda.is_available():
        return "tcp"
    if version is None:
        try:
            _engine.nccl_version(nccl_search_dirs(), None)
        except CommError as e:
            logger.info("NCCL is not usable (%s): CUDA gradients go over TCP", e)
            return "tcp"
    return "nccl"


def _init_process_group(backend: str | None, timeout: float) -> dict[str, Any]:
    """Creates the default group from the launcher's environment."""
    launch = _engine.launch_env()
    if launch is None:
        # A plain `python train.py`: a world of one.
        launch = {
            "launcher": "none",
            "rank": 0,
            "world_size": 1,
            "local_rank": 0,
            "local_size": 1,
            "master_addr": None,
            "master_port": None,
        }
    addr = launch["master_addr"]
    if addr is None:
        local_size = launch["local_size"]
        if launch["world_size"] == 1 or local_size == launch["world_size"]:
            addr = "127.0.0.1"
        else:
            raise ConfigError(
                f"MASTER_ADDR is not set and the {launch['launcher']} job spans several "
                "nodes: set it to rank 0's host (with mpirun: -x MASTER_ADDR=<host>)"
            )
    port = launch["master_port"]
    if port is None:
        port = _free_port() if launch["world_size"] == 1 else _DEFAULT_MASTER_PORT
    launch = {**launch, "master_addr": addr, "master_port": port}
    # Launchers other than torchrun leave these unset; code that reads them
    # after init (user scripts, libraries) then finds the usual names.
    os.environ.setdefault("RANK", str(launch["rank"]))
    os.environ.setdefault("WORLD_SIZE", str(launch["world_size"]))
    os.environ.setdefault("LOCAL_RANK", str(launch["local_rank"]))
    if launch["local_size"] is not None:
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(launch["local_size"]))
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    host = f"[{addr}]" if ":" in addr else addr
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{host}:{port}",
        rank=launch["rank"],
        world_size=launch["world_size"],
        timeout=datetime.timedelta(seconds=max(timeout, 60.0)),
    )
    return launch


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_config(config: _Config) -> None:
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    launcher = (_state.launch or {}).get("launcher", "user")
    if config.enabled:
        logger.info(
            "DDP communication through the tiacc engine (tcp): world_size=%d launcher=%s "
            "cuda_transport=%s channels=%d fusion_threshold=%d bytes (bucket_cap_mb=%.2f) "
            "timeout=%gs compression=%s%s nan_check=%s algorithm=%s",
            dist.get_world_size(),
            launcher,
            _state.cuda_transport
            + (" (requested: auto)" if config.transport == "auto" else "")
            + (" (host staging)" if _state.cuda_transport == "tcp" else ""),
            config.num_streams,
            config.fusion_threshold,
            config.fusion_threshold / _MIB,
            config.timeout,
            config.compression,
            " (between nodes only)" if config.compression_inter_only else "",
            "on" if config.nan_check else "off",
            (f"2d (threshold {config.hierarchical_threshold} bytes)" if config.two_d else "flat")
            + (
                f" + top-k {config.topk_ratio:g} (buckets >= {config.topk_threshold} bytes"
                f"{', fp16 values' if config.topk_fp16 else ''})"
                if config.topk
                else ""
            ),
        )
    else:
        logger.info(
            "tiacc engine disabled: DDP communicates natively (fusion_threshold=%d bytes)",
            config.fusion_threshold,
        )


# ----------------------------------------------------------------------------
# The DDP patch

_original_init = DistributedDataParallel.__init__
_original_register_comm_hook = DistributedDataParallel.register_comm_hook
_original_register_builtin = DistributedDataParallel._register_builtin_comm_hook
_init_signature = inspect.signature(_original_init)


class _HookState:
    """State of the engine's comm hook on one DDP model."""

    def __init__(self, engine: Any, process_group: Any, cuda: Any = None) -> None:
        self.engine = engine
        self.process_group = process_group
        # CUDA buckets: an _NcclChannels or a _HostStaging (None: CPU model).
        self.cuda = cuda
        self.user_hook: Callable[..., torch.futures.Future] | None = None
        self.user_state: Any = None


def _patch_ddp() -> None:
    if _state.patched:
        return
    DistributedDataParallel.__init__ = _patched_init  # type: ignore[method-assign]
    DistributedDataParallel.register_comm_hook = _patched_register_comm_hook  # type: ignore[method-assign]
    DistributedDataParallel._register_builtin_comm_hook = _patched_register_builtin  # type: ignore[method-assign]
    _state.patched = True


def _patched_init(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
    config = _state.config
    if config is not None:
        bound = _init_signature.bind(self, *args, **kwargs)
        if "bucket_cap_mb" not in bound.arguments:
            kwargs["bucket_cap_mb"] = config.fusion_threshold / _MIB
    _original_init(self, *args, **kwargs)
    if config is not None and config.enabled:
        _attach(self, config)


def _attach(ddp: DistributedDataParallel, config: _Config) -> None:
    """Registers the engine's hook on a freshly built DDP model."""
    group = ddp.process_group
    if (
        group is not None
        and group != dist.group.WORLD
        and (dist.get_world_size(group) != dist.get_world_size())
    ):
        logger.info("a DDP model on a sub-group communicates natively (the engine spans the world)")
        return
    devices = {p.device for p in ddp.module.parameters()}
    if any(d.type != "cpu" for d in devices):
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            logger.info(
                "parameters on several devices (%s): this model's gradients use native DDP "
                "communication",
                ", ".join(sorted(map(str, devices))),
            )
            return
        device = next(iter(devices))
        if _state.cuda_transport == "nccl":
            _check_one_gpu_per_rank(config, device)  # auto may fall back to tcp here
        if _state.cuda_transport == "nccl":
            state = _HookState(None, group, _nccl_channels(config, device))
        else:
            state = _HookState(None, group, _host_staging(config, device))
        ddp._tiacc_hook_state = state  # type: ignore[attr-defined]
        _original_register_comm_hook(ddp, state, _tiacc_comm_hook)
        return
    engine = _world_engine(config)
    state = _HookState(engine, group)
    ddp._tiacc_hook_state = state  # type: ignore[attr-defined]
    _original_register_comm_hook(ddp, state, _tiacc_comm_hook)


def _check_one_gpu_per_rank(config: _Config, device: torch.device) -> None:
    """Falls back to TCP staging (``auto``) when ranks share a GPU.

    NCCL needs one GPU per rank; ranks sharing one (several processes per
    GPU in tests, or a launcher given more processes than GPUs) would fail
    inside NCCL's init with a less helpful message. Every rank publishes its
    host and its GPU's UUID, so every rank sees the same list and takes the
    same branch. Under an explicit ``nccl`` transport sharing is a
    ``CommError`` naming the ranks.
    """
    _state.placement_round += 1
    store = dist.distributed_c10d._get_default_store()
    prefix = f"tiacc_training/gpu{_state.placement_round}"
    rank, world = dist.get_rank(), dist.get_world_size()
    identities = _exchange(store, prefix, rank, world, _gpu_identity(device), config.timeout)
    shared = _ranks_sharing(identities)
    if not shared:
        return
    where = "; ".join(
        f"ranks {', '.join(map(str, ranks))} share {identities[ranks[0]]}" for ranks in shared
    )
    if config.transport == "nccl":
        raise CommError(
            f"transport 'nccl' needs one GPU per rank, but {where}; use transport 'tcp' "
            "(host staging) or give each rank its own GPU"
        )
    logger.warning(
        "NCCL needs one GPU per rank, but %s: CUDA gradients go over TCP with host staging "
        "(transport auto)",
        where,
    )
    _state.cuda_transport = "tcp"


def _gpu_identity(device: torch.device) -> str:
    """``host/GPU <uuid>`` of ``device`` (its PCI address where no UUID is known).

    The UUID, not the index: ``CUDA_VISIBLE_DEVICES`` may number one GPU
    differently in each process.
    """
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "") or "")
    if not uuid:
        uuid = "pci " + ":".join(
            str(getattr(props, name, "?"))
            for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")
        )
    return f"{socket.gethostname()}/GPU {uuid}"


def _exchange(
    store: Any, prefix: str, rank: int, world: int, value: str, timeout: float
) -> list[str]:
    """Every rank's ``value``, in rank order, through the default group's store."""
    store.set(f"{prefix}/{rank}", value)
    keys = [f"{prefix}/{r}" for r in range(world)]
    store.wait(keys, datetime.timedelta(seconds=timeout))
    return [store.get(k).decode() for k in keys]


def _ranks_sharing(identities: list[str]) -> list[list[int]]:
    """Groups of ranks (two or more, in rank order) with the same identity."""
    by_identity: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        by_identity.setdefault(identity, []).append(rank)
    return sorted(ranks for ranks in by_identity.values() if len(ranks) > 1)


def _world_engine(config: _Config) -> Any:
    """The engine of the default group, connected on first use.

    DDP construction is collective, so every rank reaches this point in the
    same order and the rendezvous below pairs up.
    """
    engine = _state.engine
    if engine is not None and engine.connected:
        same = (
            not config.two_d
            and not config.topk
            and engine.two_d_members is None
            and engine.num_channels == config.num_streams
            and engine.timeout == config.timeout
            and engine.compression == _wire_compression(config, dist.get_world_size())
            and engine.nan_check == config.nan_check
        )
        if same:
            return engine
        engine.shutdown()
    _state.generation += 1
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    prefix = f"tiacc_training/engine{_state.generation}"
    intra_size = _intra_size(config, store, prefix, rank, world) if config.two_d else None
    inter_only = config.compression_inter_only and intra_size is not None
    engine = _engine.CommEngine(
        rank,
        world,
        config.num_streams,
        config.timeout,
        _advertised_host(config),
        compression=config.compression if inter_only else _wire_compression(config, world),
        compression_scale=config.compression_scale,
        nan_check=config.nan_check,
        intra_size=intra_size,
        hierarchical_threshold=config.hierarchical_threshold,
        compression_inter_only=inter_only,
        topk_ratio=config.topk_ratio if config.topk else None,
        topk_threshold=config.topk_threshold,
        topk_fp16=config.topk_fp16,
    )
    store.set(f"{prefix}/addr/{rank}", engine.address)
    if engine.two_d_addresses is not None:
        intra_addr, inter_addr = engine.two_d_addresses
        store.set(f"{prefix}/intra/{rank}", intra_addr)
        store.set(f"{prefix}/inter/{rank}", inter_addr)
    if rank == 0:
        store.set(f"{prefix}/token", _engine.random_token())
    keys = [f"{prefix}/addr/{r}" for r in range(world)] + [f"{prefix}/token"]
    if engine.two_d_addresses is not None:
        keys += [f"{prefix}/{g}/{r}" for g in ("intra", "inter") for r in range(world)]
    store.wait(keys, datetime.timedelta(seconds=config.timeout))
    addresses = [store.get(f"{prefix}/addr/{r}").decode() for r in range(world)]
    intra_addresses = inter_addresses = None
    if engine.two_d_members is not None:
        intra_members, inter_members = engine.two_d_members
        intra_addresses = [store.get(f"{prefix}/intra/{r}").decode() for r in intra_members]
        inter_addresses = [store.get(f"{prefix}/inter/{r}").decode() for r in inter_members]
    engine.connect(
        addresses,
        store.get(f"{prefix}/token"),
        _failure_board(store, f"{prefix}/first_failure"),
        intra_addresses,
        inter_addresses,
    )
    _state.engine = engine
    return engine


def _intra_size(config: _Config, store: Any, prefix: str, rank: int, world: int) -> int:
    """Ranks per node for the 2D allreduce, checked against every rank's host.

    ``LIGHT_INTRA_SIZE`` if set, else the launcher's local world size. Ranks
    ``n * size .. (n + 1) * size`` form node ``n``; each rank publishes its
    host name and local rank, and a node whose ranks are on different hosts
    (or whose local ranks do not match that numbering) is a ``ConfigError``.
    """
    launch = _state.launch or {}
    size = config.intra_size or launch.get("local_size")
    if size is None:
        raise ConfigError(
            "LIGHT_2D_ALLREDUCE=1 needs the number of ranks per node: set LIGHT_INTRA_SIZE "
            "(the launcher did not say)"
        )
    if world % size != 0:
        raise ConfigError(
            f"LIGHT_2D_ALLREDUCE=1: the world of {world} ranks does not split into nodes of "
            f"{size} ranks (LIGHT_INTRA_SIZE or the launcher's local world size)"
        )
    local_rank = launch.get("local_rank")
    published = f"{socket.gethostname()} {local_rank}"
    hosts = [
        v.split(" ")
        for v in _exchange(store, f"{prefix}/host", rank, world, published, config.timeout)
    ]
    for r, (host, local) in enumerate(hosts):
        first = (r // size) * size
        if host != hosts[first][0]:
            raise ConfigError(
                f"LIGHT_2D_ALLREDUCE=1: rank {r} is on host {host} but rank {first} of the same "
                f"node group (ranks {first}..{first + size - 1}) is on {hosts[first][0]}; "
                "set LIGHT_INTRA_SIZE to the ranks per host and launch ranks node by node"
            )
        if local != "None" and int(local) != r % size:
            raise ConfigError(
                f"LIGHT_2D_ALLREDUCE=1: rank {r} has local rank {local}, expected {r % size} "
                f"with {size} ranks per node"
            )
    return size


def _failure_board(store: Any, key: str) -> Callable[[str], str | None]:
    """The engine's failure hook, publishing the job's first failure.

    Ranks that only saw a neighbour hang up then name the rank that failed.
    """

    def on_failure(message: str) -> str | None:
        try:
            first = store.compare_set(key, "", message)
        except Exception:  # the store itself may be gone with rank 0
            return None
        return first.decode(errors="replace") if isinstance(first, bytes) else str(first)

    return on_failure


def _wire_compression(config: _Config, world: int) -> str:
    """The compression the flat ring applies.

    With scope ``inter`` it compresses only when the job spans several
    nodes, since the ring then carries traffic between them.
    """
    if not config.compression_inter_only:
        return config.compression
    local_size = (_state.launch or {}).get("local_size")
    spans_nodes = local_size is None or local_size < world
    return config.compression if spans_nodes else "none"


def _advertised_host(config: _Config) -> str:
    """The IP peers reach this rank on.

    The configured one, else the local address that routes to the
    rendezvous host.
    """
    if config.socket_addr:
        return config.socket_addr
    launch = _state.launch or {}
    host, port = launch.get("master_addr"), launch.get("master_port")
    if host is None:
        store = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        host, port = getattr(store, "host", None), getattr(store, "port", None)
    if host is None:
        return "127.0.0.1"
    return _engine.local_addr_towards(host, int(port or _DEFAULT_MASTER_PORT))


# ----------------------------------------------------------------------------
# CUDA buckets
#
# Stream ordering, for both transports: the hook runs on the thread that runs
# backward, after DDP copied the gradients into the bucket on torch's current
# stream. Each channel has its own CUDA stream; the hook makes it wait on the
# current stream (an event recorded there; no host wait), enqueues the work
# on the channel stream, marks the bucket as used there (record_stream, for
# the caching allocator) and returns a CUDA-aware future
# (``torch.futures.Future(devices=[device])``) completed from inside
# ``torch.cuda.stream(channel_stream)``: completing it records an event on
# the channel stream, and whoever consumes the result (DDP copying the
# bucket back into ``.grad``) makes its own stream wait on that event instead
# of blocking the host.
#
# Casts and scaling for fp16/bf16 compression are torch ops on the channel
# stream: they run on the GPU in stream order with the collective, need no
# host round trip, and halve what crosses the wire (and, when staging, the
# PCIe copies). Their arithmetic mirrors the engine's host codec: multiply
# by scale / world, cast, sum, cast back, divide by scale.


def _wire_dtype(config: _Config, world: int, dtype: torch.dtype) -> torch.dtype | None:
    """The half type float32/float64 CUDA buckets travel as, if compressed."""
    compression = _wire_compression(config, world)
    if world == 1 or dtype not in (torch.float32, torch.float64):
        return None
    return _WIRE_DTYPES.get(compression)


def _encode_on_stream(
    buf: torch.Tensor, wire: torch.dtype | None, world: int, scale: float, average: bool
) -> torch.Tensor:
    """The tensor to send, computed on the current (channel) stream.

    Without compression this is ``buf`` itself, pre-divided by the world
    size the way DDP's built-in allreduce does (a multiplication by
    ``1 / world`` while the bucket is filled).
    """
    if wire is None:
        if average and world > 1:
            buf.mul_(1.0 / world)
        return buf
    factor = (scale / world) if average else scale
    return (buf * factor).to(wire) if factor != 1.0 else buf.to(wire)


def _decode_on_stream(buf: torch.Tensor, sent: torch.Tensor, scale: float) -> None:
    """Writes the reduced ``sent`` back into ``buf`` (current stream)."""
    if sent is buf:
        return
    buf.copy_(sent)
    if scale != 1.0:
        buf.mul_(1.0 / scale)


class _NcclWatchdog:
    """Bounds every NCCL collective's wait; aborts the channels on failure.

    The hook hands it (communicator, event recorded after the collective,
    submission time); a daemon thread waits on each in turn through the
    engine's ``watch`` (GIL released between polls of the event). A timeout
    or an NCCL error aborts every channel's communicator, which ends the
    kernels still waiting on peers, and the next hook call raises it.
    """

    def __init__(self, timeout: float, channels: _NcclChannels) -> None:
        self.timeout = timeout
        self.channels = channels
        self.failure: BaseException | None = None
        self.queue: queue.SimpleQueue[tuple[Any, Any, float] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="tiacc-nccl-watchdog", daemon=True)
        self.thread.start()

    def submit(self, comm: Any, event: Any) -> None:
        self.queue.put((comm, event, time.monotonic()))

    def stop(self) -> None:
        self.queue.put(None)

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            comm, event, submitted = item
            if self.failure is not None:
                continue
            left = max(self.timeout - (time.monotonic() - submitted), 0.001)
            try:
                comm.watch(event.query, left, poll_interval=0.005)
            except Exception as exc:  # recorded; the next hook call raises it
                self.failure = exc
                self.channels.abort(f"aborted after a failure on another channel: {exc}")


class _NcclChannels:
    """One NCCL communicator and one CUDA stream per channel (world group)."""

    def __init__(self, comms: list[Any], device: torch.device, config: _Config) -> None:
        self.comms = comms
        self.device = device
        self.config = config
        self.world = dist.get_world_size()
        self.streams = [torch.cuda.Stream(device=device) for _ in comms]
        self.watchdog = _NcclWatchdog(config.timeout, self)

    def matches(self, config: _Config, device: torch.device) -> bool:
        """Whether these channels serve a model built with ``config`` on ``device``."""
        return (
            self.device == device
            and len(self.comms) == config.num_streams
            and self.config.timeout == config.timeout
            and self.config.compression == config.compression
            and self.config.compression_scale == config.compression_scale
            and not any(c.closed for c in self.comms)
        )

    def allreduce(self, buf: torch.Tensor, index: int) -> torch.futures.Future:
        """Averages ``buf`` over the world on channel ``index % channels``."""
        if self.watchdog.failure is not None:
            raise self.watchdog.failure
        channel = index % len(self.comms)
        comm, stream = self.comms[channel], self.streams[channel]
        wire = _wire_dtype(self.config, self.world, buf.dtype)
        scale = self.config.compression_scale if wire is not None else 1.0
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            sent = _encode_on_stream(buf, wire, self.world, scale, average=True)
            comm.allreduce(
                sent.data_ptr(),
                sent.data_ptr(),
                sent.numel(),
                str(sent.dtype),
                stream.cuda_stream,
                "sum",
            )
            _decode_on_stream(buf, sent, scale)
            done = torch.cuda.Event()
            done.record(stream)
            future: torch.futures.Future = torch.futures.Future(devices=[self.device])
            future.set_result(buf)
        # The bucket (and a temporary wire tensor, allocated on this stream)
        # is used on the channel stream: the allocator must not hand its
        # memory out again before that stream gets past this point.
        buf.record_stream(stream)
        self.watchdog.submit(comm, done)
        return future

    def abort(self, reason: str) -> None:
        for comm in self.comms:
            comm.abort(reason)

    def close(self) -> None:
        """Aborts the communicators (never waits on peers) and stops the watchdog."""
        self.watchdog.stop()
        self.abort("the tiacc engine was shut down")


def _nccl_channels(config: _Config, device: torch.device) -> _NcclChannels:
    """The NCCL channels for models on ``device``, created on first use.

    Rank 0 makes one unique id per channel and publishes them through the
    default group's store; every rank then joins the communicators in
    channel order (DDP construction is collective, so ranks get here in the
    same order).
    """
    existing = _state.nccl
    if existing is not None and existing.matches(config, device):
        return existing
    if existing is not None:
        existing.close()
        _state.nccl = None
    _state.generation += 1
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    prefix = f"tiacc_training/nccl{_state.generation}"
    dirs = nccl_search_dirs()
    keys = [f"{prefix}/id/{c}" for c in range(config.num_streams)]
    if rank == 0:
        for key in keys:
            store.set(key, _engine.nccl_unique_id(dirs, config.nccl_library))
    store.wait(keys, datetime.timedelta(seconds=config.timeout))
    comms = []
    with torch.cuda.device(device):
        # NCCL binds a communicator to the calling thread's current device
        # (whose context exists: DDP's parameters already live there).
        for key in keys:
            comms.append(
                _engine.NcclCommunicator(
                    store.get(key), rank, world, dirs, config.nccl_library, "world"
                )
            )
    if config.two_d or config.topk or config.nan_check:
        logger.info(
            "CUDA gradients over NCCL use a flat allreduce: the 2D allreduce, Top-K and the "
            "NaN check apply to gradients that go over TCP"
        )
    _state.nccl = _NcclChannels(comms, device, config)
    return _state.nccl


@dataclass
class _StagedJob:
    """One CUDA bucket on its way through host memory."""

    buf: torch.Tensor
    sent: torch.Tensor
    host: torch.Tensor
    ready: Any
    future: torch.futures.Future
    index: int
    scale: float
    compressed: bool


class _HostStaging:
    """CUDA buckets over the TCP engine, through pinned host memory.

    Per channel: a CUDA stream, a worker thread and pinned buffers (one per
    bucket index). The hook enqueues the device-to-host copy on the channel
    stream and an event after it, then returns; the worker waits for that
    event (``Event.synchronize`` releases the GIL; the training thread is
    never blocked), runs the TCP allreduce on the host buffer (GIL
    released), enqueues the host-to-device copy on the channel stream and
    completes the CUDA-aware future there.

    Reusing a pinned buffer is safe by stream order: the next device-to-host
    copy into it is enqueued after this step's future completed, so after
    the host-to-device copy that reads it, and the host only writes it
    after waiting for that next copy's event.
    """

    def __init__(self, engine: Any, device: torch.device, config: _Config) -> None:
        self.engine = engine
        self.device = device
        self.config = config
        self.world = dist.get_world_size()
        n = engine.num_channels
        self.streams = [torch.cuda.Stream(device=device) for _ in range(n)]
        self.pinned: dict[tuple[int, int], torch.Tensor] = {}
        self.queues: list[queue.SimpleQueue[_StagedJob | None]] = [
            queue.SimpleQueue() for _ in range(n)
        ]
        self.threads = [
            threading.Thread(target=self._run, args=(c,), name=f"tiacc-staging-{c}", daemon=True)
            for c in range(n)
        ]
        for t in self.threads:
            t.start()

    def matches(self, engine: Any, device: torch.device) -> bool:
        """Whether this staging serves ``engine`` on ``device``."""
        return self.engine is engine and self.device == device

    def _host_buffer(self, channel: int, index: int, like: torch.Tensor) -> torch.Tensor:
        key = (channel, index)
        host = self.pinned.get(key)
        if host is None or host.dtype != like.dtype or host.numel() != like.numel():
            host = torch.empty(like.numel(), dtype=like.dtype, pin_memory=True)
            self.pinned[key] = host
        return host

    def allreduce(self, buf: torch.Tensor, index: int) -> torch.futures.Future:
        """Averages ``buf`` over the world on channel ``index % channels``."""
        channel = index % len(self.streams)
        stream = self.streams[channel]
        wire = _wire_dtype(self.config, self.world, buf.dtype)
        scale = self.config.compression_scale if wire is not None else 1.0
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Without compression the engine averages on the host, as for CPU
            # buckets; with it, the GPU casts and the engine sums half floats.
            if wire is None:
                sent = buf
            else:
                sent = _encode_on_stream(buf, wire, self.world, scale, average=True)
            host = self._host_buffer(channel, index, sent)
            host.copy_(sent.view(-1), non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        buf.record_stream(stream)
        future: torch.futures.Future = torch.futures.Future(devices=[self.device])
        job = _StagedJob(buf, sent, host, ready, future, index, scale, wire is not None)
        self.queues[channel].put(job)
        return future.then(_unwrap)

    def _run(self, channel: int) -> None:
        stream = self.streams[channel]
        while True:
            job = self.queues[channel].get()
            if job is None:
                return
            try:
                job.ready.synchronize()
                self.engine.allreduce(
                    job.host.data_ptr(),
                    job.host.numel() * job.host.element_size(),
                    str(job.host.dtype),
                    job.index,
                    not job.compressed,
                )
                with torch.cuda.device(self.device), torch.cuda.stream(stream):
                    job.sent.view(-1).copy_(job.host, non_blocking=True)
                    if job.compressed:
                        _decode_on_stream(job.buf, job.sent, job.scale)
                    job.future.set_result(job.buf)
            except Exception as exc:  # handed to DDP through the future
                job.future.set_exception(exc)

    def close(self) -> None:
        """Stops the worker threads after the jobs already queued."""
        for q in self.queues:
            q.put(None)


def _host_staging(config: _Config, device: torch.device) -> _HostStaging:
    """The host staging for models on ``device`` over the world engine."""
    engine = _world_engine(config)
    existing = _state.staging
    if existing is not None and existing.matches(engine, device):
        return existing
    if existing is not None:
        existing.close()
    _state.staging = _HostStaging(engine, device, config)
    return _state.staging


def _tiacc_comm_hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP comm hook: hands the bucket to the engine, returns its future."""
    if state.user_hook is not None:
        return state.user_hook(state.user_state, bucket)
    buf = bucket.buffer()
    if buf.dtype not in _SUPPORTED_DTYPES or not buf.is_contiguous():
        return default_hooks.allreduce_hook(state.process_group, bucket)
    if buf.device.type == "cuda" and state.cuda is not None:
        return state.cuda.allreduce(buf, bucket.index())
    if buf.device.type != "cpu" or state.engine is None:
        return default_hooks.allreduce_hook(state.process_group, bucket)
    future: torch.futures.Future = torch.futures.Future()
    state.engine.allreduce_async(
        buf,
        buf.data_ptr(),
        buf.numel() * buf.element_size(),
        str(buf.dtype),
        bucket.index(),
        True,
        future,
    )
    # DDP reads the future from C++, where a Python-level set_exception is
    # just a value; unwrapping in a callback turns it into a real error, so
    # backward raises with the engine's message.
    return future.then(_unwrap)


def _unwrap(future: torch.futures.Future) -> torch.Tensor:
    return future.wait()


# DDP checks a hook's annotations as objects; this module's postponed
# (string) annotations would fail that check.
_tiacc_comm_hook.__annotations__ = {
    "state": _HookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _patched_register_comm_hook(
    self: DistributedDataParallel, state: object, hook: Callable[..., Any]
) -> None:
    hook_state = getattr(self, "_tiacc_hook_state", None)
    if not isinstance(hook_state, _HookState):
        _original_register_comm_hook(self, state, hook)
        return
    if hook_state.user_hook is not None:
        raise RuntimeError(
            "register_comm_hook or register_builtin_comm_hook can only be called once."
        )
    self._check_comm_hook(hook)
    hook_state.user_hook, hook_state.user_state = hook, state
    if self.logger is not None:
        self.logger._set_comm_hook_name(hook.__qualname__)
    self._comm_hooks.append((hook, state))
    logger.info(
        "user comm hook %s registered: the tiacc engine steps aside for this model",
        getattr(hook, "__qualname__", hook),
    )


def _patched_register_builtin(self: DistributedDataParallel, comm_hook_type: Any) -> None:
    if not isinstance(getattr(self, "_tiacc_hook_state", None), _HookState):
        _original_register_builtin(self, comm_hook_type)
        return
    hooks = {
        dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
        dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
    }
    if comm_hook_type not in hooks:
        raise ValueError(f"unknown built-in comm hook {comm_hook_type!r}")
    _patched_register_comm_hook(self, self.process_group, hooks[comm_hook_type])

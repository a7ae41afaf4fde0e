"""Which NCCL the engine loads, and whether CUDA buckets can use it.

CUDA buckets go over NCCL when CUDA is available, an NCCL library loads
and every rank has a GPU of its own, or NCCL lets ranks share one (NCCL
2.30 and later with ``NCCL_MULTI_RANK_GPU_ENABLE=1``; the rule lives in the
engine's configuration). Otherwise, under ``transport="auto"``, they are
staged through host memory over TCP; under an explicit ``"nccl"`` that is a
``CommError`` at once, never a failure inside NCCL later.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from typing import Any

import torch

from tiacc_training import _engine
from tiacc_training.errors import CommError

from ._rendezvous import default_store, exchange
from ._state import logger

_SINCE = ".".join(map(str, _engine.NCCL_MULTI_RANK_GPU_SINCE[:2]))
_SHARED_GPU_HOW = f"NCCL >= {_SINCE} with NCCL_MULTI_RANK_GPU_ENABLE=1"


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


def nccl_version(library: str | os.PathLike[str] | None = None) -> tuple[int, int, int]:
    """The version of the NCCL library the engine would use.

    Args:
        library: an NCCL library file to load; defaults to
            ``TIACC_TRAINING_NCCL_LIBRARY``, else the usual search.

    Returns:
        ``(major, minor, patch)``.

    Raises:
        CommError: no usable NCCL was found (the message says what was tried).
        ConfigError: an environment variable is invalid.
        TypeError: ``library`` is not a path.
    """
    if library is not None and not isinstance(library, (str, os.PathLike)):
        raise TypeError(f"library must be a path, got {library!r}")
    if library is None:
        library = _engine.CommConfig.from_env().nccl_library
    return _engine.nccl_version(nccl_search_dirs(), None if library is None else str(library))


def local_gpus_shared(launch: dict[str, Any]) -> bool:
    """Whether this node runs more ranks than it shows GPUs."""
    local_size = launch.get("local_size") or 1
    return torch.cuda.is_available() and local_size > torch.cuda.device_count()


def shared_gpu_unavailable(ranks: int) -> str | None:
    """Why ``ranks`` ranks cannot share one GPU here, or ``None``.

    The ranks are started with ``NCCL_MULTI_RANK_GPU_ENABLE=1`` and load
    the NCCL this process loads. For code that starts such ranks itself
    (the GPU tests, the benchmarks' emulated cluster); the rule is the
    core's.
    """
    need = f"{ranks} ranks on one GPU need NCCL >= {_SINCE}"
    try:
        version = nccl_version()
    except Exception as e:  # no NCCL library loads
        return f"{need}; none loads: {e}"
    if not _engine.nccl_allows_shared_gpu(version):
        return (
            f"{need} (found {'.'.join(map(str, version))}): point "
            "TIACC_TRAINING_NCCL_LIBRARY and LD_PRELOAD at a newer libnccl.so.2"
        )
    return None


def resolve_cuda_transport(config: Any, launch: dict[str, Any]) -> tuple[str, str | None]:
    """The transport of CUDA buckets, decided at init: ``(transport, reason)``.

    ``tcp`` is always possible. ``nccl`` needs CUDA and a loadable NCCL and,
    when this node runs more ranks than it has GPUs, an NCCL that allows
    ranks to share one; when asked for explicitly, a missing piece is a
    ``CommError`` here. ``auto`` takes NCCL when all are there. A
    ``TIACC_TRAINING_NCCL_LIBRARY`` that does not load is an error even
    under ``auto``: an explicit setting is not ignored.

    Returns:
        ``"nccl"`` or ``"tcp"``, and why when ``auto`` did not pick NCCL.
    """
    if not config.enabled or config.transport == "tcp":
        return "tcp", None
    explicit = config.transport == "nccl"
    version = None
    if explicit or config.nccl_library is not None:
        version = nccl_version(config.nccl_library)
    if not torch.cuda.is_available():
        if explicit:
            raise CommError(
                "transport 'nccl' (TIACC_TRAINING_TRANSPORT or the transport argument) needs "
                "a CUDA device, but torch.cuda.is_available() is False (NCCL "
                f"{'.'.join(map(str, version or ()))} loaded); use transport 'tcp' or 'auto'"
            )
        return "tcp", None
    if version is None:
        try:
            version = nccl_version(None)
        except CommError as e:
            logger.info("NCCL is not usable (%s): CUDA gradients go over TCP", e)
            return "tcp", f"NCCL is not usable: {e}"
    if local_gpus_shared(launch) and not config.nccl_allows_shared_gpu(version):
        why = (
            f"{launch.get('local_size')} ranks on this node share "
            f"{torch.cuda.device_count()} GPU(s), which NCCL {'.'.join(map(str, version))} "
            f"does not allow (it needs {_SHARED_GPU_HOW})"
        )
        if explicit:
            raise CommError(f"transport 'nccl': {why}; use transport 'tcp' or 'auto'")
        return "tcp", why
    return "nccl", None


def gpu_identity(device: torch.device) -> str:
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


def ranks_sharing(identities: list[str]) -> list[list[int]]:
    """Groups of ranks (two or more, in rank order) with the same identity."""
    by_identity: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        by_identity.setdefault(identity, []).append(rank)
    return sorted(ranks for ranks in by_identity.values() if len(ranks) > 1)


def check_gpu_placement(
    config: Any, device: torch.device, rank: int, world: int, prefix: str
) -> str | None:
    """Makes sure NCCL can run with the GPUs the ranks actually use.

    Run when the first CUDA model is wrapped: every rank publishes its host
    and its GPU's UUID under ``prefix``, so every rank sees the same list
    and takes the same branch. Ranks sharing a GPU are fine when NCCL
    allows it; otherwise ``auto`` turns to TCP host staging (with a warning
    naming the ranks) and an explicit ``nccl`` is a ``CommError`` naming
    them.

    Returns:
        ``None`` when NCCL can run; under ``auto``, which ranks share which
        GPU (the reason CUDA buckets go over TCP, for ``_runtime`` to adopt).
    """
    identities = exchange(
        default_store(), prefix, rank, world, gpu_identity(device), config.timeout
    )
    shared = ranks_sharing(identities)
    if not shared:
        return None
    version = nccl_version(config.nccl_library)
    if config.nccl_allows_shared_gpu(version):
        return None
    where = "; ".join(
        f"ranks {', '.join(map(str, ranks))} share {identities[ranks[0]]}" for ranks in shared
    )
    if config.transport == "nccl":
        raise CommError(
            f"transport 'nccl' needs one GPU per rank (or {_SHARED_GPU_HOW}), but {where}; "
            "use transport 'tcp' (host staging) or give each rank its own GPU"
        )
    logger.warning(
        "NCCL %s needs one GPU per rank (or %s), but %s: CUDA gradients go over TCP with "
        "host staging (transport auto)",
        ".".join(map(str, version)),
        _SHARED_GPU_HOW,
        where,
    )
    return where

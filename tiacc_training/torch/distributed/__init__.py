"""DDP communication through the tiacc-training engine.

Add two lines at the top of an ordinary DistributedDataParallel script::

    import tiacc_training.torch.distributed as tdist
    tdist.init_tiacc_training()

``init_tiacc_training`` leaves the default process group to the script's own
``init_process_group`` (or, for a script that never calls it, creates it
from torchrun, Open MPI's mpirun or SLURM on first use), then patches
``torch.nn.parallel.DistributedDataParallel`` so that every model wrapped
afterwards takes its bucket size from ``TIACC_TRAINING_FUSION_THRESHOLD``
and sends its gradient buckets through the engine. CPU buckets and CUDA
buckets run the same algorithms (flat ring or 2D, fp16/bf16 compression,
Top-K with error feedback, the NaN check) on several channels
(``TIACC_TRAINING_NUM_NCCL_STREAMS``): CPU buckets over TCP, CUDA buckets
over NCCL on one CUDA stream per channel (or, where NCCL cannot be used,
staged through host memory over TCP).

Every setting is an environment variable parsed by the engine (a bad value
raises ``ConfigError`` naming it); the arguments of
:func:`init_tiacc_training` override some of them and go through the same
parsers. Rank 0 logs, at start-up, which transport each kind of bucket
takes and what applies to it, and warns about every setting that cannot
apply. The variables are listed in the README.

A comm hook the user registers on a model (``register_comm_hook`` or a
built-in hook) replaces the engine for that model.

The package's modules, one job each: ``_config`` (the effective
configuration and the start-up report), ``_runtime`` (the process's default
group, the script's own ``init_process_group`` wrapped or ours on first
use, and the one writer of the process's state), ``_engines`` (the
engines built for a group),
``_launch`` (launcher to process group arguments), ``_nccl`` (which NCCL,
and whether CUDA buckets use it), ``_rendezvous`` (exchanges through the
store), ``_hook`` (the DDP patch and hook), ``_cuda`` (streams and futures
of CUDA buckets), ``_kernels`` (torch operations for the device engine),
``_state`` (process-wide state), ``_engine_state`` (the engines' state
across steps in checkpoints: :func:`state_dict`, :func:`load_state_dict`).
"""

from __future__ import annotations

import atexit
from typing import Any

import torch.distributed as dist

from tiacc_training import _engine
from tiacc_training.errors import CommError, ConfigError

from . import (
    _backend,
    _config,
    _device_collectives,
    _hook,
    _runtime,
    _summary,
    _waiting,
)
from ._engine_state import load_state_dict, state_dict
from ._hook import patch_ddp
from ._nccl import nccl_search_dirs, nccl_version
from ._state import logger, state
from ._summary import engine_counters

__all__ = [
    "CommError",
    "ConfigError",
    "comm_config",
    "cuda_transport",
    "engine_counters",
    "get_engine",
    "init_tiacc_training",
    "is_initialized",
    "load_state_dict",
    "logger",
    "nccl_search_dirs",
    "nccl_version",
    "shutdown",
    "state_dict",
    "stats",
]


def comm_config() -> dict[str, Any]:
    """The engine configuration from the environment.

    Returns:
        Every setting by name (``enabled``, ``fusion_threshold``,
        ``num_streams``, ``timeout``, ``transport``, ``compression``,
        ``algorithm``, ``topk``, ...).

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
    topk_momentum: float | None = None,
    topk_momentum_masking: bool | None = None,
    topk_warmup_steps: int | None = None,
    topk_clip_norm: float | None = None,
) -> None:
    """Initialise distributed training and route DDP through the engine.

    Call it at the top of the script, before the script's own
    ``torch.distributed.init_process_group``: the group is not created
    here. The script's call then runs with its own arguments (CPU
    collectives on the "tiacc" backend) and finishes this set-up; a script
    that never calls it gets the group from its launcher on first use (a
    DDP model, ``dist.get_rank()``, a collective). Called after the
    script's ``init_process_group``, it finishes the set-up at once.

    Safe to call more than once; later calls update the configuration used
    by DDP models built afterwards. Once the group exists, every rank calls
    it the same number of times, and the ranks check that they share the
    settings that must agree (channels, compression, algorithm, ...).

    Args:
        backend: process-group backend when the group is created from the
            launcher (default ``gloo``, or ``tiacc`` where it serves CPU
            collectives, for CPU tensors and, with CUDA, ``nccl`` for CUDA
            tensors, or ``gloo`` where ranks share GPUs that NCCL cannot
            share). The script's own ``init_process_group(backend=...)``
            wins over it, with a warning where they differ.
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
        topk_momentum: the momentum of your optimiser (``SGD(momentum=...)``)
            when Top-K is on: turns on Top-K's momentum correction (DGC);
            0 turns it off; overrides ``TIACC_TRAINING_TOPK_MOMENTUM``.
        topk_momentum_masking: with the momentum correction, also zero the
            velocity of entries that were sent (DGC's momentum factor
            masking); overrides ``TIACC_TRAINING_TOPK_MOMENTUM_MASKING``.
        topk_warmup_steps: steps over which Top-K's density falls from 25%
            to its ratio; overrides ``TIACC_TRAINING_TOPK_WARMUP_STEPS``.
        topk_clip_norm: clip each bucket's gradient to this norm before
            Top-K accumulates it (DGC's local clipping); overrides
            ``TIACC_TRAINING_TOPK_CLIP_NORM``.

    Raises:
        ConfigError: an environment variable or the launcher's variables
            are invalid, or ranks run with different values of a setting
            that must be the same everywhere (the message names the
            variable, both values and the ranks).
        CommError: ``transport="nccl"`` but CUDA is not available, the NCCL
            library cannot be loaded, or ranks share GPUs that NCCL cannot
            share; or ``TIACC_TRAINING_NCCL_LIBRARY`` names a file that is
            not a usable NCCL.
        ValueError: an argument's value is invalid (the message names it).
        TypeError: an argument has the wrong type.
    """
    config = _config.effective_config(
        fusion_threshold=fusion_threshold,
        num_streams=num_streams,
        timeout=timeout,
        enable=enable,
        compression=compression,
        nan_check=nan_check,
        transport=transport,
        topk_momentum=topk_momentum,
        topk_momentum_masking=topk_momentum_masking,
        topk_warmup_steps=topk_warmup_steps,
        topk_clip_norm=topk_clip_norm,
    )
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str, not {type(backend).__name__}")
    with state.lock:
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this PyTorch build")
        _runtime.configure(config, backend)
        patch_ddp()
        _runtime.mark_initialized()


def cuda_transport() -> str:
    """The transport CUDA gradients use: ``"nccl"`` or ``"tcp"``.

    Resolved by :func:`init_tiacc_training` from ``transport`` /
    ``TIACC_TRAINING_TRANSPORT``; ``"tcp"`` before it ran. Under ``auto``
    it turns to ``"tcp"`` when the first CUDA model is wrapped and ranks
    turn out to share a GPU that NCCL cannot share.
    """
    return state.cuda_transport


def is_initialized() -> bool:
    """Whether :func:`init_tiacc_training` has run in this process."""
    return state.initialized


def get_engine() -> Any:
    """The connected CPU engine of the default group.

    Returns:
        The engine, or ``None`` before the first DDP model with CPU buckets
        (or CUDA buckets staged through the host) was built, or when the
        engine is disabled.
    """
    return state.engine


def stats() -> dict[str, Any]:
    """What the engine did for this process's DDP models so far.

    Returns:
        ``steps`` (backward passes whose buckets reached the engine's hook),
        ``buckets`` and ``bytes`` handed to an engine per path (``"cpu"``,
        ``"cuda nccl"``, ``"cuda host staging"``; ``"world of one"`` for the
        buckets of a one-rank world, handed back as they are: their own
        average), ``accumulated`` (buckets
        kept local by gradient accumulation), ``native`` (buckets or models
        left to torch's own allreduce, per reason: each also warned once,
        or raised under ``TIACC_TRAINING_STRICT=1``), ``collectives``
        (the script's CPU collectives the "tiacc" backend served, per op),
        ``forwarded`` (those it handed to gloo, per op and reason:
        ``{"gather": {"an op the engine does not run": 2}}``),
        ``cuda_collectives`` and ``cuda_forwarded`` (the same for CUDA
        tensors under ``TIACC_TRAINING_CUDA_COLLECTIVES=tiacc``: served by
        the device engine, or handed to NCCL), ``engine``: the engines'
        own counters (:func:`engine_counters`), and ``waiting``: how long
        the DDP steps waited for communication after backward had computed
        every gradient (``steps`` measured, ``exposed_ms_per_step``,
        ``last_step_ms``, ``max_step_ms``) and the bytes each network
        interface of this host carried per measured step
        (``link_bytes_per_step``); with the engine switched off
        (``TIACC_TRAINING_DISABLE=1``) the same figures of native DDP.
    """
    totals = _hook.totals
    return {
        "steps": totals.steps,
        "buckets": dict(totals.carried),
        "bytes": dict(totals.carried_bytes),
        "accumulated": totals.accumulated,
        "native": dict(totals.native),
        "collectives": dict(_backend.served_in_process),
        "forwarded": _forwarded(_backend.forwarded_in_process),
        "cuda_collectives": dict(_device_collectives.served_in_process),
        "cuda_forwarded": _forwarded(_device_collectives.forwarded_in_process),
        "engine": engine_counters(),
        "waiting": _waiting.report(),
    }


def _forwarded(counts: Any) -> dict[str, dict[str, int]]:
    """Collectives forwarded underneath (``counts``), per op and reason."""
    table: dict[str, dict[str, int]] = {}
    for (op, why), n in sorted(counts.items()):
        table.setdefault(op, {})[why] = n
    return table


def shutdown() -> None:
    """Stops the engines' threads and communicators (also run at exit)."""
    _runtime.close_all()


# "tiacc" is a torch.distributed backend from the moment the package loads,
# so that init_process_group("tiacc") works with or without the two lines.
_backend.register()
atexit.register(shutdown)
atexit.register(_summary.report)  # runs before shutdown (last registered, first run)
# Ray's workers end without exit handlers: the summary also comes when the
# default group is destroyed (Ray Train destroys it as its workers stop).
_runtime.before_world_destroyed.append(_summary.report)

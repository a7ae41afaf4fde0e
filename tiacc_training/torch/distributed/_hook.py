"""The DDP patch and the engine's comm hook.

Every ``DistributedDataParallel`` built after ``init_tiacc_training`` takes
its bucket size from ``TIACC_TRAINING_FUSION_THRESHOLD`` and registers the
engine's hook: CPU buckets go to the CPU engine, CUDA buckets to the CUDA
path (NCCL channels or host staging). A comm hook the user registers on a
model replaces the engine for that model.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from . import _state
from ._cuda import unwrap
from ._engines import cuda_path, world_engine
from ._group import ensure_group
from ._state import logger, state

_MIB = 1024 * 1024
_SUPPORTED_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16}

_original_init = DistributedDataParallel.__init__
_original_register_comm_hook = DistributedDataParallel.register_comm_hook
_original_register_builtin = DistributedDataParallel._register_builtin_comm_hook
_init_signature = inspect.signature(_original_init)


class HookState:
    """State of the engine's comm hook on one DDP model."""

    def __init__(self, engine: Any, process_group: Any, cuda: Any = None) -> None:
        self.engine = engine
        self.process_group = process_group
        # CUDA buckets: a _cuda.NcclChannels or _cuda.HostStaging (None: CPU model).
        self.cuda = cuda
        self.user_hook: Callable[..., torch.futures.Future] | None = None
        self.user_state: Any = None
        # Local gradient accumulation (TIACC_TRAINING_ACCUMULATE_N_STEPS /
        # PERSEUS_ACCUMULATE_N_STEPS): the buckets go out in one backward
        # pass of every `accumulate_n_steps` that reach the hook.
        config = _state.state.config
        self.accumulate_n_steps: int = 1 if config is None else config.accumulate_n_steps
        self.passes = 0


def patch_ddp() -> None:
    """Patches ``DistributedDataParallel`` (once per process)."""
    if state.patched:
        return
    DistributedDataParallel.__init__ = _patched_init  # type: ignore[method-assign]
    DistributedDataParallel.register_comm_hook = _patched_register_comm_hook  # type: ignore[method-assign]
    DistributedDataParallel._register_builtin_comm_hook = _patched_register_builtin  # type: ignore[method-assign]
    state.patched = True


def _patched_init(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
    config = state.config
    if config is not None:
        bound = _init_signature.bind(self, *args, **kwargs)
        if bound.arguments.get("process_group") is None:
            ensure_group()
            config = state.config  # the script's init may have set its timeout
        if "bucket_cap_mb" not in bound.arguments:
            gradient_bytes = _gradient_bytes(bound.arguments["module"])
            kwargs["bucket_cap_mb"] = config.bucket_bytes(gradient_bytes) / _MIB
    _original_init(self, *args, **kwargs)
    if config is not None and config.enabled:
        _attach(self, config)


def _gradient_bytes(module: torch.nn.Module) -> int:
    """Bytes of the gradients DDP will bucket for ``module``."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def _attach(ddp: DistributedDataParallel, config: Any) -> None:
    """Registers the engine's hook on a freshly built DDP model."""
    group = ddp.process_group
    if (
        group is not None
        and group != dist.group.WORLD
        and (dist.get_world_size(group) != dist.get_world_size())
    ):
        if dist.get_rank(group) == 0:
            warnings.warn(
                f"tiacc_training: a DDP model on a sub-group of {dist.get_world_size(group)} "
                f"of the {dist.get_world_size()} ranks (process_group=) communicates through "
                "torch's own backend, not the tiacc engine: the engine's channels span the "
                "whole world",
                RuntimeWarning,
                stacklevel=3,
            )
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
        hook_state = HookState(None, group, cuda_path(config, next(iter(devices))))
    else:
        hook_state = HookState(world_engine(config), group)
    ddp._tiacc_hook_state = hook_state  # type: ignore[attr-defined]
    _original_register_comm_hook(ddp, hook_state, _tiacc_comm_hook)


def _tiacc_comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP comm hook: hands the bucket to the engine, returns its future."""
    if state.user_hook is not None:
        return state.user_hook(state.user_state, bucket)
    buf = bucket.buffer()
    if state.accumulate_n_steps > 1:
        communicates = state.passes % state.accumulate_n_steps == state.accumulate_n_steps - 1
        if bucket.is_last():
            state.passes += 1
        if not communicates:
            return _accumulated_locally(buf)
    if buf.dtype not in _SUPPORTED_DTYPES or not buf.is_contiguous():
        return default_hooks.allreduce_hook(state.process_group, bucket)
    perf = _state.state.perf
    if perf is not None and bucket.index() == 0:
        engine = state.engine if state.cuda is None else state.cuda.engine
        perf.before_step(engine, buf.device)
    if buf.device.type == "cuda" and state.cuda is not None:
        _state.state.engine_buckets += 1
        return state.cuda.allreduce(buf, bucket.index())
    if buf.device.type != "cpu" or state.engine is None:
        return default_hooks.allreduce_hook(state.process_group, bucket)
    _state.state.engine_buckets += 1
    future: torch.futures.Future = torch.futures.Future()
    state.engine.allreduce_async(
        buf,
        buf.data_ptr(),
        buf.numel() * buf.element_size(),
        str(buf.dtype),
        bucket.index(),
        True,
        future,
        True,
    )
    return future.then(functools.partial(_bucket_result, buf.dtype))


def _accumulated_locally(buf: torch.Tensor) -> torch.futures.Future:
    """A bucket that does not go out in this backward pass.

    DDP filled the bucket from the parameters' ``.grad`` (this rank's sum
    since the last communication), so handing it back unchanged leaves
    ``.grad`` as it is: this pass's gradients stay added locally, as under
    ``no_sync()``. With ``gradient_as_bucket_view`` the bucket is ``.grad``
    itself and DDP copies nothing.
    """
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buf)
    return future


def _bucket_result(dtype: torch.dtype, future: torch.futures.Future) -> torch.Tensor:
    """The allreduced bucket, from the engine's future.

    That is the bucket itself, or a tensor over the result the engine left
    in memory the host's ranks share: DDP copies it into the gradients as it
    would copy the bucket, and the engine keeps it unchanged until this
    bucket's next allreduce, after the next backward pass.
    """
    value = unwrap(future)
    if isinstance(value, torch.Tensor):
        return value
    memory = (ctypes.c_ubyte * value.nbytes).from_address(value.ptr)
    # The tensor keeps `memory` alive, and `memory` the mapping.
    memory._tiacc_result = value  # type: ignore[attr-defined]
    return torch.frombuffer(memory, dtype=dtype)


# DDP checks a hook's annotations as objects; this module's postponed
# (string) annotations would fail that check.
_tiacc_comm_hook.__annotations__ = {
    "state": HookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _patched_register_comm_hook(
    self: DistributedDataParallel, state: object, hook: Callable[..., Any]
) -> None:
    hook_state = getattr(self, "_tiacc_hook_state", None)
    if not isinstance(hook_state, HookState):
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
    if hasattr(self, "_comm_hooks"):  # torch >= 2.1 keeps the registered hooks here
        self._comm_hooks.append((hook, state))
    logger.info(
        "user comm hook %s registered: the tiacc engine steps aside for this model",
        getattr(hook, "__qualname__", hook),
    )


def _patched_register_builtin(self: DistributedDataParallel, comm_hook_type: Any) -> None:
    if not isinstance(getattr(self, "_tiacc_hook_state", None), HookState):
        _original_register_builtin(self, comm_hook_type)
        return
    hooks = {
        dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
        dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
    }
    if comm_hook_type not in hooks:
        raise ValueError(f"unknown built-in comm hook {comm_hook_type!r}")
    _patched_register_comm_hook(self, self.process_group, hooks[comm_hook_type])

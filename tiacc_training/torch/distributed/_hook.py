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
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from tiacc_training.errors import CommError

from . import _engine_state, _perf, _waiting
from ._cuda import unwrap
from ._dynamo import compiling
from ._runtime import cuda_path, ensure_group, world_engine
from ._state import logger
from ._state import state as runtime

_MIB = 1024 * 1024
# The span of the engine's comm hook in torch's profiler (on the thread that
# runs backward, where DDP calls the hook).
PROFILE_HOOK = "tiacc_training.comm_hook"
_SUPPORTED_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16}

_original_init = DistributedDataParallel.__init__
_original_register_comm_hook = DistributedDataParallel.register_comm_hook
_original_register_builtin = DistributedDataParallel._register_builtin_comm_hook
_init_signature = inspect.signature(_original_init)

# The hook's counters (``HookState``'s, and ``totals.steps``): a CUDA
# model's gradient and comm hooks run on autograd's device threads, the
# check on the thread that calls the model.
_counters = threading.Lock()
# DistributedDataParallel is patched (once per process).
_patched = False


@dataclass
class HookTotals:
    """What the gradient buckets of this process did (``stats()``).

    Counted by the DDP hook and by :func:`carry_bucket` (Horovod's
    ``DistributedOptimizer`` too).
    """

    # Backward passes whose buckets reached the engine.
    steps: int = 0
    # Buckets handed to an engine, per path, and their bytes.
    carried: Counter[str] = field(default_factory=Counter)
    carried_bytes: Counter[str] = field(default_factory=Counter)
    # Buckets kept local by gradient accumulation.
    accumulated: int = 0
    # Buckets or models left to torch's own allreduce, per reason.
    native: Counter[str] = field(default_factory=Counter)

    @property
    def engine_buckets(self) -> int:
        """Buckets handed to an engine, over every path."""
        return sum(self.carried.values())


totals = HookTotals()


class HookState:
    """State of the engine's comm hook on one DDP model."""

    def __init__(
        self, engine: Any, process_group: Any, cuda: Any = None, native: bool = False
    ) -> None:
        self.engine = engine
        self.process_group = process_group
        # The engine is switched off: every bucket goes to torch's allreduce
        # (timed, so that stats() shows the native step's wait too).
        self.native = native
        # Each step's wait for its buckets (stats()["waiting"]).
        self.clock = _waiting.StepClock()
        # CUDA buckets: a _cuda.NcclChannels or _cuda.HostStaging (None: CPU model).
        self.cuda = cuda
        self.user_hook: Callable[..., torch.futures.Future] | None = None
        self.user_state: Any = None
        # Local gradient accumulation (TIACC_TRAINING_ACCUMULATE_N_STEPS /
        # PERSEUS_ACCUMULATE_N_STEPS): the buckets go out in one backward
        # pass of every `accumulate_n_steps` that reach the hook.
        config = runtime.config
        self.accumulate_n_steps: int = 1 if config is None else config.accumulate_n_steps
        self.passes = 0
        # A world of one rank: the average over the world is the bucket
        # itself, so the hook hands it back without an engine call (unless
        # the NaN check asks to look at it first).
        carrier = engine if cuda is None else cuda.engine
        self.alone = process_group.size() == 1 and not getattr(carrier, "nan_check", False)
        # The never-ran check (``_watch_for_a_hook_that_never_runs``): calls
        # of the hook; ``calls`` when the last forward prepared DDP's reducer
        # for a synced backward (None: no such forward since the last
        # backward); ``calls`` when that backward accumulated gradients
        # (None: none waiting for the check); synced backward passes, and
        # those the hook missed.
        self.calls = 0
        self.armed_at: int | None = None
        self.pending_since: int | None = None
        self.synced_backwards = 0
        self.missed = 0
        self.reported = False


def patch_ddp() -> None:
    """Patches ``DistributedDataParallel`` (once per process)."""
    global _patched
    if _patched:
        return
    DistributedDataParallel.__init__ = _patched_init  # type: ignore[method-assign]
    DistributedDataParallel.register_comm_hook = _patched_register_comm_hook  # type: ignore[method-assign]
    DistributedDataParallel._register_builtin_comm_hook = _patched_register_builtin  # type: ignore[method-assign]
    _patched = True


def _patched_init(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
    config = runtime.config
    if config is not None:
        bound = _init_signature.bind(self, *args, **kwargs)
        if bound.arguments.get("process_group") is None:
            ensure_group()
            config = runtime.config  # the script's init may have set its timeout
        source = "the script's bucket_cap_mb"
        if "bucket_cap_mb" not in bound.arguments:
            gradient_bytes = _gradient_bytes(bound.arguments["module"])
            kwargs["bucket_cap_mb"] = config.bucket_bytes(gradient_bytes) / _MIB
            source = "fusion_threshold: the script gave no bucket_cap_mb"
        cap = kwargs.get("bucket_cap_mb", bound.arguments.get("bucket_cap_mb"))
    _original_init(self, *args, **kwargs)
    if config is not None and getattr(self, "_use_python_reducer", False):
        _python_reducer_stays_native(config)
    elif config is not None and config.enabled:
        _attach(self, config)
        if runtime.logged:  # rank 0, after its start-up report
            logger.info(
                "  DDP model: %.2f MiB of gradients in buckets of at most %s MiB (%s)",
                _gradient_bytes(self.module) / _MIB,
                f"{cap:g}" if isinstance(cap, (int, float)) else "torch's default",
                source,
            )
    elif config is not None:
        # The engine is off: torch's own allreduce, timed like the engine's.
        hook_state = HookState(None, self.process_group, native=True)
        self._tiacc_hook_state = hook_state  # type: ignore[attr-defined]
        _original_register_comm_hook(self, hook_state, _tiacc_comm_hook)


# Why a model built in DDP's python_reducer mode is left to torch.
PYTHON_REDUCER = (
    "a DDP model built under torch._dynamo.config.optimize_ddp='python_reducer' (compiled "
    "autograd) reduces each gradient in the compiled backward graph with torch's functional "
    "collectives on the group's backend, one call per gradient, not through DDP's buckets "
    "and the engine's comm hook"
)


def _python_reducer_stays_native(config: Any) -> None:
    """Leaves a python_reducer model to torch at once: no hook, one line, counted.

    In that mode DDP calls each comm hook per parameter with ``(grad,
    param)`` instead of a bucket and drops what the hook returns; the
    reduction torch traces instead is its own.
    """
    totals.native[PYTHON_REDUCER] += 1
    _step_aside(
        config,
        PYTHON_REDUCER,
        "leave optimize_ddp at its default for the engine to carry DDP's buckets",
        warn=runtime.config is None or dist.get_rank() == 0,
    )


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
        _step_aside(
            config,
            f"a DDP model on a sub-group of {dist.get_world_size(group)} of the "
            f"{dist.get_world_size()} ranks (process_group=) communicates through torch's own "
            "backend, not the tiacc engine: the engine's channels span the whole world",
            "build the model on the whole world to use the engine",
            warn=dist.get_rank(group) == 0,
        )
        return
    devices = {p.device for p in ddp.module.parameters()}
    if any(d.type != "cpu" for d in devices):
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            _step_aside(
                config,
                f"a DDP model with parameters on several devices "
                f"({', '.join(sorted(map(str, devices)))}) communicates through torch's own "
                "backend, not the tiacc engine",
                "keep each rank's parameters on one device (its GPU, or the CPU)",
            )
            return
        hook_state = HookState(None, group, cuda_path(config, next(iter(devices))))
    else:
        hook_state = HookState(world_engine(config), group)
    ddp._tiacc_hook_state = hook_state  # type: ignore[attr-defined]
    _original_register_comm_hook(ddp, hook_state, _tiacc_comm_hook)
    _watch_for_a_hook_that_never_runs(ddp, hook_state, config)


# The reasons a model or bucket was left to torch, each warned about once
# per process.
_warned: set[str] = set()


def _step_aside(config: Any, what: str, fix: str, warn: bool = True) -> None:
    """A model or bucket left to torch: one warning per reason, or an error.

    Raises:
        CommError: ``TIACC_TRAINING_STRICT=1``.
    """
    if config is not None and config.strict:
        raise CommError(f"{what}; {fix} (TIACC_TRAINING_STRICT=1 makes this an error)")
    if warn and what not in _warned:
        _warned.add(what)
        warnings.warn(f"tiacc_training: {what}; {fix}", RuntimeWarning, stacklevel=4)


def _watch_for_a_hook_that_never_runs(
    ddp: DistributedDataParallel, hook_state: HookState, config: Any
) -> None:
    """Reports, at the next forward, a synced backward pass the engine never saw.

    A backward pass is synced (DDP's reducer reduces its buckets, through
    the engine's comm hook) exactly when the forward that built it ran
    DDP's ``prepare_for_backward``: grad mode on and
    ``require_backward_grad_sync`` (not under ``no_sync()``) at that
    forward. A forward hook takes that decision as DDP took it, and a
    post-accumulate-grad hook on one parameter (which fires where DDP's own
    autograd hooks fire: when a gradient is accumulated into ``.grad``)
    counts the pass. The next forward's pre-hook checks that the comm hook
    ran since that forward. A backward through the wrapped module itself,
    one whose forward ran under ``no_sync()``, or ``torch.autograd.grad``
    (which accumulates nothing) is no synced pass, and is not counted. The
    hook can be missing when something replaced DDP's hook registration
    before this package loaded, or registered a hook through another route.
    """
    parameter = next((p for p in ddp.module.parameters() if p.requires_grad), None)
    if parameter is None:
        return

    def arm(module: Any, inputs: Any, output: Any) -> None:
        if compiling():
            return  # traced into a compiled forward: the check stays out of the graph
        # DDP's own condition for prepare_for_backward, at the same moment.
        if not inside(ddp):
            return  # the wrapped module called on its own, not through DDP's forward
        if not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
            return
        if getattr(ddp, "_delay_all_reduce_all_params", False):
            return  # every parameter is delayed: no bucket goes through a hook
        with _counters:
            hook_state.armed_at = hook_state.calls

    def count_backward(*_: Any) -> None:
        if compiling():
            return  # compiled autograd traces the backward
        with _counters:
            if hook_state.armed_at is None:
                return
            hook_state.pending_since = hook_state.armed_at
            hook_state.armed_at = None
            hook_state.synced_backwards += 1

    def check(module: Any, inputs: Any) -> None:
        if compiling() or not inside(ddp):
            return
        with _counters:
            since = hook_state.pending_since
            if since is None:
                return
            hook_state.pending_since = None
            if hook_state.calls > since or hook_state.user_hook is not None:
                return
            hook_state.missed += 1
            if hook_state.reported:
                return
            hook_state.reported = True
            missed = hook_state.missed
        totals.native["the comm hook never ran"] += 1
        _step_aside(
            config,
            f"the tiacc engine's comm hook did not run in {missed} "
            "backward pass(es) of a DDP model built after init_tiacc_training(): its "
            "gradients went through torch's own allreduce (something replaced DDP's "
            "comm hook registration)",
            "import tiacc_training.torch.distributed and call init_tiacc_training() before "
            "other libraries that patch DistributedDataParallel",
        )

    if hasattr(parameter, "register_post_accumulate_grad_hook"):  # torch >= 2.1
        parameter.register_post_accumulate_grad_hook(count_backward)
    else:  # torch 2.0: the gradient as computed (autograd.grad counts too)
        parameter.register_hook(count_backward)
    # On the wrapped module, which DDP's forward calls: hooks on the DDP
    # model itself would make a compiled DDP model's forward break once more.
    ddp.module.register_forward_hook(arm)
    ddp.module.register_forward_pre_hook(check)


def inside(ddp: DistributedDataParallel) -> bool:
    """Whether ``ddp``'s forward is running (it marks itself active around its module's call).

    A torch whose DDP does not mark itself counts every call of the wrapped
    module as DDP's.
    """
    return getattr(DistributedDataParallel, "_active_ddp_module", ddp) is ddp


def _tiacc_comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP comm hook: hands the bucket to the engine, returns its future.

    Every bucket that communicates is timed (``_waiting``); those kept local
    by gradient accumulation are not.
    """
    if state.user_hook is not None:
        return _timed(state, bucket, state.user_hook(state.user_state, bucket))
    if state.native:
        return _timed(state, bucket, default_hooks.allreduce_hook(state.process_group, bucket))
    if torch.autograd._profiler_enabled():
        # Under torch's profiler, the hook's own time is a span of its own
        # (``PROFILE_HOOK``), next to DDP's and autograd's in the user's trace.
        with torch.profiler.record_function(PROFILE_HOOK):
            return _route(state, bucket)
    return _route(state, bucket)


def _timed(
    state: HookState, bucket: dist.GradBucket, future: torch.futures.Future
) -> torch.futures.Future:
    return _waiting.timed(state.clock, bucket.is_last(), future)


def _route(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """Where one of the engine hook's buckets goes: the engine, torch, or nowhere."""
    buf = bucket.buffer()
    with _counters:
        state.calls += 1
        if bucket.is_last():
            totals.steps += 1
    if state.accumulate_n_steps > 1:
        communicates = state.passes % state.accumulate_n_steps == state.accumulate_n_steps - 1
        if bucket.is_last():
            state.passes += 1
        if not communicates:
            totals.accumulated += 1
            return _accumulated_locally(buf)
    if buf.dtype not in _SUPPORTED_DTYPES:
        return _native(
            state,
            bucket,
            f"gradient buckets of {buf.dtype} go through torch's allreduce: the engine "
            "carries float32, float64, float16 and bfloat16",
            "train in one of those dtypes",
        )
    if not buf.is_contiguous():
        return _native(
            state,
            bucket,
            "a gradient bucket that is not contiguous goes through torch's allreduce",
            "report it with the model: DDP's buckets are contiguous",
        )
    if state.alone:
        _carried("world of one", buf.numel() * buf.element_size())
        return _accumulated_locally(buf)  # nothing to wait for: not timed
    perf = _perf.active()
    if perf is not None and bucket.index() == 0:
        engine = state.engine if state.cuda is None else state.cuda.engine
        perf.before_step(engine, buf.device)
    if buf.device.type == "cuda" and state.cuda is not None:
        return _timed(state, bucket, carry_bucket(buf, bucket.index(), cuda=state.cuda))
    if buf.device.type != "cpu" or state.engine is None:
        return _native(
            state,
            bucket,
            f"gradient buckets on {buf.device} go through torch's allreduce: the engine "
            "carries CPU and CUDA buckets",
            "keep the model on the CPU or a CUDA device",
        )
    return _timed(state, bucket, carry_bucket(buf, bucket.index(), engine=state.engine))


def carry_bucket(
    buf: torch.Tensor,
    index: int,
    engine: Any = None,
    cuda: Any = None,
    average: bool = True,
) -> torch.futures.Future:
    """Carries one flat gradient bucket through the engine; returns its future.

    The one path of every gradient bucket (the DDP hook's, and Horovod's
    ``DistributedOptimizer``'s): a CUDA bucket goes to ``cuda`` (NCCL
    channels or host staging), a CPU bucket to ``engine``'s
    ``allreduce_async``, and the bucket is counted in ``stats()``. The
    caller has checked that ``buf`` is contiguous, of a dtype the engine
    carries, and on the CPU (with ``engine``) or a CUDA device (with
    ``cuda``); it must not touch ``buf`` until the future completes.

    Args:
        buf: the flat bucket (reduced in place, or read as scratch).
        index: the bucket's index, the same on every rank (it picks the
            channel, and keys the engine's per-bucket state).
        engine: the CPU engine (``_engine.CommEngine``), for a CPU bucket.
        cuda: a ``_cuda.NcclChannels`` or ``_cuda.HostStaging``, for a CUDA
            bucket.
        average: divide the sum by the world size (the CUDA paths always do).

    Returns:
        A future of the reduced bucket: ``buf`` itself, or a tensor over the
        result in memory the host's ranks share, which stays valid until the
        next allreduce of this bucket index.

    Raises:
        ValueError: neither path given, or ``average=False`` for a CUDA bucket.
    """
    nbytes = buf.numel() * buf.element_size()
    if _engine_state.expected_sizes:
        _engine_state.check_bucket(index, nbytes)
    if cuda is not None:
        if not average:
            raise ValueError("carry_bucket: the CUDA paths average (average=False given)")
        _carried(f"cuda {cuda.kind}", nbytes)
        return cuda.allreduce(buf, index)
    if engine is None:
        raise ValueError("carry_bucket: give engine= (CPU bucket) or cuda= (CUDA bucket)")
    _carried("cpu", nbytes)
    future: torch.futures.Future = torch.futures.Future()
    engine.allreduce_async(
        buf, buf.data_ptr(), nbytes, str(buf.dtype), index, average, future, True
    )
    return future.then(functools.partial(_bucket_result, buf.dtype))


def count_step() -> None:
    """Counts a backward pass whose buckets reached the engine (``stats()["steps"]``)."""
    with _counters:
        totals.steps += 1


def _carried(path: str, nbytes: int) -> None:
    """Counts a bucket handed to an engine (``stats()``)."""
    totals.carried[path] += 1
    totals.carried_bytes[path] += nbytes


def _native(state: HookState, bucket: dist.GradBucket, why: str, fix: str) -> torch.futures.Future:
    """A bucket handed to torch's allreduce: counted, warned once, or an error."""
    totals.native[why] += 1
    _step_aside(runtime.config, why, fix)
    return _timed(state, bucket, default_hooks.allreduce_hook(state.process_group, bucket))


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

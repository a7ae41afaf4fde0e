"""Horovod's DistributedOptimizer: gradients reduced in fused buckets as they become ready.

``DistributedOptimizer`` wraps a torch optimizer: a hook on every
parameter fires as its gradient is accumulated in backward, and the
gradients are packed, in the order they become ready, into fusion buckets
of the engine's size (``config.bucket_bytes``: ``TIACC_TRAINING_FUSION_THRESHOLD``,
``HOROVOD_FUSION_THRESHOLD`` or AIACC's fraction, as for DDP's buckets).
Each full bucket goes down the same path as the DDP hook's buckets
(``_hook.carry_bucket``: the CPU engine, or NCCL channels / host staging
for CUDA), so the engine's channels, 2D algorithm, wire compression, Top-K
and NaN check apply, and ``tdist.stats()`` counts the buckets. ``step()``
(or ``synchronize()``) waits for the buckets and writes the reduced
gradients back into ``.grad``. The buckets are planned in ``_buckets``;
``broadcast_parameters`` and ``broadcast_optimizer_state`` live in
``_broadcast_state``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tiacc_training.errors import CommError
from tiacc_training.torch.distributed import _config, _hook, _perf, _runtime

from . import _basics, _init, _timeline
from ._allgather import allgather
from ._allreduce import allreduce, grouped_allreduce_async_
from ._broadcast import broadcast_object
from ._broadcast_state import broadcast_optimizer_state, broadcast_parameters
from ._buckets import Bucket, cut, first_plan, fusion_bytes, named_parameters_of
from ._common import Adasum, Average, Sum
from ._compression import Compression
from ._exceptions import HorovodInternalError
from ._handles import synchronize
from ._process_sets import global_process_set

__all__ = ["DistributedOptimizer", "broadcast_optimizer_state", "broadcast_parameters"]

# The engine's bucket indices of Horovod buckets start here, so that they
# never share the engine's per-bucket state (Top-K residuals, shared
# results) with a DDP model's buckets in the same process.
_BUCKET_BASE = 1 << 20
# Each DistributedOptimizer of the process gets its own range of indices
# (every rank builds its optimizers in the same order, so they agree).
_INDICES_PER_OPTIMIZER = 1 << 16
_optimizers_built = 0
_ENGINE_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16}


class _DistributedMixin:
    """The methods a ``DistributedOptimizer`` adds to the wrapped class."""

    _hvd_names: dict[torch.nn.Parameter, str]

    # -- set-up --------------------------------------------------------------

    def _hvd_setup(
        self,
        named_parameters: list[tuple[str, torch.nn.Parameter]],
        compression: Any,
        backward_passes_per_step: int,
        op: Any,
        gradient_predivide_factor: float,
        groups: list[list[torch.nn.Parameter]] | int | None,
        sparse_as_dense: bool,
        process_set: Any,
    ) -> None:
        self._hvd_names = {p: name for name, p in named_parameters}
        # Horovod's attribute for the same map (scripts and tests read it).
        self._parameter_names = self._hvd_names
        self._hvd_compression = compression
        self._hvd_passes = backward_passes_per_step
        self._hvd_op = op
        self._hvd_predivide = float(gradient_predivide_factor)
        self._hvd_sparse_as_dense = sparse_as_dense
        self._hvd_process_set = process_set
        self._hvd_params = [
            p for group in self.param_groups for p in group["params"] if p.requires_grad
        ]
        self._hvd_position = {p: i for i, p in enumerate(self._hvd_params)}
        self._hvd_delay = dict.fromkeys(self._hvd_params, backward_passes_per_step)
        self._hvd_ready_order: list[int] = []
        self._hvd_rebuilt = groups is not None
        self._hvd_synchronized = False
        self._hvd_should_synchronize = True
        self._hvd_hooks: list[Any] = []
        self._hvd_dispatched: list[Bucket] = []
        self._hvd_sparse: list[Bucket] = []
        # Sparse gradients reduced dense (sparse_as_dense): sparse again after.
        self._hvd_densified: list[torch.nn.Parameter] = []
        self._hvd_steps = 0
        global _optimizers_built
        self._hvd_first_index = _BUCKET_BASE + _optimizers_built * _INDICES_PER_OPTIMIZER
        _optimizers_built += 1
        world = _set_size(process_set)
        self._hvd_threshold = fusion_bytes(self._hvd_params)
        self._hvd_groups = groups
        self._hvd_plan = first_plan(self._hvd_params, groups, self._hvd_threshold)
        # The world (hvd.init()) the buckets were planned in.
        self._hvd_world_seen = _basics.job.worlds
        self._hvd_engine_reason = _engine_reason(op, process_set)
        # In an elastic job the world can grow later: hooks from the start,
        # as Horovod's optimizer has them there.
        elastic = _init.elastic_membership() is not None
        if (world > 1 or elastic) and process_set.included():
            self._hvd_register_hooks()

    def _hvd_register_hooks(self) -> None:
        for p in self._hvd_params:
            if hasattr(p, "register_post_accumulate_grad_hook"):
                self._hvd_hooks.append(p.register_post_accumulate_grad_hook(self._hvd_hook))
            else:  # torch < 2.1: the hook of the parameter's gradient accumulator
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
                hook = functools.partial(_legacy_hook, self, p)
                self._hvd_hooks.append(accumulator.register_hook(hook))
                self._hvd_hooks.append(accumulator)  # keeps it alive

    # -- backward ------------------------------------------------------------

    def _hvd_follow_world(self) -> None:
        """Starts the buckets afresh when Horovod started again since they were planned.

        After ``shutdown()`` and ``init()`` (an elastic job's new round,
        where workers that just joined have never stepped), every rank
        drops what a failed step left in flight and plans its buckets as
        for a first step, so that all of them cut the same buckets again.
        """
        if self._hvd_world_seen == _basics.job.worlds:
            return
        self._hvd_world_seen = _basics.job.worlds
        self._hvd_plan = first_plan(self._hvd_params, self._hvd_groups, self._hvd_threshold)
        self._hvd_rebuilt = self._hvd_groups is not None
        self._hvd_ready_order = []
        self._hvd_synchronized = False
        self._hvd_engine_reason = _engine_reason(self._hvd_op, self._hvd_process_set)
        self._hvd_clear()

    def _hvd_hook(self, p: torch.nn.Parameter) -> None:
        """A parameter's gradient was accumulated in backward."""
        self._hvd_follow_world()
        if self._hvd_delay[p] <= 0:
            raise AssertionError(
                f"the gradient of {self._hvd_names.get(p, 'a parameter')} was computed more "
                f"than backward_passes_per_step={self._hvd_passes} times before step(); "
                "raise backward_passes_per_step to accumulate gradients locally"
            )
        self._hvd_delay[p] -= 1
        if self._hvd_delay[p] > 0:
            return
        bucket = self._hvd_plan.bucket_of[p]
        if not self._hvd_rebuilt:
            self._hvd_ready_order.append(self._hvd_position[p])
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._hvd_dispatch(bucket)

    def _hvd_dispatch(self, bucket: Bucket) -> None:
        """Starts the reduction of a bucket whose gradients are all in."""
        grads = []
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse and self._hvd_sparse_as_dense:
                p.grad = p.grad.to_dense()
                self._hvd_densified.append(p)
            grads.append(p.grad)
        if any(g.is_sparse for g in grads):
            # Reduced in synchronize(), in plan order (allgather of indices and values).
            bucket.pending = ("sparse",)
            self._hvd_sparse.append(bucket)
            return
        compressed, contexts = [], []
        for g in grads:
            c, ctx = self._hvd_compression.compress(g)
            compressed.append(c)
            contexts.append(ctx)
        name = f"DistributedOptimizer.bucket.{bucket.number}"
        carrier = self._hvd_carrier(compressed)
        if carrier is not None:
            # On the timeline like the collectives' operations: the bucket
            # complete, handed to the engine, submitted, done.
            _timeline.mark(name, "ALLREDUCE", "negotiate")
            flat = _flat_buffer(bucket, compressed)
            torch.cat([c.reshape(-1) for c in compressed], out=flat)
            if self._hvd_op is Average and self._hvd_predivide != 1.0:
                flat.mul_(1.0 / self._hvd_predivide)
            perf = _perf.active()
            if perf is not None and not self._hvd_dispatched:
                engine, cuda = carrier
                perf.before_step(engine if cuda is None else cuda.engine, flat.device)
            engine, cuda = carrier
            _timeline.mark(name, "ALLREDUCE", "queue")
            future = _hook.carry_bucket(
                flat,
                self._hvd_first_index + bucket.number % _INDICES_PER_OPTIMIZER,
                engine=engine,
                cuda=cuda,
                average=self._hvd_op is Average or cuda is not None,
            )
            _timeline.mark(name, "ALLREDUCE", "communicate")
            future.add_done_callback(lambda _: _timeline.mark(name, "ALLREDUCE", "done"))
            bucket.pending = ("engine", future, contexts, cuda is not None)
        else:
            prescale, postscale = 1.0, 1.0
            if self._hvd_op is Average:
                prescale, postscale = 1.0 / self._hvd_predivide, self._hvd_predivide
            handle = _grouped_allreduce_async(
                compressed,
                name=name,
                op=self._hvd_op,
                prescale_factor=prescale,
                postscale_factor=postscale,
                process_set=self._hvd_process_set,
            )
            bucket.pending = ("ops", handle, contexts, compressed)
        self._hvd_dispatched.append(bucket)

    def _hvd_carrier(self, compressed: list[torch.Tensor]) -> tuple[Any, Any] | None:
        """The engine path for these tensors: ``(cpu engine, cuda path)``, or None."""
        if self._hvd_engine_reason is not None:
            return None
        config = _config.current()
        if config is None or not config.enabled:
            return None
        dtypes = {c.dtype for c in compressed}
        devices = {c.device for c in compressed}
        if len(dtypes) != 1 or len(devices) != 1 or next(iter(dtypes)) not in _ENGINE_DTYPES:
            return None
        device = next(iter(devices))
        if device.type == "cpu":
            return _runtime.world_engine(config), None
        if device.type == "cuda":
            return None, _runtime.cuda_path(config, device)
        return None

    # -- after backward ------------------------------------------------------

    def synchronize(self) -> None:
        """Waits for every gradient's reduction and writes it into ``.grad``.

        Gradients not yet handed over (a parameter that got none in this
        backward pass, or fewer passes than ``backward_passes_per_step``)
        are reduced now, in the same order on every rank: a missing gradient
        counts as zeros.
        """
        if not self._hvd_hooks:
            self._hvd_synchronized = True
            return
        self._hvd_follow_world()
        for bucket in self._hvd_plan.buckets:
            if bucket.pending is None:
                bucket.ready = len(bucket.params)
                self._hvd_dispatch(bucket)
        carried = False
        for bucket in self._hvd_dispatched:
            assert bucket.pending is not None
            kind = bucket.pending[0]
            if kind == "engine":
                _, future, contexts, cuda = bucket.pending
                result = _wait_bucket(future)
                carried = True
                scale = 1.0
                if self._hvd_op is Average and self._hvd_predivide != 1.0:
                    scale = self._hvd_predivide
                if cuda and self._hvd_op is Sum:
                    scale *= _set_size(self._hvd_process_set)
                if scale != 1.0:
                    result = result * scale
                offset = 0
                for p, ctx in zip(bucket.params, contexts):
                    n = p.grad.numel()  # type: ignore[union-attr]
                    piece = result[offset : offset + n].view(p.grad.shape)  # type: ignore[union-attr]
                    offset += n
                    with torch.no_grad():
                        p.grad.copy_(self._hvd_compression.decompress(piece, ctx))  # type: ignore[union-attr]
            elif kind == "ops":
                _, handle, contexts, compressed = bucket.pending
                outputs = _synchronize(handle, compressed)
                for p, out, ctx in zip(bucket.params, outputs, contexts):
                    with torch.no_grad():
                        p.grad.copy_(self._hvd_compression.decompress(out, ctx))  # type: ignore[union-attr]
        for bucket in self._hvd_sparse:
            for p in bucket.params:
                p.grad = _sparse_allreduce(p.grad, self._hvd_op, self._hvd_process_set)  # type: ignore[arg-type]
        for p in self._hvd_densified:  # as Horovod: the optimizer gets a sparse gradient back
            p.grad = p.grad.to_sparse()  # type: ignore[union-attr]
        if carried:
            _hook.count_step()
        self._hvd_steps += 1
        self._hvd_reset()
        self._hvd_synchronized = True

    def _hvd_reset(self) -> None:
        self._hvd_clear()
        if not self._hvd_rebuilt:
            self._hvd_rebuild()

    def _hvd_clear(self) -> None:
        """Nothing in flight: every bucket empty, every parameter's passes to come."""
        for p in self._hvd_params:
            self._hvd_delay[p] = self._hvd_passes
        for bucket in self._hvd_plan.buckets:
            bucket.ready, bucket.pending = 0, None
        self._hvd_dispatched.clear()
        self._hvd_sparse.clear()
        self._hvd_densified.clear()

    def _hvd_rebuild(self) -> None:
        """Re-cuts the buckets in the order rank 0's gradients became ready.

        Once, after the first step: every rank takes the order of the
        process set's first rank (one small broadcast), so the buckets stay
        the same everywhere.
        """
        self._hvd_rebuilt = True
        order = list(self._hvd_ready_order)
        seen = set(order)
        order += [i for i in reversed(range(len(self._hvd_params))) if i not in seen]
        order = broadcast_object(
            order,
            root_rank=self._hvd_process_set.ranks[0],
            name="DistributedOptimizer.ready_order",
            process_set=self._hvd_process_set,
        )
        params = [self._hvd_params[i] for i in order]
        self._hvd_plan = cut(params, self._hvd_threshold)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """A block whose ``step()`` does not synchronize.

        For a ``step()`` after an explicit ``synchronize()`` (to clip the
        reduced gradients, say).
        """
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronizes the gradients (unless skipped), then the wrapped step."""
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                # Horovod's scripts and tests look for this message's opening words.
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after "
                    "optimizer.synchronize(): step() reduces the gradients a second time, "
                    "which costs a round of communication per step; call step() inside "
                    "`with optimizer.skip_synchronize():` after an explicit synchronize()",
                    UserWarning,
                    # torch wraps step() (its profiling hook): point past the wrapper.
                    stacklevel=3 if getattr(type(self).step, "hooked", False) else 2,
                )
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped ``zero_grad``; an error while gradients are in flight."""
        self._hvd_follow_world()
        if self._hvd_dispatched:
            raise AssertionError(
                "optimizer.zero_grad() called after loss.backward() and before "
                "optimizer.step() or optimizer.synchronize(): the gradients being reduced "
                "would be overwritten"
            )
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]


def _flat_buffer(bucket: Bucket, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bucket's flat buffer for ``tensors`` (one dtype and device), reused."""
    total = sum(t.numel() for t in tensors)
    flat = bucket.flat
    like = tensors[0]
    if (
        flat is None
        or flat.numel() != total
        or flat.dtype != like.dtype
        or flat.device != like.device
    ):
        flat = bucket.flat = torch.empty(total, dtype=like.dtype, device=like.device)
    return flat


def _legacy_hook(optimizer: _DistributedMixin, p: torch.nn.Parameter, *unused: Any) -> None:
    optimizer._hvd_hook(p)


def _wait_bucket(future: Any) -> torch.Tensor:
    """A bucket's reduced gradients; a failed reduction raises Horovod's error.

    Raises:
        HorovodInternalError: the engine's reduction failed (a worker died
            or timed out): elastic scripts restore their state on it.
    """
    try:
        return future.wait()
    except (CommError, RuntimeError) as error:
        raise HorovodInternalError(f"DistributedOptimizer's allreduce failed: {error}") from error


def _set_size(process_set: Any) -> int:
    """The number of ranks in ``process_set``."""
    return int(process_set.size())


def _engine_reason(op: Any, process_set: Any) -> str | None:
    """Why the fused buckets cannot go through the engine, or None."""
    if op is not Average and op is not Sum:
        return f"op={op!r}"
    if process_set is not global_process_set and process_set.size() != _basics.size():
        return "a process set that is not the whole world"
    if not dist.is_initialized():
        return "no default process group"
    return None


def _grouped_allreduce_async(tensors: list[torch.Tensor], **kwargs: Any) -> Any:
    """One grouped allreduce of the collectives part (in place)."""
    return grouped_allreduce_async_(tensors, **kwargs)


def _synchronize(handle: Any, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs of a grouped allreduce."""
    out = synchronize(handle)
    if out is None:
        return tensors
    return list(out)


def _sparse_allreduce(grad: torch.Tensor, op: Any, process_set: Any) -> torch.Tensor:
    """A sparse gradient reduced over the set.

    Every rank's entries, summed (averaged for ``Average``), as a coalesced
    sparse tensor.
    """
    if not grad.is_sparse:  # a dense gradient in the same bucket as a sparse one
        return allreduce(grad, op=op, process_set=process_set)
    if op is not Average and op is not Sum:
        raise ValueError(
            f"op={op!r}: sparse gradients are reduced with Average or "
            "Sum only; pass sparse_as_dense=True"
        )
    grad = grad.coalesce()
    indices = allgather(grad.indices().t().contiguous(), process_set=process_set)
    values = allgather(grad.values().contiguous(), process_set=process_set)
    if op is Average:
        values = values / process_set.size()
    return torch.sparse_coo_tensor(indices.t(), values, grad.shape).coalesce()


def DistributedOptimizer(  # noqa: N802  (Horovod's name)
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: list[list[torch.nn.Parameter]] | int | None = None,
    sparse_as_dense: bool = False,
    process_set: Any = global_process_set,
) -> torch.optim.Optimizer:
    """Wraps ``optimizer`` so that ``step()`` applies gradients reduced over the ranks.

    The result is an instance of a subclass of ``optimizer``'s class (so
    ``isinstance`` checks and learning-rate schedulers keep working), built
    over the same parameter groups and carrying over their state. Build it
    on every rank of ``process_set``.

    How the gradients travel: with ``op=Average`` or ``Sum`` on the whole
    world and compressed gradients of a dtype the engine carries (float32,
    float64, float16, bfloat16; ``Compression.fp16`` gives float16), they
    go in fused buckets through the engine, as DDP's do. Otherwise (a
    process set smaller than the world, ``op=Adasum``, other dtypes, the
    engine disabled with ``TIACC_TRAINING_DISABLE``) each bucket is one
    grouped allreduce of the collectives part; sparse gradients are
    allgathered (``sparse_as_dense=True`` makes them dense first). With
    ``op=Adasum`` the gradients are combined with Adasum (Horovod's
    Adasum optimizer applies it to the step's parameter change instead;
    for plain SGD the two agree).

    Args:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``model.named_parameters()``; names must be unique
            and cover every parameter of ``optimizer`` (default: generated
            names).
        compression: ``Compression.none`` or ``Compression.fp16`` (or any
            class with Horovod's ``compress``/``decompress``).
        backward_passes_per_step: backward passes whose gradients add up
            locally before they are reduced (at the last of them, or at an
            earlier ``step()``/``synchronize()``).
        op: ``Average``, ``Sum`` or ``Adasum``.
        gradient_predivide_factor: with ``Average``, gradients are divided by
            this factor before the sum and by ``size / factor`` after it.
        num_groups: older form of ``groups=<int>``.
        groups: an int ``n``: the parameters in ``n`` consecutive groups,
            each reduced together; or a list of lists of parameters, each
            list reduced together (a parameter in no list alone). Default:
            buckets of the engine's fusion threshold, in the order the
            gradients become ready.
        sparse_as_dense: turn sparse gradients dense before reducing them.
        process_set: the ranks whose gradients are reduced (default all);
            on a rank outside it the optimizer reduces nothing and steps on
            its own gradients, as Horovod's.

    Returns:
        The distributed optimizer.

    Raises:
        ValueError: a bad argument (named), duplicate or missing names in
            ``named_parameters``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}"
        )
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
        raise ValueError(
            f"backward_passes_per_step must be an int, not {backward_passes_per_step!r}"
        )
    if backward_passes_per_step < 1:
        raise ValueError(
            f"backward_passes_per_step must be at least 1, not {backward_passes_per_step}"
        )
    if not isinstance(op, int) or op not in (Average, Sum, Adasum):
        raise ValueError(f"op must be hvd.Average, hvd.Sum or hvd.Adasum, not {op!r}")
    op = next(o for o in (Average, Sum, Adasum) if o == op)
    if gradient_predivide_factor != 1.0 and op is not Average:
        raise ValueError(
            f"gradient_predivide_factor={gradient_predivide_factor} needs op=hvd.Average"
        )
    if not gradient_predivide_factor > 0:
        raise ValueError(
            f"gradient_predivide_factor must be positive, not {gradient_predivide_factor}"
        )
    if not (
        callable(getattr(compression, "compress", None))
        and callable(getattr(compression, "decompress", None))
    ):
        raise ValueError(
            "compression must have compress() and decompress() (hvd.Compression.none or .fp16)"
        )
    if num_groups:
        warnings.warn(
            "num_groups is deprecated: pass groups=<int> instead", DeprecationWarning, stacklevel=2
        )
        if groups is None:
            groups = num_groups
    if groups is not None:
        if isinstance(groups, bool) or not isinstance(groups, (int, list)):
            raise ValueError(
                "groups must be a non-negative int or a list of lists of parameters, not "
                f"{type(groups).__name__}"
            )
        if isinstance(groups, int):
            if groups < 0:
                raise ValueError(f"groups must be non-negative, not {groups}")
            if groups == 0:
                groups = None
        else:
            for i, group in enumerate(groups):
                if not isinstance(group, (list, tuple)) or not all(
                    isinstance(p, torch.Tensor) for p in group
                ):
                    raise ValueError(f"groups[{i}] must be a list of parameters (tensors)")
    named = named_parameters_of(optimizer, named_parameters)
    _basics.check_initialized()
    # A rank outside process_set gets the optimizer too, as in Horovod: it
    # reduces nothing (no hooks; synchronize() does nothing) and steps on
    # its own gradients.
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedMixin, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    base.__init__(wrapped, optimizer.param_groups)  # type: ignore[misc]
    for p, value in optimizer.state.items():
        wrapped.state[p] = value
    wrapped._hvd_setup(
        named,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    )
    return wrapped

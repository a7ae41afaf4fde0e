"""Horovod's ``SyncBatchNorm``: batch statistics over every rank of a process set.

In training, each rank computes its batch's per-channel mean, variance
and count; one allgather gives every rank everyone's, from which each
combines the statistics of the whole global batch (uneven batches
included). Backward sums the two per-channel gradient terms over the
ranks with one allreduce, so the input gradients are those of a batch
norm over the concatenated batch. The parameters' gradients stay this
rank's (``DistributedOptimizer`` reduces them with the others).
Evaluation, and a world of one, run the ordinary batch norm.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.modules.batchnorm import _BatchNorm

from ._allgather import allgather
from ._allreduce import allreduce
from ._common import Sum
from ._process_sets import global_process_set

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """A drop-in for ``torch.nn.BatchNorm1d/2d/3d`` that normalizes over all ranks.

    Args:
        num_features: channels (``C`` of an ``(N, C, ...)`` input).
        eps: added to the variance.
        momentum: factor of the running statistics' update (``None``: a
            cumulative average).
        affine: learn a scale and shift.
        track_running_stats: keep running statistics for evaluation.
        process_set: the ranks whose batches are normalized together
            (default: all).
        device: where the parameters and buffers live.
        dtype: their dtype.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: Any = global_process_set,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects an input of 2 or more dimensions (N, C, ...), "
                f"got {input.dim()}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalizes ``input`` with the batch statistics of every rank (training)."""
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got an input with {input.shape[1]} channels"
            )
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or not self.track_running_stats
        if not batch_stats or self.process_set.size() == 1:
            return F.batch_norm(
                input,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight,
                self.bias,
                batch_stats,
                factor,
                self.eps,
            )
        return _SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self.eps,
            factor,
            self.process_set,
        )


def _per_channel(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A ``(C,)`` tensor shaped to broadcast over an ``(N, C, ...)`` input of ``dim`` dims."""
    return t.view(1, -1, *([1] * (dim - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        process_set: Any,
    ) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        count = x.numel() // channels
        work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        mean = work.mean(dims) if count else work.new_zeros(channels)
        var = work.var(dims, unbiased=False) if count else work.new_zeros(channels)
        mine = torch.cat([mean, var, mean.new_full((1,), float(count))]).unsqueeze(0)
        every = allgather(mine, name="SyncBatchNorm.stats", process_set=process_set)
        counts = every[:, -1:]
        total = float(counts.sum())
        if total == 0:
            raise ValueError("SyncBatchNorm: every rank's batch is empty")
        means, variances = every[:, :channels], every[:, channels : 2 * channels]
        global_mean = (counts * means).sum(0) / total
        global_var = (counts * (variances + (means - global_mean) ** 2)).sum(0) / total
        if running_mean is not None and running_var is not None:
            unbiased = global_var * (total / max(total - 1.0, 1.0))
            running_mean.mul_(1.0 - momentum).add_(
                global_mean.to(running_mean.dtype), alpha=momentum
            )
            running_var.mul_(1.0 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        invstd = torch.rsqrt(global_var + eps)
        xhat = (work - _per_channel(global_mean, x.dim())) * _per_channel(invstd, x.dim())
        out = xhat
        if weight is not None:
            out = out * _per_channel(weight.to(out.dtype), x.dim())
        if bias is not None:
            out = out + _per_channel(bias.to(out.dtype), x.dim())
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total = total
        ctx.process_set = process_set
        ctx.has_bias = bias is not None
        ctx.input_dtype = x.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        xhat, weight, invstd = ctx.saved_tensors
        dim = xhat.dim()
        dims = [0, *range(2, dim)]
        g = grad_out.to(xhat.dtype)
        sum_g = g.sum(dims)
        sum_g_xhat = (g * xhat).sum(dims)
        grad_weight = sum_g_xhat.to(weight.dtype) if weight is not None else None
        grad_bias = (
            sum_g.to(weight.dtype if weight is not None else g.dtype) if ctx.has_bias else None
        )
        grad_input = None
        if ctx.needs_input_grad[0]:
            both = allreduce(
                torch.cat([sum_g, sum_g_xhat]),
                op=Sum,
                name="SyncBatchNorm.grad",
                process_set=ctx.process_set,
            )
            channels = sum_g.numel()
            mean_g = both[:channels] / ctx.total
            mean_g_xhat = both[channels:] / ctx.total
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_input = _per_channel(scale, dim) * (
                g - _per_channel(mean_g, dim) - xhat * _per_channel(mean_g_xhat, dim)
            )
            grad_input = grad_input.to(ctx.input_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None

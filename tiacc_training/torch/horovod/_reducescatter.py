"""Reducescatter and grouped reducescatter.

The first dimension is cut into ``size`` blocks, the first ``rows % size``
ranks of the set one row longer, as Horovod cuts it. ``Sum``, ``Average``,
``Min``, ``Max`` and ``Product``; ``Adasum`` is refused with
:class:`HorovodInternalError` on every rank, as Horovod refuses it, and a
tensor without dimensions with ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _basics
from ._allgather import allgather_async, grouped_allgather_async
from ._common import (
    TORCH_OPS,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    check_list,
    check_scales,
    check_tensor,
    form_of,
    op_of,
    scale_,
)
from ._compression import compressed
from ._exceptions import HorovodInternalError
from ._handles import Pending, mark, name_of, register, single, submit, synchronize
from ._headers import Call
from ._negotiation import attempt, check_or_refuse, schedule
from ._process_sets import ProcessSet, global_process_set, resolve

__all__ = [
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "reducescatter",
    "reducescatter_async",
]


def _check(tensors: list[torch.Tensor], op: ReduceOp, pre: Any, post: Any) -> None:
    if op not in (Sum, Average, Min, Max, Product):
        raise HorovodInternalError(
            f"reducescatter takes Sum, Average, Min, Max or Product, not {op!r}"
        )
    check_scales(pre, post)
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("reducescatter needs tensors of at least one dimension")


def start(
    tensors: list[torch.Tensor],
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    name: str,
    named: bool,
    kind: str,
) -> Pending:
    """Reduces each tensor and leaves this rank its block of the first dimension."""
    mark(name, "REDUCESCATTER", "negotiate")
    _, refusal = attempt(lambda: _check(tensors, op, prescale_factor, postscale_factor))
    call = Call(kind, name, named, process_set, tensors, op=int(op), refusal=refusal)
    if refusal is None:
        call.prescale, call.postscale = prescale_factor, postscale_factor
    scales = (prescale_factor, postscale_factor)
    return schedule(call, lambda _: _issue(tensors, op, scales, process_set, name))


def _issue(
    tensors: list[torch.Tensor],
    op: ReduceOp,
    scales: tuple[float, float],
    process_set: ProcessSet,
    name: str,
) -> Pending:
    """Issues the reductions once the ranks agreed (``scales``: prescale, postscale)."""
    prescale_factor, postscale_factor = scales
    n = len(process_set.ranks)
    me = process_set.ranks.index(_basics.rank())
    plans: list[tuple[torch.Tensor, int, float]] = []

    def issue() -> list[Any]:
        works = []
        for t in tensors:
            rows = t.shape[0]
            base, extra = divmod(rows, n)
            counts = [base + (1 if r < extra else 0) for r in range(n)]
            widest = base + (1 if extra else 0)
            if extra:
                padded = t.new_zeros((n, widest, *t.shape[1:]))
                offset = 0
                for r, c in enumerate(counts):
                    padded[r, :c] = t[offset : offset + c]
                    offset += c
                source = padded.view(n * widest, *t.shape[1:])
            else:
                source = t.contiguous().clone()
            scale_(source, prescale_factor)
            out = t.new_empty((widest, *t.shape[1:]))
            post = postscale_factor
            torch_op = TORCH_OPS.get(int(op))
            if op == Average:
                torch_op, post = dist.ReduceOp.SUM, post / n
            if n == 1:
                out.copy_(source)
            else:
                works.append(
                    dist.reduce_scatter_tensor(
                        out, source, torch_op, group=process_set.group, async_op=True
                    )
                )
            plans.append((out, counts[me], post))
        return works

    def finish() -> list[torch.Tensor]:
        results = []
        for out, count, post in plans:
            result = out[:count] if out.shape[0] != count else out
            result = result.contiguous()
            scale_(result, post)
            results.append(result)
        return results

    return submit(name, "REDUCESCATTER", issue, finish)


def _async(
    kind: str,
    tensors: Any,
    name: str | None,
    op: Any,
    process_set: ProcessSet,
    prescale_factor: float,
    postscale_factor: float,
) -> Pending:
    process_set = resolve(process_set)
    label = name_of(kind, name)
    flat, reduction = check_or_refuse(
        kind,
        label,
        process_set,
        lambda: (
            check_list(tensors) if kind == "grouped_reducescatter" else [check_tensor(tensors)],
            op_of(None, op),
        ),
    )
    return start(
        flat,
        reduction,
        prescale_factor,
        postscale_factor,
        process_set,
        label,
        name is not None,
        kind,
    )


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts reducing ``tensor`` over the set, keeping this rank's block of rows.

    Args:
        tensor: this rank's input (the same shape on every rank).
        name: the operation's name.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        process_set: the ranks taking part.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.

    Returns:
        A handle; :func:`synchronize` returns this rank's block.
    """
    return register(
        single(
            _async(
                "reducescatter", tensor, name, op, process_set, prescale_factor, postscale_factor
            )
        )
    )


def _backward_scale(op: ReduceOp, n: int, pre: float, post: float) -> float:
    """What Horovod multiplies a reducescatter's gradient by before gathering it."""
    return (n if op == Sum else 1) * pre * post


class _ReducescatterFunction(torch.autograd.Function):
    """Reducescatter whose gradient is the allgather of the gradient (scaled as Horovod's)."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: Any,
        process_set: ProcessSet,
        pre: float,
        post: float,
    ) -> torch.Tensor:  # noqa: D102
        process_set = resolve(process_set)
        ctx.scale = _backward_scale(op_of(None, op), len(process_set.ranks), pre, post)
        ctx.process_set = process_set
        return synchronize(reducescatter_async(tensor, name, op, process_set, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # noqa: D102
        gathered = synchronize(
            allgather_async(grad.contiguous() * ctx.scale, None, ctx.process_set)
        )
        return gathered, None, None, None, None, None


class _GroupedReducescatterFunction(torch.autograd.Function):
    """Grouped reducescatter; each gradient as :class:`_ReducescatterFunction`'s."""

    @staticmethod
    def forward(
        ctx: Any,
        name: str | None,
        op: Any,
        process_set: ProcessSet,
        pre: float,
        post: float,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:  # noqa: D102
        process_set = resolve(process_set)
        ctx.scale = _backward_scale(op_of(None, op), len(process_set.ranks), pre, post)
        ctx.process_set = process_set
        handle = grouped_reducescatter_async(list(tensors), name, op, process_set, pre, post)
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # noqa: D102
        scaled = [g.contiguous() * ctx.scale for g in grads]
        gathered = synchronize(grouped_allgather_async(scaled, None, ctx.process_set))
        return (None, None, None, None, None, *gathered)


def _differentiable(tensors: Any) -> bool:
    items = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    return (
        torch.is_grad_enabled()
        and all(isinstance(t, torch.Tensor) for t in items)
        and any(t.requires_grad for t in items)
    )


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduces ``tensor`` over the set and returns this rank's block of rows.

    Gradients flow as through Horovod's: the gradient of the input is the
    allgather of the output's gradient, times the set's size for ``Sum``
    and times the scale factors.
    """

    def run(sent: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if _differentiable(sent[0]):
            return [
                _ReducescatterFunction.apply(
                    sent[0], name, op, process_set, prescale_factor, postscale_factor
                )
            ]
        handle = reducescatter_async(
            sent[0], name, op, process_set, prescale_factor, postscale_factor
        )
        return [synchronize(handle)]

    # Not a tensor: sent as it is, and refused on every rank.
    given = compression if isinstance(tensor, torch.Tensor) else None
    return compressed(given, [tensor], run)[0]


grouped_reducescatter_async = form_of(
    reducescatter_async,
    lambda tensors, *args: register(_async("grouped_reducescatter", tensors, *args)),
    "grouped_reducescatter_async",
    """Starts a reducescatter of each tensor, as one operation.

    Returns:
        A handle; :func:`synchronize` returns the list of this rank's blocks.
    """,
    "int",
    grouped=True,
)


def _grouped_reducescatter(tensors: Any, *args: Any) -> list[torch.Tensor]:
    """:func:`grouped_reducescatter` on its arguments, in :func:`reducescatter`'s order."""
    name, compression, op, process_set, prescale_factor, postscale_factor = args
    scales = (prescale_factor, postscale_factor)

    def run(sent: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if isinstance(sent, (list, tuple)) and _differentiable(sent):
            return list(_GroupedReducescatterFunction.apply(name, op, process_set, *scales, *sent))
        return synchronize(grouped_reducescatter_async(sent, name, op, process_set, *scales))

    # Not a list: sent as it is, and refused on every rank.
    given = compression if isinstance(tensors, (list, tuple)) else None
    return compressed(given, tensors, run)


grouped_reducescatter = form_of(
    reducescatter,
    _grouped_reducescatter,
    "grouped_reducescatter",
    """Reducescatters each tensor of the list, as one operation; gradients flow.""",
    "list[torch.Tensor]",
    grouped=True,
)

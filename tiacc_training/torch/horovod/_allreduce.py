"""Allreduce and grouped allreduce, with their autograd functions.

Reductions as in Horovod: ``Average`` (the default), ``Sum``, ``Min``,
``Max``, ``Product``, ``Adasum`` (:mod:`._adasum`). ``prescale_factor``
multiplies the input before the reduction, ``postscale_factor`` the result
after. The average of integer tensors is the sum divided by the set's size,
rounded toward zero (with a postscale factor, ``sum * postscale / size``
rounded toward zero), and integer tensors are scaled in float64 and rounded
toward zero. Tensors of one dtype and device are fused into one buffer and
one collective (:mod:`._reduce`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import _reduce
from ._common import (
    DTYPE_CODE,
    Adasum,
    ReduceOp,
    check_list,
    check_scales,
    check_tensor,
    op_of,
)
from ._handles import Pending, mark, name_of, register, synchronize
from ._negotiation import Call, attempt, guard, negotiate, refuse
from ._process_sets import ProcessSet, global_process_set, resolve

__all__ = [
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
]


def start(
    tensors: list[torch.Tensor],
    outputs: list[torch.Tensor],
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    name: str,
    named: bool,
    kind: str,
) -> Pending:
    """Agrees on the call with the set's other ranks, then reduces ``tensors`` into ``outputs``.

    ``outputs`` may be the same tensors. The data path is :mod:`._reduce`'s.
    """
    mark(name, "ALLREDUCE", "negotiate")
    call = Call(kind, name, named, process_set, tensors, op=int(op))
    guard(call, lambda: check_scales(prescale_factor, postscale_factor))
    if call.refusal is None:
        call.prescale, call.postscale = prescale_factor, postscale_factor
    if op == Adasum:
        bad = [t.dtype for t in tensors if not t.is_floating_point()]
        if bad:
            call.refusal = ValueError(f"Adasum reduces floating-point tensors only, not {bad[0]}")
    groups = _reduce.fuse(tensors)
    call.buffers = [
        [
            DTYPE_CODE.get(dtype, -1),
            sum(tensors[i].numel() for i in members),
            len(members),
            int(device.type == "cuda"),
        ]
        for (dtype, device), members in groups.items()
    ]
    deferred = negotiate(call, defer=True).later
    pending = _reduce.start(
        tensors, outputs, op, prescale_factor, postscale_factor, process_set, name, groups, deferred
    )
    if named:
        pending.key = (int(process_set.process_set_id or 0), kind, name)
    return pending


def _single(
    tensor: Any,
    average: bool | None,
    name: str | None,
    op: Any,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    in_place: bool,
) -> int:
    process_set = resolve(process_set)
    label = name_of("allreduce", name)
    checked, refusal = attempt(lambda: (check_tensor(tensor), op_of(average, op)))
    if refusal is not None:
        refuse("allreduce", label, process_set, refusal, name is not None)
    tensor, op = checked
    output = tensor if in_place else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    pending = start(
        [tensor],
        [output],
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        label,
        name is not None,
        "allreduce",
    )
    inner = pending.finish
    pending.finish = lambda: inner()[0]
    return register(pending)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts reducing ``tensor`` over the set into a new tensor.

    Args:
        tensor: this rank's input (unchanged).
        average: deprecated; ``True`` is ``op=Average``, ``False`` ``op=Sum``.
        name: the operation's name (the timeline's row; generated if ``None``).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        process_set: the ranks taking part (default: all).

    Returns:
        A handle for :func:`synchronize` (the reduced tensor) and :func:`poll`.
    """
    return _single(tensor, average, name, op, prescale_factor, postscale_factor, process_set, False)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts reducing ``tensor`` in place; arguments as :func:`allreduce_async`.

    Returns:
        A handle; :func:`synchronize` returns ``tensor`` itself, reduced.
    """
    return _single(tensor, average, name, op, prescale_factor, postscale_factor, process_set, True)


class _AllreduceFunction(torch.autograd.Function):
    """Allreduce whose gradient is the allreduce of the gradient (same op, same scales)."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        op: ReduceOp,
        pre: float,
        post: float,
        name: str | None,
        process_set: ProcessSet,
    ) -> torch.Tensor:  # noqa: D102
        ctx.args = (op, pre, post, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, pre, post, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # noqa: D102
        op, pre, post, process_set = ctx.args
        reduced = synchronize(
            allreduce_async(grad.contiguous(), None, None, op, pre, post, process_set)
        )
        return reduced, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduces ``tensor`` over the set; gradients flow through it.

    Args:
        tensor: this rank's input (unchanged).
        average: deprecated; ``True`` is ``op=Average``, ``False`` ``op=Sum``.
        name: the operation's name.
        compression: a Horovod compressor (``Compression.fp16``, ...): the
            tensor travels compressed and comes back in its own dtype.
        op: the reduction (default ``Average``).
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        process_set: the ranks taking part (default: all).

    Returns:
        A new tensor holding the reduction.
    """
    checked, refusal = attempt(lambda: (check_tensor(tensor), op_of(average, op)))
    if refusal is not None:
        label = name_of("allreduce", name)
        refuse("allreduce", label, resolve(process_set), refusal, name is not None)
    tensor, op = checked
    context = None
    if compression is not None:
        tensor, context = compression.compress(tensor)
    result = _AllreduceFunction.apply(
        tensor, op, prescale_factor, postscale_factor, name, process_set
    )
    if compression is not None:
        result = compression.decompress(result, context)
    return result


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduces ``tensor`` in place; arguments as :func:`allreduce_async`.

    Returns:
        ``tensor``, reduced.
    """
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def _grouped(
    tensors: Any,
    average: bool | None,
    name: str | None,
    op: Any,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    in_place: bool,
) -> int:
    process_set = resolve(process_set)
    label = name_of("grouped_allreduce", name)
    checked, refusal = attempt(lambda: (check_list(tensors), op_of(average, op)))
    if refusal is not None:
        refuse("grouped_allreduce", label, process_set, refusal, name is not None)
    tensors, op = checked
    outputs = (
        list(tensors)
        if in_place
        else [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    )
    return register(
        start(
            tensors,
            outputs,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
            label,
            name is not None,
            "grouped_allreduce",
        )
    )


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts reducing a list of tensors as one operation (one fused buffer per dtype).

    Returns:
        A handle; :func:`synchronize` returns the list of reduced tensors.
    """
    return _grouped(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set, False
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """In-place :func:`grouped_allreduce_async`; ``synchronize`` returns ``tensors``."""
    return _grouped(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set, True
    )


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduces a list of tensors as one operation; returns new tensors.

    Gradients flow through each tensor as through :func:`allreduce`.
    """
    checked, refusal = attempt(lambda: check_list(tensors))
    if refusal is not None:
        label = name_of("grouped_allreduce", name)
        refuse("grouped_allreduce", label, resolve(process_set), refusal, name is not None)
    tensors = checked
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [
            allreduce(
                t,
                average,
                None if name is None else f"{name}.{i}",
                compression,
                op,
                prescale_factor,
                postscale_factor,
                process_set,
            )
            for i, t in enumerate(tensors)
        ]
    contexts = None
    if compression is not None:
        pairs = [compression.compress(t) for t in tensors]
        tensors, contexts = [p[0] for p in pairs], [p[1] for p in pairs]
    results = synchronize(
        grouped_allreduce_async(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )
    if contexts is not None:
        results = [compression.decompress(r, c) for r, c in zip(results, contexts)]
    return results


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduces a list of tensors in place as one operation; returns them."""
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )

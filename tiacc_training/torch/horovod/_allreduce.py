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

from functools import partial
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
    form_of,
    op_of,
)
from ._compression import compressed
from ._handles import mark, name_of, register, single, synchronize
from ._headers import Call
from ._negotiation import attempt, refuse, schedule
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


def _checked(
    kind: str,
    tensors: Any,
    average: bool | None,
    op: Any,
    name: str | None,
    process_set: ProcessSet,
    label: str | None = None,
) -> tuple[list[torch.Tensor], ReduceOp]:
    """The call's tensors and reduction, checked; refused on every rank when wrong.

    Args:
        kind: ``"allreduce"`` (``tensors`` is one tensor) or ``"grouped_allreduce"``.
        tensors: the tensor, or the list of them.
        average: Horovod's deprecated ``average=``.
        op: the ``op=`` given.
        name: the name given.
        process_set: the set given.
        label: the operation's name, when already drawn (drawn on refusal otherwise).

    Returns:
        The tensors as a list, and the reduction.
    """
    checked, refusal = attempt(
        lambda: (
            check_list(tensors) if kind == "grouped_allreduce" else [check_tensor(tensors)],
            op_of(average, op),
        )
    )
    if refusal is not None:
        label = name_of(kind, name) if label is None else label
        refuse(kind, label, resolve(process_set), refusal, name is not None)
    return checked


def _start(
    kind: str,
    in_place: bool,
    tensors: Any,
    average: bool | None,
    name: str | None,
    op: Any,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> int:
    """Starts an allreduce (``tensors`` one tensor) or a grouped allreduce (a list).

    The ranks agree on the call first, so a wrong argument is refused on
    every rank; the data path is :mod:`._reduce`'s.

    Args:
        kind: ``"allreduce"`` or ``"grouped_allreduce"``.
        in_place: the results go into the input tensors themselves.
        tensors: the tensor, or the list of them.
        average: Horovod's deprecated ``average=``.
        name: the operation's name (generated if ``None``).
        op: the reduction.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        process_set: the ranks taking part.

    Returns:
        A handle: :func:`synchronize` returns the reduced tensor (the list
        of them for a grouped allreduce).
    """
    process_set = resolve(process_set)
    label = name_of(kind, name)
    tensors, op = _checked(kind, tensors, average, op, name, process_set, label)
    outputs = (
        list(tensors)
        if in_place
        else [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    )
    mark(label, "ALLREDUCE", "negotiate")
    call = Call(kind, label, name is not None, process_set, tensors, op=int(op))
    _, call.refusal = attempt(lambda: check_scales(prescale_factor, postscale_factor))
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
    scales = (prescale_factor, postscale_factor)
    pending = schedule(
        call,
        lambda agreed: _reduce.start(tensors, outputs, op, *scales, process_set, label, groups),
        defer=True,
    )
    return register(single(pending) if kind == "allreduce" else pending)


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

    The other forms (``allreduce_async_``, ``allreduce_``, the grouped
    ones) take these arguments too.

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
    scales = (prescale_factor, postscale_factor)
    return _start("allreduce", False, tensor, average, name, op, *scales, process_set)


allreduce_async_ = form_of(
    allreduce_async,
    partial(_start, "allreduce", True),
    "allreduce_async_",
    """Starts reducing ``tensor`` in place; arguments as :func:`allreduce_async`.

    Returns:
        A handle; :func:`synchronize` returns ``tensor`` itself, reduced.
    """,
    "int",
)


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
    tensors, op = _checked("allreduce", tensor, average, op, name, process_set)
    return compressed(
        compression,
        tensors,
        lambda sent: [
            _AllreduceFunction.apply(
                sent[0], op, prescale_factor, postscale_factor, name, process_set
            )
        ],
    )[0]


allreduce_ = form_of(
    allreduce_async,
    lambda *args: synchronize(allreduce_async_(*args)),
    "allreduce_",
    """Reduces ``tensor`` in place; arguments as :func:`allreduce_async`.

    Returns:
        ``tensor``, reduced.
    """,
    "torch.Tensor",
)

grouped_allreduce_async = form_of(
    allreduce_async,
    partial(_start, "grouped_allreduce", False),
    "grouped_allreduce_async",
    """Starts reducing a list of tensors as one operation (one fused buffer per dtype).

    Returns:
        A handle; :func:`synchronize` returns the list of reduced tensors.
    """,
    "int",
    grouped=True,
)

grouped_allreduce_async_ = form_of(
    allreduce_async,
    partial(_start, "grouped_allreduce", True),
    "grouped_allreduce_async_",
    """In-place :func:`grouped_allreduce_async`; ``synchronize`` returns ``tensors``.""",
    "int",
    grouped=True,
)


def _grouped_allreduce(tensors: Any, *args: Any) -> list[torch.Tensor]:
    """:func:`grouped_allreduce` on its arguments, in :func:`allreduce`'s order."""
    average, name, compression, op, prescale_factor, postscale_factor, process_set = args
    # The reduction is checked by the operation that runs (each allreduce below, or the group).
    tensors, _ = _checked("grouped_allreduce", tensors, None, None, name, process_set)
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
    return compressed(
        compression,
        tensors,
        lambda sent: synchronize(
            grouped_allreduce_async(
                sent, average, name, op, prescale_factor, postscale_factor, process_set
            )
        ),
    )


grouped_allreduce = form_of(
    allreduce,
    _grouped_allreduce,
    "grouped_allreduce",
    """Reduces a list of tensors as one operation; returns new tensors.

    Gradients flow through each tensor as through :func:`allreduce`.
    """,
    "list[torch.Tensor]",
    grouped=True,
)

grouped_allreduce_ = form_of(
    allreduce_async,
    lambda *args: synchronize(grouped_allreduce_async_(*args)),
    "grouped_allreduce_",
    """Reduces a list of tensors in place as one operation; returns them.""",
    "list[torch.Tensor]",
    grouped=True,
)

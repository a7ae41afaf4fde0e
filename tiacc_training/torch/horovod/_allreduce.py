"""Allreduce and grouped allreduce, with their autograd functions.

Reductions as in Horovod: ``Average`` (the default), ``Sum``, ``Min``,
``Max``, ``Product``, ``Adasum`` (:mod:`._adasum`). ``prescale_factor``
multiplies the input before the reduction, ``postscale_factor`` the result
after. The average of integer tensors is the sum divided by the set's size,
rounded toward zero (with a postscale factor, ``sum * postscale / size``
rounded toward zero), and integer tensors are scaled in float64 and rounded
toward zero. Tensors of one dtype and device are fused into one buffer and
one collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _adasum, _basics, _negotiation
from ._common import (
    DTYPE_CODE,
    DTYPES,
    OPS,
    TORCH_OPS,
    Adasum,
    Average,
    ReduceOp,
    check_list,
    check_scales,
    check_tensor,
    native_average,
    op_of,
    scale_,
)
from ._handles import Pending, complete, mark, name_of, register, submit, synchronize
from ._negotiation import BUFFERS, OP, Call, attempt, guard, negotiate, refuse
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
    serving: bool = False,
) -> Pending:
    """Reduces ``tensors`` into ``outputs`` (which may be the same tensors).

    ``serving``: a rank inside ``join()`` taking part with zeros (the
    header exchange already ran).
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
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    call.buffers = [
        [
            DTYPE_CODE.get(dtype, -1),
            sum(tensors[i].numel() for i in members),
            len(members),
            int(device.type == "cuda"),
        ]
        for (dtype, device), members in groups.items()
    ]
    deferred = None
    if not serving:
        deferred = negotiate(call, defer=True).later
    n = len(process_set.ranks)
    group = process_set.group
    plans: list[tuple[torch.Tensor, list[int], float]] = []

    def issue() -> list[Any]:
        works = []
        for members in groups.values():
            if len(members) == 1 and outputs[members[0]].is_contiguous():
                buffer = outputs[members[0]]
                if buffer is not tensors[members[0]]:
                    buffer.copy_(tensors[members[0]])
                buffer = buffer.view(-1)
            else:
                buffer = torch.cat([tensors[i].reshape(-1) for i in members])
            scale_(buffer, prescale_factor)
            post = postscale_factor
            if op == Adasum:
                _adasum.adasum_(
                    buffer,
                    [tensors[i].numel() for i in members],
                    process_set.ranks,
                    process_set.ranks.index(_basics.rank()),
                    group,
                )
                work = None
            elif op == Average:
                if (buffer.is_floating_point() or post == 1.0) and native_average(buffer, group):
                    work = dist.all_reduce(buffer, dist.ReduceOp.AVG, group=group, async_op=True)
                else:
                    post = post / n
                    work = dist.all_reduce(buffer, dist.ReduceOp.SUM, group=group, async_op=True)
            else:
                work = dist.all_reduce(buffer, TORCH_OPS[int(op)], group=group, async_op=True)
            works.append(work)
            plans.append((buffer, members, post))
        return works

    def finish() -> list[torch.Tensor]:
        if deferred is not None:
            deferred()
        for buffer, members, post in plans:
            scale_(buffer, post)
            offset = 0
            for i in members:
                out = outputs[i]
                count = out.numel()
                if buffer.data_ptr() != out.data_ptr() or not out.is_contiguous():
                    out.copy_(buffer[offset : offset + count].view(out.shape))
                offset += count
        return outputs

    pending = submit(name, "ALLREDUCE", issue, finish)
    if named:
        pending.key = (int(process_set.process_set_id or 0), kind, name)
    return pending


def serve_zeros(row: list[int], name: str, process_set: ProcessSet) -> None:
    """Takes part with zeros in the allreduce a header describes (its fused buffers)."""
    tensors: list[torch.Tensor] = []
    for b in range(row[BUFFERS]):
        first = BUFFERS + 1 + 4 * b
        code, numel, count, cuda = row[first : first + 4]
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype = DTYPES[code]
        # The same fused length and number of tensors (Adasum's dot products are per tensor).
        tensors.append(torch.zeros(numel, dtype=dtype, device=device))
        tensors.extend(torch.zeros(0, dtype=dtype, device=device) for _ in range(count - 1))
    pre, post = _negotiation.prescale_of(row), _negotiation.postscale_of(row)
    pending = start(
        tensors, tensors, OPS[row[OP]], pre, post, process_set, name, False, "allreduce", True
    )
    complete(pending)


_negotiation.zeros = serve_zeros


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

"""Allgather, grouped allgather, the sparse allreduce built on it, and ``allgather_object``.

The first dimensions may differ across ranks (the header exchange carries
them); the other dimensions, the dtype and the device may not. Blocks of
different lengths travel padded to the longest, so every rank makes the
same equal-size call, which the engine runs.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _basics
from ._allreduce import allreduce_async, grouped_allreduce_async
from ._common import Average, Sum, check_list, check_tensor, op_of
from ._handles import (
    Pending,
    SparseHandle,
    complete,
    mark,
    name_of,
    register,
    single,
    submit,
    synchronize,
)
from ._headers import Agreement, Call
from ._negotiation import check_or_refuse, schedule
from ._process_sets import ProcessSet, global_process_set, resolve, small_device

__all__ = [
    "allgather",
    "allgather_async",
    "allgather_object",
    "grouped_allgather",
    "grouped_allgather_async",
    "sparse_allreduce_async",
]


def start(
    tensors: list[torch.Tensor], process_set: ProcessSet, name: str, named: bool, kind: str
) -> Pending:
    """Gathers each tensor along its first dimension (sizes may differ across ranks)."""
    mark(name, "ALLGATHER", "negotiate")
    flat = [t.reshape(1) if t.dim() == 0 else t.contiguous() for t in tensors]
    call = Call(
        kind, name, named, process_set, flat, skip_first=True, payload=[t.shape[0] for t in flat]
    )
    return schedule(call, lambda agreed: _issue(flat, process_set, name, agreed))


def _issue(
    flat: list[torch.Tensor], process_set: ProcessSet, name: str, agreed: Agreement
) -> Pending:
    """Issues the gathers once the ranks agreed (their first dimensions in ``agreed``)."""
    every = agreed.payloads
    n = len(process_set.ranks)
    sizes = [[row[k] for row in every] for k in range(len(flat))]
    gathered: list[torch.Tensor] = []

    def issue() -> list[Any]:
        works = []
        for k, t in enumerate(flat):
            widest = max(sizes[k])
            if t.shape[0] != widest:
                padded = t.new_zeros((widest, *t.shape[1:]))
                padded[: t.shape[0]] = t
                t = padded
            out = t.new_empty((n * widest, *t.shape[1:]))
            gathered.append(out)
            if n == 1:
                out.copy_(t)
                continue
            works.append(
                dist.all_gather_into_tensor(out, t, group=process_set.group, async_op=True)
            )
        return works

    def finish() -> list[torch.Tensor]:
        results = []
        for k, out in enumerate(gathered):
            widest = max(sizes[k])
            if all(s == widest for s in sizes[k]):
                results.append(out)
            else:
                blocks = out.view(n, widest, *out.shape[1:])
                results.append(torch.cat([blocks[r, : sizes[k][r]] for r in range(n)]))
        return results

    pending = submit(name, "ALLGATHER", issue, finish)
    pending.sizes = sizes
    return pending


def _checked(kind: str, tensors: Any, name: str | None, process_set: ProcessSet) -> tuple:
    """The set, the label and the checked tensors (refused on every rank when wrong)."""
    process_set = resolve(process_set)
    label = name_of(kind, name)
    flat = check_or_refuse(
        kind,
        label,
        process_set,
        lambda: check_list(tensors) if kind == "grouped_allgather" else [check_tensor(tensors)],
    )
    return process_set, label, flat


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts concatenating every rank's ``tensor`` along the first dimension.

    The first dimension may differ across ranks; the others and the dtype
    may not.

    Returns:
        A handle; :func:`synchronize` returns the concatenation, in rank order.
    """
    process_set, label, tensors = _checked("allgather", tensor, name, process_set)
    return register(single(start(tensors, process_set, label, name is not None, "allgather")))


class _AllgatherFunction(torch.autograd.Function):
    """Allgather whose gradient is this rank's rows of the averaged gradient (as Horovod's)."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:  # noqa: D102
        process_set, label, tensors = _checked("allgather", tensor, name, process_set)
        pending = start(tensors, process_set, label, name is not None, "allgather")
        result = complete(pending)[0]
        sizes = pending.sizes[0]
        me = process_set.ranks.index(_basics.rank())
        ctx.rows = (sum(sizes[:me]), sizes[me], tensor.dim() == 0)
        ctx.process_set = process_set
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # noqa: D102
        offset, count, scalar = ctx.rows
        averaged = synchronize(
            allreduce_async(grad.contiguous(), None, None, Average, 1.0, 1.0, ctx.process_set)
        )
        mine = averaged.narrow(0, offset, count)
        return (mine.reshape(()) if scalar else mine), None, None


class _GroupedAllgatherFunction(torch.autograd.Function):
    """Grouped allgather; each gradient as :class:`_AllgatherFunction`'s."""

    @staticmethod
    def forward(
        ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:  # noqa: D102
        process_set, label, checked = _checked(
            "grouped_allgather", list(tensors), name, process_set
        )
        pending = start(checked, process_set, label, name is not None, "grouped_allgather")
        results = complete(pending)
        me = process_set.ranks.index(_basics.rank())
        ctx.rows = [
            (sum(sizes[:me]), sizes[me], t.dim() == 0) for sizes, t in zip(pending.sizes, tensors)
        ]
        ctx.process_set = process_set
        return tuple(results)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # noqa: D102
        averaged = synchronize(
            grouped_allreduce_async(
                [g.contiguous() for g in grads], None, None, Average, 1.0, 1.0, ctx.process_set
            )
        )
        mine = []
        for grad, (offset, count, scalar) in zip(averaged, ctx.rows):
            rows = grad.narrow(0, offset, count)
            mine.append(rows.reshape(()) if scalar else rows)
        return (None, None, *mine)


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` along the first dimension; gradients flow.

    The gradient of this rank's input is its rows of the average over the
    ranks of the output's gradient, as Horovod's.
    """
    if not isinstance(tensor, torch.Tensor):
        _checked("allgather", tensor, name, process_set)  # refused on every rank
    return _AllgatherFunction.apply(tensor, name, process_set)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an allgather of each tensor, as one operation (one size exchange).

    Returns:
        A handle; :func:`synchronize` returns the list of concatenations.
    """
    process_set, label, checked = _checked("grouped_allgather", tensors, name, process_set)
    return register(start(checked, process_set, label, name is not None, "grouped_allgather"))


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allgathers each tensor of the list, as one operation.

    Gradients flow through each tensor as through :func:`allgather`.
    """
    if (
        isinstance(tensors, (list, tuple))
        and all(isinstance(t, torch.Tensor) for t in tensors)
        and any(t.requires_grad for t in tensors)
        and torch.is_grad_enabled()
    ):
        return list(_GroupedAllgatherFunction.apply(name, process_set, *tensors))
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
) -> SparseHandle:
    """Starts reducing a sparse COO tensor: every rank's entries, gathered.

    The indices and values of all ranks are allgathered (one operation) and
    make one uncoalesced sparse tensor of the input's shape, whose repeated
    indices add up when it is coalesced or used; ``Average`` divides the
    values by the set's size.

    Args:
        tensor: a sparse COO tensor (the same shape and dtype on every rank;
            the number of entries may differ).
        name: the operation's name.
        op: ``Average`` (default) or ``Sum``.
        process_set: the ranks taking part.

    Returns:
        A handle to call, as Horovod's: ``handle()`` waits and returns the
        sparse result (:func:`synchronize` and :func:`poll` take it too).
    """
    process_set = resolve(process_set)
    label = name_of("sparse_allreduce", name)

    def check() -> Any:
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
            raise TypeError("sparse_allreduce_async takes a sparse COO tensor")
        reduction = op_of(None, op)
        if reduction not in (Average, Sum):
            raise ValueError(f"sparse_allreduce_async takes Average or Sum, not {reduction!r}")
        return reduction

    reduction = check_or_refuse("grouped_allgather", label, process_set, check)
    indices = tensor._indices().t().contiguous()
    values = tensor._values().contiguous()
    pending = start([indices, values], process_set, label, name is not None, "grouped_allgather")
    inner, n = pending.finish, len(process_set.ranks)

    def finish() -> torch.Tensor:
        all_indices, all_values = inner()
        if reduction == Average:
            all_values = all_values / n
        return torch.sparse_coo_tensor(all_indices.t(), all_values, tensor.shape)

    pending.finish = finish
    return SparseHandle(register(pending))


def object_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    """``obj`` pickled, as a uint8 tensor on ``device``."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Every rank's picklable object, in rank order of the set."""
    process_set = resolve(process_set)
    label = name_of("allgather_object", name)
    payload = object_bytes(obj, small_device(process_set))
    pending = start([payload], process_set, label, False, "allgather")
    gathered = complete(pending)[0]
    sizes = pending.sizes[0]
    raw = gathered.cpu().numpy().tobytes()
    objects, offset = [], 0
    for count in sizes:
        objects.append(pickle.loads(raw[offset : offset + count]))
        offset += count
    return objects

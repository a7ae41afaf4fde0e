"""Broadcast, in place and not, with its autograd function, and ``broadcast_object``.

``root_rank`` is a global rank, as in Horovod; the ranks must agree on it,
on the dtype, shape and device of the tensor.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from . import _basics
from ._allgather import object_bytes
from ._allreduce import allreduce_async
from ._common import Average, check_root, check_tensor
from ._handles import Pending, complete, mark, name_of, register, submit, synchronize
from ._headers import Call
from ._negotiation import check_or_refuse, schedule
from ._process_sets import ProcessSet, global_process_set, resolve, small_device

__all__ = ["broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object"]


def start(
    tensor: torch.Tensor,
    output: torch.Tensor,
    root_rank: int,
    process_set: ProcessSet,
    name: str,
    named: bool,
) -> Pending:
    """Copies the root's ``tensor`` into ``output`` on every rank of the set."""
    mark(name, "BROADCAST", "negotiate")
    call = Call("broadcast", name, named, process_set, [tensor], root=root_rank)
    return schedule(call, lambda _: _issue(tensor, output, root_rank, process_set, name))


def _issue(
    tensor: torch.Tensor, output: torch.Tensor, root_rank: int, process_set: ProcessSet, name: str
) -> Pending:
    """Issues the broadcast once the ranks agreed."""
    buffer = output if output.is_contiguous() else output.contiguous()
    if buffer is not tensor and _basics.rank() == root_rank:
        buffer.copy_(tensor)

    def issue() -> list[Any]:
        if len(process_set.ranks) == 1:
            return []
        return [dist.broadcast(buffer, root_rank, group=process_set.group, async_op=True)]

    def finish() -> torch.Tensor:
        if buffer is not output:
            output.copy_(buffer)
        return output

    return submit(name, "BROADCAST", issue, finish)


def _async(
    tensor: Any, root_rank: Any, name: str | None, process_set: ProcessSet, in_place: bool
) -> int:
    process_set = resolve(process_set)
    label = name_of("broadcast", name)
    check_or_refuse(
        "broadcast",
        label,
        process_set,
        lambda: (check_tensor(tensor), check_root(root_rank, process_set)),
    )
    output = tensor if in_place else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return register(start(tensor, output, root_rank, process_set, label, name is not None))


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts copying the root's ``tensor`` to every rank of the set, into a new tensor.

    Args:
        tensor: the value on the root; on the others, its shape and dtype.
        root_rank: the global rank that sends.
        name: the operation's name.
        process_set: the ranks taking part.

    Returns:
        A handle; :func:`synchronize` returns the root's value.
    """
    return _async(tensor, root_rank, name, process_set, False)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts overwriting ``tensor`` with the root's; ``synchronize`` returns ``tensor``."""
    return _async(tensor, root_rank, name, process_set, True)


class _BroadcastFunction(torch.autograd.Function):
    """Broadcast whose gradient is the averaged gradient on the root, zero elsewhere."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:  # noqa: D102
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # noqa: D102
        reduced = synchronize(
            allreduce_async(grad.contiguous(), None, None, Average, 1.0, 1.0, ctx.process_set)
        )
        if _basics.rank() != ctx.root_rank:
            reduced.zero_()
        return reduced, None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """The root's ``tensor`` on every rank of the set, as a new tensor; gradients flow.

    The gradient reaching the root's input is the average over the ranks of
    the output's gradient; the other ranks' inputs get zero.
    """
    if not isinstance(tensor, torch.Tensor):
        _async(tensor, root_rank, name, process_set, False)  # refused on every rank
    return _BroadcastFunction.apply(tensor, root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Overwrites ``tensor`` with the root's, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """The root's picklable object, on every rank of the set.

    Returns:
        The root's object (a copy on the other ranks; the object itself on the root).
    """
    process_set = resolve(process_set)
    label = name_of("broadcast_object", name)
    check_or_refuse("broadcast", label, process_set, lambda: check_root(root_rank, process_set))
    device = small_device(process_set)
    is_root = _basics.rank() == root_rank
    payload = object_bytes(obj, device) if is_root else None
    length = torch.tensor(
        [payload.numel() if payload is not None else 0], dtype=torch.int64, device=device
    )
    complete(start(length, length, root_rank, process_set, f"{label}.size", False))
    if payload is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    complete(start(payload, payload, root_rank, process_set, f"{label}.data", False))
    if is_root:
        return obj
    return pickle.loads(payload.cpu().numpy().tobytes())

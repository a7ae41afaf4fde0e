"""Alltoall, with uneven splits and its autograd function.

Each rank sends ``splits[i]`` rows of its tensor to the i-th rank of the
set (``None``: the first dimension cut equally). The header exchange
carries every rank's splits; uneven blocks travel padded to the widest, so
every rank makes the same equal-split call, which the engine runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import _basics
from ._common import check_tensor
from ._handles import Pending, mark, name_of, register, submit, synchronize
from ._headers import Agreement, Call
from ._negotiation import attempt, check_or_refuse, schedule
from ._process_sets import ProcessSet, global_process_set, resolve

__all__ = ["alltoall", "alltoall_async"]


def _send_splits(tensor: torch.Tensor, splits: Any, n: int, name: str) -> list[int]:
    """The rows this rank sends each rank, checked as Horovod checks them.

    Raises:
        ValueError: equal splits that do not divide the first dimension,
            splits that are not integers, of the wrong length, negative or
            not adding up to the first dimension.
    """
    rows = tensor.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(
                f"alltoall {name!r}: the first dimension ({rows}) is not divisible by the "
                f"set's size {n}; pass splits="
            )
        return [rows // n] * n
    if isinstance(splits, torch.Tensor):
        if splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool:
            raise ValueError(f"alltoall {name!r}: splits must hold integers, not {splits.dtype}")
        send = [int(s) for s in splits.reshape(-1).tolist()]
    else:
        if any(isinstance(s, bool) or not isinstance(s, int) for s in splits):
            raise ValueError(f"alltoall {name!r}: splits must be integers, got {list(splits)}")
        send = [int(s) for s in splits]
    if len(send) != n:
        raise ValueError(f"alltoall {name!r}: splits has {len(send)} entries, the set {n} ranks")
    if any(s < 0 for s in send) or sum(send) != rows:
        raise ValueError(
            f"alltoall {name!r}: splits {send} must be non-negative and add up to the "
            f"first dimension {rows}"
        )
    return send


def start(
    tensor: torch.Tensor, splits: Any, process_set: ProcessSet, name: str, named: bool
) -> Pending:
    """Sends this rank's blocks; the result is ``(rows received, received splits)``."""
    mark(name, "ALLTOALL", "negotiate")
    n = len(process_set.ranks)
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    send, refusal = attempt(lambda: _send_splits(tensor, splits, n, name))
    call = Call(
        "alltoall", name, named, process_set, [tensor], skip_first=True, refusal=refusal,
        payload=send if refusal is None else [],
    )  # fmt: skip
    return schedule(call, lambda agreed: _issue(tensor, send, process_set, name, agreed))


def _issue(
    tensor: torch.Tensor, send: list[int], process_set: ProcessSet, name: str, agreed: Agreement
) -> Pending:
    """Issues the exchange once the ranks agreed (every rank's splits in ``agreed``)."""
    n = len(process_set.ranks)
    matrix = agreed.payloads  # matrix[src][dst]: rows src sends dst
    me = process_set.ranks.index(_basics.rank())
    received = [matrix[src][me] for src in range(n)]
    widest = max(max(row) for row in matrix)
    uniform = all(v == widest for row in matrix for v in row)
    trailing = tuple(tensor.shape[1:])
    outgoing = tensor
    if not uniform:
        outgoing = tensor.new_zeros((n * widest, *trailing))
        offset = 0
        for dst, rows_to in enumerate(send):
            outgoing[dst * widest : dst * widest + rows_to] = tensor[offset : offset + rows_to]
            offset += rows_to
    incoming = tensor.new_empty((n * widest, *trailing))

    def issue() -> list[Any]:
        if n == 1 or widest == 0:
            incoming.copy_(outgoing)
            return []
        return [dist.all_to_all_single(incoming, outgoing, group=process_set.group, async_op=True)]

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        if uniform:
            output = incoming
        else:
            output = torch.cat(
                [incoming[src * widest : src * widest + received[src]] for src in range(n)]
            )
        return output, torch.tensor(received, dtype=torch.int32)

    return submit(name, "ALLTOALL", issue, finish)


def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts sending rows of ``tensor`` to every rank: ``splits[i]`` rows to the i-th.

    Args:
        tensor: the rows to send, in order of destination.
        splits: rows for each rank of the set (a list or integer tensor);
            ``None`` splits the first dimension equally.
        name: the operation's name.
        process_set: the ranks taking part.

    Returns:
        A handle; :func:`synchronize` returns ``(output, received_splits)``:
        the rows received, in rank order, and how many came from each rank
        (an int32 tensor).
    """
    process_set = resolve(process_set)
    label = name_of("alltoall", name)
    check_or_refuse("alltoall", label, process_set, lambda: check_tensor(tensor))
    return register(start(tensor, splits, process_set, label, name is not None))


class _AlltoallFunction(torch.autograd.Function):
    """Alltoall whose gradient is the alltoall of the gradient, with the received splits."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet
    ) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set, ctx.shape = received, process_set, tensor.shape
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[Any, ...]:  # noqa: D102
        back, _ = synchronize(
            alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set)
        )
        return back.reshape(ctx.shape), None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Sends rows of ``tensor`` to every rank of the set; gradients flow.

    Returns:
        The rows received (in rank order); with ``splits`` given, the pair
        ``(output, received_splits)``, as Horovod returns.
    """
    if not isinstance(tensor, torch.Tensor):
        alltoall_async(tensor, splits, name, process_set)  # refused on every rank
    output, received = _AlltoallFunction.apply(tensor, splits, name, process_set)
    if splits is None:
        return output
    return output, received

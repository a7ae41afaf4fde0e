"""An allreduce's data: its tensors fused per dtype and device, reduced, scaled.

Tensors of one dtype and device go into one buffer and one collective
(the buffer is the output itself when a single contiguous tensor has it
alone). ``prescale_factor`` multiplies the buffer before the reduction,
``postscale_factor`` after; ``Average`` is the group's own average where
its backend has one, otherwise a sum divided by the set's size; ``Adasum``
runs :mod:`._adasum`'s exchange.

No header is exchanged here: :mod:`._allreduce` has the ranks agree on
the call first (:mod:`._negotiation`), and a rank that takes part with
zeros in an allreduce the others issued reduces them here directly
(``_cycles.serve_zeros``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _adasum, _basics
from ._common import TORCH_OPS, Adasum, Average, ReduceOp, native_average, scale_
from ._handles import Pending, submit
from ._process_sets import ProcessSet

# The indices of an allreduce's tensors, by the (dtype, device) of their buffer.
Groups = dict[tuple[torch.dtype, torch.device], list[int]]


def fuse(tensors: Sequence[torch.Tensor]) -> Groups:
    """The tensors' indices, one entry per fused buffer (in order of first appearance)."""
    groups: Groups = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return groups


def start(
    tensors: list[torch.Tensor],
    outputs: list[torch.Tensor],
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    name: str,
    groups: Groups,
) -> Pending:
    """Reduces ``tensors`` into ``outputs`` (which may be the same tensors).

    Args:
        tensors: this rank's inputs.
        outputs: where the results go, one per input.
        op: the reduction.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        process_set: the ranks taking part (registered, holding this rank).
        name: the operation's name (the timeline's row).
        groups: :func:`fuse` of ``tensors``.

    Returns:
        The operation in flight (its works issued). ``intact`` says whether
        the inputs stay as they are until the result is handed out (no
        buffer is an input itself), so that the reduction can be run again.
    """
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
    pending.intact = all(buffer.data_ptr() != tensors[m[0]].data_ptr() for buffer, m, _ in plans)
    return pending

"""Adasum: the adaptive summation of gradients, over a process set.

Two vectors ``a`` and ``b`` combine as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 where its vector is zero): the sum where the two are
orthogonal, their mean where they are equal. For the ranks of a set the
combination runs as a binary tree: ranks 0 and 1, 2 and 3, ... first, then
those pairs' results (0-1 with 2-3, ...), and so on, with the dot products
taken per tensor (a fused buffer of several tensors has a coefficient pair
per tensor).

The communication is the recursive vector-halving, distance-doubling
exchange: at distance ``d`` (1, 2, 4, ...) each rank swaps half of its
current segment with rank ``rank ^ d``, keeps the other half, and the ranks
of each block of ``2d`` add their partial dot products (one small allreduce
per level); after ``log2(n)`` levels each rank holds ``1/n`` of the result,
and an allgather puts it back together. The halves travel by ``send`` and
``recv`` between the two partners (on the CPU gloo carries them under the
"tiacc" backend; the dot products and the allgather run on the engine), so
CPU and CUDA tensors take the same path.

Sizes that are not a power of two (Horovod refuses them on the CPU): with
``p`` the largest power of two below ``n``, rank ``p + i`` first hands its
vector to rank ``i``, which combines the two (``adasum(x_i, x_{p+i})``);
ranks ``0 .. p-1`` then run the tree above and every rank receives the
result.

Floating-point tensors only; the dot products are taken in float64, and
float16/bfloat16 vectors are combined in float32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._exceptions import wait

__all__ = ["adasum_", "combine", "segments"]

# Below this squared norm a vector counts as zero (its coefficient is 1).
ZERO_NORM = 1e-30


def combine(
    a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor, dots: torch.Tensor
) -> torch.Tensor:
    """``adasum(a, b)`` per tensor, given the per-tensor dot products.

    Args:
        a: one side (1-D).
        b: the other side, the same length.
        ids: the index of the tensor each element belongs to.
        dots: ``[tensors, 3]`` float64: ``a.b``, ``|a|^2``, ``|b|^2`` per tensor.

    Returns:
        The combined vector, in ``a``'s dtype.
    """
    ab, aa, bb = dots.unbind(-1)
    one = torch.ones_like(ab)
    ca = torch.where(aa > ZERO_NORM, 1.0 - ab / (2.0 * aa.clamp_min(ZERO_NORM)), one)
    cb = torch.where(bb > ZERO_NORM, 1.0 - ab / (2.0 * bb.clamp_min(ZERO_NORM)), one)
    ca, cb = ca.to(a.dtype)[ids], cb.to(a.dtype)[ids]
    return ca * a + cb * b


def partial_dots(a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor, tensors: int) -> torch.Tensor:
    """``[tensors, 3]`` float64 sums of ``a*b``, ``a*a``, ``b*b`` per tensor."""
    a64, b64 = a.double(), b.double()
    out = torch.zeros(tensors, 3, dtype=torch.float64, device=a.device)
    if a.numel():
        products = torch.stack([a64 * b64, a64 * a64, b64 * b64], dim=1)
        out.index_add_(0, ids, products)
    return out


def segments(length: int, power: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` each of ``power`` ranks holds after the halving levels."""
    result = []
    for r in range(power):
        lo, hi = 0, length
        d = 1
        while d < power:
            mid = lo + (hi - lo) // 2
            lo, hi = (lo, mid) if r & d == 0 else (mid, hi)
            d *= 2
        result.append((lo, hi))
    return result


def _swap(send: torch.Tensor, receive: torch.Tensor, me: int, peer: int, group: object) -> None:
    """Sends ``send`` to global rank ``peer`` and fills ``receive`` from it.

    The lower rank sends first and the higher receives first, so the pair
    never waits on each other (NCCL runs the two in order on one stream).
    Empty sides are skipped; both ranks know every size.
    """
    steps = [("send", send), ("recv", receive)]
    if me > peer:
        steps.reverse()
    for kind, tensor in steps:
        if tensor.numel() == 0:
            continue
        if kind == "send":
            wait(dist.isend(tensor, peer, group=group), "Adasum send")
        else:
            wait(dist.irecv(tensor, peer, group=group), "Adasum receive")


def adasum_(
    buffer: torch.Tensor, lengths: list[int], ranks: list[int], me: int, group: object
) -> None:
    """Replaces ``buffer`` on every rank of the set with Adasum of all ranks' buffers.

    Args:
        buffer: this rank's 1-D contiguous floating-point buffer (the same
            length and dtype on every rank).
        lengths: the element counts of the tensors fused in ``buffer``, in order.
        ranks: the global ranks of the set, sorted.
        me: this process's index in ``ranks``.
        group: the set's torch.distributed group.
    """
    n = len(ranks)
    if n == 1 or buffer.numel() == 0:
        return
    device = buffer.device
    work = torch.float32 if buffer.dtype in (torch.float16, torch.bfloat16) else buffer.dtype
    x = buffer.to(work).clone()
    length, tensors = x.numel(), len(lengths)
    ids = torch.repeat_interleave(
        torch.arange(tensors, device=device), torch.tensor(lengths, device=device)
    )
    power = 1 << (n.bit_length() - 1)
    if n > power:
        # Fold the ranks above the largest power of two onto ranks 0 .. n-p-1.
        if me >= power:
            _swap(x, x[:0], ranks[me], ranks[me - power], group)
        elif me < n - power:
            received = torch.empty_like(x)
            _swap(x[:0], received, ranks[me], ranks[me + power], group)
            x = combine(x, received, ids, partial_dots(x, received, ids, tensors))
    active = me < power
    lo, hi = 0, length
    d = 1
    while d < power:
        keep = (lo, lo)
        received = x[:0]
        if active:
            partner = me ^ d
            mid = lo + (hi - lo) // 2
            keep, give = ((lo, mid), (mid, hi)) if me & d == 0 else ((mid, hi), (lo, mid))
            received = torch.empty(keep[1] - keep[0], dtype=work, device=device)
            send = x[give[0] : give[1]].contiguous()
            _swap(send, received, ranks[me], ranks[partner], group)
        block = me // (2 * d)
        dots = torch.zeros(power // (2 * d), tensors, 3, dtype=torch.float64, device=device)
        if active:
            # ``a`` is the lower half-block's vector on both ranks of a pair,
            # so that the block's partial norms add up per side.
            a, b = x[keep[0] : keep[1]], received
            if me & d:
                a, b = b, a
            seg_ids = ids[keep[0] : keep[1]]
            dots[block] = partial_dots(a, b, seg_ids, tensors)
        wait(
            dist.all_reduce(dots, op=dist.ReduceOp.SUM, group=group, async_op=True),
            "Adasum dot products",
        )
        if active:
            x[keep[0] : keep[1]] = combine(a, b, seg_ids, dots[block])
            lo, hi = keep
        d *= 2
    # Every rank gets every segment back.
    parts = segments(length, power)
    widest = max(end - start for start, end in parts)
    mine = torch.zeros(widest, dtype=work, device=device)
    if active:
        mine[: hi - lo] = x[lo:hi]
    gathered = torch.empty(n * widest, dtype=work, device=device)
    wait(
        dist.all_gather_into_tensor(gathered, mine, group=group, async_op=True), "Adasum allgather"
    )
    rows = gathered.view(n, widest)
    result = torch.empty(length, dtype=work, device=device)
    for r, (start, end) in enumerate(parts):
        result[start:end] = rows[r, : end - start]
    buffer.copy_(result)

"""One rank of a job that checks torch.distributed's CPU collectives.

Started by ``test_collectives.py`` (torchrun-style variables). ``--init``
says how the default group is made: ``tdist`` (the two lines, then the
script's own ``init_process_group("gloo")``) or ``explicit`` (the two
lines, then ``init_process_group("cpu:tiacc")``). Every rank checks each
collective against values it computes itself, then (``--train``) trains a
small model with a synchronised batch norm and ``ZeroRedundancyOptimizer``
and writes its losses and parameters to ``--out``. The last line is
``RESULT {json}``: what served the collectives.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _launch import exit_failed  # noqa: E402


def expect(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Exact equality (values, dtype), or an error naming the check and rank."""
    if got.dtype != want.dtype or not torch.equal(got, want):
        raise AssertionError(f"rank {dist.get_rank()}: {what}: got {got}, want {want}")


def values(rank: int, dtype: torch.dtype, n: int = 10) -> torch.Tensor:
    """Rank ``rank``'s input: small values every type holds exactly."""
    base = (torch.arange(n) * 5 + rank * 3) % 7 - 3
    if dtype == torch.bool:
        return (torch.arange(n) + rank) % 3 == 0
    if dtype == torch.uint8:
        base = base.abs()
    return base.to(dtype)


def reference(op: str, world: int, dtype: torch.dtype) -> torch.Tensor:
    """``op`` over every rank's input, computed here in float64 (exact)."""
    stack = torch.stack([values(r, dtype).double() for r in range(world)])
    result = {
        "sum": stack.sum(0),
        "product": stack.prod(0),
        "min": stack.min(0).values,
        "max": stack.max(0).values,
        "avg": stack.sum(0) / world,
    }[op]
    if op == "avg" and not dtype.is_floating_point:
        # NCCL's integer mean (and what Lightning's gloo path leaves in a
        # count): the quotient rounded toward zero.
        result = torch.div(stack.sum(0), world, rounding_mode="trunc")
    if dtype == torch.bool:
        return result != 0
    return result.to(dtype)


OPS = {
    "sum": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.AVG,
}
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]


def by_op(counts: dict) -> dict[str, int]:
    """Counts per ``(op, reason)`` summed per op."""
    total: dict[str, int] = {}
    for (op, _), n in counts.items():
        total[op] = total.get(op, 0) + n
    return total


def lacking(gloo: bool, call: Any, *args: Any, **kwargs: Any) -> bool:
    """Runs ``call``; True where it ran on gloo and this torch's gloo lacks it.

    gloo gained ``reduce_scatter``, ``all_gather_into_tensor`` and some
    element types (bfloat16) after torch 2.0: the gloo reference run skips
    them there; the engine serves them on every torch.
    """
    try:
        call(*args, **kwargs)
    except RuntimeError as error:
        if gloo and ("support" in str(error) or "Invalid scalar type" in str(error)):
            return True
        raise
    return False


def check_collectives(rank: int, world: int, gloo: bool) -> None:
    """Every collective, reduction and type against local references."""
    for dtype in DTYPES:
        if lacking(gloo, dist.all_reduce, values(rank, dtype)):
            continue  # the reference run on a torch whose gloo lacks this type
        for name, op in OPS.items():
            if name == "avg" and (gloo or dtype == torch.bool):
                continue  # gloo has no average; bools have none anywhere
            t = values(rank, dtype)
            dist.all_reduce(t, op=op)
            expect(t, reference(name, world, dtype), f"all_reduce {name} {dtype}")
            t = values(rank, dtype)
            work = dist.all_reduce(t, op=op, async_op=True)
            work.wait()
            expect(t, reference(name, world, dtype), f"async all_reduce {name} {dtype}")
        # reduce_scatter_tensor: block r of the reduced input.
        big = torch.cat([values(rank, dtype) for _ in range(world)])
        out = torch.empty(10, dtype=dtype)
        if not lacking(gloo, dist.reduce_scatter_tensor, out, big, op=dist.ReduceOp.MAX):
            expect(out, reference("max", world, dtype), f"reduce_scatter_tensor max {dtype}")
            expect(big, torch.cat([values(rank, dtype)] * world), "reduce_scatter keeps its input")
        if dtype.is_floating_point and not gloo:
            # The average FSDP2 asks for (gloo has none).
            dist.reduce_scatter_tensor(out, big, op=dist.ReduceOp.AVG)
            expect(out, reference("avg", world, dtype), f"reduce_scatter_tensor avg {dtype}")
        outs = [torch.empty(10, dtype=dtype) for _ in range(world)]
        dist.all_gather(outs, values(rank, dtype))
        for r, o in enumerate(outs):
            expect(o, values(r, dtype), f"all_gather {dtype} piece {r}")
        flat = torch.empty(10 * world, dtype=dtype)
        if not lacking(gloo, dist.all_gather_into_tensor, flat, values(rank, dtype)):
            expect(
                flat,
                torch.cat([values(r, dtype) for r in range(world)]),
                f"all_gather_into {dtype}",
            )
            work = dist.all_gather_into_tensor(flat, values(rank, dtype), async_op=True)
            work.wait()
        t = values(rank, dtype)
        dist.broadcast(t, src=world - 1)
        expect(t, values(world - 1, dtype), f"broadcast {dtype}")
    # reduce_scatter of a list; all_to_all_single (equal and uneven splits).
    out = torch.empty(3)
    inputs = [torch.full((3,), float(rank * 10 + j)) for j in range(world)]
    if not lacking(gloo, dist.reduce_scatter, out, inputs):
        want = torch.full((3,), float(sum(r * 10 + rank for r in range(world))))
        expect(out, want, "reduce_scatter")
    inp = torch.arange(2 * world, dtype=torch.int64) + 100 * rank
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp)
    want = torch.cat([torch.arange(2 * rank, 2 * rank + 2) + 100 * r for r in range(world)])
    expect(out, want, "all_to_all_single")
    # Uneven splits (forwarded): rank r sends j + 1 rows to rank j.
    send = [j + 1 for j in range(world)]
    inp = torch.full((sum(send),), float(rank))
    out = torch.empty(world * (rank + 1))
    dist.all_to_all_single(out, inp, [rank + 1] * world, send)
    expect(out, torch.arange(world).repeat_interleave(rank + 1).float(), "uneven all_to_all")
    # Splits that look even to rank 0 alone (its row and column of the split
    # matrix are all 1; the others' are not): every rank must still take the
    # same way, or the job hangs. Rank i sends rows of value 10 i + j to j.
    rows = [[1 if i == 0 or j == 0 else 2 for j in range(world)] for i in range(world)]
    inp = torch.cat([torch.full((rows[rank][j],), float(10 * rank + j)) for j in range(world)])
    out = torch.empty(sum(rows[j][rank] for j in range(world)))
    dist.all_to_all_single(out, inp, [rows[j][rank] for j in range(world)], rows[rank])
    want = torch.cat([torch.full((rows[j][rank],), float(10 * j + rank)) for j in range(world)])
    expect(out, want, "all_to_all with splits even on rank 0 only")
    dist.barrier()
    # Forwarded: gather, scatter, object collectives, send/recv, reduce.
    got = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), got, dst=0)
    if rank == 0:
        for r, g in enumerate(got):
            expect(g, torch.full((2,), float(r)), f"gather piece {r}")
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": r} for r in range(world)], objects
    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=1)
    elif rank == 1:
        got = torch.empty(1)
        dist.recv(got, src=0)
        expect(got, torch.tensor([42.0]), "recv")
    t = torch.tensor([float(rank + 1)])
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
    if rank == 0:
        expect(t, torch.tensor([float(world * (world + 1) // 2)]), "reduce")
    # Many small collectives in flight, then waited for in order.
    tensors = [torch.full((5,), float(i + rank)) for i in range(20)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for i, (t, w) in enumerate(zip(tensors, works)):
        w.wait()
        expect(t, torch.full((5,), float(world * i + world * (world - 1) // 2)), f"in flight {i}")


class _SyncBatchNormFunction(torch.autograd.Function):
    """SyncBatchNorm's algorithm on CPU tensors.

    torch's ``SyncBatchNorm`` needs CUDA kernels (``batch_norm_stats`` has
    no CPU version), so this is its communication pattern in plain torch
    operations: the per-channel sums and counts of every rank through
    ``all_gather_into_tensor`` in the forward pass, the gradient sums
    through ``all_reduce`` in the backward pass; weight and bias gradients
    stay local (DDP averages them), as in torch's.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):  # noqa: D102
        channels = x.shape[1]
        local = torch.cat(
            [x.sum(0), (x * x).sum(0), torch.tensor([float(x.shape[0])], dtype=x.dtype)]
        )
        gathered = torch.empty(dist.get_world_size() * local.numel(), dtype=x.dtype)
        dist.all_gather_into_tensor(gathered, local)
        total = gathered.view(dist.get_world_size(), -1).sum(0)
        count = total[-1]
        mean = total[:channels] / count
        var = total[channels : 2 * channels] / count - mean * mean
        invstd = torch.rsqrt(var + eps)
        xhat = (x - mean) * invstd
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.count = count
        return xhat * weight + bias

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        xhat, invstd, weight = ctx.saved_tensors
        sums = torch.cat([dy.sum(0), (dy * xhat).sum(0)])
        grad_weight, grad_bias = sums[dy.shape[1] :].clone(), sums[: dy.shape[1]].clone()
        dist.all_reduce(sums)
        sum_dy, sum_dy_xhat = sums.chunk(2)
        grad_x = weight * invstd * (dy - sum_dy / ctx.count - xhat * sum_dy_xhat / ctx.count)
        return grad_x, grad_weight, grad_bias, None


class CpuSyncBatchNorm(torch.nn.Module):
    """A batch norm over the batches of every rank (training mode only)."""

    def __init__(self, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(channels))
        self.bias = torch.nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias, self.eps)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g) * (1 + rank)
    return x, x.sum(1, keepdim=True).sin()


def train(rank: int, world: int, out: Path) -> None:
    """SyncBatchNorm and ZeroRedundancyOptimizer under DDP, a few steps."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), CpuSyncBatchNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    # The synchronised batch norm equals one over every rank's batch,
    # computed here: outputs, and the gradients of this rank's inputs.
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.5, 0.5)
    hidden = model[0](batch(rank, 0)[0]).detach().requires_grad_()
    mine = model[1](hidden)
    (mine * torch.arange(16.0)).sum().backward()
    everyone = torch.cat([model[0](batch(r, 0)[0]).detach() for r in range(world)])
    everyone.requires_grad_()
    reference_bn = torch.nn.functional.batch_norm(
        everyone, None, None, model[1].weight, model[1].bias, training=True
    )
    (reference_bn * torch.arange(16.0)).sum().backward()
    rows = slice(16 * rank, 16 * (rank + 1))
    torch.testing.assert_close(mine, reference_bn[rows])
    torch.testing.assert_close(hidden.grad, everyone.grad[rows])
    model.zero_grad()
    ddp = DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9
    )
    losses = []
    for _ in range(7):
        x, y = batch(rank, 1)  # one batch, learnt over the steps
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # ZeRO's shards were broadcast back: every rank holds the same model.
    for p in model.parameters():
        gathered = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(gathered, p.detach())
        for g in gathered:
            expect(g, p.detach(), "parameters after ZeroRedundancyOptimizer")
    torch.save(
        {"losses": torch.tensor(losses), **{k: v for k, v in model.state_dict().items()}},
        out / f"train_rank{rank}.pt",
    )


def peer_exits(rank: int) -> None:
    """The last rank leaves after one allreduce; rank 0's next collectives
    must raise the engine's error, never return with their output unfilled.

    Prints ``RAISED <how> <error type>`` per way of waiting on rank 0.
    """
    from tiacc_training.errors import CommError

    x = torch.ones(4)
    dist.all_reduce(x)
    expect(x, torch.full((4,), float(dist.get_world_size())), "allreduce before the exit")
    if rank == dist.get_world_size() - 1:
        os._exit(0)
    if rank != 0:
        return
    out = torch.full((4 * dist.get_world_size(),), -7.0)
    ways = {
        "async wait": lambda: dist.all_gather_into_tensor(out, x, async_op=True).wait(),
        "future value": lambda: dist.all_reduce(x, async_op=True).get_future().wait(),
        "sync all_reduce": lambda: dist.all_reduce(x),
        "sync barrier": lambda: dist.barrier(),
    }
    for how, call in ways.items():
        try:
            call()
        except Exception as error:
            # CommError itself, or torch's wrapper of a callback's error.
            kind = (
                "CommError"
                if isinstance(error, CommError) or "CommError" in str(error)
                else type(error).__name__
            )
            print(f"RAISED {how} {kind}", flush=True)
            print(f"TEXT {how} {str(error)[:300]!r}", flush=True)
        else:
            print(f"RETURNED {how} {out.tolist()}", flush=True)
    os._exit(0)  # the group is broken: no orderly teardown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", choices=["tdist", "explicit"], default="tdist")
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--peer-exits", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import tiacc_training.torch.distributed as tdist
    from tiacc_training.torch.distributed import _backend, _collectives

    tdist.init_tiacc_training()
    # torch 2.0.0 takes one backend name for every device: "tiacc" there.
    explicit = "cpu:tiacc" if _backend.takes_device_strings() else "tiacc"
    dist.init_process_group("gloo" if args.init == "tdist" else explicit)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.peer_exits:
        peer_exits(rank)
        return
    served = _backend.cpu_backend_of()
    gloo = served is None
    try:
        check_collectives(rank, world, gloo)
        if args.train and lacking(
            gloo, dist.all_gather_into_tensor, torch.empty(world), torch.ones(1)
        ):
            # The batch norm gathers into one tensor, which gloo lacks here.
            (args.out / "gloo_lacks_all_gather_into_tensor").write_text(torch.__version__)
        elif args.train:
            train(rank, world, args.out)
    except Exception as exc:
        exit_failed(exc, linger=2.0)
    cpu = dist.group.WORLD._get_backend(torch.device("cpu"))
    result = {
        "backend": str(dist.get_backend()),
        "cpu_backend": type(
            dist.group.WORLD if isinstance(dist.group.WORLD, _backend.TiaccProcessGroup) else cpu
        ).__name__,
        "line": _backend.describe_cpu_collectives(),
        "served": dict(served.served) if served else {},
        "forwarded": by_op(served.forwarded) if served else {},
        "forwarded_why": sorted([*k, n] for k, n in served.forwarded.items()) if served else [],
        "transport": served.transport if served else None,
        "env": os.environ.get("TIACC_TRAINING_COLLECTIVES"),
        "paths": {
            f"{path}/{codec}": {"buckets": row["buckets"], "wire": row["wire"]}
            for (path, codec), row in _collectives.counters_in_process().items()
        },
    }
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

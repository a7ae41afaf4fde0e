"""One rank of a job that checks the CUDA side of the "tiacc" backend's code.

Started by ``test_device_collectives.py`` (torchrun-style variables). The
collectives torch calls on a group's CUDA tensors (``DeviceCollectives``)
run here on CPU tensors over the device engine's TCP rings, with gloo
underneath in NCCL's place: the same checks, dispatch, counts and engine
calls as on a GPU, without the streams. ``--device cuda`` runs the same
checks on the GPU through ``init_process_group("cpu:tiacc,cuda:tiacc")``.

Every value is a small integer, so sums and averages over any order are
exact: results must equal the references bit for bit. Prints ``RESULT``
with what each way served, forwarded and counted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _launch import exit_failed  # noqa: E402

BLOCK = 515


def data(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    values = [float((i * 7 + rank * 5) % 13 - 6) for i in range(world * BLOCK)]
    return torch.tensor(values).to(dtype)


def check(rank: int, world: int, on: torch.device, call: Any) -> int:
    """Every collective the engine serves, and some it forwards, through
    ``call(torch_name, *args)``; returns how many were checked."""
    c10d = torch.distributed.distributed_c10d
    checked = 0

    def opts(kind: str, op: Any = None) -> Any:
        made = getattr(c10d, kind)()
        if op is not None:
            made.reduceOp = op
        return made

    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        total = sum(data(r, world, dtype).double() for r in range(world))
        mine = slice(rank * BLOCK, (rank + 1) * BLOCK)
        ops = [("sum", dist.ReduceOp.SUM, total)]
        if dtype.is_floating_point:
            ops.append(("avg", dist.ReduceOp.AVG, total / world))
        for name, op, want in ops:
            t = data(rank, world, dtype).to(on)
            call("allreduce", [t], opts("AllreduceOptions", op)).wait()
            assert torch.equal(t.cpu().double(), want.to(dtype).double()), ("allreduce", name)
            out = torch.empty(BLOCK, dtype=dtype, device=on)
            src = data(rank, world, dtype).to(on)
            work = call("reduce_scatter_tensor", out, src, opts("ReduceScatterOptions", op))
            work.get_future().wait()
            got = out.cpu().double()
            assert torch.equal(got, want[mine].to(dtype).double()), ("reduce_scatter", name)
            assert torch.equal(src.cpu(), data(rank, world, dtype)), "the input is kept"
            pieces = list(data(rank, world, dtype).to(on).split(BLOCK))
            out = torch.empty(BLOCK, dtype=dtype, device=on)
            call("reduce_scatter", [out], [pieces], opts("ReduceScatterOptions", op)).wait()
            assert torch.equal(out.cpu().double(), want[mine].to(dtype).double())
            checked += 3
        mine_in = data(rank, world, dtype)[mine].to(on)
        flat = torch.empty(world * BLOCK, dtype=dtype, device=on)
        call("allgather_into_tensor", flat, mine_in, opts("AllgatherOptions")).wait()
        want = torch.cat([data(r, world, dtype)[r * BLOCK : (r + 1) * BLOCK] for r in range(world)])
        assert torch.equal(flat.cpu(), want), "allgather_into_tensor"
        outs = [torch.empty(BLOCK, dtype=dtype, device=on) for _ in range(world)]
        call("allgather", [outs], [mine_in], opts("AllgatherOptions")).wait()
        assert torch.equal(torch.cat([o.cpu() for o in outs]), want), "allgather"
        checked += 2
    # Forwarded underneath: a max, an average of integers, broadcast,
    # all_to_all and barrier, with the backend's own results.
    t = torch.tensor([float(rank)], device=on)
    call("allreduce", [t], opts("AllreduceOptions", dist.ReduceOp.MAX)).wait()
    assert t.item() == world - 1, "max"
    t = torch.full((4,), rank + 1, dtype=torch.int64, device=on)
    call("allreduce", [t], opts("AllreduceOptions", dist.ReduceOp.SUM)).wait()
    assert t.tolist() == [world * (world + 1) // 2] * 4, "int64 sum"
    b = torch.full((3,), float(rank), device=on)
    o = opts("BroadcastOptions")
    o.rootRank = world - 1
    call("broadcast", [b], o).wait()
    assert b.tolist() == [float(world - 1)] * 3, "broadcast"
    call("barrier", opts("BarrierOptions")).wait()
    return checked + 4


def horovod_on(on: torch.device, rank: int, world: int) -> int:
    """Horovod's collectives on ``on``'s tensors (they run on the same group)."""
    import tiacc_training.torch.horovod as hvd

    hvd.init()
    t = torch.full((1000,), float(rank + 1), device=on)
    assert torch.equal(hvd.allreduce(t, op=hvd.Sum).cpu(), torch.full((1000,), 3.0)), "hvd sum"
    got = hvd.allgather(torch.full((2, 3), float(rank), device=on)).cpu()
    assert got.shape == (2 * world, 3) and got[-1, 0].item() == world - 1, "hvd allgather"
    scattered = hvd.reducescatter(torch.ones(4 * world, device=on), op=hvd.Sum).cpu()
    assert torch.equal(scattered, torch.full((4,), float(world))), "hvd reducescatter"
    return 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--horovod", action="store_true", help="then hvd ops on CUDA tensors")
    args = parser.parse_args()
    import tiacc_training.torch.distributed as tdist
    from tiacc_training.torch.distributed import _backend, _collectives, _device_collectives

    tdist.init_tiacc_training()
    try:
        if args.device == "cpu":
            dist.init_process_group("gloo")
            rank, world = dist.get_rank(), dist.get_world_size()
            store = dist.distributed_c10d._get_default_store()
            timeout = datetime.timedelta(seconds=60)
            under = dist.ProcessGroupGloo(dist.PrefixStore("under/", store), rank, world, timeout)
            group = _collectives.GroupArgs(store, rank, world, timeout, "check")
            collectives = _device_collectives.DeviceCollectives(
                group.under("device/"), under, "cpu"
            )

            def call(name: str, *call_args: Any) -> Any:
                return getattr(collectives, name)(*call_args)

            on = torch.device("cpu")
        else:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local % torch.cuda.device_count())
            dist.init_process_group("cpu:tiacc,cuda:tiacc")
            rank, world = dist.get_rank(), dist.get_world_size()
            on = torch.device("cuda", torch.cuda.current_device())
            collectives = None

            def call(name: str, *call_args: Any) -> Any:
                return _TORCH_CALLS[name](*call_args)

        checked = check(rank, world, on, call)
        if args.horovod:
            checked += horovod_on(on, rank, world)
        if collectives is None:
            collectives = _backend.cuda_collectives_of()
            assert collectives is not None, "no tiacc collectives for CUDA tensors"
        counted = {
            f"{path}/{codec}": {"buckets": row["buckets"], "wire": row["wire"]}
            for (path, codec), row in collectives.counters().items()
        }
        result = {
            "checked": checked,
            "served": dict(collectives.served),
            "forwarded": sorted([*k, n] for k, n in collectives.forwarded.items()),
            "transport": collectives.transport,
            "paths": counted,
            "in_process": dict(_device_collectives.served_in_process),
            "cpu_counted": sorted(f"{p}/{c}" for p, c in _collectives.counters_in_process()),
        }
        print("RESULT " + json.dumps(result), flush=True)
        collectives.shutdown()
    except Exception as exc:
        exit_failed(exc, linger=2.0)
    dist.destroy_process_group()


# The same checks through torch.distributed's own functions (the GPU run).
_TORCH_CALLS: dict[str, Any] = {
    "allreduce": lambda ts, o: dist.all_reduce(ts[0], op=o.reduceOp, async_op=True),
    "reduce_scatter_tensor": lambda out, src, o: dist.reduce_scatter_tensor(
        out, src, op=o.reduceOp, async_op=True
    ),
    "reduce_scatter": lambda outs, ins, o: dist.reduce_scatter(
        outs[0], ins[0], op=o.reduceOp, async_op=True
    ),
    "allgather_into_tensor": lambda out, src, o: dist.all_gather_into_tensor(
        out, src, async_op=True
    ),
    "allgather": lambda outs, ins, o: dist.all_gather(outs[0], ins[0], async_op=True),
    "broadcast": lambda ts, o: dist.broadcast(ts[0], src=o.rootRank, async_op=True),
    "barrier": lambda o: dist.barrier(async_op=True),
}


if __name__ == "__main__":
    main()

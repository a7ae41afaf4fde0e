"""DDP on one GPU through the NCCL transport, and the GPU codecs' throughput.

Part 1: ResNet-50 (torchvision, random weights) on synthetic 224x224
ImageNet-shaped batches, DDP with a world of one: native DDP (NCCL) against
the tiacc hook over the NCCL transport with 1 and 4 channels. Reports the
median step time and the tiacc overhead relative to native. With one rank
the allreduce itself is a copy, so this measures what the hook adds
(stream hand-offs, the CUDA-aware future, the watchdog), not bandwidth.

Part 2: the casts and selections the CUDA path runs on the channel stream,
on 25M float32 elements: the fp16 cast (bytes read + written per second)
and Top-K of 1% (|x| top-k plus the gather of the values; input bytes per
second).

Needs a CUDA device; exits with a message otherwise. Writes
benches/results/bench_nccl.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import REPO, machine_info  # noqa: E402


def _step_times(ddp: Any, opt: Any, batch: int, steps: int, warmup: int) -> list[float]:
    import torch
    from torch import nn

    device = next(ddp.parameters()).device
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, device=device, generator=gen)
    y = torch.randint(0, 1000, (batch,), device=device, generator=gen)
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def bench_ddp(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    import torchvision
    from torch import nn

    import tiacc_training.torch.distributed as tdist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    runs = [("native", None), ("tiacc nccl", 1), ("tiacc nccl", 4)]
    rows = []
    for name, channels in runs:
        tdist.init_tiacc_training(
            backend="nccl",
            enable=channels is not None,
            num_streams=channels,
            transport="nccl",
        )
        torch.manual_seed(0)
        model = torchvision.models.resnet50().to(device)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
        if channels is not None and getattr(ddp, "_tiacc_hook_state", None) is None:
            raise RuntimeError("the tiacc hook was not attached")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        times = _step_times(ddp, opt, args.batch, args.steps, args.warmup)
        rows.append(
            {
                "pipeline": name,
                "channels": channels,
                "median_ms": round(statistics.median(times) * 1000, 2),
                "min_ms": round(min(times) * 1000, 2),
            }
        )
        del ddp, model, opt
        torch.cuda.empty_cache()
    native = rows[0]["median_ms"]
    for row in rows:
        row["overhead_vs_native"] = round(row["median_ms"] / native - 1.0, 4)
    return rows


def _gpu_seconds(fn: Any, repeats: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1000.0)
    return statistics.median(samples)


def bench_codecs(elements: int, repeats: int) -> list[dict[str, Any]]:
    import torch

    x = torch.randn(elements, device="cuda")
    k = max(1, elements // 100)

    def fp16_cast() -> None:
        x.to(torch.float16)

    def topk() -> None:
        _, idx = torch.topk(x.abs(), k, sorted=False)
        x.gather(0, idx)

    rows = []
    cast_s = _gpu_seconds(fp16_cast, repeats)
    rows.append(
        {
            "codec": "fp16 cast",
            "elements": elements,
            "median_ms": round(cast_s * 1000, 3),
            "gb_per_s": round(elements * (4 + 2) / cast_s / 1e9, 1),
            "bytes_counted": "read float32 + write float16",
        }
    )
    topk_s = _gpu_seconds(topk, repeats)
    rows.append(
        {
            "codec": "top-k 1%",
            "elements": elements,
            "median_ms": round(topk_s * 1000, 3),
            "gb_per_s": round(elements * 4 / topk_s / 1e9, 1),
            "bytes_counted": "float32 input",
        }
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--elements", type=int, default=25_000_000)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=REPO / "benches/results/bench_nccl.json")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_nccl.py needs a CUDA device: torch.cuda.is_available() is False")
    for var, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        os.environ.setdefault(var, value)
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])

    import tiacc_training.torch.distributed as tdist

    rows = bench_ddp(args)
    print(f"ResNet-50, batch {args.batch}, DDP world of 1, median of {args.steps} steps")
    print(f"{'pipeline':<12} {'channels':>8} {'median ms':>10} {'overhead':>9}")
    for row in rows:
        ch = "-" if row["channels"] is None else str(row["channels"])
        print(
            f"{row['pipeline']:<12} {ch:>8} {row['median_ms']:>10.2f} "
            f"{row['overhead_vs_native'] * 100:>8.1f}%"
        )
    codecs = bench_codecs(args.elements, args.repeats)
    print(f"\nGPU codecs on {args.elements} float32 elements")
    for row in codecs:
        print(f"{row['codec']:<10} {row['median_ms']:>9.3f} ms {row['gb_per_s']:>8.1f} GB/s")
    result = {
        "benchmark": "bench_nccl",
        "setup": {
            "model": "torchvision resnet50, random weights, synthetic 224x224 batches, SGD",
            "batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "world_size": 1,
            "gpu": torch.cuda.get_device_name(0),
            "nccl_version": ".".join(map(str, tdist.nccl_version())),
        },
        "ddp": rows,
        "codecs": codecs,
        "machine": machine_info(["torch", "torchvision", "tiacc-training"]),
    }
    tdist.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

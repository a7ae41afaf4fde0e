"""One rank of the DDP benchmark (launched by bench_ddp.py).

Trains a stack of 1024x1024 Linear layers (about 16.8 MB of float32
gradients) with DistributedDataParallel, natively (gloo) or through the
tiacc engine, and prints the per-step wall times of rank 0 as JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["native", "tiacc"], required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    if args.mode == "tiacc":
        import tiacc_training.torch.distributed as tdist

        tdist.init_tiacc_training()
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width)
    times = []
    cpu_start = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu_start = usage.ru_utime + usage.ru_stime
        start = time.perf_counter()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_per_step = (usage.ru_utime + usage.ru_stime - cpu_start) / args.steps
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    if dist.get_rank() == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "step_s": times,
                    "grad_bytes": grad_bytes,
                    "bucket_bytes_cap": ddp.bucket_bytes_cap,
                    "checksum": checksum,
                    "rank0_cpu_s_per_step": cpu_per_step,
                }
            ),
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

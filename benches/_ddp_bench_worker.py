"""One rank of the DDP benchmarks (launched by bench_ddp.py and bench_nccl.py).

Trains a stack of square Linear layers (``--layers`` x ``--width``; the
default 4 x 1024 is about 16.8 MB of float32 gradients) with
DistributedDataParallel, natively or through the tiacc engine, and prints
the per-step wall times of rank 0 as JSON. On ``--device cpu`` native runs
use gloo; on ``--device cuda`` (every rank on ``cuda:LOCAL_RANK %
device_count``) native runs use NCCL. Native runs may register one of
torch's own communication hooks (``--hook``). Rank 0 also reads its node's
link counters around the timed steps, which gives the bytes that crossed
between the nodes per step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist
from torch import nn


def link_bytes() -> int:
    """Bytes this node's end of the link has sent plus received so far.

    Read from ``/proc/net/dev``, which shows the reading process's network
    namespace however the process entered it.
    """
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    with open("/proc/net/dev", encoding="ascii") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == ifname:
                fields = counters.split()
                return int(fields[0]) + int(fields[8])
    raise RuntimeError(f"{ifname} is not in /proc/net/dev")


def register_torch_hook(ddp: nn.parallel.DistributedDataParallel, hook: str) -> None:
    """One of torch's built-in communication hooks, as a user would."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        # Compression from the third step on, so every timed step uses it.
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["native", "tiacc"], required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hook", choices=["none", "fp16", "bf16", "powersgd"], default="none")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if args.mode == "tiacc":
        import tiacc_training.torch.distributed as tdist

        tdist.init_tiacc_training()
    else:
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers).to(device)
    # PowerSGD chains allreduces inside future callbacks, whose order gloo
    # does not keep the same on every rank once there are several buckets
    # (ranks then abort on mismatched messages): it gets a single bucket.
    bucket_cap_mb = 64 if args.hook == "powersgd" and not cuda else None
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if args.hook != "none":
        register_torch_hook(ddp, args.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width, device=device)
    times = []
    cpu_start = 0.0
    link_start = 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu_start = usage.ru_utime + usage.ru_stime
            link_start = link_bytes()
        start = time.perf_counter()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    # Every rank's last step is done when the barrier returns; the counters
    # then hold exactly the timed steps' traffic (plus one barrier's).
    dist.barrier()
    link_per_step = (link_bytes() - link_start) / args.steps
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
                    "link_bytes_per_step": link_per_step,
                }
            ),
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

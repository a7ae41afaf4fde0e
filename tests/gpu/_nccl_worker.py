"""One rank of a small DDP run on CUDA, for the GPU tests.

Launched by the GPU tests with torchrun-style variables. Trains a small
MLP on ``cuda:LOCAL_RANK % device_count`` natively or through the tiacc
engine (``--transport nccl``, ``tcp`` or ``auto``; the algorithm comes from
the environment: ``LIGHT_*``, ``TIACC_TRAINING_*``) and saves the final
parameters per rank. Reads each step's loss on the host, as a training loop
that logs does, so a failure on another rank surfaces at the next step.
Prints ``DONE <mode> <transport used>`` at the end; ``--nan-rank`` puts a
NaN into that rank's input at ``--nan-step``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import tiacc_training.torch.distributed as tdist
from tests._launch import exit_failed


def build_model(width: int) -> nn.Module:
    torch.manual_seed(1234)
    layers: list[nn.Module] = [nn.Linear(32, width), nn.ReLU()]
    for _ in range(6):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=["native", "tiacc"], required=True)
    parser.add_argument("--transport", choices=["auto", "nccl", "tcp"], default="nccl")
    # The transport the engine must end up with (default: --transport).
    parser.add_argument("--expect-transport", choices=["nccl", "tcp"])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.1)
    parser.add_argument("--nan-rank", type=int, default=-1)
    parser.add_argument("--nan-step", type=int, default=3)
    args = parser.parse_args()
    try:
        # Bitwise comparisons need deterministic kernels and no TF32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True)
        tdist.init_tiacc_training(
            backend=args.backend,
            enable=args.mode == "tiacc",
            num_streams=args.channels,
            transport=args.transport,
            timeout=120,
        )
        rank = dist.get_rank()
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        model = build_model(args.width).to(device)
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index], bucket_cap_mb=args.bucket_cap_mb
        )
        if args.mode == "tiacc":
            assert getattr(ddp, "_tiacc_hook_state", None) is not None, "hook not attached"
            expected = args.expect_transport or args.transport
            assert tdist.cuda_transport() == expected, tdist.cuda_transport()
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        gen = torch.Generator().manual_seed(100 + rank)
        teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
        losses: list[float] = []
        for step in range(args.steps):
            x = torch.randn(64, 32, generator=gen)
            y = (x @ teacher).argmax(dim=1)
            if rank == args.nan_rank and step == args.nan_step:
                x[0, 0] = float("nan")
            loss = nn.functional.cross_entropy(ddp(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        torch.cuda.synchronize(device)
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        assert all(torch.isfinite(v).all() for v in state.values()), "non-finite parameters"
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(state, args.out / f"{args.mode}_rank{rank}.pt")
        transport = tdist.cuda_transport() if args.mode == "tiacc" else args.backend
        # Mean losses of the first and the last five steps (one batch is noisy).
        n = min(5, len(losses))
        first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
        print(f"LOSS first {first:.6f} last {last:.6f}", flush=True)
        print(f"DONE {args.mode} {transport}", flush=True)
        dist.barrier()
        tdist.shutdown()
        dist.destroy_process_group()
        return 0
    except Exception as exc:  # the tests read the WORKER_ERROR line
        exit_failed(exc, linger=5)
        return 3


if __name__ == "__main__":
    sys.exit(main())

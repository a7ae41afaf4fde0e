"""One rank of the settings tests (``test_settings.py``).

Trains the MLP of ``ddp_worker`` in windows of ``--window`` backward passes
and one optimiser step per window, in each mode of ``--modes``:

- ``native-nosync``: native DDP, the first passes of each window under
  ``no_sync()``;
- ``tiacc-nosync``: the same loop through the engine;
- ``tiacc-accumulate`` / ``tiacc-accumulate-view``: the engine, no
  ``no_sync()`` at all (``PERSEUS_ACCUMULATE_N_STEPS`` in the environment
  makes the engine communicate once per window), the second with
  ``gradient_as_bucket_view=True``.

Saves, per mode and rank, the gradients at each window's end and the final
parameters, and prints what the engine and the DDP patch chose.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import tiacc_training.torch.distributed as tdist
from tests._launch import exit_failed
from tests.distributed.ddp_worker import build_model
from tiacc_training.torch.distributed._hook import totals


def train(mode: str, window: int, windows: int, bucket_cap_mb: float | None) -> dict:
    rank = dist.get_rank()
    model = build_model()
    kwargs: dict = {"gradient_as_bucket_view": mode.endswith("-view")}
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"BUCKET_CAP {mode} {ddp.bucket_bytes_cap} {gradient_bytes}", flush=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    grads, sent = [], []
    for p in range(window * windows):
        last = p % window == window - 1
        x = torch.randn(16, 32, generator=gen)
        y = torch.randint(0, 10, (16,), generator=gen)
        skip = mode.endswith("nosync") and not last
        before = totals.engine_buckets
        with ddp.no_sync() if skip else contextlib.nullcontext():
            nn.functional.cross_entropy(ddp(x), y).backward()
        sent.append(totals.engine_buckets - before)
        if last:
            grads.append({n: q.grad.detach().clone() for n, q in model.named_parameters()})
            opt.step()
            opt.zero_grad()
    print(f"ENGINE_BUCKETS_PER_PASS {mode} {' '.join(map(str, sent))}", flush=True)
    params = {n: q.detach().clone() for n, q in model.named_parameters()}
    return {"grads": grads, "params": params}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--modes", default="native-nosync,tiacc-nosync")
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    args = parser.parse_args()
    try:
        results = {}
        for mode in args.modes.split(","):
            tdist.init_tiacc_training(enable=mode.startswith("tiacc"))
            results[mode] = train(mode, args.window, args.windows, args.bucket_cap_mb)
        engine = tdist.get_engine()
        rank = dist.get_rank()
        if engine is not None:
            store = dist.distributed_c10d._get_default_store()
            addr = store.get(f"tiacc_training/engine1/addr/{rank}").decode()
            print(f"ENGINE_CHANNELS={engine.num_channels}", flush=True)
            print(f"ENGINE_ADDR={addr.rsplit(':', 1)[0]}", flush=True)
            print(f"SOCKET_ADDR={engine.config.socket_addr}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(results, args.out / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except Exception as exc:  # the tests read the WORKER_ERROR line
        exit_failed(exc, linger=1.0 if dist.is_initialized() and dist.get_rank() == 0 else 0.0)
        return 3


if __name__ == "__main__":
    sys.exit(main())

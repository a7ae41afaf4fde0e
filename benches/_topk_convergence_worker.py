"""One rank of bench_topk_convergence.py: trains one task and logs held-out loss.

Launched by the benchmark (plain processes with torchrun-style variables);
the engine's settings (``LIGHT_TOPK_*``, ``TIACC_TRAINING_TOPK_*``) come
from the environment. ``--mode native`` leaves DDP's communication native.

Tasks, both trained by ``torch.optim.SGD`` with momentum 0.9 on 4 ranks:

* ``mlp``: the learnable task of ``tests/distributed/ddp_worker.py`` (its
  model and data, batch 64 per rank, lr 0.05, 20 KB buckets), so the final
  loss here equals the one the tests print;
* ``cnn``: a convolutional classifier of 16 x 16 images: ten smooth random
  class templates, each sample a template at a random shift of up to 2
  pixels plus unit Gaussian noise; batch 32 per rank, lr 0.02, 256 KB
  buckets.

Rank 0 writes ``{"steps": [...], "loss": [...]}`` (held-out loss every
``--eval-every`` steps and after the last) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from _models import conv_classifier
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tiacc_training.torch.distributed as tdist  # noqa: E402
from tests.distributed.ddp_worker import build_model  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]


def mlp_task(rank: int) -> tuple[nn.Module, Callable[[], Batch], Batch, float, float]:
    """ddp_worker's learnable task: model, batch source, held-out set, lr, bucket MB."""
    gen = torch.Generator().manual_seed(100 + rank)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))

    def batch() -> Batch:
        x = torch.randn(64, 32, generator=gen)
        return x, (x @ teacher).argmax(dim=1)

    held = torch.randn(4096, 32, generator=torch.Generator().manual_seed(999))
    return build_model(), batch, (held, (held @ teacher).argmax(dim=1)), 0.05, 0.02


def _images(gen: torch.Generator, templates: torch.Tensor, n: int) -> Batch:
    y = torch.randint(0, 10, (n,), generator=gen)
    shifts = torch.randint(-2, 3, (n, 2), generator=gen).tolist()
    x = torch.stack(
        [torch.roll(templates[c], (a, b), dims=(1, 2)) for c, (a, b) in zip(y.tolist(), shifts)]
    )
    return 0.3 * x + torch.randn(x.shape, generator=gen), y


def cnn_task(rank: int) -> tuple[nn.Module, Callable[[], Batch], Batch, float, float]:
    """The convolutional task: model, batch source, held-out set, lr, bucket MB."""
    noise = torch.randn(10, 1, 20, 20, generator=torch.Generator().manual_seed(11))
    templates = nn.functional.avg_pool2d(noise, 5, stride=1)
    templates = templates / templates.flatten(1).std(dim=1).view(10, 1, 1, 1)
    torch.manual_seed(4321)
    model = conv_classifier(1, [(32, 1), (64, 2), (64, 2)], [64 * 4 * 4, 128, 10])
    gen = torch.Generator().manual_seed(200 + rank)
    held = _images(torch.Generator().manual_seed(999), templates, 2048)
    return model, lambda: _images(gen, templates, 32), held, 0.02, 0.25


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=["mlp", "cnn"], required=True)
    parser.add_argument("--mode", choices=["native", "tiacc"], required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tdist.init_tiacc_training(enable=args.mode == "tiacc")
    rank = dist.get_rank()
    task = mlp_task if args.task == "mlp" else cnn_task
    model, batch, (held_x, held_y), lr, bucket_mb = task(rank)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    steps, losses = [], []

    def evaluate(step: int) -> None:
        if rank == 0:
            with torch.no_grad():
                loss = nn.functional.cross_entropy(model(held_x), held_y).item()
            steps.append(step)
            losses.append(round(loss, 6))

    for step in range(args.steps):
        if step % args.eval_every == 0:
            evaluate(step)
        x, y = batch()
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    evaluate(args.steps)
    if rank == 0:
        args.out.write_text(json.dumps({"steps": steps, "loss": losses}))
        print(f"FINAL_LOSS {args.mode} {losses[-1]:.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

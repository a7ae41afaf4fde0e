"""One rank of a Top-K run that is checkpointed and resumed (``test_engine_state_resume``).

Top-K with DGC's momentum correction and a warm-up comes from the
environment. ``--mode full`` trains ``STEPS`` steps from the start and,
after step ``STOP``, saves a checkpoint (the model's and the optimizer's
state and ``tdist.state_dict()``) with ``torch.save``, then goes on: its
final parameters are the uninterrupted run's. ``--mode resume``, a fresh
process, trains the rest from that checkpoint three times, each in a group
of its own (so on engines built afresh): loading the engine state before
the DDP model exists (``before``: held, then applied when DDP builds the
engine), after it (``after``: into the engine DDP built), and not at all
(``none``). Every rank saves the final parameters of each.

The DDP model is built with ``find_unused_parameters=True``, which fixes
DDP's buckets from construction (no rebuild after the first step), so the
resumed run's buckets are the uninterrupted run's from its first step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import tiacc_training.torch.distributed as tdist
from tests._launch import exit_failed

MOMENTUM = 0.9
# Steps of the run, and the step after which it is checkpointed.
STEPS, STOP = 8, 3


def build_model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, torch.randint(0, 4, (8,), generator=g)


def train(rank: int, first: int, load: str, checkpoint: dict | None, path: Path) -> nn.Module:
    """Steps ``first`` to ``STEPS`` of a model (from ``checkpoint`` when given).

    A run from the start saves its checkpoint to ``path`` after step ``STOP``
    (at once: a state dict's tensors are the live ones).
    """
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=MOMENTUM)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if load == "before":
            tdist.load_state_dict(checkpoint["tiacc"])
            held = tdist.state_dict()["engines"]
            assert held.keys() == checkpoint["tiacc"]["engines"].keys(), held.keys()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    if checkpoint is not None and load == "after":
        tdist.load_state_dict(checkpoint["tiacc"])
    loss_fn = nn.CrossEntropyLoss()
    for step in range(first, STEPS):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        loss_fn(ddp(x), y).backward()
        optimizer.step()
        if checkpoint is None and step + 1 == STOP:
            saved = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "tiacc": tdist.state_dict(),
                "step": STOP,
            }
            torch.save(saved, path)
            buckets = saved["tiacc"]["engines"]["cpu"]["buckets"]
            print(f"BUCKETS {len(buckets)} STEPS {[b['steps'] for b in buckets.values()]}")
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["full", "resume"], required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()

    tdist.init_tiacc_training()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    path = a.out / f"checkpoint_rank{rank}.pt"
    if a.mode == "full":
        finals = {"full": train(rank, 0, "none", None, path)}
    else:
        # One variant per group: each one's engines are built afresh.
        finals = {}
        for n, load in enumerate(("before", "after", "none")):
            if n:
                dist.destroy_process_group()
                dist.init_process_group("gloo")
            checkpoint = torch.load(path, weights_only=True)
            finals[load] = train(rank, checkpoint["step"], load, checkpoint, path)
            print(f"CARRIED {load} {tdist.stats()['buckets'].get('cpu', 0)}", flush=True)
    for name, model in finals.items():
        params = [q.detach().clone() for q in model.parameters()]
        torch.save(params, a.out / f"final_{name}_rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        exit_failed(exc)

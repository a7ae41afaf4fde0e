"""An image-classification reference script's shape, adapted to the CPU.

The two lines, then: the script's own ``init_process_group`` (env://) and a
barrier, an image-folder dataset behind DataLoader workers, a small CNN
with batch norm, DDP, one training loop per epoch (forward before
``zero_grad``, ``model.train()``), an evaluation under
``torch.inference_mode()`` with ``model.eval()`` and the samples counted
across ranks, metrics averaged with ``all_reduce``, a checkpoint saved on
rank 0 after every epoch.

``--extra-passes``: each epoch's first step also runs, before its own
forward, the backward passes DDP does not sync that scripts do run: a
``torch.autograd.grad`` through the DDP model's output (last), a backward
through the wrapped module itself, and one whose forward ran under
``no_sync()``
(their gradients are cleared by the step's ``zero_grad``).

``TIACC_TEST_START_JITTER`` (seconds): each process sleeps a random time up
to that before it starts, so that the ranks reach the group, the engine's
rendezvous and the first forward at different moments. Rank 0 prints
``LOSS <epoch> <value>`` and every rank one ``RESULT`` line: its synced
backward passes, ``tdist.stats()`` (when the two lines are there) and the
warnings it saw.
"""

import tiacc_training.torch.distributed as tdist

tdist.init_tiacc_training()

import argparse
import json
import os
import random
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

CAUGHT: list[str] = []


def _record(message, category, filename, lineno, file=None, line=None):
    CAUGHT.append(f"{category.__name__}: {message}")
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


warnings.showwarning = _record


def make_folder(root: str, classes: int, per_class: int, seed: int) -> None:
    """Writes ``root/<class>/<n>.png``: small images with a class pattern."""
    g = torch.Generator().manual_seed(seed)
    for c in range(classes):
        os.makedirs(os.path.join(root, f"class{c}"), exist_ok=True)
        for n in range(per_class):
            pixels = torch.randint(0, 256, (20, 20, 3), generator=g, dtype=torch.uint8)
            pixels[c * 2 : c * 2 + 4, :, c % 3] = 255
            path = os.path.join(root, f"class{c}", f"{n}.png")
            Image.fromarray(pixels.numpy()).save(path)


class Folder(Dataset):
    """``root/<class>/<file>``, read with Pillow, as an image folder reads."""

    def __init__(self, root: str, train: bool) -> None:
        self.classes = sorted(os.listdir(root))
        self.items = [
            (os.path.join(root, c, f), i)
            for i, c in enumerate(self.classes)
            for f in sorted(os.listdir(os.path.join(root, c)))
        ]
        self.train = train

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        path, label = self.items[index]
        with Image.open(path) as image:
            x = torch.from_numpy(__import__("numpy").asarray(image.convert("RGB")).copy())
        x = x.permute(2, 0, 1).float() / 255.0
        if self.train and torch.rand(()) < 0.5:
            x = x.flip(-1)
        x = x[:, 2:18, 2:18]
        return (x - 0.5) / 0.25, label


def model_of(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, classes),
    )


def unsynced_passes(model, image):
    """Backward passes DDP does not sync (none reaches a comm hook).

    In this order: ``autograd.grad`` leaves DDP's reducer waiting for a
    backward (the step's own forward prepares it again).
    """
    model.module(image).sum().backward()
    with model.no_sync():
        output = model(image)
    output.sum().backward()
    output = model(image)
    torch.autograd.grad(output.square().mean(), list(model.parameters()))


def train_one_epoch(model, loss_fn, optimizer, loader, counted, extra):
    model.train()
    total = torch.zeros(2)
    for step, (image, target) in enumerate(loader):
        if extra and step == 0:
            unsynced_passes(model, image)
        output = model(image)
        optimizer.zero_grad()
        loss = loss_fn(output, target)
        loss.backward()
        counted[0] += 1
        optimizer.step()
        total += torch.tensor([loss.item() * len(target), len(target)])
    return total


def evaluate(model, loss_fn, loader):
    model.eval()
    total = torch.zeros(3, dtype=torch.float64)
    with torch.inference_mode():
        for image, target in loader:
            output = model(image)
            loss = loss_fn(output, target)
            correct = (output.argmax(1) == target).sum()
            total += torch.tensor([loss.item() * len(target), correct.item(), len(target)])
    dist.barrier()
    dist.all_reduce(total)
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", default="")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--extra-passes", action="store_true")
    args = parser.parse_args()

    jitter = float(os.environ.get("TIACC_TEST_START_JITTER", "0"))
    if jitter:
        time.sleep(random.uniform(0, jitter))
    dist.init_process_group(backend="gloo", init_method="env://")
    rank = dist.get_rank()
    dist.barrier()
    torch.manual_seed(0)

    train_set = Folder(os.path.join(args.data, "train"), train=True)
    test_set = Folder(os.path.join(args.data, "val"), train=False)
    train_sampler = DistributedSampler(train_set, seed=0)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    loader = DataLoader(
        train_set, batch_size=args.batch, sampler=train_sampler, num_workers=args.workers
    )
    test_loader = DataLoader(
        test_set, batch_size=args.batch, sampler=test_sampler, num_workers=args.workers
    )
    model = model_of(len(train_set.classes))
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model_without_ddp = model
    model = DDP(model)
    model_without_ddp = model.module

    counted = [0]
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        torch.manual_seed(epoch + 100 * rank)  # the workers' flips
        total = train_one_epoch(model, loss_fn, optimizer, loader, counted, args.extra_passes)
        scheduler.step()
        dist.all_reduce(total)
        scores = evaluate(model, loss_fn, test_loader)
        if rank == 0:
            print(f"LOSS {epoch} {total[0].item() / total[1].item():.6f}", flush=True)
            print(f"LOSS val{epoch} {scores[0].item() / scores[2].item():.6f}", flush=True)
            if args.out:
                checkpoint = {
                    "model": model_without_ddp.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                }
                torch.save(checkpoint, os.path.join(args.out, "checkpoint.pth"))
    stats = None
    if tdist.is_initialized():
        full = tdist.stats()
        stats = {"steps": full["steps"], "native": full["native"]}
    result = {"rank": rank, "synced": counted[0], "stats": stats, "warnings": CAUGHT}
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--make-data":
        make_folder(os.path.join(sys.argv[2], "train"), 4, 12, 0)
        make_folder(os.path.join(sys.argv[2], "val"), 4, 4, 1)
    else:
        main()

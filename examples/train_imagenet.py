r"""ImageNet-style training with the three parts of tiacc-training.

One script for every launcher: torchrun, mpirun and SLURM's srun all start
it unchanged (``init_tiacc_training`` reads whichever launcher's variables it
finds). It uses

1. communication: ``tdist.init_tiacc_training()`` before the DDP model is
   built, so the native ``DistributedDataParallel`` sends its gradient
   buckets through the tiacc engine;
2. data: ``IndexTFRDataset`` over shards packed by ``img2tfrecord`` (the
   crop, flip and normalisation run fused in Rust) and the drop-in
   ``DataLoader`` that decodes whole batches in threads;
3. mixed precision: ``MixedPrecision_TrainingPolicy`` says each epoch
   whether autocast is on; its state is saved in the checkpoint.

Pack the training images first (see docs/data.md)::

    general_image_list --img_dir train/ --img_list train_list
    img2tfrecord --img_dir train/ --img_list train_list --tfrecords_name train \
        --dataset_type ImageFold --output_dir packed/train --workers 8

then launch, for example::

    torchrun --nproc_per_node 8 examples/train_imagenet.py --train packed/train/train.index

``train_imagenet_torchrun.sh``, ``train_imagenet_mpirun.sh`` and
``train_imagenet.sbatch`` beside this file are complete launch scripts.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision.transforms as T
from torch import nn
from torch.utils.data.distributed import DistributedSampler

import tiacc_training.torch.distributed as tdist
from tiacc_training.torch.data import DataLoader
from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset, MixedPrecision_TrainingPolicy

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", required=True, help="index of the packed training set")
    p.add_argument("--val", help="index of the packed validation set (optional)")
    p.add_argument("--arch", default="resnet50", help="a torchvision model, or 'tiny'")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=0.1, help="for 256 images per step; scaled")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=4, help="decode threads per rank")
    p.add_argument("--max-steps", type=int, default=0, help="steps per epoch (0: all)")
    p.add_argument("--amp-start", type=int, default=1, help="first epoch in mixed precision")
    p.add_argument("--checkpoint", default="checkpoint.pt", help="written by rank 0")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    return p.parse_args(argv)


class TinyNet(nn.Sequential):
    """A small CNN for trying the script out on a CPU."""

    def __init__(self, num_classes: int) -> None:
        super().__init__(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, num_classes),
        )


def build_model(arch: str, num_classes: int) -> nn.Module:
    """``arch`` from torchvision's model zoo (untrained), or the tiny CNN."""
    if arch == "tiny":
        return TinyNet(num_classes)
    import torchvision.models

    return getattr(torchvision.models, arch)(num_classes=num_classes)


def datasets(args: argparse.Namespace) -> tuple[IndexTFRDataset, IndexTFRDataset | None]:
    """The packed training set (and validation set); both take the fused path."""
    size = args.image_size
    train_tf = T.Compose(
        [T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]
    )
    val_tf = T.Compose(
        [T.Resize(size * 8 // 7), T.CenterCrop(size), T.ToTensor(), T.Normalize(MEAN, STD)]
    )
    train = IndexTFRDataset(os.path.dirname(args.train) or ".", args.train, train_tf)
    val = IndexTFRDataset(os.path.dirname(args.val) or ".", args.val, val_tf) if args.val else None
    return train, val


def all_sum(*values: float) -> list[float]:
    """``values`` summed over the ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Top-1 accuracy over every rank's share of the validation set."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in loader:
            logits = model(images.to(device, non_blocking=True))
            correct += int((logits.argmax(1).cpu() == labels).sum())
            total += len(labels)
    model.train()
    correct, total = all_sum(correct, total)
    return correct / max(total, 1)


def main(argv: list[str] | None = None) -> None:
    """Trains; rank 0 prints one line per epoch and writes the checkpoint."""
    args = parse_args(argv)
    # 1. Communication: the launcher's variables give the rank and world; the
    # engine creates the process group and takes over DDP's gradient buckets.
    tdist.init_tiacc_training()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else None
    device = device or torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    # 2. Data: packed shards, read with random access; the sampler splits
    # them over the ranks as it would an ImageFolder.
    train_set, val_set = datasets(args)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=cuda,
        drop_last=True,
    )
    val_loader = None
    if val_set is not None:
        val_sampler = DistributedSampler(val_set, shuffle=False)
        val_loader = DataLoader(
            val_set, batch_size=args.batch_size, sampler=val_sampler, num_workers=args.workers
        )

    model = build_model(args.arch, max(train_set.class_num, 1)).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    # 3. Mixed precision: policy 0 keeps the first epochs in float32 and
    # turns autocast on from --amp-start. bfloat16 where the device has it
    # (no loss scaling needed), else float16 with a GradScaler.
    policy = MixedPrecision_TrainingPolicy(0, start_time=args.amp_start)
    amp_dtype = policy.autocast_dtype(device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=cuda and amp_dtype == torch.float16)
    # A CPU without native bfloat16 emulates it, far slower than float32:
    # there the policy's answer is reported but autocast stays off.
    native_low_precision = cuda or torch.ops.mkldnn._is_mkldnn_bf16_supported()

    first_epoch, loss_value = 0, None
    if args.resume and Path(args.checkpoint).exists():
        state = torch.load(args.checkpoint, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        policy.load_state_dict(state["amp_policy"])
        first_epoch, loss_value = state["epoch"] + 1, state["loss"]
    if rank == 0:
        how = "fused" if train_set.uses_fused_path else "PIL"
        print(
            f"{world} ranks on {device.type}; {len(train_set)} training images "
            f"({train_set.class_num} classes, {how} path); {args.arch}",
            flush=True,
        )

    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        current_lr = optimizer.param_groups[0]["lr"]
        mixed = policy.enable_mixed_precision(epoch, current_lr, loss_value, scaler=scaler)
        autocast = mixed and native_low_precision
        start, loss_sum, seen = time.perf_counter(), 0.0, 0
        for step, (images, labels) in enumerate(loader):
            if args.max_steps and step >= args.max_steps:
                break
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=autocast):
                loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_sum += float(loss.detach()) * len(labels)
            seen += len(labels)
        scheduler.step()
        seconds = time.perf_counter() - start
        loss_sum, seen, seconds = all_sum(loss_sum, seen, seconds)
        loss_value = loss_sum / max(seen, 1)
        accuracy = evaluate(model, val_loader, device) if val_loader is not None else None
        if rank == 0:
            shown = "" if accuracy is None else f", val top-1 {accuracy:.1%}"
            print(
                f"epoch {epoch}: loss {loss_value:.4f}{shown}, "
                f"{seen / (seconds / world):.0f} images/s, mixed precision "
                f"{'on' if mixed else 'off'} ({policy.last_reason})"
                f"{'' if mixed == autocast else ', autocast off: no native support'}",
                flush=True,
            )
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "amp_policy": policy.state_dict(),
                "epoch": epoch,
                "loss": loss_value,
            }
            torch.save(state, args.checkpoint)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

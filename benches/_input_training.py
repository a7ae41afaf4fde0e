"""The input benchmark's training part: its rows, in order, and their loaders.

Each row trains the model fed by one loader (or runs a GPU decoder
alone); ``train_plan`` orders them, ``train_part`` measures them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from _input_decoders import decoder_backends
from _input_measure import WARMUP_STEPS, loader_rate, train_rate, transform
from torch.utils.data import DataLoader, RandomSampler
from torchvision.datasets import ImageFolder

from tiacc_training.torch.data import DataLoader as DropInLoader
from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset

# GPU decode's CPU threads: at most this many (they read records and hand
# whole batches to the GPU decoder, one batch at a time per decoder).
GPU_DECODE_THREADS = 4
# The training part's feeds that decode on the device, and their decoder.
GPU_DECODE_FEEDS = {
    "dropin_decode_device": "torchvision",
    "dropin_nvimagecodec": "nvimagecodec",
    "decode_device_alone": "torchvision",
    "nvimagecodec_alone": "nvimagecodec",
}
# The training part's loaders (``--train-feeds``); synthetic data always runs.
TRAIN_FEEDS = (
    "stock_imagefolder",
    "fused_torch_loader",
    "dropin",
    "dropin_device",
    "dropin_decode_device",
    "dropin_nvimagecodec",
    "decode_device_alone",
    "nvimagecodec_alone",
)


class TrainRow(NamedTuple):
    """One row of the training part.

    Attributes:
        key: Its name in the part's ``rows``.
        feed: What feeds the model (``synthetic``, ``stock_imagefolder``, ...).
        workers: The loader's worker processes or threads (0: synthetic).
        alone: The loader alone: its batches reach the GPU, nothing trains.
    """

    key: str
    feed: str
    workers: int
    alone: bool = False


def train_plan(
    counts: list[int], nvimagecodec: bool, alone: bool, feeds: list[str] | None = None
) -> list[TrainRow]:
    """The training part's rows for the worker ``counts``, the most telling first.

    Synthetic data first (every other row's reference); then, at the fewest
    workers, GPU decode, stock ``ImageFolder``, nvImageCodec (where
    ``nvimagecodec``) and the drop-in loader on the CPU; then each GPU
    decoder alone (where ``alone``); then stock and the drop-in loader at
    each larger count, the largest first, with GPU decode again only where
    its thread count (at most :data:`GPU_DECODE_THREADS`) differs; last,
    torch's loader over the fused path and the drop-in loader's device
    output at the most workers. With one count the keys are the feeds'
    names; with several, each ends in its workers or threads (``dropin_8``).
    ``feeds`` (default: all) keeps only those loaders' rows, and synthetic data.
    """
    counts = sorted(set(counts))
    single = len(counts) == 1

    def row(feed: str, workers: int, alone: bool = False) -> TrainRow:
        return TrainRow(feed if single else f"{feed}_{workers}", feed, workers, alone)

    plan = [TrainRow("synthetic", "synthetic", 0)]
    gpu_threads: set[int] = set()

    def group(workers: int) -> list[TrainRow]:
        threads = min(GPU_DECODE_THREADS, workers)
        new = threads not in gpu_threads
        gpu_threads.add(threads)
        rows = [row("dropin_decode_device", threads)] if new else []
        rows.append(row("stock_imagefolder", workers))
        if new and nvimagecodec:
            rows.append(row("dropin_nvimagecodec", threads))
        return [*rows, row("dropin", workers)]

    plan += group(counts[0])
    if alone:
        threads = min(GPU_DECODE_THREADS, counts[0])
        plan.append(row("decode_device_alone", threads, alone=True))
        if nvimagecodec:
            plan.append(row("nvimagecodec_alone", threads, alone=True))
    for workers in reversed(counts[1:]):
        plan += group(workers)
    plan += [row("fused_torch_loader", counts[-1]), row("dropin_device", counts[-1])]
    return [r for r in plan if feeds is None or r.feed == "synthetic" or r.feed in feeds]


def train_part(
    args: argparse.Namespace,
    img_dir: Path,
    index: Path,
    save: Callable[[dict[str, Any]], None] = lambda part: None,
) -> dict[str, Any]:
    """Training images/s fed by each loader (see the module docstring).

    ``save(part)`` gets the part as it stands after each row (``"complete":
    False``), so a run stopped midway keeps the rows it measured.
    """
    device = torch.device(args.train_device)
    counts = args.train_workers or [max(1, (os.cpu_count() or 2) - 1)]
    batch = args.train_batch
    pin = device.type == "cuda"
    nvimagecodec = device.type == "cuda" and _installed("nvidia.nvimgcodec")
    plan = train_plan(counts, nvimagecodec, alone=device.type == "cuda", feeds=args.train_feeds)
    rows: dict[str, dict[str, Any]] = {}
    decoders: dict[str, dict[str, Any]] = {}

    def part(complete: bool) -> dict[str, Any]:
        return {
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "model": args.train_model,
            "batch": batch,
            "workers": max(counts),
            "worker_counts": sorted(set(counts)),
            "gpu_decode_threads": GPU_DECODE_THREADS,
            "steps": args.train_steps,
            "decoders": decoders,
            "rows": rows,
            "complete": complete,
        }

    def packed() -> IndexTFRDataset:
        return IndexTFRDataset(str(index.parent), str(index), transform())

    def loader(cls: Any, dataset: Any, **kwargs: Any) -> Any:
        # One shuffled pass of every batch the run draws (images repeat
        # where the dataset is smaller): no loader restarts its workers'
        # pipeline mid-measurement at an epoch's end.
        draws = (WARMUP_STEPS + args.train_steps) * batch
        sampler = RandomSampler(dataset, num_samples=draws)
        return cls(dataset, batch_size=batch, sampler=sampler, drop_last=True, **kwargs)

    # Each feed's loader with ``w`` workers (processes, or the drop-in's threads).
    feeds: dict[str, Callable[[int], Any]] = {
        "stock_imagefolder": lambda w: loader(
            DataLoader, ImageFolder(str(img_dir), transform()), num_workers=w,
            pin_memory=pin, persistent_workers=True),
        "fused_torch_loader": lambda w: loader(
            DataLoader, packed(), num_workers=w, pin_memory=pin, persistent_workers=True),
        "dropin": lambda w: loader(DropInLoader, packed(), num_workers=w, pin_memory=pin),
        "dropin_device": lambda w: loader(DropInLoader, packed(), num_workers=w, device=device),
        "dropin_decode_device": lambda w: loader(
            DropInLoader, packed(), num_workers=w, decode_device=device),
        "dropin_nvimagecodec": lambda w: loader(
            DropInLoader, packed(), num_workers=w, decode_device=device,
            jpeg_decoder="nvimagecodec"),
    }  # fmt: skip
    feeds["decode_device_alone"] = feeds["dropin_decode_device"]
    feeds["nvimagecodec_alone"] = feeds["dropin_nvimagecodec"]
    for row in plan:  # synthetic first: the others' reference
        entry: dict[str, Any] = {"feed": row.feed, "workers": row.workers}
        decoder = GPU_DECODE_FEEDS.get(row.feed)
        if decoder is not None:
            if not decoders:  # once, before the first GPU-decode row
                decoders.update(decoder_backends(img_dir, device, nvimagecodec))
            found = decoders.get(decoder) or {"decoder": decoder, "backend": "unknown"}
            entry.update(decoder=found["decoder"], backend=found["backend"])
        make = None if row.feed == "synthetic" else feeds[row.feed]
        unit = "thread" if row.feed.startswith(("dropin", "decode", "nvimage")) else "worker"
        unit += "" if row.workers == 1 else "s"
        if row.alone:
            rate = loader_rate(make(row.workers), device, args.train_steps)
            rows[row.key] = {"images_per_s": rate, **entry}
            print(f"  {row.key:<28} {rate:8.1f} images/s (alone, {row.workers} {unit})",
                  flush=True)  # fmt: skip
        else:
            feed = None if make is None else _bind(make, row.workers)
            rate = train_rate(feed, device, args.train_model, args.train_steps, batch)
            synthetic = rows["synthetic"]["images_per_s"] if rows else rate
            rows[row.key] = {"images_per_s": rate, "fraction_of_synthetic": rate / synthetic,
                             **entry}  # fmt: skip
            print(f"  train {row.key:<28} {rate:8.1f} images/s ({rate / synthetic:.1%}"
                  + (f", {row.workers} {unit})" if row.workers else ")"), flush=True)  # fmt: skip
        save(part(complete=False))
    return part(complete=True)


def _bind(make: Callable[[int], Any], workers: int) -> Callable[[], Any]:
    """``make`` with its worker count given: the loader ``train_rate`` builds."""
    return lambda: make(workers)


def _installed(module: str) -> bool:
    """Whether ``module`` (dotted: its packages too) can be imported here."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False

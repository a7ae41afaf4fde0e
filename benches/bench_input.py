"""Benchmark: input pipeline throughput, stock torchvision vs IndexTFRDataset.

Every pipeline delivers float32 NCHW batches of 64 at 224x224 through a
``DataLoader`` with 2 worker processes (shuffled), from the same >= 2000
ImageNet-sized JPEGs (``tools/make_image_folder.py``: ~500x375, quality 90,
4:2:0), with the standard training transform::

    RandomResizedCrop(224), RandomHorizontalFlip(), ToTensor(), Normalize(...)

* ``a_imagefolder``: torchvision ``ImageFolder`` + PIL (the stock baseline);
* ``b_per_item``: ``IndexTFRDataset`` with the same transform on the PIL path
  (``fused=False``): packed shards, batch decode in Rust, PIL transforms;
* ``c_fused``: ``IndexTFRDataset`` fused path (decode + crop + resize + flip +
  normalize in one Rust pass per image);
* ``c_fused_uint8``: the fused path with ``output="uint8"`` (uint8 NCHW,
  normalised later on the GPU: a quarter of the bytes through worker IPC);
* ``d_dropin``: the fused dataset through ``tiacc_training.torch.data.DataLoader``
  (the drop-in loader: 2 threads decoding whole batches into the batch
  tensor, no worker processes, no collate);
* ``d_dropin_uint8``: the drop-in loader with ``output="uint8"`` batches;
* ``e_dali_cpu``: NVIDIA DALI's CPU pipeline (file reader, ROI-decoding
  ``decoders.image_random_crop``, resize, flip, normalize; 2 threads),
  when the ``nvidia-dali`` wheel is installed;
* ``engine_bound``: the engine alone, read + decode + crop + resize + flip
  + normalise of every batch in one thread with no loader, times the cores:
  what no loader on this decoder can beat;
* ``decode_bound``: PIL's plain decode (``Image.open().convert("RGB")``),
  images/s on one core x the number of cores: what a PIL pipeline cannot beat.

Scaling part (``--scaling``, on by default): stock ``ImageFolder`` and the
drop-in loader at 1, 2, 4, 8 and 15 workers (as many as the cores allow, at
least 2), the engine alone in as many threads at once (the machine's own
ceiling for that many workers), and the GIL time the drop-in loader takes
from a training thread per image (``gil_held_us_per_image``), with the
engine's draws and with torch's per-image draws.

Training part (``--train``; on by default where CUDA is available): ResNet-50
(bf16 autocast, channels_last, batch ``--train-batch``) trained for
``--train-steps`` steps fed by each loader, against the same model on
synthetic data already on the GPU: stock ``ImageFolder``, the fused dataset
through torch's loader, the drop-in loader (float32 pinned; ``device="cuda"``,
uint8 shipped and normalised on the GPU; ``decode_device="cuda"``, GPU decode
with at most 4 threads; where nvImageCodec is installed, the same with
``jpeg_decoder="nvimagecodec"``); on a GPU also each GPU-decode loader alone
(``decode_device_alone``, ``nvimagecodec_alone``: batches reach the GPU,
nothing trains). ``--train-workers`` is one worker count or several
(``4,8,15``: a host with few CPUs per GPU measured beside one with many):
the rows run the most telling first (``train_plan``): synthetic data, then
at the fewest workers GPU decode, stock, nvImageCodec and the drop-in loader
on the CPU, then each GPU decoder alone, then stock and the drop-in loader
at each larger count, the largest first (GPU decode again only where its
thread count differs), and last torch's loader over the fused path and the
drop-in loader's device output at the most workers (``--train-feeds`` keeps
only the loaders it names). With one count the rows keep the loaders' names;
with several each name ends in its workers or threads
(``stock_imagefolder_4``, ``dropin_decode_device_4``). Every row
records its ``feed`` and ``workers`` (worker processes, or threads); each
GPU-decode row also its ``decoder`` and the ``backend`` that decoded, with
how that was found (``decoder_backends``: neither torchvision nor
nvImageCodec reports it). Each loader draws one shuffled pass of all the
batches a run takes, repeating images where the dataset has fewer
(``--images`` may be below 2000 with ``--skip-loaders``), so none restarts
an epoch while timed. The part is written to the JSON after each row
(``"complete": false`` until the last). ``--train-device cpu --train-model
resnet18`` runs it on the CPU to check the harness.

Pipelines run alternately, ``--repeats`` times each (median reported); each
run iterates the whole dataset after one warm-up batch. Files are read once
first, so every pipeline reads from the page cache. Peak RSS of each worker
process (VmHWM) is recorded. Results go to ``benches/results/bench_input.json``.

Run: ``make bench`` or ``.venv/bin/python benches/bench_input.py``.

This file runs the parts and writes the results; the measurements are
``_input_measure.py``'s, the training part ``_input_training.py``'s and
the GPU decoders' backends ``_input_decoders.py``'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import _machine
import plot_input
import torch
from _input_measure import (
    BATCH,
    WORKERS,
    dali_available,
    decode_bound,
    engine_bound,
    engine_threads,
    gil_held_us_per_image,
    prepare,
    run_loader,
    transform,
)
from _input_training import TRAIN_FEEDS, train_part
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

from tiacc_training.torch.data import DataLoader as DropInLoader
from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset


def sweep_workers(cores: int) -> list[int]:
    """The worker counts of the sweep: 1, 2, 4, 8, 15, up to the cores (at least 2)."""
    top = max(2, cores - 1) if cores > 2 else 2
    return [w for w in (1, 2, 4, 8, 15) if w <= top]


def scaling_part(args: argparse.Namespace, img_dir: Path, index: Path) -> dict[str, Any]:
    """Images/s against the worker count, stock and ours, and the GIL time per image."""
    from tiacc_training.torch.data import _random_params

    cores = os.cpu_count() or 1
    counts = sweep_workers(cores)
    names = ("stock_imagefolder", "dropin")
    rates: dict[tuple[str, int], list[float]] = {(n, w): [] for n in names for w in counts}
    # Repeats interleaved over the worker counts and loaders, so a machine
    # whose speed drifts during the run drifts every cell alike.
    for rep in range(args.repeats):
        for workers in counts:
            for name in names:
                torch.manual_seed(rep)
                if name == "stock_imagefolder":
                    row = run_loader(ImageFolder(str(img_dir), transform()), DataLoader, workers)
                else:
                    ds = IndexTFRDataset(str(index.parent), str(index), transform())
                    row = run_loader(ds, DropInLoader, workers)
                rates[name, workers].append(row["images_per_s"])
                print(f"  repeat {rep + 1}/{args.repeats}  {name:<18} {workers:>2} workers "
                      f"{row['images_per_s']:8.1f} images/s", flush=True)  # fmt: skip
    sweep = {n: {str(w): statistics.median(rates[n, w]) for w in counts} for n in names}
    engine = {str(w): engine_threads(index, w) for w in counts}
    for w, rate in engine.items():
        print(f"  engine alone, {w} threads at once {rate:8.1f} images/s", flush=True)
    gil: dict[str, Any] = {}
    for draws in ("engine", "torch"):
        saved = dict(_random_params._CHECKED)
        if draws == "torch":  # every draw through torch's calls, as before the engine drew
            _random_params._CHECKED["flag"] = None
        try:
            gil[draws] = gil_held_us_per_image(index)
        finally:
            _random_params._CHECKED.clear()
            _random_params._CHECKED.update(saved)
        print(f"  GIL held per image, {draws} draws: {gil[draws]['us_per_image']:.1f} us "
              f"(of {gil[draws]['wall_us_per_image']:.0f} us)", flush=True)  # fmt: skip
    ours = sweep["dropin"]
    return {
        "workers": counts,
        "images_per_s": sweep,
        "dropin_2_vs_1_workers": ours["2"] / ours["1"],
        "stock_2_vs_1_workers": sweep["stock_imagefolder"]["2"] / sweep["stock_imagefolder"]["1"],
        "runs": {n: {str(w): rates[n, w] for w in counts} for n in names},
        "engine_alone_threads": engine,
        "engine_2_vs_1_threads": engine["2"] / engine["1"],
        "gil_held_per_image": gil,
        "goals": {"dropin_2_vs_1_workers": 1.9, "gil_held_us_per_image": 20.0},
    }


def worker_counts(text: str) -> list[int]:
    """``--train-workers``: one count or a comma-separated list, sorted (``[]`` for ``0``).

    Raises:
        argparse.ArgumentTypeError: Not positive whole numbers (or a lone 0).
    """
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if counts == [0]:
        return []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a worker count or several, such as 4,8,15 (0: the cores - 1)"
        )
    return sorted(set(counts))


def feed_names(text: str) -> list[str]:
    """``--train-feeds``: loader names of :data:`TRAIN_FEEDS`, comma-separated.

    Raises:
        argparse.ArgumentTypeError: A name not in :data:`TRAIN_FEEDS`, or none.
    """
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TRAIN_FEEDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected some of {', '.join(TRAIN_FEEDS)} (comma-separated)"
        )
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (argparse exits with status 2 on an error)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--workdir", default="data/bench_input")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benches/results/bench_input.json")
    p.add_argument(
        "--train",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the training part (default: where CUDA is available)",
    )
    p.add_argument("--train-device", default="cuda")
    p.add_argument("--train-model", default="resnet50")
    p.add_argument("--train-batch", type=int, default=256)
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument(
        "--train-workers",
        type=worker_counts,
        default="0",
        help="loader workers: one count or several (4,8,15), each a row of its own; "
        "0: the cores - 1",
    )
    p.add_argument(
        "--train-feeds",
        type=feed_names,
        default=None,
        help="only these loaders' training rows, comma-separated (synthetic data always "
        "runs; default: all)",
    )
    p.add_argument("--skip-loaders", action="store_true", help="only the training part")
    p.add_argument(
        "--scaling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the worker sweep and the GIL time per image",
    )
    args = p.parse_args(argv)
    if args.train is None:
        args.train = torch.cuda.is_available()
    if not args.skip_loaders and args.images < 2000:
        p.error("--images must be >= 2000 for the loaders (or give --skip-loaders)")
    if args.train and args.images < args.train_batch:
        p.error("--images must be >= --train-batch (the training part's batches are whole)")
    return args


def main() -> int:
    """Runs the benchmark; returns the exit status."""
    args = parse_args()
    img_dir, index = prepare(Path(args.workdir), args.images)
    result: dict[str, Any] = {
        "benchmark": "bench_input",
        "machine": _machine.machine_info(["torchvision", "pillow"]),
    }
    if not args.skip_loaders:
        torch.set_num_threads(1)
        result.update(loader_part(args, img_dir, index))
        if args.scaling:
            result["scaling"] = scaling_part(args, img_dir, index)
        torch.set_num_threads(os.cpu_count() or 1)
    if args.train:

        def save(part: dict[str, Any]) -> None:
            _machine.write_json(Path(args.out), {**result, "training": part})

        result["training"] = train_part(args, img_dir, index, save)
    _machine.write_results(Path(args.out), result)
    if "results" in result:  # the chart of the loaders (plot_input.py)
        chart = Path(args.out).with_suffix(".png")
        plot_input.plot(result, chart)
        print(f"wrote {chart}")
    return 0


def loader_part(args: argparse.Namespace, img_dir: Path, index: Path) -> dict[str, Any]:
    """Every loader over the whole dataset, alternately, ``--repeats`` times."""

    def packed(**kwargs: Any) -> IndexTFRDataset:
        return IndexTFRDataset(str(index.parent), str(index), transform(), **kwargs)

    pipelines: dict[str, tuple[Callable[[], Any], Any]] = {
        "a_imagefolder": (lambda: ImageFolder(str(img_dir), transform()), DataLoader),
        "b_per_item": (lambda: packed(fused=False), DataLoader),
        "c_fused": (packed, DataLoader),
        "c_fused_uint8": (lambda: packed(output="uint8"), DataLoader),
        "d_dropin": (packed, DropInLoader),
        "d_dropin_uint8": (lambda: packed(output="uint8"), DropInLoader),
    }
    if dali_available():
        pipelines["e_dali_cpu"] = (lambda: img_dir, "dali")
    else:
        print("nvidia-dali is not installed: no DALI row")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in pipelines}
    for rep in range(args.repeats):
        names = list(pipelines)
        names = names[rep % len(names) :] + names[: rep % len(names)]
        for name in names:
            torch.manual_seed(rep)
            make, loader_class = pipelines[name]
            result = run_loader(make(), loader_class)
            runs[name].append(result)
            print(f"  repeat {rep + 1}/{args.repeats}  {name:<14} "
                  f"{result['images_per_s']:7.1f} images/s", flush=True)  # fmt: skip
    bound = decode_bound(img_dir)
    engine = engine_bound(index)
    base = statistics.median(r["images_per_s"] for r in runs["a_imagefolder"])
    summary = {}
    print(f"\n{'pipeline':<16}{'images/s':>10}{'x stock':>9}  worker peak RSS (MB)")
    for name, rs in runs.items():
        med = statistics.median(r["images_per_s"] for r in rs)
        rss = max((max(r["worker_peak_rss_mb"], default=0) for r in rs), default=0)
        summary[name] = {"median_images_per_s": med, "ratio_vs_stock": med / base,
                         "min": min(r["images_per_s"] for r in rs),
                         "max": max(r["images_per_s"] for r in rs),
                         "worker_peak_rss_mb": rss, "dtype": rs[0]["dtype"]}  # fmt: skip
        print(f"{name:<16}{med:>10.1f}{med / base:>8.2f}x  {rss:.0f}")
    print(f"{'engine_bound':<16}{engine['bound']:>10.1f}{engine['bound'] / base:>8.2f}x  "
          f"(the engine alone {engine['per_core']:.0f}/s per core x {engine['cores']})"
          )  # fmt: skip
    print(f"{'decode_bound':<16}{bound['bound']:>10.1f}{bound['bound'] / base:>8.2f}x  "
          f"(PIL decode {bound['per_core']:.0f}/s per core x {bound['cores']})")  # fmt: skip
    return {
        "config": {
            "images": args.images,
            "batch": BATCH,
            "workers": WORKERS,
            "repeats": args.repeats,
            "transform": repr(transform()),
            "page_cache": "warm",
        },  # fmt: skip
        "results": summary,
        "runs": runs,
        "decode_bound": bound,
        "engine_bound": engine,
        "goals": {"d_vs_a": 4.0, "d_vs_e_dali_cpu": 1.5, "b_vs_a": 1.0},
    }


if __name__ == "__main__":
    sys.exit(main())

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
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Callable, NamedTuple

import _machine
import plot_input
import torch
import torchvision
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import DataLoader, RandomSampler
from torchvision.datasets import ImageFolder
from torchvision.io import decode_jpeg

from tiacc_training.tools.general_image_list import list_images
from tiacc_training.tools.img2tfrecord import Item, pack
from tiacc_training.torch.data import DataLoader as DropInLoader
from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset

REPO = Path(__file__).resolve().parent.parent
BATCH = 64
WORKERS = 2
# Batches each training-part run takes before it starts timing.
WARMUP_STEPS = 5
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
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
# JPEGs of the dataset the decoders' backends are probed with.
PROBE_IMAGES = 64
# nvJPEG's C API (nvjpeg.h): NVJPEG_BACKEND_HARDWARE, NVJPEG_STATUS_ARCH_MISMATCH.
NVJPEG_BACKEND_HARDWARE = 3
NVJPEG_STATUS_ARCH_MISMATCH = 7


def transform() -> T.Compose:
    """The standard ImageNet training transform."""
    return T.Compose(
        [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]
    )


def prepare(workdir: Path, images: int) -> tuple[Path, Path]:
    """Generates the images (once) and packs them; returns (image dir, index)."""
    sys.path.insert(0, str(REPO / "tools"))
    from make_image_folder import make_image_folder

    img_dir = workdir / "images"
    make_image_folder(img_dir, classes=10, per_class=-(-images // 10), seed=0)
    entries, _ = list_images(str(img_dir))
    out = workdir / "tfrecord"
    index = out / "train.index"
    if not index.exists():
        items = [
            Item(str(img_dir / rel), rel, label, rel, features={"image/class/label": [label]})
            for rel, label in entries
        ]
        pack(items, str(out), "train", workers=2, show_progress=False)
    for rel, _ in entries:  # warm the page cache
        (img_dir / rel).read_bytes()
    for shard in out.glob("*.tfrecord"):
        shard.read_bytes()
    return img_dir, index


def worker_peak_rss_mb(iterator: Any) -> list[float]:
    """VmHWM of each live DataLoader worker process, in MB."""
    peaks = []
    for worker in getattr(iterator, "_workers", []):
        try:
            with open(f"/proc/{worker.pid}/status", encoding="utf-8") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peaks.append(int(line.split()[1]) / 1024)
        except OSError:
            pass
    return peaks


def run_loader(
    dataset: Any, loader_class: Any = DataLoader, workers: int = WORKERS
) -> dict[str, Any]:
    """Iterates the whole dataset once after a warm-up batch; returns stats."""
    if loader_class == "dali":
        return run_dali(dataset)
    loader = loader_class(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        drop_last=True,
        persistent_workers=False,
    )
    iterator = iter(loader)
    first, _ = next(iterator)
    assert first.shape == (BATCH, 3, 224, 224), first.shape
    images = 0
    rss: list[float] = []
    start = time.perf_counter()
    for x, _ in iterator:
        images += x.shape[0]
        if images == BATCH * 4:  # workers are at their working size by now
            rss = worker_peak_rss_mb(iterator)
    seconds = time.perf_counter() - start
    dtype = str(first.dtype)
    del iterator
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds,
            "worker_peak_rss_mb": rss, "dtype": dtype}  # fmt: skip


def dali_available() -> bool:
    """Whether NVIDIA DALI imports here."""
    try:
        import nvidia.dali  # noqa: F401
    except Exception:
        return False
    return True


def run_dali(img_dir: Path) -> dict[str, Any]:
    """DALI's CPU pipeline over the image folder, the same transform."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    @pipeline_def(batch_size=BATCH, num_threads=WORKERS, device_id=None, seed=0)
    def train() -> Any:
        jpegs, labels = fn.readers.file(file_root=str(img_dir), random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=224, resize_y=224)
        flip = fn.random.coin_flip(probability=0.5)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            mean=[255 * m for m in MEAN],
            std=[255 * s for s in STD],
            mirror=flip,
        )
        return images, labels

    pipe = train()
    pipe.build()
    iterator = DALIGenericIterator(pipe, ["images", "labels"], reader_name="reader")
    first = next(iterator)[0]["images"]
    assert first.shape == (BATCH, 3, 224, 224), first.shape
    images = 0
    start = time.perf_counter()
    for batch in iterator:
        images += batch[0]["images"].shape[0]
    seconds = time.perf_counter() - start
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds,
            "worker_peak_rss_mb": [], "dtype": str(first.dtype)}  # fmt: skip


def engine_bound(index: Path) -> dict[str, float]:
    """The engine on one core, times the cores: read + decode + crop +
    resize + flip + normalise of every batch in one thread, no loader. No
    loader built on this decoder can beat it."""
    ds = IndexTFRDataset(str(index.parent), str(index), transform())
    order = torch.randperm(len(ds)).tolist()
    batches = [order[i : i + BATCH] for i in range(0, len(order) - BATCH + 1, BATCH)]
    ds._fused_batch(batches[0], threads=1)  # warm-up
    start = time.perf_counter()
    for b in batches[1:]:
        ds._fused_batch(b, threads=1)
    per_core = BATCH * (len(batches) - 1) / (time.perf_counter() - start)
    cores = os.cpu_count() or 1
    return {"per_core": per_core, "cores": cores, "bound": per_core * cores}


def cycle(loader: Iterable[Any]) -> Iterator[Any]:
    """``loader``'s batches without end: a pass ends, the next begins.

    Raises:
        ValueError: A pass yielded no batch (fewer images than one batch).
    """
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the loader yields no batch: fewer images than one batch?")


def train_rate(
    make_loader: Callable[[], Any], device: torch.device, model_name: str, steps: int, batch: int
) -> float:
    """Images/s of ``model_name`` trained on ``device`` fed by ``make_loader()``
    (``None``: synthetic batches already on the device)."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.get_model(model_name, num_classes=10).to(device)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    batches = cycle(make_loader()) if make_loader is not None else None
    synthetic = (
        torch.randn(batch, 3, 224, 224, device=device),
        torch.randint(0, 10, (batch,), device=device),
    )

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        if batches is None:
            return synthetic
        x, y = next(batches)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    seen, start = 0, 0.0
    for step in range(WARMUP_STEPS + steps):
        if step == WARMUP_STEPS:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        x, y = next_batch()
        x = x.contiguous(memory_format=torch.channels_last)
        with autocast:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= WARMUP_STEPS:
            seen += x.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return seen / (time.perf_counter() - start)


def loader_rate(loader: Any, device: torch.device, steps: int) -> float:
    """Images/s of ``loader`` alone: its batches reach ``device``, nothing trains."""
    batches = cycle(loader)
    for _ in range(WARMUP_STEPS):  # workers started, decoder ready
        next(batches)
    torch.cuda.synchronize(device)
    seen, start = 0, time.perf_counter()
    for _ in range(steps):
        x, _labels = next(batches)
        seen += x.shape[0]
    torch.cuda.synchronize(device)
    return seen / (time.perf_counter() - start)


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


def _loaded_library(prefix: str) -> str | None:
    """The path of a shared library this process has mapped whose name starts with ``prefix``."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                path = line.split()[-1]
                if path.startswith("/") and Path(path).name.startswith(prefix):
                    return path
    except OSError:
        pass
    return None


def nvjpeg_backend(jpegs: list[bytes], device: torch.device) -> dict[str, Any]:
    """The nvJPEG backend torchvision's batched CUDA decode takes for ``jpegs``.

    torchvision (``decode_jpeg`` on a list, 0.19 and later) creates its
    nvJPEG handle with the hardware backend, falling back to the default
    (CUDA) one where ``nvjpegCreateEx`` answers ARCH_MISMATCH (no hardware
    JPEG engine), and decodes on the hardware engine the images
    ``nvjpegDecodeBatchedSupported`` accepts, the others on CUDA. It does not
    report which; the same calls on the libnvjpeg it loaded say it.
    """
    basis = (
        f"torchvision {torchvision.__version__} does not report it; nvjpegCreateEx("
        "NVJPEG_BACKEND_HARDWARE) and nvjpegDecodeBatchedSupported, the calls by which its "
        "batched CUDA decode chooses, asked on its libnvjpeg"
    )
    # One decode loads torchvision's libnvjpeg (and proves it decodes here).
    decode_jpeg([torch.frombuffer(bytearray(jpegs[0]), dtype=torch.uint8)], device=device)
    path = _loaded_library("libnvjpeg")
    if path is None:
        return {"backend": "unknown", "backend_basis": "no libnvjpeg is loaded after a decode"}
    lib = ctypes.CDLL(path)
    lib.nvjpegCreateEx.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint,
                                   ctypes.POINTER(ctypes.c_void_p)]  # fmt: skip
    lib.nvjpegJpegStreamCreate.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.nvjpegJpegStreamParseHeader.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                                ctypes.c_void_p]  # fmt: skip
    lib.nvjpegDecodeBatchedSupported.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                                 ctypes.POINTER(ctypes.c_int)]  # fmt: skip
    lib.nvjpegJpegStreamDestroy.argtypes = [ctypes.c_void_p]
    lib.nvjpegDestroy.argtypes = [ctypes.c_void_p]
    handle = ctypes.c_void_p()
    status = lib.nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, None, None, 0, ctypes.byref(handle))
    if status == NVJPEG_STATUS_ARCH_MISMATCH:
        return {"backend": "CUDA", "backend_basis": basis + f" ({path}): no hardware JPEG "
                "engine on this GPU (ARCH_MISMATCH)"}  # fmt: skip
    if status != 0:
        return {"backend": "unknown", "backend_basis": basis + f" ({path}): nvjpegCreateEx "
                f"failed with status {status}"}  # fmt: skip
    stream = ctypes.c_void_p()
    hardware = 0
    try:
        if lib.nvjpegJpegStreamCreate(handle, ctypes.byref(stream)) != 0:
            return {"backend": "unknown", "backend_basis": basis + ": no nvJPEG stream"}
        for data in jpegs:
            supported = ctypes.c_int(-1)
            if (
                lib.nvjpegJpegStreamParseHeader(handle, data, len(data), stream) == 0
                and lib.nvjpegDecodeBatchedSupported(handle, stream, ctypes.byref(supported)) == 0
                and supported.value == 0  # 0: the hardware backend decodes it
            ):
                hardware += 1
    finally:
        if stream.value:
            lib.nvjpegJpegStreamDestroy(stream)
        lib.nvjpegDestroy(handle)
    return {
        "backend": _backend_name(hardware, len(jpegs), "CUDA"),
        "backend_basis": basis + f" ({path}), for {len(jpegs)} of the dataset's JPEGs",
        "hardware_images": hardware,
        "probe_images": len(jpegs),
    }


def _backend_name(hardware: int, total: int, other: str | None) -> str:
    """``hardware``, ``other``, or both with the count each decoded."""
    if hardware == total:
        return "hardware"
    if other is None:
        return f"hardware for {hardware} of {total} images, no other backend" if hardware else (
            "unknown")  # fmt: skip
    if hardware == 0:
        return other
    return f"hardware for {hardware} of {total} images, {other} for the rest"


def nvimagecodec_backend(jpegs: list[bytes], device: torch.device, repeats: int = 3) -> dict:
    """The nvImageCodec backend that decodes ``jpegs`` on ``device``, and each one's rate.

    nvImageCodec does not report which backend decoded an image. The loader's
    decoder (``_gpu_jpeg``) lists the hardware JPEG engine, then CUDA, then
    hybrid CPU/GPU decoding, and each image goes to the first that takes it;
    here a decoder limited to each backend in turn decodes the images (timed
    over ``repeats`` passes after one), and the backend named is the first
    in that order that decoded them: inferred, not reported.
    """
    from nvidia import nvimgcodec

    index = device.index if device.index is not None else torch.cuda.current_device()
    params = nvimgcodec.DecodeParams(
        apply_exif_orientation=False,
        color_spec=nvimgcodec.ColorSpec.SRGB,
        sample_format=nvimgcodec.SampleFormat.I_RGB,
    )
    arrays = [torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy() for data in jpegs]
    backends: dict[str, dict[str, Any]] = {}
    for name, kind in (("hardware", "HW_GPU_ONLY"), ("CUDA", "GPU_ONLY"),
                       ("hybrid", "HYBRID_CPU_GPU")):  # fmt: skip
        found: dict[str, Any] = {"decoded": 0, "of": len(jpegs)}
        try:
            backend = nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, kind))
            decoder = nvimgcodec.Decoder(device_id=index, backends=[backend])
            streams = [nvimgcodec.CodeStream(array) for array in arrays]
            images = decoder.decode(streams, params=params)
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(repeats):
                decoder.decode(streams, params=params)
            torch.cuda.synchronize(device)
            found["decoded"] = sum(image is not None for image in images)
            if found["decoded"]:
                found["images_per_s"] = repeats * found["decoded"] / (time.perf_counter() - start)
        except Exception as exc:  # a backend this GPU or this build lacks
            found["error"] = f"{type(exc).__name__}: {exc}"[:300]
        backends[name] = found
    whole = [n for n in ("CUDA", "hybrid") if backends[n]["decoded"] == len(jpegs)]
    return {
        "backend": _backend_name(
            backends["hardware"]["decoded"], len(jpegs), whole[0] if whole else None
        ),
        "backend_basis": "inferred: nvImageCodec does not report it; of decoders limited to one "
        f"backend each, the first in the loader's order (hardware, CUDA, hybrid) that decoded "
        f"{len(jpegs)} of the dataset's JPEGs",
        "backends": backends,
    }


def decoder_backends(img_dir: Path, device: torch.device, nvimagecodec: bool) -> dict:
    """Per GPU decoder, the backend that decodes the dataset's JPEGs on ``device``.

    Keyed by decoder (``torchvision``, ``nvimagecodec``), each with how the
    backend was found (``backend_basis``). The first :data:`PROBE_IMAGES`
    JPEGs of ``img_dir`` are asked about; a probe that fails records
    ``"unknown"`` and why, and the rows still run.
    """
    if device.type != "cuda":
        return {"torchvision": {"decoder": "torchvision", "backend": "CPU (libjpeg)",
                                "backend_basis": "decode_jpeg on the CPU"}}  # fmt: skip
    jpegs = [f.read_bytes() for f in sorted(img_dir.rglob("*.JPEG"))[:PROBE_IMAGES]]
    probes: dict[str, Callable[[list[bytes], torch.device], dict[str, Any]]] = {
        "torchvision": nvjpeg_backend
    }
    if nvimagecodec:
        probes["nvimagecodec"] = nvimagecodec_backend
    found: dict[str, dict[str, Any]] = {}
    for decoder, probe in probes.items():
        try:
            found[decoder] = {"decoder": decoder, **probe(jpegs, device)}
        except Exception as exc:  # the rows run all the same
            why = f"the probe failed: {type(exc).__name__}: {exc}"
            found[decoder] = {"decoder": decoder, "backend": "unknown", "backend_basis": why}
        print(f"  {decoder} decodes on {found[decoder]['backend']}", flush=True)
    return found


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


def decode_bound(img_dir: Path, limit: int = 300) -> dict[str, float]:
    """PIL decode images/s on one core, and that times the core count."""
    files = sorted(img_dir.rglob("*.JPEG"))[:limit]
    start = time.perf_counter()
    for f in files:
        with Image.open(f) as im:
            im.convert("RGB")
    per_core = len(files) / (time.perf_counter() - start)
    return {"per_core": per_core, "cores": os.cpu_count() or 1,
            "bound": per_core * (os.cpu_count() or 1)}  # fmt: skip


def sweep_workers(cores: int) -> list[int]:
    """The worker counts of the sweep: 1, 2, 4, 8, 15, up to the cores (at least 2)."""
    top = max(2, cores - 1) if cores > 2 else 2
    return [w for w in (1, 2, 4, 8, 15) if w <= top]


def gil_held_us_per_image(index: Path, batches: int = 12) -> dict[str, float]:
    """GIL-held microseconds per image of the drop-in loader's batch, in one thread.

    Each batch is what a drop-in worker thread does (``_fused_batch`` with
    its own generator, then the labels collated); the engine counts the time
    it ran with the GIL released, and the rest of the wall time held it.
    Freeing a batch is the consumer's (the training loop drops it), timed
    apart: ``consumer_free_us_per_image`` (pageable memory is returned to the
    system; pinned batches go back to torch's cache).
    """
    from torch.utils.data._utils.collate import default_collate

    from tiacc_training import _engine

    ds = IndexTFRDataset(str(index.parent), str(index), transform())
    order = torch.randperm(len(ds)).tolist()
    work = [order[i * BATCH : (i + 1) * BATCH] for i in range(batches + 1)]
    generator = torch.Generator().manual_seed(0)
    ds._fused_batch(work[0], threads=1, generator=generator)  # warm-up, the probe
    kept = []  # freed after the timing: the consumer frees a batch, not the loader
    released = _engine.data_gil_released_seconds()
    start = time.perf_counter()
    for indices in work[1:]:
        images, targets = ds._fused_batch(indices, threads=1, generator=generator)
        kept.append((images, default_collate(targets)))
    wall = time.perf_counter() - start
    released = _engine.data_gil_released_seconds() - released
    start = time.perf_counter()
    kept.clear()
    freed = time.perf_counter() - start
    images = batches * BATCH
    return {"us_per_image": (wall - released) / images * 1e6,
            "wall_us_per_image": wall / images * 1e6,
            "consumer_free_us_per_image": freed / images * 1e6}  # fmt: skip


def engine_threads(index: Path, threads: int) -> float:
    """Images/s of the engine alone in ``threads`` threads at once, no loader.

    What the machine's cores give together (shared caches, memory, the
    hypervisor): the ceiling of a loader with that many workers.
    """
    import threading

    ds = IndexTFRDataset(str(index.parent), str(index), transform())
    order = torch.randperm(len(ds)).tolist()
    batches = [order[i : i + BATCH] for i in range(0, len(order) - BATCH + 1, BATCH)]

    def work(mine: list[list[int]]) -> None:
        generator = torch.Generator().manual_seed(0)
        for indices in mine:
            ds._fused_batch(indices, threads=1, generator=generator)

    work(batches[:1])  # warm-up
    pool = [threading.Thread(target=work, args=(batches[k::threads],)) for k in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return BATCH * len(batches) / (time.perf_counter() - start)


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
    _machine.write_json(Path(args.out), result)
    print(f"wrote {args.out}")
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

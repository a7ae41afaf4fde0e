"""The input benchmark's measurements: each loader, the training loop and the bounds.

``bench_input.py`` runs them in its parts and writes what they return;
nothing here prints or writes a file.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Callable

import torch
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import DataLoader

from tiacc_training.tools.general_image_list import list_images
from tiacc_training.tools.img2tfrecord import Item, pack
from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset

REPO = Path(__file__).resolve().parent.parent
BATCH = 64
WORKERS = 2
# Batches each training-part run takes before it starts timing.
WARMUP_STEPS = 5
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


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

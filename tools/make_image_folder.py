"""Generate a small synthetic ImageNet-like image folder.

The output is meant for demos, tests and benchmarks of the input pipeline. It follows the
ImageNet training-set layout::

    OUT/n01000000/n01000000_00000.JPEG
    OUT/n01000000/n01000000_00001.JPEG
    ...
    OUT/n01000001/n01000001_00000.JPEG

Images look and compress roughly like photographs: sizes are drawn mostly from the common
ImageNet shapes (500x375, 375x500, 500x333, 333x500) plus some random sizes between 200 and
800 pixels per side, and the content is smooth multi-scale colour noise with a few filled
shapes on top and mild per-pixel noise, which lands a 500x375 JPEG at quality 90 near
110 KB (the ImageNet mean). The fill colour and preferred kind of the shapes depend on the
class, so a small CNN can learn the classes. Optionally a COCO-style ``instances`` JSON is
written whose boxes are the shapes drawn.

Generation is deterministic: every image is derived only from ``(seed, class, index)``, so
the same arguments give byte-identical files whatever the number of workers. Reruns skip
files that already exist with a non-zero size, and each file is written under a temporary
name and moved into place with :func:`os.replace`.

Example::

    python tools/make_image_folder.py --out data/fake_imagenet --classes 10 --per-class 200
    python tools/make_image_folder.py --out /tmp/tiny --size 32x24 --classes 3 --per-class 4
    python tools/make_image_folder.py --out /tmp/mixed --png-fraction 0.5 --coco coco.json
"""

from __future__ import annotations

import argparse
import colorsys
import functools
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageChops, ImageDraw

#: Common ImageNet sizes (width, height) and how often they are drawn when no fixed size is
#: requested; the remaining probability mass goes to random sizes in [200, 800] per side.
COMMON_SIZES: tuple[tuple[int, int], ...] = ((500, 375), (375, 500), (500, 333), (333, 500))
COMMON_WEIGHTS: tuple[float, ...] = (0.40, 0.15, 0.12, 0.08)
RANDOM_SIZE_RANGE: tuple[int, int] = (200, 800)

SHAPE_KINDS: tuple[str, ...] = ("ellipse", "rectangle", "polygon")

#: Standard deviation (in 8-bit levels) of the per-pixel Gaussian noise; tuned so that a
#: 500x375 JPEG at quality 90 is about 110 KB.
PIXEL_NOISE_SIGMA = 9.0

#: Smooth noise fields of the background, coarse to fine: (longer side / cell size, blend
#: weight of the field over the fields before it, colour or grey). Fine texture is mostly
#: luminance, as in photographs.
NOISE_SCALES: tuple[tuple[float, float, bool], ...] = (
    (3.0, 1.0, True),
    (12.0, 0.35, True),
    (50.0, 0.35, False),
    (250.0, 0.6, False),
)

JPEG_EXT = ".JPEG"
PNG_EXT = ".png"
PNG_COMPRESS_LEVEL = 3


def class_name(index: int) -> str:
    """Return the synthetic WordNet-style id of a class.

    Args:
        index: Zero-based class index.

    Returns:
        A name like ``n01000000`` (index 0), ``n01000001`` (index 1), ...

    """
    return f"n{1_000_000 + index:08d}"


def class_hue(index: int) -> float:
    """Return the base hue in [0, 1) of the shapes of a class.

    Hues are spread with the golden ratio so that neighbouring classes differ strongly.

    Args:
        index: Zero-based class index.

    Returns:
        The hue, as used by :func:`colorsys.hsv_to_rgb`.

    """
    return (0.11 + index * 0.6180339887498949) % 1.0


def parse_size(text: str) -> tuple[int, int]:
    """Parse a ``WxH`` size such as ``32x24``.

    Args:
        text: The size text.

    Returns:
        ``(width, height)``.

    Raises:
        ValueError: If the text is not two positive integers separated by ``x``.

    """
    parts = text.lower().split("x")
    if len(parts) != 2:
        raise ValueError(f"size must look like WxH, got {text!r}")
    width, height = int(parts[0]), int(parts[1])
    if width < 1 or height < 1:
        raise ValueError(f"size must be positive, got {text!r}")
    return width, height


@dataclass(frozen=True)
class _Task:
    """Everything a worker needs to produce one image."""

    out: str
    seed: int
    cls: int
    index: int
    size: tuple[int, int] | None
    quality: int
    png_fraction: float


@dataclass(frozen=True)
class _Shape:
    """One annotated filled shape; ``bbox`` is ``(x0, y0, x1, y1)`` in pixels."""

    kind: str
    bbox: tuple[int, int, int, int]
    points: tuple[tuple[float, float], ...]
    fill: tuple[int, int, int]
    outline: tuple[int, int, int]
    line_width: int


@dataclass(frozen=True)
class _Layout:
    """Size, format and shapes of one image (cheap to compute, no pixels)."""

    width: int
    height: int
    png: bool
    shapes: tuple[_Shape, ...]


def _draw_size(rng: np.random.Generator) -> tuple[int, int]:
    """Draw a realistic ImageNet-like image size."""
    u = rng.random()
    acc = 0.0
    for size, weight in zip(COMMON_SIZES, COMMON_WEIGHTS):
        acc += weight
        if u < acc:
            return size
    lo, hi = RANDOM_SIZE_RANGE
    width, height = rng.integers(lo, hi + 1, size=2)
    return int(width), int(height)


def _hsv_rgb(hue: float, sat: float, val: float) -> tuple[int, int, int]:
    """Convert HSV in [0, 1] to an 8-bit RGB tuple."""
    r, g, b = colorsys.hsv_to_rgb(hue % 1.0, min(max(sat, 0.0), 1.0), min(max(val, 0.0), 1.0))
    return round(r * 255), round(g * 255), round(b * 255)


def _make_shape(rng: np.random.Generator, cls: int, width: int, height: int) -> _Shape:
    """Draw the geometry and colour of one class-coloured shape."""
    preferred = SHAPE_KINDS[cls % len(SHAPE_KINDS)]
    kind = preferred if rng.random() < 0.7 else SHAPE_KINDS[int(rng.integers(len(SHAPE_KINDS)))]
    side = min(width, height)
    half_w = max(1.0, 0.5 * side * rng.uniform(0.18, 0.5) * rng.uniform(0.7, 1.4))
    half_h = max(1.0, 0.5 * side * rng.uniform(0.18, 0.5) * rng.uniform(0.7, 1.4))
    cx = rng.uniform(0.2, 0.8) * width
    cy = rng.uniform(0.2, 0.8) * height
    points: tuple[tuple[float, float], ...] = ()
    if kind == "polygon":
        n = int(rng.integers(3, 8))
        start = rng.uniform(0.0, 2.0 * math.pi)
        angles = start + np.sort(rng.uniform(0.0, 2.0 * math.pi, size=n))
        radii = rng.uniform(0.6, 1.0, size=n)
        points = tuple(
            (float(cx + half_w * r * math.cos(a)), float(cy + half_h * r * math.sin(a)))
            for a, r in zip(angles, radii)
        )
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        raw = (min(xs), min(ys), max(xs), max(ys))
    else:
        raw = (cx - half_w, cy - half_h, cx + half_w, cy + half_h)
    x0 = min(max(math.floor(raw[0]), 0), width - 1)
    y0 = min(max(math.floor(raw[1]), 0), height - 1)
    x1 = max(min(math.ceil(raw[2]), width), x0 + 1)
    y1 = max(min(math.ceil(raw[3]), height), y0 + 1)
    hue = class_hue(cls) + rng.uniform(-0.03, 0.03)
    sat = rng.uniform(0.55, 1.0)
    val = rng.uniform(0.5, 1.0)
    fill = _hsv_rgb(hue, sat, val)
    outline = _hsv_rgb(hue, sat, val * rng.uniform(0.3, 0.7))
    line_width = max(1, round(side * rng.uniform(0.0, 0.015)))
    return _Shape(kind, (x0, y0, x1, y1), points, fill, outline, line_width)


def _layout(task: _Task) -> _Layout:
    """Compute size, file format and annotated shapes of one image (no pixel work)."""
    rng = np.random.default_rng([task.seed, task.cls, task.index, 0])
    png = bool(rng.random() < task.png_fraction)
    width, height = _draw_size(rng)
    if task.size is not None:
        width, height = task.size
    n_shapes = int(rng.integers(1, 5))
    shapes = tuple(_make_shape(rng, task.cls, width, height) for _ in range(n_shapes))
    return _Layout(width, height, png, shapes)


def _noise_field(
    rng: np.random.Generator, width: int, height: int, cell: float, colour: bool
) -> Image.Image:
    """Return a smooth random RGB field: a low-res random image upsampled bicubically."""
    small_w = max(2, math.ceil(width / cell) + 1)
    small_h = max(2, math.ceil(height / cell) + 1)
    mode, bands = ("RGB", 3) if colour else ("L", 1)
    small = Image.frombytes(mode, (small_w, small_h), rng.bytes(small_w * small_h * bands))
    return small.resize((width, height), Image.Resampling.BICUBIC).convert("RGB")


@functools.cache
def _pixel_noise_table(sigma: float) -> list[int]:
    """Map a uniform byte to ``128 + round(sigma * z)``, z ~ N(0, 1), for all 3 bands."""
    normal = statistics.NormalDist()
    table = [
        min(255, max(0, 128 + round(sigma * normal.inv_cdf((k + 0.5) / 256.0)))) for k in range(256)
    ]
    return table * 3


def _draw_shape(draw: ImageDraw.ImageDraw, shape: _Shape) -> None:
    """Draw one filled shape."""
    x0, y0, x1, y1 = shape.bbox
    box = (x0, y0, max(x0, x1 - 1), max(y0, y1 - 1))
    width = shape.line_width
    if shape.kind == "ellipse":
        draw.ellipse(box, fill=shape.fill, outline=shape.outline, width=width)
    elif shape.kind == "rectangle":
        draw.rectangle(box, fill=shape.fill, outline=shape.outline, width=width)
    else:
        draw.polygon(list(shape.points), fill=shape.fill, outline=shape.outline, width=width)


def _render(task: _Task, layout: _Layout) -> Image.Image:
    """Render the pixels of one image."""
    rng = np.random.default_rng([task.seed, task.cls, task.index, 1])
    width, height = layout.width, layout.height
    side = max(width, height)
    # Multi-scale colour noise: coarse blobs, medium structure and fine texture.
    img = _noise_field(rng, width, height, side / NOISE_SCALES[0][0], NOISE_SCALES[0][2])
    for divisor, alpha, colour in NOISE_SCALES[1:]:
        field = _noise_field(rng, width, height, max(2.0, side / divisor), colour)
        img = Image.blend(img, field, alpha)
    # Restore the contrast lost by averaging, with a per-image gain and colour tint.
    gain = rng.uniform(1.3, 1.9)
    tint = rng.uniform(-25.0, 25.0, size=3)
    table = [
        min(255, max(0, round((v - 127.5) * gain + 127.5 + float(t))))
        for t in tint
        for v in range(256)
    ]
    img = img.point(table)

    draw = ImageDraw.Draw(img)
    # Unannotated low-saturation distractors behind the class-coloured shapes.
    for _ in range(int(rng.integers(0, 3))):
        cx, cy = rng.uniform(0.0, width), rng.uniform(0.0, height)
        rx = max(1.0, rng.uniform(0.05, 0.3) * width)
        ry = max(1.0, rng.uniform(0.05, 0.3) * height)
        grey = _hsv_rgb(rng.random(), rng.uniform(0.0, 0.2), rng.uniform(0.2, 0.9))
        box = (cx - rx, cy - ry, cx + rx, cy + ry)
        if rng.random() < 0.5:
            draw.ellipse(box, fill=grey)
        else:
            draw.rectangle(box, fill=grey)
    for shape in layout.shapes:
        _draw_shape(draw, shape)

    # Mild per-pixel Gaussian noise (quantised through a table: all in C, no float arrays).
    noise = Image.frombytes("RGB", (width, height), rng.bytes(width * height * 3))
    noise = noise.point(_pixel_noise_table(PIXEL_NOISE_SIGMA))
    return ImageChops.add(img, noise, scale=1.0, offset=-128)


def _relative_path(cls: int, index: int, png: bool) -> str:
    """Return the path of one image relative to the output folder (``/`` separated)."""
    name = class_name(cls)
    return f"{name}/{name}_{index:05d}{PNG_EXT if png else JPEG_EXT}"


def _make_one(task: _Task) -> dict[str, Any]:
    """Produce one image unless it already exists; return its metadata.

    Args:
        task: What to produce.

    Returns:
        A record with ``cls``, ``index``, ``file_name``, ``width``, ``height``, ``bytes``,
        ``written`` and ``boxes`` (``[x, y, w, h]`` lists).

    """
    layout = _layout(task)
    rel = _relative_path(task.cls, task.index, layout.png)
    path = os.path.join(task.out, *rel.split("/"))
    written = False
    try:
        nbytes = os.path.getsize(path)
    except OSError:
        nbytes = 0
    if nbytes == 0:
        img = _render(task, layout)
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
        try:
            if layout.png:
                img.save(tmp, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
            else:
                img.save(tmp, format="JPEG", quality=task.quality)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        nbytes = os.path.getsize(path)
        written = True
    boxes = [
        [
            float(s.bbox[0]),
            float(s.bbox[1]),
            float(s.bbox[2] - s.bbox[0]),
            float(s.bbox[3] - s.bbox[1]),
        ]
        for s in layout.shapes
    ]
    return {
        "cls": task.cls,
        "index": task.index,
        "file_name": rel,
        "width": layout.width,
        "height": layout.height,
        "bytes": nbytes,
        "written": written,
        "boxes": boxes,
    }


def _write_coco(path: str, records: Sequence[dict[str, Any]], classes: int) -> None:
    """Write a COCO-style ``instances`` JSON for the generated images (atomically).

    Image ids are 1-based in class/index order, category ids are class index + 1, and the
    ``area`` of an annotation is its box area (occlusion by later shapes is ignored).
    """
    images = []
    annotations = []
    for image_id, rec in enumerate(records, start=1):
        images.append(
            {
                "id": image_id,
                "file_name": rec["file_name"],
                "width": rec["width"],
                "height": rec["height"],
            }
        )
        for box in rec["boxes"]:
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": rec["cls"] + 1,
                    "bbox": box,
                    "area": box[2] * box[3],
                    "iscrowd": 0,
                }
            )
    categories = [{"id": k + 1, "name": class_name(k)} for k in range(classes)]
    doc = {"images": images, "annotations": annotations, "categories": categories}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.write("\n")
    os.replace(tmp, path)


def _run_tasks(tasks: Sequence[_Task], workers: int, progress: bool) -> list[dict[str, Any]]:
    """Run the tasks, in a process pool when ``workers > 1``, with an optional progress bar."""
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(tasks), unit="img", dynamic_ncols=True)
        except ImportError:  # pragma: no cover - tqdm is optional
            bar = None

    def consume(results: Iterator[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for n, rec in enumerate(results, start=1):
            out.append(rec)
            if bar is not None:
                bar.update(1)
            elif progress and (n % 100 == 0 or n == len(tasks)):
                print(f"\r{n}/{len(tasks)} images", end="", flush=True)
        if progress and bar is None:
            print()
        return out

    try:
        if workers <= 1 or len(tasks) <= 1:
            records = consume(map(_make_one, tasks))
        else:
            chunksize = max(1, min(16, len(tasks) // (workers * 8)))
            with multiprocessing.Pool(processes=workers) as pool:
                records = consume(pool.imap_unordered(_make_one, tasks, chunksize=chunksize))
    finally:
        if bar is not None:
            bar.close()
    records.sort(key=lambda r: (r["cls"], r["index"]))
    return records


def make_image_folder(
    out: str | os.PathLike[str],
    classes: int = 10,
    per_class: int = 50,
    seed: int = 0,
    workers: int | None = None,
    quality: int = 90,
    size: tuple[int, int] | str | None = None,
    png_fraction: float = 0.0,
    coco: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Generate a synthetic ImageNet-style image folder.

    Args:
        out: Output folder; one sub-folder per class is created in it.
        classes: Number of classes.
        per_class: Number of images per class.
        seed: Non-negative base seed; image ``(class, i)`` uses ``[seed, class, i]``.
        workers: Number of worker processes; ``None`` means ``os.cpu_count()``.
        quality: JPEG quality (1-100).
        size: Fixed ``(width, height)`` or ``"WxH"`` for every image; ``None`` draws
            realistic ImageNet-like sizes.
        png_fraction: Fraction (0-1) of the images written as PNG instead of JPEG.
        coco: If given, path of a COCO-style ``instances`` JSON to write; file names in it
            are relative to ``out``.
        progress: Show a progress bar; ``None`` shows one when stdout is a terminal.

    Returns:
        Summary with keys ``out``, ``images``, ``classes``, ``written``, ``skipped``,
        ``total_bytes``, ``total_mb``, ``mean_kb``, ``seconds``, ``images_per_s``,
        ``coco`` and ``files`` (the relative file names, in class/index order).

    Raises:
        ValueError: If an argument is out of range.

    """
    if classes < 1 or per_class < 1:
        raise ValueError("classes and per_class must be at least 1")
    if seed < 0:
        raise ValueError("seed must be non-negative")
    if not 1 <= quality <= 100:
        raise ValueError("quality must be in [1, 100]")
    if not 0.0 <= png_fraction <= 1.0:
        raise ValueError("png_fraction must be in [0, 1]")
    if isinstance(size, str):
        size = parse_size(size)
    if size is not None:
        size = (int(size[0]), int(size[1]))
        if size[0] < 1 or size[1] < 1:
            raise ValueError("size must be positive")
    if workers is None:
        workers = os.cpu_count() or 1
    if progress is None:
        progress = sys.stdout.isatty()

    start = time.perf_counter()
    out_str = os.fspath(out)
    os.makedirs(out_str, exist_ok=True)
    tasks = [
        _Task(out_str, seed, cls, i, size, quality, png_fraction)
        for cls in range(classes)
        for i in range(per_class)
    ]
    records = _run_tasks(tasks, max(1, min(workers, len(tasks))), progress)
    coco_path = None
    if coco is not None:
        coco_path = os.fspath(coco)
        _write_coco(coco_path, records, classes)
    seconds = time.perf_counter() - start

    total_bytes = sum(r["bytes"] for r in records)
    written = sum(1 for r in records if r["written"])
    n = len(records)
    return {
        "out": out_str,
        "images": n,
        "classes": classes,
        "written": written,
        "skipped": n - written,
        "total_bytes": total_bytes,
        "total_mb": total_bytes / 1e6,
        "mean_kb": total_bytes / n / 1e3,
        "seconds": seconds,
        "images_per_s": n / seconds if seconds > 0 else float("inf"),
        "coco": coco_path,
        "files": [r["file_name"] for r in records],
    }


def _size_arg(text: str) -> tuple[int, int]:
    """Argparse type for ``--size``: :func:`parse_size` with an argparse error."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="Generate a synthetic ImageNet-like image folder (OUT/<wnid>/*.JPEG).",
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--classes", type=int, default=10, help="number of classes (10)")
    parser.add_argument("--per-class", type=int, default=50, help="images per class (50)")
    parser.add_argument("--seed", type=int, default=0, help="base seed (0)")
    parser.add_argument(
        "--workers", type=int, default=None, help="worker processes (default: os.cpu_count())"
    )
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality (90)")
    parser.add_argument(
        "--size",
        type=_size_arg,
        default=None,
        metavar="WxH",
        help="fixed image size, e.g. 32x24 (default: realistic varied ImageNet-like sizes)",
    )
    parser.add_argument(
        "--png-fraction",
        type=float,
        default=0.0,
        help="fraction of images written as PNG instead of JPEG (0.0)",
    )
    parser.add_argument(
        "--coco", default=None, metavar="FILE", help="also write a COCO-style instances JSON"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments without the program name; ``None`` uses ``sys.argv[1:]``.

    Returns:
        The process exit status.

    """
    args = _parse_args(argv)
    try:
        summary = make_image_folder(
            args.out,
            classes=args.classes,
            per_class=args.per_class,
            seed=args.seed,
            workers=args.workers,
            quality=args.quality,
            size=args.size,
            png_fraction=args.png_fraction,
            coco=args.coco,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"images={summary['images']} classes={summary['classes']} "
        f"written={summary['written']} skipped={summary['skipped']} "
        f"total_mb={summary['total_mb']:.1f} mean_kb={summary['mean_kb']:.1f} "
        f"seconds={summary['seconds']:.2f} images_per_s={summary['images_per_s']:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

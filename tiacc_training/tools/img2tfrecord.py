r"""Pack images into TFRecord shards plus an index, for ``IndexTFRDataset``.

Output (under ``./NAME/`` by default, or ``--output_dir``):

* ``NAME-00000.tfrecord``, ...: shards of ``--records_per_shard`` records,
  each a ``tf.train.Example`` holding the original encoded image bytes;
* ``NAME-00000.tfrecord.idx``, ...: DALI-style ``offset size`` per record;
* ``NAME.index``: ``shard_file<TAB>shard_idx<TAB>offset<TAB>label`` per
  record, written last: a dataset without it is incomplete.

``ImageFold`` reads the list written by ``general_image_list``; ``coco``
reads a COCO ``instances_*.json`` as ``--img_list`` and writes the
TensorFlow object-detection keys. The same input gives byte-identical output
for any ``--workers``.

Usage:
    python3 tiacc_training/tools/img2tfrecord.py --img_dir val_demo \\
        --img_list val_list --tfrecords_name val_demo --dataset_type ImageFold
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from tiacc_training import _engine
from tiacc_training.errors import TiaccError
from tiacc_training.tools._cli import UsageError, die, progress, warn

DEFAULT_RECORDS_PER_SHARD = 1024
"""~110 MB shards for ImageNet-sized JPEGs (~110 KB each)."""

CHUNK = 256
"""Items handed to the engine per call (the progress bar's step)."""


@dataclass
class Item:
    """One image to pack."""

    path: str
    filename: str
    label: int
    source: str
    """Where it came from, for messages: ``LIST:LINE`` or ``JSON image id N``."""
    expect_size: Optional[tuple[int, int]] = None
    features: dict[str, Any] = field(default_factory=dict)

    def as_engine_item(self) -> tuple[str, str, int, Optional[tuple[int, int]], dict[str, Any]]:
        """The tuple ``_engine.ImagePacker.add`` takes."""
        return (self.path, self.filename, self.label, self.expect_size, self.features)


def check_img_dir(img_dir: str) -> None:
    """Raises UsageError if ``img_dir`` is missing, not a folder, or empty."""
    if not os.path.exists(img_dir):
        raise UsageError(f"--img_dir {img_dir!r} does not exist")
    if not os.path.isdir(img_dir):
        raise UsageError(f"--img_dir {img_dir!r} is not a directory")
    with os.scandir(img_dir) as it:
        if next(it, None) is None:
            raise UsageError(f"--img_dir {img_dir!r} is empty")


def read_image_list(img_dir: str, img_list: str) -> list[Item]:
    """Parses a ``path label`` list (paths relative to ``img_dir``).

    The label is the last whitespace-separated field, so paths may contain
    spaces. Blank lines are skipped.

    Raises:
        UsageError: The list is missing or empty, or a line is malformed or
            names a missing file; the message gives ``LIST:LINE``.
    """
    try:
        with open(img_list, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise UsageError(f"--img_list {img_list!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"--img_list {img_list!r} is not UTF-8 text: {e}") from None
    items = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{img_list}:{number}"
        parts = line.rsplit(None, 1)
        if len(parts) != 2:
            raise UsageError(f"{where}: expected `path label`, got {line!r}")
        rel, label_text = parts[0].strip(), parts[1]
        try:
            label = int(label_text)
        except ValueError:
            raise UsageError(f"{where}: label {label_text!r} is not an integer") from None
        if not -(2**63) <= label < 2**63:
            raise UsageError(f"{where}: label {label} does not fit in int64")
        path = os.path.join(img_dir, rel)
        if not os.path.isfile(path):
            raise UsageError(f"{where}: image {path!r} does not exist")
        items.append(Item(path, rel, label, where, features={"image/class/label": [label]}))
    if not items:
        raise UsageError(f"--img_list {img_list!r} lists no images")
    return items


@dataclass
class CocoStats:
    """Counts of what the COCO conversion dropped or changed."""

    images: int = 0
    boxes: int = 0
    dropped_boxes: int = 0
    clipped_boxes: int = 0


def _coco_field(obj: dict[str, Any], key: str, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise UsageError(f"{where}: missing key {key!r}")
    return obj[key]


def read_coco(img_dir: str, annotations: str) -> tuple[list[Item], CocoStats]:
    """Builds one item per COCO image, with TF object-detection features.

    Boxes are ``[x, y, w, h]`` in pixels in COCO; they are stored normalised
    to [0, 1] by the image's annotated size (clipped to the image), and boxes
    with non-positive width or height are dropped and counted. The index
    label is the image id.

    Raises:
        UsageError: The JSON is missing or malformed (naming the key), or an
            image file is missing.
    """
    try:
        with open(annotations, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"--img_list {annotations!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--img_list {annotations!r} is not valid JSON: {e}") from None
    images = _coco_field(data, "images", annotations)
    anns = data.get("annotations", []) if isinstance(data, dict) else []
    categories = {
        int(_coco_field(c, "id", f"{annotations}: categories")): str(c.get("name", ""))
        for c in data.get("categories", [])
    }
    by_image: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for i, ann in enumerate(anns):
        by_image[int(_coco_field(ann, "image_id", f"{annotations}: annotations[{i}]"))].append(ann)
    stats = CocoStats()
    items = []
    for img in sorted(images, key=lambda im: int(_coco_field(im, "id", annotations))):
        image_id = int(img["id"])
        where = f"{annotations}: image id {image_id}"
        file_name = str(_coco_field(img, "file_name", where))
        width = int(_coco_field(img, "width", where))
        height = int(_coco_field(img, "height", where))
        if width <= 0 or height <= 0:
            raise UsageError(f"{where}: size {width}x{height} is not positive")
        path = os.path.join(img_dir, file_name)
        if not os.path.isfile(path):
            raise UsageError(f"{where}: image {path!r} does not exist")
        boxes: dict[str, list[Any]] = defaultdict(list)
        for ann in by_image.get(image_id, []):
            bbox = _coco_field(ann, "bbox", f"{where}: annotation {ann.get('id')}")
            if not (isinstance(bbox, list) and len(bbox) == 4):
                raise UsageError(f"{where}: annotation {ann.get('id')}: bbox must be [x, y, w, h]")
            x, y, w, h = (float(v) for v in bbox)
            if w <= 0 or h <= 0:
                stats.dropped_boxes += 1
                continue
            coords = (x / width, (x + w) / width, y / height, (y + h) / height)
            clipped = tuple(min(max(c, 0.0), 1.0) for c in coords)
            stats.clipped_boxes += clipped != coords
            for key, value in zip(("xmin", "xmax", "ymin", "ymax"), clipped):
                boxes[key].append(value)
            category = int(_coco_field(ann, "category_id", f"{where}: annotation {ann.get('id')}"))
            boxes["label"].append(category)
            boxes["text"].append(categories.get(category, "").encode("utf-8"))
            boxes["area"].append(float(ann.get("area", w * h)))
            boxes["is_crowd"].append(int(ann.get("iscrowd", 0)))
            stats.boxes += 1
        features = {
            "image/source_id": str(image_id).encode(),
            "image/object/bbox/xmin": np.array(boxes["xmin"], dtype=np.float32),
            "image/object/bbox/xmax": np.array(boxes["xmax"], dtype=np.float32),
            "image/object/bbox/ymin": np.array(boxes["ymin"], dtype=np.float32),
            "image/object/bbox/ymax": np.array(boxes["ymax"], dtype=np.float32),
            "image/object/class/label": np.array(boxes["label"], dtype=np.int64),
            "image/object/class/text": np.array(boxes["text"], dtype=object),
            "image/object/area": np.array(boxes["area"], dtype=np.float32),
            "image/object/is_crowd": np.array(boxes["is_crowd"], dtype=np.int64),
        }
        items.append(Item(path, file_name, image_id, where, (width, height), features))
        stats.images += 1
    if not items:
        raise UsageError(f"--img_list {annotations!r} lists no images")
    return items, stats


def _chunks(items: list[Item], size: int) -> Iterable[list[Item]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def pack(
    items: list[Item],
    out_dir: str,
    name: str,
    *,
    records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
    workers: int = 0,
    strict: bool = False,
    lowercase_format: bool = False,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Packs ``items`` into dataset ``name`` in ``out_dir``.

    Unreadable or non-image files are skipped with a warning (an error with
    ``strict``). On any error or interrupt nothing is published.

    Returns:
        The summary dict of the engine plus ``skipped`` and ``seconds``.

    Raises:
        UsageError: A file vanished, a file is bad under ``strict``, or no
            image could be packed.
    """
    start = time.perf_counter()
    packer = _engine.ImagePacker(out_dir, name, records_per_shard, workers, lowercase_format)
    bar = progress(len(items), desc=name) if show_progress else None
    skipped = 0
    try:
        for chunk in _chunks(items, CHUNK):
            for position, kind, message in packer.add([it.as_engine_item() for it in chunk]):
                item = chunk[position]
                if kind == "missing":
                    raise UsageError(f"{item.source}: image {item.path!r} does not exist")
                if strict:
                    raise UsageError(f"{item.source}: {message} (--strict)")
                warn(f"{item.source}: skipped: {message}")
                skipped += 1
            if bar is not None:
                bar.update(len(chunk))
        if packer.records == 0:
            raise UsageError(f"none of the {len(items)} images could be packed")
        summary = packer.finish()
    except BaseException:
        packer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    summary["skipped"] = skipped
    summary["seconds"] = time.perf_counter() - start
    return summary


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    p = argparse.ArgumentParser(
        prog="img2tfrecord",
        description="Pack an image list (or COCO annotations) into TFRecord shards plus an index.",
    )
    p.add_argument("--img_dir", required=True, help="folder the list's paths are relative to")
    p.add_argument(
        "--img_list",
        required=True,
        help="`path label` list from general_image_list (ImageFold) or instances_*.json (coco)",
    )
    p.add_argument("--tfrecords_name", required=True, help="dataset name, used in file names")
    p.add_argument("--dataset_type", required=True, choices=["ImageFold", "coco"])
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="threads that read and encode images (0: the main thread only; default 0)",
    )
    p.add_argument(
        "--output_dir",
        default=None,
        help="directory that receives the files (default: ./TFRECORDS_NAME)",
    )
    p.add_argument(
        "--records_per_shard",
        type=int,
        default=DEFAULT_RECORDS_PER_SHARD,
        help=f"records per shard (default {DEFAULT_RECORDS_PER_SHARD}, ~110 MB of ImageNet JPEGs)",
    )
    p.add_argument("--strict", action="store_true", help="fail on an unreadable or non-image file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 0:
        parser.error(f"--workers must be >= 0, got {args.workers}")
    if args.records_per_shard < 1:
        parser.error(f"--records_per_shard must be >= 1, got {args.records_per_shard}")
    out_dir = args.output_dir or os.path.join(".", args.tfrecords_name)
    extra = ""
    try:
        check_img_dir(args.img_dir)
        if args.dataset_type == "ImageFold":
            items = read_image_list(args.img_dir, args.img_list)
        else:
            items, stats = read_coco(args.img_dir, args.img_list)
            extra = f" with {stats.boxes} boxes ({stats.dropped_boxes} empty dropped, "
            extra += f"{stats.clipped_boxes} clipped)"
        summary = pack(
            items,
            out_dir,
            args.tfrecords_name,
            records_per_shard=args.records_per_shard,
            workers=args.workers,
            strict=args.strict,
            lowercase_format=args.dataset_type == "coco",
            show_progress=not args.quiet,
        )
    except UsageError as e:
        die("img2tfrecord", str(e))
    except ValueError as e:
        die("img2tfrecord", str(e))
    except TiaccError as e:
        die("img2tfrecord", str(e), status=1)
    except KeyboardInterrupt:
        die("img2tfrecord", "interrupted; nothing was published", status=130)
    secs = max(summary["seconds"], 1e-9)
    mb = summary["bytes"] / 1e6
    print(
        f"packed {summary['records']} images ({summary['skipped']} skipped){extra} into "
        f"{len(summary['shard_files'])} shards, {mb:.1f} MB, in {secs:.2f} s "
        f"({summary['records'] / secs:.0f} images/s, {mb / secs:.0f} MB/s) -> "
        f"{summary['index_path']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

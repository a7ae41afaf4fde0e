r"""Pack a COCO split into TFRecord shards, verify them and read one record back.

COCO's ``instances_*.json`` and its image folder become shards of
``tf.train.Example`` records with the TensorFlow object-detection keys (one
record per image, in image-id order; boxes normalised to [0, 1]) and an index
whose label column is the image id. For COCO 2017::

    python examples/pack_coco.py --images coco/train2017 \
        --annotations coco/annotations/instances_train2017.json \
        --name train2017 --output-dir packed/coco_train2017 --workers 8

This runs exactly what the command-line tools run::

    img2tfrecord --img_dir coco/train2017 --img_list coco/annotations/instances_train2017.json \
        --tfrecords_name train2017 --dataset_type coco --output_dir packed/coco_train2017
    tfrecord_verify packed/coco_train2017

and then prints the first record's boxes in pixels, read through the index
with random access.
"""

from __future__ import annotations

import argparse
import os
import sys

from tiacc_training import tfrecord
from tiacc_training.tools import img2tfrecord, tfrecord_verify


def boxes_in_pixels(example: dict) -> list[tuple[str, float, float, float, float]]:
    """``(class name, x, y, width, height)`` of each box of a decoded record."""
    width, height = example["image/width"][0], example["image/height"][0]
    names = [n.decode() for n in example.get("image/object/class/text", [])]
    xmin = example.get("image/object/bbox/xmin", [])
    xmax = example.get("image/object/bbox/xmax", [])
    ymin = example.get("image/object/bbox/ymin", [])
    ymax = example.get("image/object/bbox/ymax", [])
    return [
        (name, x0 * width, y0 * height, (x1 - x0) * width, (y1 - y0) * height)
        for name, x0, x1, y0, y1 in zip(names, xmin, xmax, ymin, ymax)
    ]


def main(argv: list[str] | None = None) -> int:
    """Packs, verifies and shows the first record; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", required=True, help="the split's image folder (train2017/)")
    p.add_argument("--annotations", required=True, help="its instances_*.json")
    p.add_argument("--name", default="coco", help="dataset name (file names, NAME.index)")
    p.add_argument("--output-dir", default=None, help="default: ./NAME")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--records-per-shard", type=int, default=1024)
    args = p.parse_args(argv)
    out = args.output_dir or os.path.join(".", args.name)

    status = img2tfrecord.main(
        [
            "--img_dir", args.images,
            "--img_list", args.annotations,
            "--tfrecords_name", args.name,
            "--dataset_type", "coco",
            "--output_dir", out,
            "--workers", str(args.workers),
            "--records_per_shard", str(args.records_per_shard),
        ]
    )  # fmt: skip
    if status:
        return status
    status = tfrecord_verify.main([out])
    if status:
        return status

    index = os.path.join(out, f"{args.name}.index")
    shard, _, offset, image_id = tfrecord.read_index(index)[0]
    example = tfrecord.read_example(os.path.join(out, shard), offset)
    filename = example["image/filename"][0].decode()
    print(f"first record: image id {image_id} ({filename}), {shard} at offset {offset}")
    for name, x, y, w, h in boxes_in_pixels(example):
        print(f"  {name or '?'}: x {x:.1f}, y {y:.1f}, {w:.1f} x {h:.1f} px")
    return 0


if __name__ == "__main__":
    sys.exit(main())

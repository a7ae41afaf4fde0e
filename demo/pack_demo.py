"""End-to-end demo of the data tools: generate, list, pack, verify, read back.

1. generates an ImageNet-like folder of real JPEGs (``tools/make_image_folder.py``);
2. runs ``general_image_list`` and ``img2tfrecord`` on it, exactly as a user
   would from the shell;
3. verifies every CRC and index line with ``tfrecord_verify``;
4. reads random records back by their index offsets and checks that the
   stored bytes and labels are the original files and list labels;
5. reads the packed dataset through a ``DataLoader`` with ``IndexTFRDataset``
   (the standard training transform, run by the fused Rust path);
6. prints a summary (records, shards, bytes, throughput).

Run with ``make demo`` (or ``.venv/bin/python demo/pack_demo.py --workdir DIR``).
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import torchvision.transforms as T  # noqa: E402
from make_image_folder import make_image_folder  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from tiacc_training import tfrecord  # noqa: E402
from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset  # noqa: E402


def run(args: list[str]) -> float:
    """Runs a tool as a subprocess, echoing the command; returns seconds taken."""
    shown = " ".join(shlex.quote(a) for a in args).replace(sys.executable, "python3")
    print(f"\n$ {shown}", flush=True)
    start = time.perf_counter()
    subprocess.run(args, check=True)
    return time.perf_counter() - start


def main() -> int:
    """Runs the demo; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="data/demo", help="where data goes (default data/demo)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--records-per-shard", type=int, default=256)
    args = p.parse_args()

    work = Path(args.workdir)
    images, img_list, out = work / "images", work / "train_list", work / "train_tfrecord"
    work.mkdir(parents=True, exist_ok=True)

    print(f"== 1. image folder: {args.classes} classes x {args.per_class} JPEGs in {images}")
    gen = make_image_folder(str(images), classes=args.classes, per_class=args.per_class, seed=0)
    print(
        f"   {gen['images']} images ({gen['written']} new), {gen['total_mb']:.1f} MB, "
        f"mean {gen['mean_kb']:.0f} KB"
    )

    tools = [sys.executable, "-m", "tiacc_training.tools."]
    print("\n== 2. list and pack")
    run([*tools[:2], tools[2] + "general_image_list", "--img_dir", str(images),
         "--img_list", str(img_list)])  # fmt: skip
    pack_s = run([*tools[:2], tools[2] + "img2tfrecord", "--img_dir", str(images),
                  "--img_list", str(img_list), "--tfrecords_name", "train",
                  "--dataset_type", "ImageFold", "--workers", str(args.workers),
                  "--records_per_shard", str(args.records_per_shard),
                  "--output_dir", str(out)])  # fmt: skip

    print("\n== 3. verify every CRC and index line")
    verify_s = run([*tools[:2], tools[2] + "tfrecord_verify", str(out)])

    print("\n== 4. random access read-back against the source files")
    index = tfrecord.read_index(out / "train.index")
    listed = [line.rsplit(" ", 1) for line in img_list.read_text().splitlines()]
    rng = random.Random(0)
    picks = rng.sample(range(len(index)), k=min(50, len(index)))
    for i in picks:
        shard_file, _, offset, label = index[i]
        example = tfrecord.read_example(out / shard_file, offset)
        rel, list_label = listed[i]
        if example["image/encoded"] != [(images / rel).read_bytes()]:
            raise SystemExit(f"record {i} does not hold the bytes of {images / rel}")
        if example["image/class/label"] != [label] or label != int(list_label):
            raise SystemExit(f"record {i}: label mismatch ({label} vs list {list_label})")
    print(f"   {len(picks)} random records match their source files and labels")

    print("\n== 5. a DataLoader over the packed dataset (IndexTFRDataset, fused path)")
    transform = T.Compose(
        [
            T.RandomResizedCrop(224),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    dataset = IndexTFRDataset(str(out), str(out / "train.index"), transform)
    loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=args.workers)
    start = time.perf_counter()
    seen, shape = 0, None
    for images_batch, labels in loader:
        seen += len(labels)
        shape = (tuple(images_batch.shape[1:]), images_batch.dtype)
    load_s = time.perf_counter() - start
    print(
        f"   {seen} images as {shape[0]} {shape[1]} tensors (fused path: {dataset.uses_fused_path})"
    )

    shard_bytes = sum((out / f).stat().st_size for f in {e[0] for e in index})
    shards = len({e[0] for e in index})
    print("\n== summary")
    print(f"   records         {len(index)} ({len(set(e[3] for e in index))} classes)")
    print(f"   shards          {shards} in {out}")
    print(f"   bytes           {shard_bytes / 1e6:.1f} MB (+ {out / 'train.index'})")
    print(
        f"   pack            {len(index) / pack_s:.0f} images/s, {shard_bytes / 1e6 / pack_s:.0f} "
        f"MB/s with --workers {args.workers} (whole command, interpreter start included)"
    )
    print(f"   verify          {shard_bytes / 1e9 / verify_s:.2f} GB/s (whole command)")
    print(
        f"   load            {seen / load_s:.0f} images/s through the DataLoader "
        f"({args.workers} workers, worker start included)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

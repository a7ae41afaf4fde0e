"""Build a dataset index for TFRecord shards written by other tools.

``IndexTFRDataset`` needs an index (``shard_file  shard_idx  offset  label``
per record). ``img2tfrecord`` writes one; for shards from elsewhere (for
instance TensorFlow's ImageNet scripts, ``train-00000-of-01024`` ...) this
tool scans them, verifying every CRC and parsing every Example, and writes
the index with the label taken from an int64 feature.

Usage:
    python -m tiacc_training.tools.build_index imagenet_tf/ --output imagenet_tf/train.index
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from tiacc_training import _engine
from tiacc_training.errors import TiaccError
from tiacc_training.tools._cli import UsageError, die, warn
from tiacc_training.tools.general_image_list import write_atomic

_SKIP_SUFFIXES = (".idx", ".index", ".json", ".txt", ".pkl", ".md")


def find_shards(paths: Sequence[str]) -> list[str]:
    """Shard files named by ``paths``; a directory contributes its files, sorted.

    Hidden files and index, list or metadata files (``.idx``, ``.index``,
    ``.json``, ``.txt``, ``.pkl``, ``.md``) in a directory are skipped.

    Raises:
        UsageError: A path does not exist or nothing was found.
    """
    shards: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            names = sorted(
                n
                for n in os.listdir(path)
                if not n.startswith(".")
                and not n.endswith(_SKIP_SUFFIXES)
                and os.path.isfile(os.path.join(path, n))
            )
            shards.extend(os.path.join(path, n) for n in names)
        elif os.path.isfile(path):
            shards.append(path)
        else:
            raise UsageError(f"{path!r} does not exist")
    if not shards:
        raise UsageError(f"no shard files in {', '.join(map(repr, paths))}")
    return shards


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser."""
    p = argparse.ArgumentParser(
        prog="build_index",
        description="Write an IndexTFRDataset index for existing TFRecord shards.",
    )
    p.add_argument("paths", nargs="+", help="shard files or folders of shards")
    p.add_argument("--output", required=True, help="index file to write")
    p.add_argument(
        "--label-key",
        default="image/class/label",
        help="int64 feature holding the label (default image/class/label)",
    )
    p.add_argument("--quiet", action="store_true", help="print nothing when all is well")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        shards = find_shards(args.paths)
        index_dir = os.path.dirname(os.path.abspath(args.output))
        text, unlabelled = _engine.build_index(shards, index_dir, args.label_key)
        write_atomic(args.output, text.encode("utf-8"))
    except UsageError as e:
        die("build_index", str(e))
    except TiaccError as e:
        die("build_index", str(e), status=1)
    records = text.count("\n")
    if unlabelled:
        warn(f"{unlabelled} records have no int64 {args.label_key!r}; labelled -1")
    if not args.quiet:
        print(
            f"indexed {records} records in {len(shards)} shards in "
            f"{time.perf_counter() - start:.2f} s -> {args.output}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Verify TFRecord shards and dataset indexes.

``PATH`` may be a shard, a dataset index (``*.index``) or a directory. Every
record's length and payload CRCs are checked, payloads are parsed as
``tf.train.Example`` (unless ``--no-check-examples``), every index line must
point at the first byte of a record of an existing shard, and a DALI
``.idx`` beside a shard must list exactly its records. A directory is checked
index by index, plus any shard no index names.

Exit status: 0 when everything is valid, 1 at the first problem (reported
with its file and offset or line), 2 for usage errors.

On a terminal, a progress bar (bytes checked) is shown when there is at
least ``PROGRESS_BYTES`` to check; ``--quiet`` turns it off.

Usage:
    python -m tiacc_training.tools.tfrecord_verify train/train.index
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from tiacc_training import tfrecord
from tiacc_training.errors import TiaccError
from tiacc_training.tools._cli import UsageError, die, progress

SHARD_SUFFIXES = (".tfrecord", ".tfrecords")
PROGRESS_BYTES = 1 << 30
"""Datasets of at least this many bytes get a progress bar (smaller ones take a second)."""


def _targets(path: str) -> tuple[list[str], list[str]]:
    """The index files and the standalone shards to check under ``path``."""
    if not os.path.exists(path):
        raise UsageError(f"{path!r} does not exist")
    if os.path.isfile(path):
        return ([path], []) if path.endswith(".index") else ([], [path])
    names = sorted(n for n in os.listdir(path) if not n.startswith("."))
    indexes = [os.path.join(path, n) for n in names if n.endswith(".index")]
    covered = {
        os.path.normpath(os.path.join(os.path.dirname(ix), entry[0]))
        for ix in indexes
        for entry in tfrecord.read_index(ix)
    }
    shards = [
        os.path.join(path, n)
        for n in names
        if n.endswith(SHARD_SUFFIXES) and os.path.normpath(os.path.join(path, n)) not in covered
    ]
    if not indexes and not shards:
        raise UsageError(f"{path!r} holds no .index or .tfrecord files")
    return indexes, shards


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # missing: the verification itself reports it
        return 0


def _bytes_to_check(indexes: list[str], shards: list[str]) -> int:
    """The bytes the verification reads: every shard the indexes name, and ``shards``."""
    named = {
        os.path.normpath(os.path.join(os.path.dirname(ix), entry[0]))
        for ix in indexes
        for entry in tfrecord.read_index(ix)
    }
    return sum(_size(p) for p in named) + sum(_size(p) for p in shards)


def verify(path: str, check_examples: bool = True, show_progress: bool = False) -> dict[str, float]:
    """Verifies ``path``; returns counts and timing.

    Args:
        path: A shard, an index or a folder.
        check_examples: Parse every payload as a ``tf.train.Example``.
        show_progress: Show a progress bar on a terminal when there are at
            least ``PROGRESS_BYTES`` to check.

    Raises:
        UsageError: ``path`` does not exist or holds nothing to check.
        TiaccError: The first problem found (a ``CorruptRecordError`` names
            the shard and offset, a ``DataError`` the index line).
    """
    start = time.perf_counter()
    indexes, shards = _targets(path)
    total = _bytes_to_check(indexes, shards) if show_progress else 0
    bar = progress(total, "verify", unit="B", unit_scale=True) if total >= PROGRESS_BYTES else None
    totals = {"indexes": len(indexes), "entries": 0, "shards": 0, "records": 0, "bytes": 0}
    try:
        for ix in indexes:
            report = tfrecord.verify_index(ix, check_examples, bar.update if bar else None)
            for key in ("entries", "shards", "records", "bytes"):
                totals[key] += report[key]
        for shard in shards:
            records, size = tfrecord.verify_shard(shard, check_examples)
            totals["shards"] += 1
            totals["records"] += records
            totals["bytes"] += size
            if bar:
                bar.update(size)
    finally:
        if bar:
            bar.close()
    totals["seconds"] = time.perf_counter() - start
    return totals


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    p = argparse.ArgumentParser(
        prog="tfrecord_verify",
        description="Check every CRC of TFRecord shards and every line of their indexes.",
    )
    p.add_argument("path", help="a shard, a .index file, or a directory")
    p.add_argument(
        "--no-check-examples",
        dest="check_examples",
        action="store_false",
        help="do not parse payloads as tf.train.Example (for shards of other record types)",
    )
    p.add_argument(
        "--quiet", action="store_true", help="print nothing when all is well (no progress bar)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        totals = verify(args.path, args.check_examples, show_progress=not args.quiet)
    except UsageError as e:
        die("tfrecord_verify", str(e))
    except TiaccError as e:
        die("tfrecord_verify", f"INVALID: {e}", status=1)
    if not args.quiet:
        secs = max(totals["seconds"], 1e-9)
        print(
            f"OK: {totals['records']} records in {totals['shards']} shards "
            f"({totals['entries']} index entries in {totals['indexes']} indexes), "
            f"{totals['bytes'] / 1e6:.1f} MB checked at {totals['bytes'] / 1e9 / secs:.2f} GB/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

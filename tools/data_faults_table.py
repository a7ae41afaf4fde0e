"""Prints the data rows of the README's reliability table, from real runs.

Runs every case of ``tests/faults/test_data_faults.py`` (in its child
process, as the tests do) and checks each with the tests' own ``check``;
reads the fuzzing summary that ``fuzz/run.sh`` wrote (``fuzz/logs/
summary.tsv``), so run ``make fuzz FUZZ_SECONDS=30`` (what CI runs) first::

    make fuzz FUZZ_SECONDS=30
    .venv/bin/python tools/data_faults_table.py

Prints two markdown tables: one row per fault (outcome in each way of
reading, the error class, the slowest time from the fault to the error) and
one row per fuzz target (seconds, executions, crashes), then the totals:
inputs tried and crashes.
"""

from __future__ import annotations

import csv
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.faults.test_data_faults import FAULTS, MODES, check, make_base, run_faults  # noqa: E402

LABELS = {
    "truncated_shard": "truncated shard",
    "index_past_end": "index offset past the end of the shard",
    "index_inside_record": "index offset inside a record",
    "huge_length": "length field of 2^62 (valid length CRC)",
    "payload_text_not_image": "text where the image should be",
    "payload_random_jpeg_header": "random bytes behind a JPEG signature",
    "payload_random_png_header": "random bytes behind a PNG signature",
    "payload_not_an_example": "record payload that is not an Example",
    "truncated_mid_epoch": "shard truncated mid-epoch",
    "rewritten_same_size_between_epochs": (
        "shard rewritten in place between epochs (same size, valid CRCs, other pixels)"
    ),
    "deleted_between_epochs": "shard deleted between epochs",
    "replaced_by_rename_mid_epoch": "shard replaced by rename mid-epoch",
}
INPUTS = {
    "record_reader": "a TFRecord file",
    "example_decode": "a `tf.train.Example`",
    "image_decode": "an image file",
}


def main() -> int:
    """Prints the tables; returns 1 if any case failed its check or crashed."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        make_base(base)
        results = run_faults(base)
    print("| data fault | dataset, loader threads, loader processes | error | time to error |")
    print("| --- | --- | --- | --- |")
    cases = failed = crashed = 0
    for fault in FAULTS:
        outcomes, classes, slowest = [], set(), 0.0
        for mode in MODES:
            row = results.get((fault, mode), "never started")
            cases += 1
            try:
                check(fault, mode, row)
                outcomes.append("ok")
            except AssertionError:
                failed += 1
                outcomes.append("FAIL")
            if not isinstance(row, dict):
                crashed += 1
                continue
            if row.get("status") == "error":
                classes.add(row["mro"][0])
                slowest = max(slowest, row["seconds_to_error"])
        print(
            f"| {LABELS.get(fault, fault)} | {', '.join(outcomes)} | "
            f"{' / '.join(sorted(classes))} | {slowest * 1000:.0f} ms |"
        )
    executions = fuzz_crashes = 0
    summary = REPO / "fuzz" / "logs" / "summary.tsv"
    if summary.exists():
        print()
        print("| fuzz target | input | seconds | executions | crashes |")
        print("| --- | --- | --- | --- | --- |")
        with open(summary, newline="") as f:
            for row in csv.DictReader(f, delimiter="\t"):
                n = int(row["executions"] or 0)
                executions += n
                fuzz_crashes += int(row["crashes"])
                target = row["target"]
                print(
                    f"| `{target}` | {INPUTS.get(target, '')} | {row['seconds']} | {n:,} | "
                    f"{row['crashes']} |"
                )
    else:
        print(f"\n(no {summary.relative_to(REPO)}: run `make fuzz FUZZ_SECONDS=30` first)")
    print()
    print(
        f"inputs tried: {executions + cases:,} ({executions:,} fuzz executions, "
        f"{cases} fault cases); crashes: {crashed + fuzz_crashes}; "
        f"fault cases failing their check: {failed}"
    )
    return 1 if failed or crashed or fuzz_crashes else 0


if __name__ == "__main__":
    sys.exit(main())

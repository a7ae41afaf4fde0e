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
bad inputs tried and crashes.
"""

from __future__ import annotations

import csv
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.faults.test_data_faults import FAULTS, MODES, check, make_base, run_faults  # noqa: E402


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
            f"| {fault.replace('_', ' ')} | {', '.join(outcomes)} | "
            f"{' / '.join(sorted(classes))} | {slowest * 1000:.0f} ms |"
        )
    executions = fuzz_crashes = 0
    summary = REPO / "fuzz" / "logs" / "summary.tsv"
    if summary.exists():
        print()
        print("| fuzz target | seconds | executions | crashes |")
        print("| --- | --- | --- | --- |")
        with open(summary, newline="") as f:
            for row in csv.DictReader(f, delimiter="\t"):
                n = int(row["executions"] or 0)
                executions += n
                fuzz_crashes += int(row["crashes"])
                print(f"| `{row['target']}` | {row['seconds']} | {n:,} | {row['crashes']} |")
    else:
        print(f"\n(no {summary.relative_to(REPO)}: run `make fuzz FUZZ_SECONDS=30` first)")
    print()
    print(
        f"bad inputs tried: {executions + cases:,} ({executions:,} fuzz executions, "
        f"{cases} fault cases); crashes: {crashed + fuzz_crashes}; "
        f"fault cases failing their check: {failed}"
    )
    return 1 if failed or crashed or fuzz_crashes else 0


if __name__ == "__main__":
    sys.exit(main())

"""Collects the communication fault suite's measurements into a table.

Reads the output of ``pytest tests/faults/test_comm_faults.py -s`` (a file,
or standard input) and prints a Markdown table: each fault, its outcome,
and the time from the fault to the error on each rank that reported one
(the ``TIME_TO_ERROR`` and ``FAULT_RESULT`` lines the tests print)::

    python -m pytest tests/faults/test_comm_faults.py -s -q | tee faults.log
    python tools/fault_table.py faults.log
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence

# What each case injects, in the table's words (the tests' case names).
FAULTS = {
    "kill9_mid_allreduce": (
        "`kill -9` of rank 2 of 3 in the middle of an allreduce (CPU, one host: shared memory)"
    ),
    "sigstop": "`SIGSTOP` of rank 1 of 3 (timeout 4 s)",
    "bucket_layout_mismatch": "rank 1 of 2 with a different bucket layout",
    "strangers": "clients on an engine port sending a wrong token, random bytes, nothing",
    "config_mismatch_TIACC_TRAINING_NUM_NCCL_STREAMS": "rank 1 of 3 with other channels",
    "config_mismatch_TIACC_TRAINING_COMPRESSION": "rank 1 of 3 with other compression",
    "config_mismatch_TIACC_TRAINING_ALGORITHM": "rank 1 of 3 with another algorithm",
    "netem_loss5_delay50": "5% loss and 50 ms delay on the link between 2 emulated nodes",
    "link_down": "the link between 2 emulated nodes taken down mid-step (timeout 5 s)",
}

LINE = re.compile(r"(TIME_TO_ERROR|FAULT_RESULT) (\S+) (.*)")


def collect(lines: Iterable[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(outcome per case, times to error per case) from the tests' output."""
    outcomes: dict[str, str] = {}
    times: dict[str, list[str]] = defaultdict(list)
    for line in lines:
        found = LINE.search(line)
        if not found:
            continue
        kind, case, rest = found.groups()
        fields = dict(re.findall(r"(\w+)=((?:(?! \w+=).)*)", rest))
        if kind == "TIME_TO_ERROR":
            times[case].append(f"rank {fields['rank']}: {float(fields['seconds']):.2f} s")
        else:
            extra = ", ".join(f"{k} {v} s" for k, v in fields.items() if k != "outcome")
            outcomes[case] = fields.get("outcome", "") + (f" ({extra})" if extra else "")
    return outcomes, times


def table(outcomes: dict[str, str], times: dict[str, list[str]]) -> str:
    """The Markdown table of what ``collect`` found, in the suite's order."""
    rows = [
        "| fault injected | outcome on every rank | time from fault to error |",
        "| --- | --- | --- |",
    ]
    for case in list(FAULTS) + sorted(set(outcomes) - set(FAULTS)):
        if case not in outcomes and case not in times:
            continue
        untimed = "at init, before the first step" if case.startswith("config_") else "none"
        when = "; ".join(times.get(case, [])) or untimed
        rows.append(f"| {FAULTS.get(case, case)} | {outcomes.get(case, '')} | {when} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", nargs="?", help="the tests' output (default: standard input)")
    args = parser.parse_args(argv)
    with open(args.log) if args.log else sys.stdin as source:  # noqa: SIM115
        print(table(*collect(source)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

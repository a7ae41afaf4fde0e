"""The shared-memory transport alone against loopback TCP, on one host.

Runs the engine's example ``shm_vs_tcp`` (``cargo run --release -p
tiacc-core --example shm_vs_tcp RANKS MIB REPS``: every rank a thread with
its own buffer, the transports alternating round by round so that load
from elsewhere hits them alike) for each configuration, ``--runs`` times,
and keeps what each run printed: the median float32 allreduce time over TCP,
over shared memory, and over shared memory leaving the result in a region
every rank maps (as for DDP's buckets). Results:
``benches/results/bench_shm_transport.json``.

    python benches/bench_shm_transport.py [--runs 3] [--reps 15]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_shm_transport.json"
# (ranks, MiB per rank)
CONFIGS = [(4, 16), (4, 1), (2, 16)]
LINE = re.compile(
    r"(?P<ranks>\d+) ranks, (?P<mib>\d+) MiB float32 allreduce, median of (?P<reps>\d+): "
    r"TCP (?P<tcp>[\d.]+) ms, shared memory (?P<shm>[\d.]+) ms \([\d.]+x\), "
    r"result left in shared memory (?P<shared>[\d.]+) ms"
)


def parse(output: str) -> dict[str, Any]:
    """The figures of one run of the example, from what it printed."""
    match = LINE.search(output)
    if not match:
        raise ValueError(f"unexpected output from shm_vs_tcp: {output!r}")
    return {
        "ranks": int(match["ranks"]),
        "mib": int(match["mib"]),
        "reps": int(match["reps"]),
        "tcp_ms": float(match["tcp"]),
        "shm_ms": float(match["shm"]),
        "shm_result_shared_ms": float(match["shared"]),
    }


def run_example(ranks: int, mib: int, reps: int) -> dict[str, Any]:
    """One run of the example (built in release mode first if need be)."""
    cmd = ["cargo", "run", "--release", "-q", "-p", "tiacc-core", "--example", "shm_vs_tcp"]
    out = subprocess.run(
        [*cmd, str(ranks), str(mib), str(reps)],
        cwd=_machine.REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return parse(out.stdout)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs of each configuration")
    p.add_argument("--reps", type=int, default=15, help="rounds per run (the example's median)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "tiacc-core", "--example", "shm_vs_tcp"],
        cwd=_machine.REPO,
        check=True,
    )
    load_at_start = _machine.load_average()
    start = time.monotonic()
    rows = []
    for ranks, mib in CONFIGS:
        runs = []
        for i in range(args.runs):
            run = run_example(ranks, mib, args.reps)
            runs.append(run)
            print(
                f"{ranks} ranks x {mib} MiB, run {i + 1}/{args.runs}: TCP {run['tcp_ms']:.1f} ms, "
                f"shared memory {run['shm_ms']:.1f} ms, result shared "
                f"{run['shm_result_shared_ms']:.1f} ms",
                flush=True,
            )
        row: dict[str, Any] = {"ranks": ranks, "mib": mib, "runs": runs}
        for key in ("tcp_ms", "shm_ms", "shm_result_shared_ms"):
            values = [r[key] for r in runs]
            row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        row["shm_speedup"] = [round(r["tcp_ms"] / r["shm_ms"], 3) for r in runs]
        row["shared_result_speedup"] = [
            round(r["tcp_ms"] / r["shm_result_shared_ms"], 3) for r in runs
        ]
        rows.append(row)
    machine = _machine.machine_info()
    machine["load_average_at_start"] = load_at_start
    result = {
        "benchmark": "shm_vs_tcp: one host's ranks (threads), float32 allreduce",
        "method": (
            "cargo example shm_vs_tcp RANKS MIB REPS, run --runs times per configuration; "
            "each run prints the median over REPS rounds, the transports alternating"
        ),
        "reps": args.reps,
        "seconds": round(time.monotonic() - start, 1),
        "machine": machine,
        "rows": rows,
    }
    _machine.write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

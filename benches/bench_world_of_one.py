"""DDP in a world of one rank on the CPU: what the two lines cost when nobody is there to talk to.

The CPU proxy of the GPU check's world-of-one goal (tiacc within 2% of
native DDP): a model of ``--layers`` ``Linear(--width)`` layers and ReLUs
under DDP with ``bucket_cap_mb=--bucket-mb`` (so many buckets per step),
SGD, one thread, a world of one started by the script itself. Rows, each
its own process, alternating within each round (the first row turns each
round):

- ``native``: stock DDP over gloo;
- ``tiacc``: the same script with the two lines.

A row's figure is the median of every timed step, pooled over the rounds;
the ratio is tiacc's over native's. Each row's round medians and their
spread (slowest over fastest) are kept, the same method as the GPU check's
world-of-one stage (at least 30 steps a row, interleaved rounds).

    python benches/bench_world_of_one.py [--rounds 6] [--steps 150]

Writes benches/results/bench_world_of_one.json (with the machine, its load
average before and after, and the commit).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import free_port  # noqa: E402
from _machine import REPO, last_result, machine_info, print_result, write_results  # noqa: E402

RESULTS = REPO / "benches" / "results" / "bench_world_of_one.json"
ROWS = ("native", "tiacc")


def worker(args: argparse.Namespace) -> None:
    """One run: timed DDP steps; prints ``RESULT`` JSON."""
    if args.row == "tiacc":
        import tiacc_training.torch.distributed as tdist

        tdist.init_tiacc_training()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{args.port}"
    )
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*layers), bucket_cap_mb=args.bucket_mb
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, args.width)
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    result = {"step_s": times[args.warmup :]}
    if args.row == "tiacc":
        import tiacc_training.torch.distributed as tdist

        result["buckets"] = dict(tdist.stats()["buckets"])
    print_result(result)
    dist.destroy_process_group()


def run_row(row: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--row", row]
    for name in ("layers", "width", "batch", "bucket_mb", "steps", "warmup"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIACC_TRAINING_")}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    result = last_result(done.stdout)
    if done.returncode != 0 or result is None:
        raise SystemExit(f"{row} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    load_before = os.getloadavg()
    steps: dict[str, list[float]] = {row: [] for row in ROWS}
    round_medians: dict[str, list[float]] = {row: [] for row in ROWS}
    buckets: dict = {}
    for round_ in range(args.rounds):
        order = ROWS[round_ % 2 :] + ROWS[: round_ % 2]
        for row in order:
            result = run_row(row, args)
            steps[row] += result["step_s"]
            round_medians[row].append(statistics.median(result["step_s"]) * 1e3)
            buckets = result.get("buckets", buckets)
            print(
                f"round {round_}: {row}: {statistics.median(result['step_s']) * 1e3:.2f} ms/step",
                flush=True,
            )
    medians = {row: statistics.median(steps[row]) * 1e3 for row in ROWS}
    ratio = medians["tiacc"] / medians["native"]
    print(f"native {medians['native']:.2f} ms, tiacc {medians['tiacc']:.2f} ms: {ratio:.3f}x")
    out = {
        "benchmark": "bench_world_of_one",
        "setup": {k: getattr(args, k) for k in ("layers", "width", "batch", "bucket_mb")},
        "steps_per_run": args.steps,
        "rounds": args.rounds,
        "median_ms": {row: round(m, 3) for row, m in medians.items()},
        "round_medians_ms": {row: [round(m, 3) for m in ms] for row, ms in round_medians.items()},
        # How far apart a row's rounds are: its slowest round median over its fastest.
        "spread_pct": {
            row: round((max(ms) / min(ms) - 1) * 100, 2) for row, ms in round_medians.items()
        },
        "tiacc_over_native": round(ratio, 4),
        "tiacc_buckets": buckets,
        "machine": machine_info(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    write_results(args.out, out)


if __name__ == "__main__":
    main()

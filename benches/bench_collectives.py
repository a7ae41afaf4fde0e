"""all_reduce through the "tiacc" backend against gloo, on one host.

For 2 and 4 ranks on this machine, one job each: the default group serves
CPU tensors with "tiacc" and a second group over the same ranks with gloo,
so both run in the same processes. Each round times every size (4 KB to
256 MB of float32) on both, alternating which goes first; the figure of a
size is the median over rounds of the slowest rank's mean time per
``all_reduce``. Results: ``benches/results/bench_collectives.json``.

    python benches/bench_collectives.py [--rounds 5] [--worlds 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_collectives.json"
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def iterations(nbytes: int) -> int:
    """all_reduce calls per timing: about 64 MB moved, between 3 and 300."""
    return max(3, min(300, (64 << 20) // nbytes))


def worker(rounds: int, sizes: list[int]) -> None:
    """One rank: times both groups, prints rank 0's ``TIMES {json}``."""
    import torch
    import torch.distributed as dist

    import tiacc_training.torch.distributed as tdist

    tdist.init_tiacc_training()
    dist.init_process_group("cpu:tiacc")
    gloo = dist.new_group(backend="gloo")
    groups = {"tiacc": dist.group.WORLD, "gloo": gloo}
    rank = dist.get_rank()
    times: dict[str, dict[int, list[float]]] = {b: {s: [] for s in sizes} for b in groups}
    buffers = {s: torch.ones(s // 4) for s in sizes}
    for s in sizes:  # warm-up: connections, shared-memory pages, buffers
        for group in groups.values():
            dist.all_reduce(buffers[s], group=group)
    for round_ in range(rounds):
        for s in sizes:
            order = list(groups) if (round_ + s.bit_length()) % 2 == 0 else list(groups)[::-1]
            for name in order:
                group = groups[name]
                n = iterations(s)
                dist.barrier(group=gloo)
                start = time.perf_counter()
                for _ in range(n):
                    dist.all_reduce(buffers[s], group=group)
                seconds = torch.tensor([(time.perf_counter() - start) / n], dtype=torch.float64)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=gloo)
                times[name][s].append(seconds.item())
    if rank == 0:
        print("TIMES " + json.dumps(times), flush=True)
    dist.destroy_process_group()


def run_job(world: int, rounds: int, sizes: list[int]) -> dict[str, dict[str, list[float]]]:
    """Starts ``world`` ranks on loopback and returns rank 0's timings."""
    import subprocess

    sys.path.insert(0, str(_machine.REPO / "tests"))
    from _launch import base_env, free_port

    port = free_port()
    procs = []
    for rank in range(world):
        env = base_env(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TIACC_TRAINING_TIMEOUT": "600",
            }
        )
        command = [sys.executable, __file__, "--worker", "--rounds", str(rounds)]
        command += ["--sizes", *map(str, sizes)]
        procs.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = [p.communicate() for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            raise RuntimeError(f"rank {rank} of the {world}-rank job failed:\n{out}\n{err[-3000:]}")
    line = next(x for x in outputs[0][0].splitlines() if x.startswith("TIMES "))
    return json.loads(line.removeprefix("TIMES "))


def label(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.rounds, args.sizes)
        return 0
    rows: list[dict[str, Any]] = []
    started = time.time()
    for world in args.worlds:
        times = run_job(world, args.rounds, args.sizes)
        for s in args.sizes:
            tiacc = statistics.median(times["tiacc"][str(s)])
            gloo = statistics.median(times["gloo"][str(s)])
            rows.append(
                {
                    "world": world,
                    "bytes": s,
                    "tiacc_seconds": tiacc,
                    "gloo_seconds": gloo,
                    "speedup": gloo / tiacc,
                    "tiacc_rounds": times["tiacc"][str(s)],
                    "gloo_rounds": times["gloo"][str(s)],
                }
            )
            print(
                f"{world} ranks {label(s):>7}: tiacc {tiacc * 1e3:9.3f} ms  "
                f"gloo {gloo * 1e3:9.3f} ms  {gloo / tiacc:5.2f}x",
                flush=True,
            )
    result = {
        "benchmark": "all_reduce (sum, float32) through the tiacc backend against gloo, one host",
        "method": (
            "one job per world size; the default group on tiacc and a gloo group over the same "
            "ranks; every round times each size on both (order alternating), "
            f"{args.rounds} rounds; a figure is the median over rounds of the slowest rank's "
            "mean time per all_reduce"
        ),
        "seconds": round(time.time() - started, 1),
        "machine": _machine.machine_info(),
        "environment": {k: v for k, v in os.environ.items() if k.startswith("TIACC_TRAINING_")},
        "rows": rows,
    }
    _machine.write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

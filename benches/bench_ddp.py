"""DDP step time on an emulated 2-node x 2-rank cluster: native vs tiacc.

Two network namespaces joined by a veth link limited to --rate-mbit each way
(tools/netns_cluster.py); ranks 0-1 on node 0, ranks 2-3 on node 1. The
model has about 16.8 MB of float32 gradients. In one run it measures:

- native DDP (gloo) with its defaults, and with torch's own communication
  hooks as peers: ``fp16_compress_hook`` and PowerSGD (rank 4);
- tiacc's flat ring with 1, 2 and 4 channels
  (TIACC_TRAINING_NUM_NCCL_STREAMS) and with fp16 compression;
- tiacc's 2D allreduce (LIGHT_2D_ALLREDUCE=1), alone, with fp16 everywhere,
  and with fp16 between nodes only ("mixed precision",
  TIACC_TRAINING_COMPRESSION_SCOPE=inter);
- tiacc's Top-K 1% with 2D (dense inside a node, sparse between nodes),
  with float32 and with float16 values.

Every tiacc run uses TIACC_TRAINING_FUSION_THRESHOLD=--fusion-bytes and 2
channels unless stated. Reported per run: median step time, native/this,
the bytes that crossed the link per step per rank (rank 0 reads its node's
link counters around the timed steps; the link is shared by the 4 ranks),
and, for dense pipelines, the time bound the link sets: a ring crosses the
link once each way carrying 2(p-1)/p of the gradients (1.5 x gradient
bytes / link rate), 2D's inter-node step carries each gradient byte once
each way (1.0 x), fp16 halves either. Needs root.

Writes benches/results/bench_ddp.json (plot: benches/plot_ddp.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster_jobs import run_job  # noqa: E402
from _machine import REPO, machine_info  # noqa: E402
from netns_cluster import cluster  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_ddp_bench_worker.py"


@dataclass(frozen=True)
class Pipeline:
    """One measured configuration."""

    label: str
    mode: str  # "native" or "tiacc"
    channels: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    hook: str = "none"
    # Link crossings per gradient byte (1.5 ring, 1.0 2D; halved by fp16);
    # None where the traffic depends on the data (Top-K, PowerSGD).
    bound_factor: float | None = None


def pipelines(channels: list[int]) -> list[Pipeline]:
    """Every configuration, native first (the ratios' reference)."""
    fp16 = ("TIACC_TRAINING_COMPRESSION", "fp16")
    two_d = ("LIGHT_2D_ALLREDUCE", "1")
    topk = (("LIGHT_TOPK_ALLREDUCE", "1"), ("LIGHT_TOPK_RATIO", "0.01"))
    runs = [
        Pipeline("native DDP (gloo)", "native", bound_factor=1.5),
        Pipeline("torch fp16_compress_hook", "native", hook="fp16", bound_factor=0.75),
        Pipeline("torch PowerSGD rank 4", "native", hook="powersgd"),
    ]
    runs += [Pipeline("tiacc ring", "tiacc", c, bound_factor=1.5) for c in channels]
    runs += [
        Pipeline("tiacc ring fp16", "tiacc", 2, (fp16,), bound_factor=0.75),
        Pipeline("tiacc 2D", "tiacc", 2, (two_d,), bound_factor=1.0),
        Pipeline("tiacc 2D + fp16", "tiacc", 2, (two_d, fp16), bound_factor=0.5),
        Pipeline(
            "tiacc 2D mixed precision",
            "tiacc",
            2,
            (two_d, fp16, ("TIACC_TRAINING_COMPRESSION_SCOPE", "inter")),
            bound_factor=0.5,
        ),
        Pipeline("tiacc 2D + Top-K 1%", "tiacc", 2, (two_d, *topk)),
        Pipeline("tiacc 2D + Top-K 1% fp16", "tiacc", 2, (two_d, *topk, ("LIGHT_TOPK_FP16", "1"))),
    ]
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--channels", default="1,2,4", help="channel counts of the flat ring")
    parser.add_argument("--fusion-bytes", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--only", default="", help="comma-separated substrings: run only matching pipelines"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benches/results/bench_ddp.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_ddp.py needs root (network namespaces and tc)")

    runs = pipelines([int(c) for c in args.channels.split(",")])
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        runs = [runs[0]] + [r for r in runs[1:] if any(w in r.label for w in wanted)]
    rows = []
    with cluster(args.rate_mbit) as nodes:
        for run in runs:
            env = dict(run.env)
            if run.mode == "tiacc":
                env["TIACC_TRAINING_NUM_NCCL_STREAMS"] = str(run.channels)
                env["TIACC_TRAINING_FUSION_THRESHOLD"] = str(args.fusion_bytes)
            worker_args = ["--mode", run.mode, "--hook", run.hook]
            worker_args += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            result = run_job(nodes, WORKER, worker_args, env)
            rows.append({"pipeline": run.label, "channels": run.channels, "env": env, **result})
            print(f"  {run.label}: {statistics.median(result['step_s']) * 1000:.0f} ms", flush=True)

    link_bytes_per_s = args.rate_mbit * 1e6 / 8
    grad_bytes = rows[0]["grad_bytes"]
    native_median = statistics.median(rows[0]["step_s"])
    world = 4
    print(f"gradients {grad_bytes / 1e6:.1f} MB, link {args.rate_mbit:g} Mbit/s each way")
    print(
        f"{'pipeline':<28} {'ch':>3} {'median ms':>10} {'native/this':>12} "
        f"{'MB/step/rank':>13} {'bound ms':>9} {'drops':>6}"
    )
    for run, row in zip(runs, rows):
        median = statistics.median(row["step_s"])
        row["median_ms"] = round(median * 1000, 1)
        row["native_over_this"] = round(native_median / median, 3)
        row["link_bytes_per_step_per_rank"] = round(row["link_bytes_per_step"] / world)
        bound = (
            None if run.bound_factor is None else run.bound_factor * grad_bytes / link_bytes_per_s
        )
        row["bound_ms"] = None if bound is None else round(bound * 1000, 1)
        ch = "-" if row["channels"] is None else str(row["channels"])
        bound_text = "-" if bound is None else f"{bound * 1000:.0f}"
        print(
            f"{row['pipeline']:<28} {ch:>3} {row['median_ms']:>10.1f} "
            f"{row['native_over_this']:>11.2f}x "
            f"{row['link_bytes_per_step_per_rank'] / 1e6:>13.2f} {bound_text:>9} "
            f"{row['link_dropped_packets']:>6}"
        )
    result = {
        "benchmark": "bench_ddp",
        "setup": {
            "nodes": 2,
            "ranks_per_node": 2,
            "rate_mbit_each_way": args.rate_mbit,
            "fusion_threshold_bytes": args.fusion_bytes,
            "steps": args.steps,
            "warmup": args.warmup,
            "model": "4 x Linear(1024, 1024) + ReLU, batch 16, SGD",
        },
        "grad_bytes": grad_bytes,
        "rows": rows,
        "machine": machine_info(["torch", "tiacc-training"]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

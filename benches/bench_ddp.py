"""DDP step time on an emulated 2-node x 2-rank cluster: native vs tiacc.

Two network namespaces joined by a veth link limited to --rate-mbit each way
(tools/netns_cluster.py); ranks 0-1 on node 0, ranks 2-3 on node 1. The
model has about 16.8 MB of float32 gradients. Native DDP uses gloo with its
defaults; tiacc uses the engine with 1, 2 and 4 channels and
TIACC_TRAINING_FUSION_THRESHOLD=--fusion-bytes. Reports the median step time
and native/tiacc, and the ring allreduce bound: a ring crosses the link once
each way, carrying 2(p-1)/p of the gradients, so
bound = 1.5 x gradient bytes / link bytes per second. A last run uses the 2D
allreduce (LIGHT_2D_ALLREDUCE=1, 2 channels), whose inter-node step carries
each gradient byte across the link once each way: bound = 1.0 x gradient
bytes / link rate. Needs root.

Writes benches/results/bench_ddp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import REPO, machine_info  # noqa: E402
from netns_cluster import cluster, link_stats  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_ddp_bench_worker.py"


def run_job(nodes, mode: str, env_extra: dict[str, str], args: argparse.Namespace) -> dict:
    ranks_per_node = 2
    world = ranks_per_node * len(nodes)
    port = 29000 + int(time.time()) % 1000
    procs = []
    for rank in range(world):
        node = nodes[rank // ranks_per_node]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIACC_TRAINING_")}
        env.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank % ranks_per_node),
                "LOCAL_WORLD_SIZE": str(ranks_per_node),
                "MASTER_ADDR": nodes[0].address,
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": node.veth,
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(REPO),
                **env_extra,
            }
        )
        cmd = node.command(
            [
                sys.executable,
                str(WORKER),
                "--mode",
                mode,
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
            ]
        )
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    before = link_stats()
    outputs = [p.communicate(timeout=900) for p in procs]
    after = link_stats()
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            raise RuntimeError(f"{mode} rank {rank} failed ({p.returncode}):\n{out}\n{err[-3000:]}")
    line = next(x for x in outputs[0][0].splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    result["link_dropped_packets"] = after["dropped_packets"] - before["dropped_packets"]
    result["link_sent_bytes"] = after["sent_bytes"] - before["sent_bytes"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--channels", default="1,2,4")
    parser.add_argument("--fusion-bytes", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--no-2d", dest="two_d", action="store_false", help="skip the LIGHT_2D_ALLREDUCE=1 run"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benches/results/bench_ddp.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_ddp.py needs root (network namespaces and tc)")

    rows = []
    with cluster(args.rate_mbit) as nodes:
        native = run_job(nodes, "native", {}, args)
        rows.append({"pipeline": "native DDP (gloo)", "channels": None, **native})
        for channels in [int(c) for c in args.channels.split(",")]:
            env = {
                "TIACC_TRAINING_NUM_NCCL_STREAMS": str(channels),
                "TIACC_TRAINING_FUSION_THRESHOLD": str(args.fusion_bytes),
            }
            result = run_job(nodes, "tiacc", env, args)
            rows.append({"pipeline": "tiacc", "channels": channels, **result})
        if args.two_d:
            env = {
                "TIACC_TRAINING_NUM_NCCL_STREAMS": "2",
                "TIACC_TRAINING_FUSION_THRESHOLD": str(args.fusion_bytes),
                "LIGHT_2D_ALLREDUCE": "1",
            }
            result = run_job(nodes, "tiacc", env, args)
            rows.append({"pipeline": "tiacc 2D", "channels": 2, **result})

    link_bytes_per_s = args.rate_mbit * 1e6 / 8
    grad_bytes = rows[0]["grad_bytes"]
    bound_s = 1.5 * grad_bytes / link_bytes_per_s
    native_median = statistics.median(rows[0]["step_s"])
    print(
        f"gradients {grad_bytes / 1e6:.1f} MB, link {args.rate_mbit:g} Mbit/s each way, "
        f"ring bound {bound_s * 1000:.0f} ms"
    )
    header = ("pipeline", "channels", "median ms", "native/tiacc", "vs bound", "drops")
    print(
        f"{header[0]:<20} {header[1]:>8} {header[2]:>10} {header[3]:>13} {header[4]:>9} "
        f"{header[5]:>7}"
    )
    for row in rows:
        median = statistics.median(row["step_s"])
        row["median_ms"] = round(median * 1000, 1)
        row["native_over_this"] = round(native_median / median, 3)
        row["over_ring_bound"] = round(median / bound_s, 3)
        ch = "-" if row["channels"] is None else str(row["channels"])
        print(
            f"{row['pipeline']:<20} {ch:>8} {row['median_ms']:>10.1f} "
            f"{row['native_over_this']:>12.2f}x {row['over_ring_bound']:>8.2f}x "
            f"{row['link_dropped_packets']:>7}"
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
        "ring_bound_ms": round(bound_s * 1000, 1),
        "rows": rows,
        "machine": machine_info(["torch", "tiacc-training"]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Two builds of the engine, the same DDP rows, interleaved: what a change bought.

``--before DIR`` is a copy of the repository (its ``tiacc_training`` with
the built extension, and ``benches/``) taken before a change; the
repository this script sits in is the build after it. Every round runs the
row once from each, in turn, on the emulated 2-node x 2-rank cluster
(``tools/netns_cluster.py``) at ``--rate``; each run reports rank 0's step
times and its CPU per thread group (``_ddp_bench_worker.py``). Needs root.

    cp -r tiacc_training benches tools /tmp/before   # before the change
    python benches/ab_builds.py --before /tmp/before --change "what changed" \\
        --out benches/results/ab_<name>.json

Writes the runs, and per build the median step and the mean CPU a step of
the engine's threads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _cluster_jobs  # noqa: E402
from _machine import REPO, machine_info, write_results  # noqa: E402
from netns_cluster import cluster  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the copy before the change")
    parser.add_argument("--change", required=True, help="what changed, for the results file")
    parser.add_argument("--rate", type=float, default=1000.0, help="Mbit/s each way; 0 = unshaped")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--env", action="append", default=["LIGHT_2D_ALLREDUCE=1"], help="NAME=VALUE, repeatable"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not (args.before / "tiacc_training").is_dir():
        sys.exit(f"--before {args.before}: no tiacc_training package there")
    builds = {"before": args.before.resolve(), "after": REPO}
    env = dict(item.split("=", 1) for item in args.env)
    worker_args = [
        "--mode", "tiacc", "--model", args.model, "--batch", str(args.batch),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]  # fmt: skip
    runs = []
    with cluster(args.rate) as nodes:
        for round_index in range(args.rounds):
            for name, tree in builds.items():
                result = _cluster_jobs.run_job(
                    nodes, tree / "benches/_ddp_bench_worker.py", worker_args, env,
                    import_root=tree,
                )  # fmt: skip
                threads = result["rank0_thread_cpu_s_per_step"]
                runs.append(
                    {
                        "build": name,
                        "round": round_index,
                        "step_s": result["step_s"],
                        "engine_cpu_s_per_step": threads["engine"],
                        "rank0_cpu_s_per_step": result["rank0_cpu_s_per_step"],
                    }
                )
                median = statistics.median(result["step_s"]) * 1000
                print(f"{name} round {round_index + 1}: {median:.0f} ms", flush=True)
    summary = {}
    for name in builds:
        own = [r for r in runs if r["build"] == name]
        steps = [t for r in own for t in r["step_s"]]
        summary[name] = {
            "median_step_ms": round(statistics.median(steps) * 1e3, 1),
            "engine_cpu_ms_per_step": round(
                statistics.fmean(r["engine_cpu_s_per_step"] for r in own) * 1e3, 1
            ),
            "rank0_cpu_ms_per_step": round(
                statistics.fmean(r["rank0_cpu_s_per_step"] for r in own) * 1e3, 1
            ),
        }
        print(name, summary[name])
    result = {
        "benchmark": "ab_builds",
        "change": args.change,
        # Where the copies lie says nothing about the builds: left out.
        "setup": {
            **{k: v for k, v in vars(args).items() if k not in ("before", "out", "env")},
            "env": env,
        },
        "machine": machine_info(["torch", "tiacc-training"]),
        "summary": summary,
        "runs": runs,
    }
    write_results(args.out, result)


if __name__ == "__main__":
    main()

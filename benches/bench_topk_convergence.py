"""Top-K with momentum SGD: held-out loss of native DDP, Top-K and Top-K + DGC.

Every run trains on 4 ranks (plain processes on loopback, CPU, TCP), with
``torch.optim.SGD(momentum=0.9)`` and the same seeds, and records the
held-out loss every ``--eval-every`` steps. Two tasks
(``benches/_topk_convergence_worker.py``):

* ``mlp``: the learnable task of ``tests/distributed/ddp_worker.py``
  (41,386 parameters in 20 KB buckets), 300 steps;
* ``cnn``: a convolutional classifier of shifted noisy templates
  (188,234 parameters in 256 KB buckets), 400 steps.

Variants, native DDP first in the same run (the reference):

* ``native``: DDP's own allreduce;
* ``topk``: ``LIGHT_TOPK_ALLREDUCE=1``, ``LIGHT_TOPK_RATIO=--ratio``, error
  feedback only (the optimiser's momentum acts on the sparse sums);
* ``dgc``: plus ``TIACC_TRAINING_TOPK_MOMENTUM=0.9``: momentum correction
  (its default: without momentum factor masking);
* ``dgc-masking``: plus ``TIACC_TRAINING_TOPK_MOMENTUM_MASKING=1``: DGC's
  recipe with masking;
* ``dgc-warmup``: ``dgc`` with ``TIACC_TRAINING_TOPK_WARMUP_STEPS=--warmup-steps``;
* ``dgc-clip``: ``dgc`` with ``TIACC_TRAINING_TOPK_CLIP_NORM=--clip-norm``.

Writes ``benches/results/bench_topk_convergence.json``: per task and
variant the environment, the loss curve, the final loss, the mean of the
last five evaluations (the curves move by a few hundredths between
evaluations) and both over native's; prints a table. The goal it checks:
a final loss within 10% of native's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import free_port  # noqa: E402
from _machine import REPO, machine_info, write_results  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_topk_convergence_worker.py"
WORLD = 4
STEPS = {"mlp": 300, "cnn": 400}


def variants(ratio: float, warmup: int, clip: float) -> dict[str, dict[str, str]]:
    """Every variant's environment, native first."""
    topk = {
        "LIGHT_TOPK_ALLREDUCE": "1",
        "LIGHT_TOPK_RATIO": str(ratio),
        "LIGHT_TOPK_THRESHOLD": "0",
    }
    dgc = {**topk, "TIACC_TRAINING_TOPK_MOMENTUM": "0.9"}
    return {
        "native": {},
        "topk": topk,
        "dgc": dgc,
        "dgc-masking": {**dgc, "TIACC_TRAINING_TOPK_MOMENTUM_MASKING": "1"},
        "dgc-warmup": {**dgc, "TIACC_TRAINING_TOPK_WARMUP_STEPS": str(warmup)},
        "dgc-clip": {**dgc, "TIACC_TRAINING_TOPK_CLIP_NORM": str(clip)},
    }


def run(task: str, variant: str, env: dict[str, str], steps: int, every: int) -> dict:
    """Trains ``task`` on WORLD ranks; returns rank 0's curve and the seconds taken."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TIACC_", "LIGHT_"))}
    base.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_WORLD_SIZE": str(WORLD),
            "TIACC_TRAINING_TIMEOUT": "120",
            **env,
        }
    )
    mode = "native" if variant == "native" else "tiacc"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "curve.json"
        start = time.monotonic()
        procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), "--task", task, "--mode", mode]
                + ["--steps", str(steps), "--eval-every", str(every), "--out", str(out)],
                env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(WORLD)
        ]
        outputs = [p.communicate(timeout=1200) for p in procs]
        seconds = time.monotonic() - start
        for p, (stdout, stderr) in zip(procs, outputs):
            if p.returncode != 0:
                raise RuntimeError(f"{task}/{variant} failed:\n{stdout}\n{stderr[-3000:]}")
        curve = json.loads(out.read_text())
    return {**curve, "seconds": round(seconds, 1)}


def summarise(rows: dict[str, dict]) -> None:
    """Adds each row's ratios to native's (final loss, mean of the last 5)."""
    for row in rows.values():
        row["tail_mean"] = round(sum(row["loss"][-5:]) / len(row["loss"][-5:]), 6)
    native = rows["native"]
    for row in rows.values():
        row["over_native"] = round(row["final_loss"] / native["final_loss"], 3)
        row["tail_over_native"] = round(row["tail_mean"] / native["tail_mean"], 3)
        row["within_10_percent"] = row["final_loss"] <= 1.1 * native["final_loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="mlp,cnn")
    parser.add_argument("--only", default="", help="comma-separated variants (native always runs)")
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--clip-norm", type=float, default=0.5)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--steps", type=int, default=0, help="override both tasks' step counts")
    parser.add_argument(
        "--out", type=Path, default=REPO / "benches/results/bench_topk_convergence.json"
    )
    args = parser.parse_args()
    table = variants(args.ratio, args.warmup_steps, args.clip_norm)
    chosen = ["native"] + [v for v in args.only.split(",") if v and v != "native"]
    if not args.only:
        chosen = list(table)
    unknown = [v for v in chosen if v not in table]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {', '.join(table)}")
    results: dict[str, dict] = {}
    for task in args.tasks.split(","):
        steps = args.steps or STEPS[task]
        rows = {}
        for variant in chosen:
            row = run(task, variant, table[variant], steps, args.eval_every)
            row["env"] = table[variant]
            row["final_loss"] = row["loss"][-1]
            rows[variant] = row
            print(f"  {task} {variant}: {row['final_loss']:.4f} ({row['seconds']} s)", flush=True)
        summarise(rows)
        results[task] = {"steps": steps, "variants": rows}
    header = f"{'final loss':>10} {'/ native':>9} {'last 5':>8} {'/ native':>9}"
    print(f"{'task':<5} {'variant':<20} {header}")
    for task, result in results.items():
        for variant, row in result["variants"].items():
            print(
                f"{task:<5} {variant:<20} {row['final_loss']:>10.4f} {row['over_native']:>8.2f}x "
                f"{row['tail_mean']:>8.4f} {row['tail_over_native']:>8.2f}x"
            )
    report = {
        "benchmark": "bench_topk_convergence",
        "setup": {
            "ranks": WORLD,
            "transport": "tcp on loopback, CPU",
            "optimizer": "torch.optim.SGD, momentum 0.9 (lr: mlp 0.05, cnn 0.02)",
            "topk_ratio": args.ratio,
            "warmup_steps": args.warmup_steps,
            "clip_norm": args.clip_norm,
            "eval_every": args.eval_every,
            "goal": "final held-out loss within 10% of native DDP's",
        },
        "tasks": results,
        "machine": machine_info(["torch", "tiacc-training"]),
    }
    write_results(args.out, report)


if __name__ == "__main__":
    main()

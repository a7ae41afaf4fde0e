"""Real models trained end to end across link speeds: examples/s per rank and scaling efficiency.

A torchvision model (``--model``, ResNet-18 on 64x64 images by default on
CPU), forward, backward and an SGD step on random inputs of batch
``--batch`` per rank, on the emulated 2-node x 2-rank cluster
(``tools/netns_cluster.py``: two network namespaces joined by a veth link
shaped to each rate of ``--rates`` in each direction, ``0`` = unshaped).

Rows at each rate, each a separate 4-rank job (``_ddp_bench_worker.py``):
native DDP (gloo), torch's ``fp16_compress_hook`` and ``bf16_compress_hook``,
tiacc flat ring (exact), 2D (exact), 2D + fp16, Top-K 1% (flat ring), and
tiacc with no setting at all (its default, ``auto``). Two references, once
per round: the **compute floor** (the same 4 processes, model and batch with
no gradient exchange: what 4 ranks of these cores do when communication
costs nothing) and **one rank alone** (one process, no DDP).

For each row and rate: the median step of every round and of all steps
pooled, examples/s per rank (batch / median step), the **scaling
efficiency** against the compute floor (its median step / the row's) and
against one rank alone, and the speed over native DDP at the same rate.
Rounds interleave everything in time (every row at every rate, then again),
so a slow spell of the machine lands on all rows. Rank 0's auto line (the
algorithm ``auto`` picked, and why) is kept for the tiacc rows.

On a machine with fewer cores than ranks the 4 ranks share them, so the
efficiency against one rank alone is capped by the cores (2 cores, 4 ranks:
about 50%); the efficiency against the compute floor is the one the
communication decides. Needs root. The full CPU sweep::

    python benches/bench_scaling.py && python benches/plot_scaling.py

Writes ``benches/results/bench_scaling.json`` (every run kept).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster_jobs import AUTO_PREFIXES, cuda_env, cuda_unavailable, run_job  # noqa: E402
from _ddp_bench_worker import VISION_MODELS, build_model, model_stats  # noqa: E402
from _machine import REPO, machine_info  # noqa: E402
from netns_cluster import cluster  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_ddp_bench_worker.py"
WORLD = 4
NATIVE = "native DDP"
AUTO = "tiacc default (auto)"
COMPUTE_FLOOR = "compute floor (4 ranks, no exchange)"
ONE_RANK = "one rank alone"
EXACT = ("tiacc flat ring", "tiacc 2D")


@dataclass(frozen=True)
class Row:
    """One configuration of the 4-rank job."""

    label: str
    mode: str  # "native" or "tiacc"
    env: tuple[tuple[str, str], ...] = ()
    hook: str = "none"


def rows() -> list[Row]:
    """The rows of every rate, native first."""
    flat = ("TIACC_TRAINING_ALGORITHM", "flat")
    two_d = ("LIGHT_2D_ALLREDUCE", "1")
    fp16 = ("TIACC_TRAINING_COMPRESSION", "fp16")
    topk = (("LIGHT_TOPK_ALLREDUCE", "1"), ("LIGHT_TOPK_RATIO", "0.01"))
    return [
        Row(NATIVE, "native"),
        Row("torch fp16_compress_hook", "native", hook="fp16"),
        Row("torch bf16_compress_hook", "native", hook="bf16"),
        Row("tiacc flat ring", "tiacc", (flat,)),
        Row("tiacc 2D", "tiacc", (two_d,)),
        Row("tiacc 2D + fp16", "tiacc", (two_d, fp16)),
        Row("tiacc Top-K 1%", "tiacc", (flat, *topk)),
        Row(AUTO, "tiacc"),
    ]


def _worker_args(args: argparse.Namespace, mode: str, hook: str = "none") -> list[str]:
    return [
        "--mode", mode, "--model", args.model, "--hook", hook, "--device", args.device,
        "--batch", str(args.batch), "--image-size", str(args.image_size),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]  # fmt: skip


def _device_env(args: argparse.Namespace) -> dict[str, str]:
    """Every rank's variables for the device: all ranks share GPU 0 on CUDA."""
    return cuda_env() if args.device == "cuda" else {}


def run_row(nodes: tuple, row: Row, rate: float, args: argparse.Namespace) -> dict:
    """One 4-rank job; rank 0's step times and what the run reported."""
    result = run_job(
        nodes,
        WORKER,
        _worker_args(args, row.mode, row.hook),
        {**_device_env(args), **dict(row.env)},
        ranks_per_node=WORLD // len(nodes),
        stderr_prefixes=AUTO_PREFIXES if row.mode == "tiacc" else (),
    )
    auto = result.pop("rank0_stderr_lines", [])
    run = {"pipeline": row.label, "rate_mbit": rate, "step_s": result["step_s"]}
    run["link_bytes_per_step"] = result["link_bytes_per_step"]
    run["rank0_cpu_s_per_step"] = result["rank0_cpu_s_per_step"]
    run["link_dropped_packets"] = result["link_dropped_packets"]
    run["grad_bytes"] = result["grad_bytes"]
    if auto:
        run["auto_choice"] = "; ".join(auto)
    median = statistics.median(result["step_s"]) * 1000
    print(f"  {rate:g} Mbit/s: {row.label}: {median:.0f} ms", flush=True)
    return run


def run_reference(nodes: tuple, label: str, args: argparse.Namespace) -> dict:
    """The compute floor (4 ranks, no DDP) or one rank alone, on node 0's loopback."""
    ranks = WORLD if label == COMPUTE_FLOOR else 1
    result = run_job(
        nodes[:1], WORKER, _worker_args(args, "none"), _device_env(args), ranks_per_node=ranks
    )
    median = statistics.median(result["step_s"]) * 1000
    print(f"  {label}: {median:.0f} ms", flush=True)
    return {
        "pipeline": label,
        "rate_mbit": None,
        "step_s": result["step_s"],
        "rank0_cpu_s_per_step": result["rank0_cpu_s_per_step"],
    }


def summarize(runs: list[dict], batch: int) -> list[dict]:
    """One line per (row, rate): medians, spread, examples/s, efficiencies, speed over native."""
    groups: dict[tuple[str, float | None], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["pipeline"], run["rate_mbit"]), []).append(run)

    def median_s(key: tuple[str, float | None]) -> float:
        return statistics.median(t for run in groups[key] for t in run["step_s"])

    floor_s = median_s((COMPUTE_FLOOR, None))
    alone_s = median_s((ONE_RANK, None))
    lines = []
    for (label, rate), parts in groups.items():
        step_s = median_s((label, rate))
        round_ms = [round(statistics.median(p["step_s"]) * 1000, 1) for p in parts]
        line = {
            "pipeline": label,
            "rate_mbit": rate,
            "median_ms": round(step_s * 1000, 1),
            "round_medians_ms": round_ms,
            "spread_pct": round((max(round_ms) - min(round_ms)) / min(round_ms) * 100, 1),
            "examples_per_s_per_rank": round(batch / step_s, 2),
            "efficiency_vs_compute_floor": round(floor_s / step_s, 3),
            "efficiency_vs_one_rank": round(alone_s / step_s, 3),
        }
        cpu = [p["rank0_cpu_s_per_step"] for p in parts if "rank0_cpu_s_per_step" in p]
        if cpu:  # rank 0's CPU time a step: on cores shared by the ranks, its cost
            line["rank0_cpu_ms_per_step"] = round(statistics.fmean(cpu) * 1000, 1)
        if rate is not None:
            line["speed_over_native"] = round(median_s((NATIVE, rate)) / step_s, 3)
            line["link_mb_per_step"] = round(
                statistics.fmean(p["link_bytes_per_step"] for p in parts) / 1e6, 2
            )
            choices = sorted({p["auto_choice"] for p in parts if p.get("auto_choice")})
            if choices:
                line["auto_choice"] = choices
        lines.append(line)
    return lines


def goals(lines: list[dict], rates: list[float]) -> dict:
    """The issue's goals, measured: per rate, and at the rate native scales 40-60%."""
    by = {(x["pipeline"], x["rate_mbit"]): x for x in lines}
    per_rate = []
    for rate in rates:
        if (NATIVE, rate) not in by or (AUTO, rate) not in by:
            continue  # cut off before this rate's rows
        native = by[(NATIVE, rate)]
        auto = by[(AUTO, rate)]
        goal = {
            "rate_mbit": rate,
            "native_efficiency": native["efficiency_vs_compute_floor"],
            "auto_over_native": auto["speed_over_native"],
        }
        exact = [by[(label, rate)]["median_ms"] for label in EXACT if (label, rate) in by]
        if exact:
            best = min(exact)
            goal["best_exact_over_native"] = round(native["median_ms"] / best, 3)
            goal["auto_within_pct_of_best_exact"] = round(
                (auto["median_ms"] / min(best, auto["median_ms"]) - 1) * 100, 1
            )
        fp16 = by.get(("tiacc 2D + fp16", rate))
        if fp16 is not None:
            goal["two_d_fp16_over_native"] = fp16["speed_over_native"]
            goal["two_d_fp16_efficiency"] = fp16["efficiency_vs_compute_floor"]
        per_rate.append(goal)
    regime = [g for g in per_rate if 0.4 <= g["native_efficiency"] <= 0.6]
    return {"per_rate": per_rate, "ti_acc_regime": regime}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (argparse exits with 2 on errors)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: every rank on GPU 0 (NCCL >= 2.30), native rows on NCCL",
    )
    parser.add_argument("--model", choices=tuple(VISION_MODELS), default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--rates", default="200,1000,3000,10000,0", help="Mbit/s each way; 0 = unshaped"
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--only", default="", help="comma-separated label substrings (native always runs)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benches/results/bench_scaling.json")
    return parser.parse_args(argv)


def write(
    out: Path, result: dict, runs: list[dict], args: argparse.Namespace, rates: list[float]
) -> list[dict]:
    """Writes the runs so far and what they sum up to (after each run: a cut-off run keeps them)."""
    lines = summarize(runs, args.batch) if runs else []
    complete = {(r["pipeline"], r["rate_mbit"]) for r in runs}
    result["rows"] = lines
    result["goals"] = goals(lines, rates) if (COMPUTE_FLOOR, None) in complete else None
    result["runs"] = runs
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return lines


def main() -> None:
    args = parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_scaling.py needs root (network namespaces and tc)")
    if args.device == "cuda" and cuda_unavailable():
        sys.exit(f"bench_scaling.py --device cuda: {cuda_unavailable()}")
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    chosen = [r for r in rows() if r.label in (NATIVE, AUTO) or not wanted or any(
        w in r.label for w in wanted
    )]  # fmt: skip
    module, _, description = build_model(args.model, args.batch, image_size=args.image_size)
    setup = {
        "model": args.model,
        "description": description,
        "batch_per_rank": args.batch,
        "image_size": args.image_size,
        **model_stats(module),
        "nodes": 2,
        "ranks_per_node": WORLD // 2,
        "rates_mbit_each_way": rates,
        "unshaped_rate": "0 = the veth pair unshaped",
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "device": args.device,
        "native": "gloo" if args.device == "cpu" else "NCCL",
        "optimizer": "SGD lr 1e-3, loss = mean(output^2)",
        "efficiency": "compute floor's median step / the row's (the same 4 ranks with "
        "no gradient exchange), and one rank alone's / the row's",
    }
    runs: list[dict] = []
    started = time.monotonic()
    result = {
        "benchmark": "bench_scaling",
        "setup": setup,
        "machine": machine_info(["torch", "torchvision", "tiacc-training"]),
    }
    for round_index in range(args.rounds):
        print(f"round {round_index + 1} of {args.rounds}", flush=True)
        for rate in rates:
            with cluster(rate) as nodes:
                if rate == rates[0]:
                    for label in (COMPUTE_FLOOR, ONE_RANK):
                        runs.append({**run_reference(nodes, label, args), "round": round_index})
                for row in chosen:
                    runs.append({**run_row(nodes, row, rate, args), "round": round_index})
                    result["seconds"] = round(time.monotonic() - started)
                    write(args.out, result, runs, args, rates)
    lines = write(args.out, result, runs, args, rates)
    for line in lines:
        rate = "-" if line["rate_mbit"] is None else f"{line['rate_mbit']:g}"
        print(
            f"{line['pipeline']:<38} {rate:>6} {line['median_ms']:>8.1f} ms "
            f"{line['examples_per_s_per_rank']:>7.2f}/s "
            f"eff {line['efficiency_vs_compute_floor']:.2f} "
            f"x{line.get('speed_over_native', 1.0):.2f} spread {line['spread_pct']}%"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Real models trained end to end across link rates, held against the step's physical bound.

Each model of ``--models`` (by default torchvision's ResNet-18 on 64x64
random images, batch 16 per rank, SGD, and ``lm``, our own 6-layer causal
transformer language model, batch 4 sequences of 64 tokens per rank,
AdamW) trains on the emulated 2-node x 2-rank cluster
(``tools/netns_cluster.py``: two network namespaces joined by a veth link
shaped to each rate of ``--rates`` in each direction, ``0`` = unshaped).

Rows at each rate, each a separate 4-rank job (``_ddp_bench_worker.py``):
by default native DDP (gloo), tiacc 2D (exact), 2D + fp16 and tiacc with no
setting at all (its default, ``auto``); ``--all-rows`` adds torch's
``fp16_compress_hook`` and ``bf16_compress_hook``, tiacc's flat ring and
Top-K 1%, and ``--only`` picks rows by a part of their name. Two references
per model, once per round: the **compute floor** (the same 4 processes,
model and batch with no gradient exchange: what 4 ranks of these cores do
when communication costs nothing) and **one rank alone** (one process, no
DDP).

**The bound.** No step can be shorter than the compute floor's, and none
can be shorter than its forward pass plus the time its own bytes need to
cross the link in one direction: no gradient exists before backward
starts, so the exchange cannot begin earlier, and the link carries at most
the rate each way. So a row's bound at a rate is::

    max(floor step, floor forward + one-way link bytes per step * 8 / rate)

where the step and forward are the compute floor's medians, and the
one-way bytes the larger of what rank 0's node sent and received per step,
measured on the row's own run (so headers and any extra traffic count).
On the unshaped link the bound is the floor. The **efficiency against the
bound** is the bound over the row's median step: 1 means the row cannot
get faster on this link and these cores. Each line also says which term
set the bound (``floor`` or ``link``), the row's own median forward, and
the bytes the algorithm must move one way for reference (the ring over 4
ranks across the node boundary: 1.5 x the gradient bytes for native DDP and
the flat ring, 0.75 x for torch's 16-bit hooks, 1 x for 2D, 0.5 x for 2D +
fp16; none for Top-K).

Also per row and rate, as before: the median step of every round and of all
steps pooled, examples/s per rank, the scaling efficiency against the
compute floor (its median step / the row's) and against one rank alone,
and the speed over native DDP at the same rate. Rounds interleave
everything in time (every rate, model and row, then again), so a slow spell
of the machine lands on all rows. Rank 0's auto line (the algorithm
``auto`` picked, and why) is kept for the tiacc rows.

**Goals** (``goals`` in the JSON, per model and rate, each with ``met``):
the default row at >= 0.90 of its bound at 1, 3 and 10 Gbit/s; 2D + fp16 at
>= 0.85 of its bound at 1 and 3 Gbit/s; the default at >= 0.98x native's
speed at every rate, and >= 1.45x on ``lm`` at 1 Gbit/s.

On a machine with fewer cores than ranks the 4 ranks share them, so the
efficiency against one rank alone is capped by the cores (2 cores, 4 ranks:
about 50%); the bound and the compute floor already include that sharing.
Needs root. The full CPU sweep::

    python benches/bench_scaling.py && python benches/plot_scaling.py

Writes ``benches/results/bench_scaling.json`` (every run kept, rewritten
after each run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster_jobs import AUTO_PREFIXES, cuda_env, cuda_unavailable, run_job  # noqa: E402
from _ddp_bench_worker import (  # noqa: E402
    LANGUAGE_MODELS,
    VISION_MODELS,
    build_model,
    model_stats,
)
from _machine import REPO, machine_info, write_json  # noqa: E402
from netns_cluster import cluster  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_ddp_bench_worker.py"
WORLD = 4
NATIVE = "native DDP"
AUTO = "tiacc default (auto)"
TWO_D = "tiacc 2D"
TWO_D_FP16 = "tiacc 2D + fp16"
COMPUTE_FLOOR = "compute floor (4 ranks, no exchange)"
ONE_RANK = "one rank alone"
# The compute floor with the ranks waiting for each other once a step (a
# 4-byte allreduce after backward): what synchronising costs where the ranks
# share too few cores, with no gradient exchanged. Not part of the bound.
SYNCED_FLOOR = "synced floor (4 ranks, 4 bytes a step)"
REFERENCES = (COMPUTE_FLOOR, SYNCED_FLOOR, ONE_RANK)
THREADS = "rank0_thread_cpu_s_per_step"
EXACT = ("tiacc flat ring", TWO_D)
DEFAULT_ROWS = (NATIVE, TWO_D, TWO_D_FP16, AUTO)
MODEL_CHOICES = tuple(VISION_MODELS) + LANGUAGE_MODELS
# Each model's batch per rank unless --batch is given (vision models: 16).
BATCH = {"lm": 4}
VISION_BATCH = 16
# Each model's optimizer (the others: SGD), as the worker names it.
OPTIMIZER = {"lm": "adamw"}
OPTIMIZER_TEXT = {
    "sgd": "SGD lr 1e-3",
    "adamw": "AdamW lr 1e-4, weight decay 0.01",
}
# The bytes each exact algorithm moves across the node boundary one way per
# step, in gradient bytes: a ring over 4 ranks crosses it once each way and
# each ring link carries 2 (n - 1) / n = 1.5 x; 2D sends each node's half of
# the reduced gradient to the other node (reduce-scatter plus all-gather
# between 2 nodes) from each of its 2 ranks: 1 x; 16-bit halves either.
RING_ONE_WAY = 1.5
TWO_D_ONE_WAY = 1.0
# What ``auto`` reports choosing (its log line), and that algorithm's share.
AUTO_ONE_WAY = {"flat": RING_ONE_WAY, "2d": TWO_D_ONE_WAY}
# (name, row, the line's metric, minimum, the rates it applies at, Mbit/s;
# None: every rate).
GOALS: tuple[tuple[str, str, str, float, tuple[float, ...] | None], ...] = (
    ("default efficiency vs bound", AUTO, "efficiency_vs_bound", 0.90, (1000.0, 3000.0, 10000.0)),
    ("2D + fp16 efficiency vs bound", TWO_D_FP16, "efficiency_vs_bound", 0.85, (1000.0, 3000.0)),
    ("default over native", AUTO, "speed_over_native", 0.98, None),
)
# Stricter minimums of one goal for one model at one rate.
GOAL_OVERRIDES = {("default over native", "lm", 1000.0): 1.45}
# An efficiency against the bound above this says the floor was measured too slow.
OVER_BOUND = 1.05


@dataclass(frozen=True)
class Row:
    """One configuration of the 4-rank job."""

    label: str
    mode: str  # "native" or "tiacc"
    env: tuple[tuple[str, str], ...] = ()
    hook: str = "none"
    # Bytes across the node boundary one way per step, in gradient bytes
    # (None: not fixed by the algorithm).
    nominal_one_way: float | None = None


def rows() -> list[Row]:
    """Every row of a rate, native first."""
    flat = ("TIACC_TRAINING_ALGORITHM", "flat")
    two_d = ("LIGHT_2D_ALLREDUCE", "1")
    fp16 = ("TIACC_TRAINING_COMPRESSION", "fp16")
    topk = (("LIGHT_TOPK_ALLREDUCE", "1"), ("LIGHT_TOPK_RATIO", "0.01"))
    return [
        Row(NATIVE, "native", nominal_one_way=RING_ONE_WAY),
        Row("torch fp16_compress_hook", "native", hook="fp16", nominal_one_way=RING_ONE_WAY / 2),
        Row("torch bf16_compress_hook", "native", hook="bf16", nominal_one_way=RING_ONE_WAY / 2),
        Row("tiacc flat ring", "tiacc", (flat,), nominal_one_way=RING_ONE_WAY),
        Row(TWO_D, "tiacc", (two_d,), nominal_one_way=TWO_D_ONE_WAY),
        Row(TWO_D_FP16, "tiacc", (two_d, fp16), nominal_one_way=TWO_D_ONE_WAY / 2),
        Row("tiacc Top-K 1%", "tiacc", (flat, *topk)),
        Row(AUTO, "tiacc"),
    ]


def chosen_rows(only: str, all_rows: bool) -> list[Row]:
    """The rows to run: the default four, every row, or those ``--only`` names (and native, auto).

    Args:
        only: comma-separated parts of row labels ("" for none).
        all_rows: every row of :func:`rows`.
    """
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    picked = []
    for row in rows():
        if row.label in (NATIVE, AUTO) or all_rows:
            picked.append(row)
        elif wanted:
            if any(w in row.label for w in wanted):
                picked.append(row)
        elif row.label in DEFAULT_ROWS:
            picked.append(row)
    return picked


def batch_of(model: str, args: argparse.Namespace) -> int:
    """The batch per rank of ``model``: ``--batch``, else the model's own default."""
    if args.batch is not None:
        return args.batch
    return BATCH.get(model, VISION_BATCH)


def _worker_args(args: argparse.Namespace, model: str, mode: str, hook: str = "none") -> list[str]:
    return [
        "--mode", mode, "--model", model, "--hook", hook, "--device", args.device,
        "--batch", str(batch_of(model, args)), "--image-size", str(args.image_size),
        "--optimizer", OPTIMIZER.get(model, "sgd"),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]  # fmt: skip


def _device_env(args: argparse.Namespace) -> dict[str, str]:
    """Every rank's variables for the device: all ranks share GPU 0 on CUDA."""
    return cuda_env() if args.device == "cuda" else {}


def timeline_steps(prefix: Path) -> dict:
    """The medians over the timed steps of the engine's timelines ``prefix.rank*.json``.

    Per step (``tiacc_training.tools.timeline_summary``): the span from the
    first hand-over to the last bucket done, the ranks' skew in handing the
    last bucket over, the tail after it, and how long rank 0 had bytes
    crossing the link.
    """
    from tiacc_training.tools.timeline_summary import load, summarize

    traces = [load(f"{prefix}.rank{rank}.json") for rank in range(WORLD)]
    steps = summarize(traces)[1:]  # the first is the warm-up's first bucket alone
    keys = ("span_ms", "skew_ms", "tail_ms", "link_ms", "link_share")
    return {
        "steps": len(steps),
        "files": f"{prefix.name}.rank*.json",  # under --timeline
        **{k: statistics.median(x[k] for x in steps) for k in keys if steps},
    }


# What a run keeps of rank 0's result: every run, and the rows over the link.
MEASURED = (
    "step_s",
    "forward_s",
    "rank0_cpu_s_per_step",
    "machine_cpu_busy",
    "rank0_thread_cpu_s_per_step",
    "optimizer",
)
LINK_MEASURED = (
    "link_bytes_per_step",
    "link_tx_bytes_per_step",
    "link_rx_bytes_per_step",
    "link_dropped_packets",
    "grad_bytes",
)


def run_row(
    nodes: tuple,
    model: str,
    row: Row,
    rate: float,
    args: argparse.Namespace,
    timeline: Path | None = None,
) -> dict:
    """One 4-rank job; rank 0's step and forward times and what the run reported.

    With ``timeline`` (a tiacc row), the engine writes its timeline there
    and the run keeps its summary.
    """
    traced = {"TIACC_TRAINING_TIMELINE": str(timeline)} if timeline is not None else {}
    result = run_job(
        nodes,
        WORKER,
        _worker_args(args, model, row.mode, row.hook),
        {**_device_env(args), **dict(row.env), **traced},
        ranks_per_node=WORLD // len(nodes),
        stderr_prefixes=AUTO_PREFIXES if row.mode == "tiacc" else (),
    )
    auto = result.pop("rank0_stderr_lines", [])
    run = {"model": model, "pipeline": row.label, "rate_mbit": rate}
    if timeline is not None:
        run["timeline"] = timeline_steps(timeline)
    run.update({key: result[key] for key in (*MEASURED, *LINK_MEASURED)})
    if auto:
        run["auto_choice"] = "; ".join(auto)
    median = statistics.median(result["step_s"]) * 1000
    print(f"  {rate:g} Mbit/s: {model}: {row.label}: {median:.0f} ms", flush=True)
    return run


def run_reference(nodes: tuple, model: str, label: str, args: argparse.Namespace) -> dict:
    """The compute floor (4 ranks, no DDP) or one rank alone, on node 0's loopback."""
    ranks = 1 if label == ONE_RANK else WORLD
    sync = ["--sync"] if label == SYNCED_FLOOR else []
    result = run_job(
        nodes[:1],
        WORKER,
        _worker_args(args, model, "none") + sync,
        _device_env(args),
        ranks_per_node=ranks,
    )
    median = statistics.median(result["step_s"]) * 1000
    print(f"  {model}: {label}: {median:.0f} ms", flush=True)
    run = {"model": model, "pipeline": label, "rate_mbit": None}
    return {**run, **{key: result[key] for key in MEASURED}}


def one_way_bytes(run: dict) -> float:
    """The bytes per step that crossed the link in its busier direction at rank 0's node."""
    return max(run["link_tx_bytes_per_step"], run["link_rx_bytes_per_step"])


def bound_s(floor_s: float, forward_s: float, link_bytes: float, rate_mbit: float) -> float:
    """The shortest step possible: the compute floor, or forward plus the link's time one way.

    Args:
        floor_s: the compute floor's median step.
        forward_s: the compute floor's median forward pass.
        link_bytes: the row's bytes per step across the link, one way.
        rate_mbit: the link's rate each way (0: unshaped, the bound is the floor).
    """
    if rate_mbit <= 0:
        return floor_s
    return max(floor_s, forward_s + link_bytes * 8 / (rate_mbit * 1e6))


def auto_one_way(choices: list[str]) -> float | None:
    """The nominal one-way share of the algorithm ``auto`` chose, if every run chose the same."""
    picked = {m.group(1) for c in choices for m in [re.search(r"chose (\w+)", c)] if m}
    exact = all("compression stays off" in c for c in choices)
    if len(picked) == 1 and exact:
        return AUTO_ONE_WAY.get(picked.pop())
    return None


def _pooled_median(runs: list[dict], key: str) -> float:
    """The median of ``key``'s values pooled over ``runs``."""
    return statistics.median(t for run in runs for t in run[key])


def summarize(runs: list[dict], batch: int, nominal: dict[str, float | None]) -> list[dict]:
    """One line per (row, rate) of one model: medians, bound, efficiencies, speed over native.

    Args:
        runs: the model's runs, its two references among them.
        batch: the model's batch per rank.
        nominal: each row's one-way bytes in gradient bytes (see :class:`Row`).
    """
    groups: dict[tuple[str, float | None], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["pipeline"], run["rate_mbit"]), []).append(run)
    floor_s = _pooled_median(groups[(COMPUTE_FLOOR, None)], "step_s")
    floor_forward_s = _pooled_median(groups[(COMPUTE_FLOOR, None)], "forward_s")
    alone_s = _pooled_median(groups[(ONE_RANK, None)], "step_s")
    lines = []
    for (label, rate), parts in groups.items():
        step_s = _pooled_median(parts, "step_s")
        round_ms = [round(statistics.median(p["step_s"]) * 1000, 1) for p in parts]
        line = {
            "model": runs[0]["model"],
            "pipeline": label,
            "rate_mbit": rate,
            "median_ms": round(step_s * 1000, 1),
            "forward_ms": round(_pooled_median(parts, "forward_s") * 1000, 1),
            "round_medians_ms": round_ms,
            "spread_pct": round((max(round_ms) - min(round_ms)) / min(round_ms) * 100, 1),
            "examples_per_s_per_rank": round(batch / step_s, 2),
            "efficiency_vs_compute_floor": round(floor_s / step_s, 3),
            "efficiency_vs_one_rank": round(alone_s / step_s, 3),
        }
        cpu = [p["rank0_cpu_s_per_step"] for p in parts if "rank0_cpu_s_per_step" in p]
        if cpu:  # rank 0's CPU time a step: on cores shared by the ranks, its cost
            line["rank0_cpu_ms_per_step"] = round(statistics.fmean(cpu) * 1000, 1)
        threads = [p[THREADS] for p in parts if THREADS in p]
        if threads:  # where rank 0's CPU went: the engine's threads, gloo's, the rest
            line["rank0_thread_cpu_ms_per_step"] = {
                k: round(statistics.fmean(t[k] for t in threads) * 1000, 1) for k in threads[0]
            }
        traced = [p["timeline"] for p in parts if p.get("timeline")]
        if traced:  # the engine's timeline of the round that kept one
            line["timeline"] = traced[-1]
        busy = [p["machine_cpu_busy"] for p in parts if "machine_cpu_busy" in p]
        if busy:  # near 1.0: the cores, not the link, set the pace
            line["machine_cpu_busy"] = round(statistics.fmean(busy), 3)
        if rate is not None:
            line.update(_link_and_bound(parts, rate, floor_s, floor_forward_s, nominal.get(label)))
            line["efficiency_vs_bound"] = round(line["bound_ms"] / line["median_ms"], 3)
            if cpu:
                # The CPU work of the 4 ranks (rank 0's, times 4) packed onto
                # the machine's cores: no schedule runs it in less time.
                cores = os.cpu_count() or 1
                line["cpu_bound_ms"] = round(
                    WORLD * line["rank0_cpu_ms_per_step"] / min(cores, WORLD), 1
                )
                line["efficiency_vs_cpu_and_link_bound"] = round(
                    max(line["bound_ms"], line["cpu_bound_ms"]) / line["median_ms"], 3
                )
            native = groups.get((NATIVE, rate))
            line["speed_over_native"] = (
                round(_pooled_median(native, "step_s") / step_s, 3) if native else None
            )
        lines.append(line)
    return lines


def _link_and_bound(
    parts: list[dict],
    rate: float,
    floor_s: float,
    floor_forward_s: float,
    nominal_one_way: float | None,
) -> dict:
    """A row's link bytes (both directions, one way, nominal), its bound and what set it."""
    mean = statistics.fmean
    one_way = mean(one_way_bytes(p) for p in parts)
    grad_bytes = parts[0]["grad_bytes"]
    choices = sorted({p["auto_choice"] for p in parts if p.get("auto_choice")})
    if choices and nominal_one_way is None:
        nominal_one_way = auto_one_way(choices)
    bound = bound_s(floor_s, floor_forward_s, one_way, rate)
    link = {
        "link_mb_per_step": round(mean(p["link_bytes_per_step"] for p in parts) / 1e6, 2),
        "link_tx_mb_per_step": round(mean(p["link_tx_bytes_per_step"] for p in parts) / 1e6, 2),
        "link_rx_mb_per_step": round(mean(p["link_rx_bytes_per_step"] for p in parts) / 1e6, 2),
        "link_mb_one_way_per_step": round(one_way / 1e6, 2),
        "nominal_mb_one_way_per_step": (
            None if nominal_one_way is None else round(nominal_one_way * grad_bytes / 1e6, 2)
        ),
        "bound_ms": round(bound * 1000, 1),
        "bound_by": "floor" if bound == floor_s else "link",
    }
    if choices:
        link["auto_choice"] = choices
    return link


def goal_minimum(name: str, model: str, rate: float) -> float | None:
    """The minimum of goal ``name`` for ``model`` at ``rate`` (None: no goal there)."""
    for goal, _, _, minimum, rates in GOALS:
        if goal == name and (rates is None or rate in rates):
            return GOAL_OVERRIDES.get((name, model, rate), minimum)
    return None


def _checks(by: dict, model: str, rate: float) -> list[dict]:
    """The goals that apply to ``model`` at ``rate`` whose row ran, each measured and met or not."""
    checks = []
    for name, label, metric, _, _ in GOALS:
        minimum = goal_minimum(name, model, rate)
        line = by.get((label, rate))
        if minimum is None or line is None or line.get(metric) is None:
            continue
        measured = line[metric]
        checks.append(
            {
                "goal": name,
                "row": label,
                "metric": metric,
                "measured": measured,
                "minimum": minimum,
                "met": measured >= minimum,
            }
        )
    return checks


def _rate_goals(by: dict, model: str, rate: float) -> dict:
    """One model's goals at one rate (its native and default rows ran)."""
    native = by[(NATIVE, rate)]
    auto = by[(AUTO, rate)]
    goal = {
        "model": model,
        "rate_mbit": rate,
        "native_efficiency": native["efficiency_vs_compute_floor"],
        "native_efficiency_vs_bound": native["efficiency_vs_bound"],
        "auto_over_native": auto["speed_over_native"],
        "auto_efficiency_vs_bound": auto["efficiency_vs_bound"],
    }
    exact = [by[(label, rate)]["median_ms"] for label in EXACT if (label, rate) in by]
    if exact:
        best = min(exact)
        goal["best_exact_over_native"] = round(native["median_ms"] / best, 3)
        goal["auto_within_pct_of_best_exact"] = round(
            (auto["median_ms"] / min(best, auto["median_ms"]) - 1) * 100, 1
        )
    fp16 = by.get((TWO_D_FP16, rate))
    if fp16 is not None:
        goal["two_d_fp16_over_native"] = fp16["speed_over_native"]
        goal["two_d_fp16_efficiency"] = fp16["efficiency_vs_compute_floor"]
        goal["two_d_fp16_efficiency_vs_bound"] = fp16["efficiency_vs_bound"]
    goal["checks"] = _checks(by, model, rate)
    return goal


def goals(lines: list[dict], models: list[str], rates: list[float]) -> dict:
    """The issue's goals, measured: per model and rate, each check with ``met``.

    ``per_rate`` holds one entry per model and rate whose native and default
    rows ran; ``missed`` names every check not met; ``met`` is whether every
    check so far was (None before any).
    """
    per_rate = []
    for model in models:
        by = {(x["pipeline"], x["rate_mbit"]): x for x in lines if x["model"] == model}
        for rate in rates:
            if (NATIVE, rate) in by and (AUTO, rate) in by:
                per_rate.append(_rate_goals(by, model, rate))
    checks = [(g, c) for g in per_rate for c in g["checks"]]
    missed = [
        f"{g['model']} at {g['rate_mbit']:g} Mbit/s: {c['goal']} {c['measured']:.2f} "
        f"< {c['minimum']:.2f}"
        for g, c in checks
        if not c["met"]
    ]
    regime = [g for g in per_rate if 0.4 <= g["native_efficiency"] <= 0.6]
    return {
        "per_rate": per_rate,
        "met": None if not checks else not missed,
        "missed": missed,
        "ti_acc_regime": regime,
    }


def _model_list(text: str) -> list[str]:
    """``--models``: comma-separated names of :data:`MODEL_CHOICES`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODEL_CHOICES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown model(s) {unknown}: choose from {', '.join(MODEL_CHOICES)}"
        )
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (argparse exits with 2 on errors)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: every rank on GPU 0 (NCCL >= 2.30), native rows on NCCL",
    )
    parser.add_argument(
        "--models",
        type=_model_list,
        default=["resnet18", "lm"],
        help=f"comma-separated, of {', '.join(MODEL_CHOICES)}",
    )
    parser.add_argument(
        "--model", choices=MODEL_CHOICES, default=None, help="one model (instead of --models)"
    )
    parser.add_argument("--image-size", type=int, default=64, help="vision models only")
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"per rank, every model (default: lm {BATCH['lm']}, vision models {VISION_BATCH})",
    )
    parser.add_argument(
        "--rates", default="1000,3000,10000,0", help="Mbit/s each way; 0 = unshaped"
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated label substrings, of every row (native and the default always run)",
    )
    parser.add_argument(
        "--all-rows",
        action="store_true",
        help="every row: adds torch's fp16/bf16 hooks, tiacc flat ring and Top-K 1%%",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benches/results/bench_scaling.json")
    parser.add_argument(
        "--from-runs",
        action="store_true",
        help="rewrite --out's rows and goals from the runs it holds (no job runs)",
    )
    parser.add_argument(
        "--timeline",
        type=Path,
        help="write the engine's timeline of every tiacc row of the last round here "
        "(TIACC_TRAINING_TIMELINE) and keep its per-step summary in the run",
    )
    args = parser.parse_args(argv)
    if args.model is not None:
        args.models = [args.model]
    return args


def model_setup(model: str, args: argparse.Namespace) -> dict:
    """What one model's rows train: description, batch, optimizer, loss, gradient sizes."""
    batch = batch_of(model, args)
    module, _, description = build_model(model, batch, image_size=args.image_size)
    setup = {"description": description, "batch_per_rank": batch}
    if model in VISION_MODELS:
        setup["image_size"] = args.image_size
        setup["loss"] = "mean(output^2) on random images"
    else:
        setup["loss"] = "next-token cross-entropy on random token ids (fixed seed)"
    setup["optimizer"] = OPTIMIZER_TEXT[OPTIMIZER.get(model, "sgd")]
    return {**setup, **model_stats(module)}


def setup_of(args: argparse.Namespace, rates: list[float], chosen: list[Row]) -> dict:
    """The run's setup: per model, then what every model shares."""
    return {
        "models": {model: model_setup(model, args) for model in args.models},
        "rows": [row.label for row in chosen],
        "nodes": 2,
        "ranks_per_node": WORLD // 2,
        "rates_mbit_each_way": rates,
        "unshaped_rate": "0 = the veth pair unshaped",
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "device": args.device,
        "native": "gloo" if args.device == "cpu" else "NCCL",
        "efficiency": "compute floor's median step / the row's (the same 4 ranks with "
        "no gradient exchange), and one rank alone's / the row's",
        "bound": "max(compute floor's median step, compute floor's median forward + the row's "
        "bytes per step one way (the larger of rank 0's node's sent and received) * 8 / rate); "
        "the compute floor on the unshaped link; efficiency_vs_bound = bound / median step",
        "goals": [
            {
                "goal": name,
                "row": label,
                "metric": metric,
                "minimum": minimum,
                "rates_mbit": "every rate" if rates_of is None else list(rates_of),
            }
            for name, label, metric, minimum, rates_of in GOALS
        ]
        + [
            {"goal": name, "model": model, "rate_mbit": rate, "minimum": minimum}
            for (name, model, rate), minimum in GOAL_OVERRIDES.items()
        ],
    }


def write(
    out: Path,
    result: dict,
    runs: list[dict],
    args: argparse.Namespace,
    rates: list[float],
    chosen: list[Row],
) -> list[dict]:
    """Writes the runs so far and what they sum up to (after each run: a cut-off run keeps them).

    A model's lines appear once both its references have run.
    """
    nominal = {row.label: row.nominal_one_way for row in chosen}
    lines = []
    for model in args.models:
        own = [r for r in runs if r["model"] == model]
        done = {r["pipeline"] for r in own}
        if all(label in done for label in REFERENCES):
            lines += summarize(own, batch_of(model, args), nominal)
    result["rows"] = lines
    result["goals"] = goals(lines, args.models, rates) if lines else None
    result["runs"] = runs
    write_json(out, result)
    return lines


def sweep(
    args: argparse.Namespace, rates: list[float], chosen: list[Row], result: dict
) -> list[dict]:
    """Every round: each rate's cluster, every model's rows on it (references on the first)."""
    runs: list[dict] = []
    started = time.monotonic()
    for round_index in range(args.rounds):
        print(f"round {round_index + 1} of {args.rounds}", flush=True)
        for rate in rates:
            with cluster(rate) as nodes:
                if rate == rates[0]:
                    for model in args.models:
                        for label in REFERENCES:
                            run = run_reference(nodes, model, label, args)
                            runs.append({**run, "round": round_index})
                for model in args.models:
                    for row in chosen:
                        timeline = None
                        if args.timeline and row.mode == "tiacc" and round_index == args.rounds - 1:
                            args.timeline.mkdir(parents=True, exist_ok=True)
                            slug = "".join(c if c.isalnum() else "-" for c in row.label)
                            timeline = args.timeline / f"{model}-{rate:g}-{slug}"
                        run = run_row(nodes, model, row, rate, args, timeline)
                        runs.append({**run, "round": round_index})
                        result["seconds"] = round(time.monotonic() - started)
                        write(args.out, result, runs, args, rates, chosen)
    return write(args.out, result, runs, args, rates, chosen)


def print_tables(lines: list[dict], models: list[str], summary: dict | None) -> None:
    """Per model: row, rate, median, bound, efficiency against it, speed over native; then goals."""
    for model in models:
        own = [x for x in lines if x["model"] == model]
        if not own:
            continue
        print(f"\n{model}")
        print(
            f"{'row':<38} {'rate':>6} {'median ms':>10} {'fwd ms':>7} {'bound ms':>9} "
            f"{'by':>5} {'eff/bound':>9} {'x native':>8}"
        )
        for line in own:
            rate = "-" if line["rate_mbit"] is None else f"{line['rate_mbit']:g}"
            bound = line.get("bound_ms")
            eff = line.get("efficiency_vs_bound")
            speed = line.get("speed_over_native")
            print(
                f"{line['pipeline']:<38} {rate:>6} {line['median_ms']:>10.1f} "
                f"{line['forward_ms']:>7.1f} "
                f"{'-' if bound is None else f'{bound:.1f}':>9} {line.get('bound_by', '-'):>5} "
                f"{'-' if eff is None else f'{eff:.2f}':>9} "
                f"{'-' if speed is None else f'{speed:.2f}x':>8}"
            )
    over = [x for x in lines if (x.get("efficiency_vs_bound") or 0) > OVER_BOUND]
    if over:
        print(
            f"\n{len(over)} line(s) ran faster than their bound: the compute floor was measured "
            "slower than it can be (a busy machine, or too few steps)"
        )
    if summary:
        print(f"\ngoals met: {summary['met']}")
        for text in summary["missed"]:
            print(f"  missed: {text}")


def main() -> None:
    args = parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_scaling.py needs root (network namespaces and tc)")
    if args.device == "cuda" and cuda_unavailable():
        sys.exit(f"bench_scaling.py --device cuda: {cuda_unavailable()}")
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    chosen = chosen_rows(args.only, args.all_rows)
    if args.from_runs:
        # Only the summary, again, from the runs a sweep kept (no job runs).
        result = json.loads(args.out.read_text())
        args.models = list(result["setup"]["models"])
        rates = result["setup"]["rates_mbit_each_way"]
        chosen = [r for r in rows() if r.label in result["setup"]["rows"]]
        lines = write(args.out, result, result["runs"], args, rates, chosen)
        print_tables(lines, args.models, result.get("goals"))
        print(f"rewrote {args.out}")
        return
    result = {
        "benchmark": "bench_scaling",
        "setup": setup_of(args, rates, chosen),
        "machine": machine_info(["torch", "torchvision", "tiacc-training"]),
    }
    lines = sweep(args, rates, chosen, result)
    print_tables(lines, args.models, result.get("goals"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

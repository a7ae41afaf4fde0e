"""DDP step time against its floor on an emulated 2-node x 2-rank cluster.

Two network namespaces joined by a veth link limited to --rate-mbit each way
(tools/netns_cluster.py); ranks 0-1 on node 0, ranks 2-3 on node 1. Three
models (``--models``; built by ``_ddp_bench_worker.build_model``), batch 16,
plain SGD:

- ``mlp``: 4 x Linear(1024, 1024) + ReLU, 16.8 MB of float32 gradients in
  equal layers;
- ``dominant``: a small conv stem on 32x32 images and an uneven Linear
  stack, 19.5 MB, one Linear(1024, 3072) holding 65% of it (few, large
  buckets);
- ``tiny``: 60 residual blocks of LayerNorm(24) + Linear(24, 24) behind a
  Linear(1024, 1024), 4.5 MB in 246 tensors of which 243 are under 4 KB
  (the cost per parameter and per bucket).

Rows per model, each a separate 4-rank job:

- ``compute floor (no DDP)``: the same 4 processes, model and batch with no
  DDP and no gradient communication (a gloo group exists only for the
  barriers around the timed steps); its median step is the model's compute
  floor;
- ``DDP without communication``: native DDP whose hook returns each bucket
  as it is: DDP's own cost per step (bucket copies, hook calls, allocating
  the gradients anew each step), under which no engine behind DDP's hook
  can go; ``..., gradient_as_bucket_view`` is the same with the gradients
  kept in the buckets (DDP's option, off by default). Both floors run once
  more at the end of the model's rows and pool their steps, so that they
  span the same stretch of time as the rows they are the floors of;
- ``native DDP (gloo)`` and ``torch fp16_compress_hook``;
- ``tiacc ring`` (TIACC_TRAINING_ALGORITHM=flat), ``tiacc 2D``
  (LIGHT_2D_ALLREDUCE=1), ``tiacc 2D + fp16`` (with
  TIACC_TRAINING_COMPRESSION=fp16), ``tiacc Top-K 1%``
  (LIGHT_TOPK_ALLREDUCE=1 LIGHT_TOPK_RATIO=0.01 on the flat ring),
  ``tiacc 2D + Top-K 1%``, and ``tiacc auto`` (TIACC_TRAINING_ALGORITHM=auto
  and nothing else); no tiacc row sets the fusion threshold or the channel
  count, so the engine's defaults apply. ``--channels 1,2,4`` adds flat-ring
  rows with TIACC_TRAINING_NUM_NCCL_STREAMS forced to each count (off by
  default);
- ``loopback gloo`` and ``loopback tiacc default``: all 4 ranks in one
  namespace (ranks_per_node=4, nothing crosses the shaped link), native DDP
  against tiacc with no setting at all, reported as tiacc's speed over
  gloo's (gloo median / tiacc median); ``loopback tiacc over TCP``
  (TIACC_TRAINING_SHM=0); ``loopback gloo`` and ``loopback tiacc default``
  again with ``gradient_as_bucket_view=True``. Gloo's median over DDP's
  floor is the most any engine can gain over gloo on one node.

Columns: median step (ms); the link bound (ms), the time the shaped link
needs for the bytes the algorithm must send each way: link crossings per
gradient byte x gradient bytes / link byte rate, with 1.5 crossings for a
ring over 2 x 2 ranks (2(p-1)/p: native gloo and tiacc ring), 1.0 for 2D,
halved by fp16 (torch's hook 0.75, 2D + fp16 0.5), and 1.0 for auto (the
best dense algorithm without compression); Top-K's traffic depends on the
data, so its bound is the measured link bytes per step in one direction /
link byte rate, which unlike the dense bounds includes the Ethernet, IP and
TCP headers (about 4.6%); loopback rows have no link (bound 0). The floor
is compute floor + link bound, and ratio = median / floor. The floor adds
the two as if communication could not overlap computation, so a ratio
under 1.0 means the pipeline overlapped them. The DDP floor is DDP without
communication (with the row's own ``gradient_as_bucket_view``, which the
worker reports) + link bound, and ``ratio_to_ddp_floor`` = median / DDP
floor: what the engine adds over DDP itself and the link. Also kept: native/this (the
native row's median over this one), the bytes that crossed the link per
step per rank (rank 0 reads its node's link counters around the timed
steps; the link is shared by the 4 ranks), the packets the shapers dropped,
and, for tiacc rows, ``auto_choice``: rank 0's stderr lines starting with
"tiacc-training: auto" (or "tiacc_training: auto", the logger's name),
where the engine logs the algorithm its auto mode picked. Needs root.

``--only`` takes comma-separated label substrings; the compute floor, DDP
floor and native rows always run (they are the references); ``--skip``
leaves out the rows whose label holds one of its parts. ``--rounds N``
runs every row N times, one round after the other, and pools the steps.
The full run:

    python benches/bench_ddp.py && python benches/plot_ddp.py

Writes benches/results/bench_ddp.json (one file, every model, with a
``setup`` block describing the models; plot: benches/plot_ddp.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster_jobs import AUTO_PREFIXES, run_job  # noqa: E402
from _ddp_bench_worker import MODELS, build_model, model_stats  # noqa: E402
from _machine import REPO, machine_info, write_results  # noqa: E402
from netns_cluster import cluster  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_ddp_bench_worker.py"
WORLD = 4
COMPUTE_FLOOR = "compute floor (no DDP)"
NATIVE = "native DDP (gloo)"
LOOPBACK_GLOO = "loopback gloo (1 node x 4)"
LOOPBACK_TIACC = "loopback tiacc default (1 node x 4)"
LOOPBACK_TIACC_TCP = "loopback tiacc over TCP, no shared memory (1 node x 4)"
DDP_FLOOR = "DDP without communication"
GRAD_VIEW = ", gradient_as_bucket_view"
REFERENCES = (COMPUTE_FLOOR, DDP_FLOOR, NATIVE)


@dataclass(frozen=True)
class Pipeline:
    """One measured configuration."""

    label: str
    mode: str  # "none" (compute floor), "native" or "tiacc"
    env: tuple[tuple[str, str], ...] = ()
    hook: str = "none"
    # Link crossings per gradient byte (1.5 ring, 1.0 2D; halved by fp16);
    # None where the traffic depends on the data (Top-K): the measured bytes.
    bound_factor: float | None = None
    # All 4 ranks on one node: no shaped link between them.
    loopback: bool = False
    # DDP(gradient_as_bucket_view=True): no copy of the gradients into the
    # buckets and back (DDP's default is False, and tiacc keeps it).
    grad_view: bool = False

    @property
    def floor(self) -> bool:
        """A floor row: no DDP at all, or DDP with no communication."""
        return self.mode == "none" or self.hook == "noop"


def pipelines(channels: list[int]) -> list[Pipeline]:
    """Every configuration of one model, the two references first."""
    flat = ("TIACC_TRAINING_ALGORITHM", "flat")
    fp16 = ("TIACC_TRAINING_COMPRESSION", "fp16")
    two_d = ("LIGHT_2D_ALLREDUCE", "1")
    topk = (("LIGHT_TOPK_ALLREDUCE", "1"), ("LIGHT_TOPK_RATIO", "0.01"))
    runs = [
        Pipeline(COMPUTE_FLOOR, "none", bound_factor=0.0),
        Pipeline(DDP_FLOOR, "native", hook="noop", bound_factor=0.0),
        Pipeline(NATIVE, "native", bound_factor=1.5),
        Pipeline("torch fp16_compress_hook", "native", hook="fp16", bound_factor=0.75),
        Pipeline("tiacc ring", "tiacc", (flat,), bound_factor=1.5),
    ]
    runs += [
        Pipeline(
            f"tiacc ring, {c} channel{'s' if c > 1 else ''}",
            "tiacc",
            (flat, ("TIACC_TRAINING_NUM_NCCL_STREAMS", str(c))),
            bound_factor=1.5,
        )
        for c in channels
    ]
    runs += [
        Pipeline("tiacc 2D", "tiacc", (two_d,), bound_factor=1.0),
        Pipeline("tiacc 2D + fp16", "tiacc", (two_d, fp16), bound_factor=0.5),
        Pipeline("tiacc Top-K 1%", "tiacc", (flat, *topk)),
        Pipeline("tiacc 2D + Top-K 1%", "tiacc", (two_d, *topk)),
        Pipeline("tiacc auto", "tiacc", (("TIACC_TRAINING_ALGORITHM", "auto"),), bound_factor=1.0),
        Pipeline(LOOPBACK_GLOO, "native", bound_factor=0.0, loopback=True),
        Pipeline(LOOPBACK_TIACC, "tiacc", bound_factor=0.0, loopback=True),
        Pipeline(
            LOOPBACK_TIACC_TCP,
            "tiacc",
            (("TIACC_TRAINING_SHM", "0"),),
            bound_factor=0.0,
            loopback=True,
        ),
        Pipeline(DDP_FLOOR + GRAD_VIEW, "native", hook="noop", bound_factor=0.0, grad_view=True),
        *(
            Pipeline(label + GRAD_VIEW, mode, bound_factor=0.0, loopback=True, grad_view=True)
            for label, mode in ((LOOPBACK_GLOO, "native"), (LOOPBACK_TIACC, "tiacc"))
        ),
    ]
    return runs


def _parts(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


def selected(runs: list[Pipeline], only: str, skip: str = "") -> list[Pipeline]:
    """The references plus the runs whose label holds one of ``only``'s parts
    (every run when ``only`` is empty) and none of ``skip``'s."""
    wanted, unwanted = _parts(only), _parts(skip)
    chosen = [
        r
        for r in runs
        if r.label in REFERENCES
        or (
            (not wanted or any(w in r.label for w in wanted))
            and not any(w in r.label for w in unwanted)
        )
    ]
    if any(r.grad_view for r in chosen):
        chosen += [r for r in runs if r.floor and r.grad_view and r not in chosen]
    return chosen


def finish_rows(rows: list[dict], runs: list[Pipeline], link_rate: float) -> dict:
    """Adds the median, bound, floor and ratios to one model's rows."""
    by_label = {row["pipeline"]: row for row in rows}
    for row in rows:
        row["median_ms"] = round(statistics.median(row["step_s"]) * 1000, 1)
    compute_ms = by_label[COMPUTE_FLOOR]["median_ms"]
    native_ms = by_label[NATIVE]["median_ms"]
    ddp_ms = {False: by_label[DDP_FLOOR]["median_ms"]}
    if DDP_FLOOR + GRAD_VIEW in by_label:
        ddp_ms[True] = by_label[DDP_FLOOR + GRAD_VIEW]["median_ms"]
    for run, row in zip(runs, rows):
        if run.bound_factor is None:
            # Sent plus received at node 0's end: one direction is half.
            bound_s = row["link_bytes_per_step"] / 2 / link_rate
            row["bound_source"] = "measured link bytes per step, one direction"
        else:
            bound_s = run.bound_factor * row["grad_bytes"] / link_rate
            row["bound_source"] = f"{run.bound_factor:g} x gradient bytes"
        row["link_bound_ms"] = round(bound_s * 1000, 1)
        row["floor_ms"] = round(compute_ms + bound_s * 1000, 1)
        row["ratio_to_floor"] = round(row["median_ms"] / row["floor_ms"], 3)
        if run.mode != "none":
            # Under DDP's own floor: what an engine behind DDP's hook can reach.
            # The floor of the same DDP setting (the worker reports it).
            view = bool(row.get("gradient_as_bucket_view"))
            ddp_floor = ddp_ms[view] + bound_s * 1000
            row["ddp_floor_ms"] = round(ddp_floor, 1)
            row["ratio_to_ddp_floor"] = round(row["median_ms"] / ddp_floor, 3)
        row["native_over_this"] = (
            None if run.loopback or run.floor else round(native_ms / row["median_ms"], 3)
        )
        row["link_bytes_per_step_per_rank"] = round(row["link_bytes_per_step"] / WORLD)

    def over(numerator: str, denominator: str) -> float | None:
        if numerator in by_label and denominator in by_label:
            return round(by_label[numerator]["median_ms"] / by_label[denominator]["median_ms"], 3)
        return None

    return {
        "compute_floor_ms": compute_ms,
        "ddp_floor_ms": ddp_ms[False],
        "ddp_floor_grad_view_ms": ddp_ms.get(True),
        "loopback_tiacc_speed_over_gloo": over(LOOPBACK_GLOO, LOOPBACK_TIACC),
        "loopback_most_any_engine_gains_over_gloo": over(LOOPBACK_GLOO, DDP_FLOOR),
        "loopback_grad_view_tiacc_speed_over_gloo": over(
            LOOPBACK_GLOO + GRAD_VIEW, LOOPBACK_TIACC + GRAD_VIEW
        ),
        "loopback_grad_view_tiacc_speed_over_plain_gloo": over(
            LOOPBACK_GLOO, LOOPBACK_TIACC + GRAD_VIEW
        ),
        "rows": rows,
    }


def run_row(nodes: list, name: str, run: Pipeline, args: argparse.Namespace) -> dict:
    """One 4-rank job of one row; rank 0's result with the row's description."""
    worker_args = ["--mode", run.mode, "--model", name, "--hook", run.hook]
    worker_args += ["--batch", str(args.batch)]
    worker_args += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if run.grad_view:
        worker_args.append("--grad-view")
    result = run_job(
        nodes[:1] if run.loopback else nodes,
        WORKER,
        worker_args,
        dict(run.env),
        ranks_per_node=WORLD if run.loopback else WORLD // len(nodes),
        stderr_prefixes=AUTO_PREFIXES if run.mode == "tiacc" else (),
    )
    auto_lines = result.pop("rank0_stderr_lines", [])
    row = {"pipeline": run.label, "mode": run.mode, "env": dict(run.env), "hook": run.hook}
    row["nodes"] = 1 if run.loopback else len(nodes)
    row.update(result)
    if auto_lines:
        row["auto_choice"] = "; ".join(auto_lines)
    median = statistics.median(result["step_s"]) * 1000
    print(f"  {name}: {run.label}: {median:.0f} ms", flush=True)
    return row


def pool(parts: tuple[dict, ...]) -> dict:
    """One row from its rounds: every step pooled, the link counters summed or averaged."""
    row = dict(parts[0])
    row["step_s"] = [t for part in parts for t in part["step_s"]]
    row["round_medians_ms"] = [round(statistics.median(p["step_s"]) * 1000, 1) for p in parts]
    row["link_bytes_per_step"] = statistics.fmean(p["link_bytes_per_step"] for p in parts)
    row["rank0_cpu_s_per_step"] = statistics.fmean(p["rank0_cpu_s_per_step"] for p in parts)
    row["link_sent_bytes"] = sum(p["link_sent_bytes"] for p in parts)
    row["link_dropped_packets"] = sum(p["link_dropped_packets"] for p in parts)
    return row


def print_table(name: str, model: dict, rate_mbit: float) -> None:
    """One model's rows as a text table."""
    print(
        f"\n{name}: {model['setup']['grad_bytes'] / 1e6:.1f} MB of gradients, "
        f"compute floor {model['compute_floor_ms']:.1f} ms, DDP floor "
        f"{model['ddp_floor_ms']:.1f} ms, link {rate_mbit:g} Mbit/s each way"
    )
    print(
        f"{'pipeline':<36} {'median ms':>10} {'bound ms':>9} {'floor ms':>9} {'ratio':>6} "
        f"{'DDP floor':>10} {'ratio':>6} {'native/this':>12} {'MB/step/rank':>13} {'drops':>6}"
    )
    for row in model["rows"]:
        native = row["native_over_this"]
        native_text = "-" if native is None else f"{native:.2f}x"
        ddp_floor, ddp_ratio = row.get("ddp_floor_ms"), row.get("ratio_to_ddp_floor")
        ddp_text = "-" if ddp_floor is None else f"{ddp_floor:.1f}"
        ratio_text = "-" if ddp_ratio is None else f"{ddp_ratio:.2f}"
        print(
            f"{row['pipeline'][:36]:<36} {row['median_ms']:>10.1f} {row['link_bound_ms']:>9.1f} "
            f"{row['floor_ms']:>9.1f} {row['ratio_to_floor']:>6.2f} {ddp_text:>10} "
            f"{ratio_text:>6} {native_text:>12} "
            f"{row['link_bytes_per_step_per_rank'] / 1e6:>13.3f} {row['link_dropped_packets']:>6}"
        )
    for row in model["rows"]:
        if row.get("auto_choice"):
            print(f"  {row['pipeline']}: {row['auto_choice']}")
    for key, text in (
        ("loopback_tiacc_speed_over_gloo", "tiacc speed / gloo speed"),
        ("loopback_most_any_engine_gains_over_gloo", "gloo / DDP without communication"),
        ("loopback_grad_view_tiacc_speed_over_gloo", "both with gradient_as_bucket_view"),
        ("loopback_grad_view_tiacc_speed_over_plain_gloo", "tiacc with the view / plain gloo"),
    ):
        if model.get(key) is not None:
            print(f"  loopback: {text} = {model[key]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS)
    )
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument(
        "--channels", default="", help="channel counts for extra flat-ring rows (none by default)"
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every row this many times, one round after the other, and pool the steps",
    )
    parser.add_argument(
        "--only", default="", help="comma-separated label substrings: run only matching rows"
    )
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated label substrings: leave out matching rows (not the references)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benches/results/bench_ddp.json")
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        parser.error(f"--models: unknown {unknown}; expected some of {', '.join(MODELS)}")
    if os.geteuid() != 0:
        sys.exit("bench_ddp.py needs root (network namespaces and tc)")

    channels = [int(c) for c in args.channels.split(",") if c.strip()]
    runs = selected(pipelines(channels), args.only, args.skip)
    link_rate = args.rate_mbit * 1e6 / 8
    setups = {}
    for name in models:
        module, _, description = build_model(name, args.batch)
        setups[name] = {"description": description, "batch": args.batch, **model_stats(module)}
    results = {}
    with cluster(args.rate_mbit) as nodes:
        for name in models:
            # Rounds interleave the rows in time, so a slow spell of the
            # machine lands on every row instead of on one.
            rounds: list[list[dict]] = [
                [run_row(nodes, name, run, args) for run in runs] for _ in range(args.rounds)
            ]
            # The floors run once more at the end, so their medians span
            # the whole model's run like the rows they are the floors of.
            closing = {i: run_row(nodes, name, r, args) for i, r in enumerate(runs) if r.floor}
            rows = [
                pool(parts + ((closing[i],) if i in closing else ()))
                for i, parts in enumerate(zip(*rounds))
            ]
            results[name] = {"setup": setups[name], **finish_rows(rows, runs, link_rate)}

    for name, model in results.items():
        print_table(name, model, args.rate_mbit)
    out = {
        "benchmark": "bench_ddp",
        "setup": {
            "nodes": 2,
            "ranks_per_node": WORLD // 2,
            "loopback_rows": "1 node x 4 ranks in one namespace",
            "rate_mbit_each_way": args.rate_mbit,
            "link_bytes_per_s_each_way": link_rate,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "optimizer": "SGD lr 1e-3, loss = mean(output^2)",
            "tiacc_defaults": "fusion threshold and channel count left to the engine",
            "channels_rows": channels,
            "only": args.only,
            "skip": args.skip,
            "models": setups,
            "floor": "compute floor (no-DDP median) + link bound; ratio = median / floor",
            "ddp_floor": "DDP without communication (median) + link bound; "
            "ratio_to_ddp_floor = median / DDP floor",
        },
        "models": {
            name: {k: v for k, v in m.items() if k != "setup"} for name, m in results.items()
        },
        "machine": machine_info(["torch", "tiacc-training"]),
    }
    write_results(args.out, out)


if __name__ == "__main__":
    main()

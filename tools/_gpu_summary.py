"""The GPU check's ``summary.md``: a pure function of the output folder.

Stages (``stages.json``), versions, test counts (JUnit XML, else the
per-test outcomes a cut-off stage leaves) and each goal against the
benchmark JSON there.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _gpu_stages import (
    CPU_DECODE_WORKERS,
    GPU_DECODE_FEEDS,
    GPU_DECODE_THREADS,
    INPUT_WORKERS,
    JUNIT,
    PLAN,
    STAGES,
)


@dataclass
class Goal:
    """One benchmark goal and what was measured for it."""

    name: str
    target: str
    measured: str
    met: bool | None  # None: not measured (``measured`` says why)


def render_summary(out: Path) -> str:
    """``summary.md`` from what ``out`` holds (stages, versions, JUnit, JSON)."""
    stages = _load(out / "stages.json") or {}
    versions = _load(out / "versions.json") or {}
    counted = {stage: test_counts(out, stage) for stage in JUNIT}
    tests = counted["tests"] or counted["gpu-tests"]
    lines = ["# GPU check", ""]
    gpu = versions.get("gpu")
    lines += [
        f"- GPU: {', '.join(gpu) if isinstance(gpu, list) else gpu or 'unknown'}",
        f"- driver: {versions.get('gpu_driver') or 'unknown'}",
        f"- CUDA: {versions.get('cuda') or 'unknown'}; torch {versions.get('torch') or '?'}",
        f"- NCCL: torch's {versions.get('nccl') or 'unknown'}; "
        f"the engine's {versions.get('engine_nccl') or 'unknown'}",
        "",
        "## Stages",
        "",
        "| stage | result | seconds | GPU memory peak | GPU processes at start |",
        "| --- | --- | --- | --- | --- |",
    ]
    for stage in STAGES:
        record = stages.get(stage)
        if record is not None:
            peak, total = record.get("gpu_memory_peak_mib"), record.get("gpu_memory_total_mib")
            memory = "-" if peak is None else f"{peak} of {total} MiB"
            processes = record.get("gpu_processes_at_start")
            lines.append(
                f"| {stage} | {record['status']} | {record['seconds']} | {memory} | "
                f"{'-' if processes is None else processes} |"
            )
        elif stage in PLAN:
            lines.append(f"| {stage} | not run | - | - | - |")
    lines += ["", "## Tests", ""]
    if not any(counted.values()):
        lines.append("No JUnit XML and no per-test outcomes (no test stage ran).")
    for stage, found in counted.items():
        if found is None:
            continue
        source = (
            "JUnit XML"
            if found["complete"]
            else "per-test outcomes; the stage did not finish, so tests may be missing"
        )
        lines += [
            f"`{stage}` ({source}): {found['tests']} tests: {found['passed']} passed, "
            f"{found['failed']} failed, {found['errors']} errors, {found['skipped']} skipped."
        ]
        for title, key in (("Failed", "failures"), ("Skipped", "skips")):
            if found[key]:
                lines += ["", f"{title}:", ""]
                lines += [f"- `{name}`: {reason}" for name, reason in found[key]]
        lines.append("")
    lines += ["", "## Goals", "", "| goal | target | measured | met |", "| --- | --- | --- | --- |"]
    for goal in evaluate_goals(out, tests):
        met = "not measured" if goal.met is None else ("yes" if goal.met else "**no**")
        lines.append(f"| {goal.name} | {goal.target} | {goal.measured} | {met} |")
    return "\n".join(lines) + "\n"


def test_counts(out: Path, stage: str) -> dict[str, Any] | None:
    """A test stage's counts: its JUnit XMLs, else its per-test outcomes (cut off).

    The sum of the stage's JUnit XMLs when each is there; else the outcomes
    file, which every command of the stage appends to; else the XMLs there are.
    The failures are listed from the outcomes file where there is one: its
    lines carry the error lines that say why, besides the first.
    """
    junits = [junit_counts(out / name) for name in JUNIT[stage]]
    found = [counts for counts in junits if counts is not None]
    outcomes = outcome_counts(out / f"outcomes-{stage}.jsonl")
    if found and len(found) == len(junits):
        complete = _sum_counts(found)
        if outcomes is not None:
            complete["failures"] = outcomes["failures"]
        return {**complete, "complete": True}
    if outcomes is not None:
        return {**outcomes, "complete": False}
    return {**_sum_counts(found), "complete": False} if found else None


def _sum_counts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts and listed tests of several parts, added up (numbers add, lists join)."""
    return {key: sum((part[key] for part in parts[1:]), parts[0][key]) for key in parts[0]}


def outcome_counts(path: Path) -> dict[str, Any] | None:
    """Counts and the failed/skipped tests of an outcomes file (``TIACC_TEST_OUTCOMES``)."""
    if not path.exists():
        return None
    counts: dict[str, Any] = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    counts["failures"], counts["skips"] = [], []
    for text in path.read_text().splitlines():
        try:
            line = json.loads(text)
        except ValueError:  # the last line of a run killed mid-write
            continue
        counts["tests"] += 1
        outcome = line.get("outcome")
        key, listed = {
            "failed": ("failed", "failures"),
            "error": ("errors", "failures"),
            "skipped": ("skipped", "skips"),
        }.get(outcome, (None, None))
        if key is not None:
            counts[key] += 1
            counts[listed].append((line.get("test", "?"), _reason(line)))
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts


def _reason(line: dict[str, Any]) -> str:
    """An outcome's first line, then the error lines that say more (a rank's, a case's)."""
    first = line.get("first_line") or ""
    more = [x for x in line.get("error_lines") or [] if x and x not in first]
    return " / ".join([first, *more] if first else more) or "(no reason)"


def junit_counts(path: Path) -> dict[str, Any] | None:
    """Counts and the failed/skipped tests (with reasons) of a JUnit XML."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    counts: dict[str, Any] = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    counts["failures"], counts["skips"] = [], []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        for tag, key, listed in (
            ("failure", "failed", "failures"),
            ("error", "errors", "failures"),
            ("skipped", "skipped", "skips"),
        ):
            element = case.find(tag)
            if element is not None:
                counts[key] += 1
                reason = (element.get("message") or element.text or "").strip().splitlines()
                counts[listed].append((name, reason[0][:200] if reason else "(no reason given)"))
                break
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts


def evaluate_goals(out: Path, tests: dict[str, Any] | None) -> list[Goal]:
    """Each goal of the GPU check against the folder's measurements."""
    goals = []
    nccl = _load(out / "bench_nccl.json") or {}
    one = _load(out / "bench_nccl_one.json") or {}
    if one.get("ddp"):  # the plan's world-of-one stage writes its own file
        nccl = {**nccl, "ddp": one["ddp"]}
    cluster = nccl.get("cluster") or {}
    rows = {row["pipeline"]: row for row in cluster.get("rows", [])}
    why = cluster.get("skipped") or ("bench_nccl.json has no cluster rows" if not rows else None)

    def speedup(label: str, minimum: float, over: str | None = None) -> None:
        name = f"2 x 2 cluster: {label}" + (f" vs {over}" if over else " vs native NCCL")
        target = f">= {minimum}x"
        row, base = rows.get(label), rows.get(over) if over else None
        if row is None or (over and base is None):
            goals.append(Goal(name, target, why or f"no row {over if row else label!r}", None))
            return
        ratio = base["median_ms"] / row["median_ms"] if base else row["native_over_this"]
        goals.append(Goal(name, target, f"{ratio:.2f}x", ratio >= minimum))

    grad = cluster.get("grad_bytes")
    goals.append(
        Goal(
            "2 x 2 cluster: gradients",
            ">= 100 MB",
            f"{grad / 1e6:.0f} MB" if grad else why or "not recorded",
            None if not grad else grad >= 100e6,
        )
    )
    speedup("tiacc 2D", 1.4)
    speedup("tiacc 2D + fp16", 2.7)
    speedup("tiacc 2D + fp16", 1.3, over="torch bf16_compress_hook")
    speedup("tiacc Top-K 1%", 10.0)
    goals.append(_auto_goal(rows, why))
    ddp = [row for row in nccl.get("ddp", []) if row.get("channels") is not None]
    if ddp:
        worst = max(row["overhead_vs_native"] for row in ddp)
        spread = max(row.get("spread_pct", 0.0) for row in nccl.get("ddp", []))
        goals.append(Goal("world of one: overhead over native DDP", "<= 1%",
                          f"{worst * 100:.1f}% (worst of {len(ddp)}; rounds spread up to "
                          f"{spread:.1f}%)", worst <= 0.01))  # fmt: skip
    else:
        goals.append(Goal("world of one: overhead over native DDP", "<= 1%", "not run", None))
    goals += input_goals(_load(out / "bench_input.json"))
    goals += scaling_goals(_load(out / "bench_scaling_cuda.json"))
    goals += fsdp_goals(_load(out / "bench_fsdp_cuda.json"))
    if tests is None:
        goals.append(Goal("suite with CUDA present", "0 failures", "not run", None))
    else:
        bad = tests["failed"] + tests["errors"]
        goals.append(
            Goal(
                "suite with CUDA present",
                "0 failures",
                f"{bad} failed of {tests['tests']} ({tests['skipped']} skipped, listed)",
                bad == 0,
            )
        )
    return goals


def scaling_goals(result: dict | None) -> list[Goal]:
    """ResNet-50 across link rates over NCCL (``bench_scaling.py --device cuda``)."""
    per_rate = ((result or {}).get("goals") or {}).get("per_rate") or []
    why = "not run" if result is None else "no rate finished"
    name = "scaling, ResNet-50: tiacc default vs native NCCL at every rate"
    if not per_rate:
        return [
            Goal(name, ">= 0.98x", why, None),
            Goal(_BOUND, ">= 90%", why, None),
            Goal(_REGIME, ">= 1.7x", why, None),
        ]
    worst = min(per_rate, key=lambda g: g["auto_over_native"])
    goals = [
        Goal(
            name,
            ">= 0.98x",
            f"{worst['auto_over_native']:.2f}x (worst, at {worst['rate_mbit']:g} Mbit/s)",
            worst["auto_over_native"] >= 0.98,
        )
    ]
    bounded = [g for g in per_rate if g.get("auto_efficiency_vs_bound") is not None]
    if not bounded:
        goals.append(Goal(_BOUND, ">= 90%", "no bound in the results", None))
    else:
        low = min(bounded, key=lambda g: g["auto_efficiency_vs_bound"])
        goals.append(
            Goal(
                _BOUND,
                ">= 90%",
                f"{low['auto_efficiency_vs_bound']:.0%} (worst, at {low['rate_mbit']:g} Mbit/s)",
                low["auto_efficiency_vs_bound"] >= 0.9,
            )
        )
    regime = [g for g in per_rate if 0.4 <= g["native_efficiency"] <= 0.6]
    fp16 = [g for g in regime if "two_d_fp16_over_native" in g]
    if not fp16:
        seen = ", ".join(f"{g['native_efficiency']:.0%}" for g in per_rate)
        goals.append(Goal(_REGIME, ">= 1.7x", f"no rate there (native: {seen})", None))
    else:
        best = max(g["two_d_fp16_over_native"] for g in fp16)
        goals.append(Goal(_REGIME, ">= 1.7x", f"{best:.2f}x", best >= 1.7))
    return goals


_REGIME = "scaling, ResNet-50: 2D + fp16 vs native where native scales 40-60%"
_BOUND = "scaling, ResNet-50: tiacc default against its bound (floor, or forward + link)"


def fsdp_goals(result: dict | None) -> list[Goal]:
    """FSDP2 on the 2 x 2 cluster over NCCL (``bench_fsdp.py --device cuda``)."""
    layout = ((result or {}).get("layouts") or {}).get("link2x2") or {}
    speedups = layout.get("speedup_over_native") or {}
    goals = []
    for row, label, minimum in (
        ("tiacc 2d", "tiacc 2D (exact)", 1.3),
        ("tiacc 2d + bf16", "tiacc 2D, reduce-scatters bf16 between nodes", 2.0),
    ):
        name, target = f"FSDP2 on 2 x 2: {label} vs native NCCL", f">= {minimum}x"
        ratio = speedups.get(row)
        if ratio is None:
            why = "not run" if result is None else f"bench_fsdp_cuda.json has no row {row!r}"
            goals.append(Goal(name, target, why, None))
        else:
            goals.append(Goal(name, target, f"{ratio:.2f}x", ratio >= minimum))
    return goals


def input_goals(result: dict | None) -> list[Goal]:
    """ResNet-50 fed by each loader (``bench_input.py --train``).

    The shares of the GPU-bound rate (CPU decode on 15 threads, GPU decode
    on 4), GPU decode against stock ``ImageFolder`` with as few workers,
    the default GPU decoder against nvImageCodec in training, the backend
    each GPU decoder's rows name, and GPU decode alone. nvImageCodec's own
    rows appear only where it ran.
    """
    training = (result or {}).get("training") or {}
    threads, few = GPU_DECODE_THREADS, INPUT_WORKERS[0]

    def row(feed: str, workers: int) -> dict | None:
        return _input_row(training, feed, workers)

    def missing(feed: str, workers: int) -> str:
        if not training.get("rows"):
            return "not run"
        unit = "workers" if feed == "stock_imagefolder" else "threads"
        return f"no {feed} row with {workers} {unit}"

    goals = []
    for label, feed, workers in (
        (f"CPU decode, {CPU_DECODE_WORKERS} threads", "dropin", CPU_DECODE_WORKERS),
        (f"GPU decode, {threads} threads", "dropin_decode_device", threads),
        (f"GPU decode (nvImageCodec), {threads} threads", "dropin_nvimagecodec", threads),
    ):
        name, found = f"{label}: share of the GPU-bound rate", row(feed, workers)
        if found is None and feed == "dropin_nvimagecodec":
            continue  # not installed there: the rows above say what ran
        if found is None:
            goals.append(Goal(name, ">= 97%", missing(feed, workers), None))
        else:
            share = found["fraction_of_synthetic"]
            goals.append(Goal(name, ">= 97%", f"{share:.1%}", share >= 0.97))
    gpu, stock = row("dropin_decode_device", threads), row("stock_imagefolder", few)
    name = f"GPU decode, {threads} threads, vs stock ImageFolder with {few} workers"
    if gpu is None:
        goals.append(Goal(name, ">= 3.0x", missing("dropin_decode_device", threads), None))
    elif stock is None:
        goals.append(Goal(name, ">= 3.0x", missing("stock_imagefolder", few), None))
    else:
        ratio = gpu["images_per_s"] / stock["images_per_s"]
        goals.append(Goal(name, ">= 3.0x", f"{ratio:.2f}x", ratio >= 3.0))
    nv = row("dropin_nvimagecodec", threads)
    name = f"GPU decode in training, {threads} threads: the default decoder is the faster"
    target = ">= 1.00x the other"
    if gpu is None or nv is None:
        why = missing("dropin_decode_device", threads) if gpu is None else (
            "nvImageCodec did not run (not installed)")  # fmt: skip
        goals.append(Goal(name, target, why, None))
    else:
        ratio = gpu["images_per_s"] / nv["images_per_s"]
        goals.append(Goal(name, target, f"{ratio:.2f}x nvImageCodec's ({gpu['images_per_s']:.0f} "
                          f"vs {nv['images_per_s']:.0f} images/s)", ratio >= 1.0))  # fmt: skip
    goals.append(_backend_goal(training))
    for label, feed in (
        ("GPU decode alone, 224 px", "decode_device_alone"),
        ("GPU decode alone (nvImageCodec), 224 px", "nvimagecodec_alone"),
    ):
        alone = row(feed, threads)
        if alone is None and feed == "nvimagecodec_alone":
            continue  # not installed there: the row above says what ran
        goals.append(
            Goal(
                label,
                ">= 8000 images/s",
                "not run" if alone is None else f"{alone['images_per_s']:.0f} images/s",
                None if alone is None else alone["images_per_s"] >= 8000,
            )
        )
    return goals


def _backend_goal(training: dict) -> Goal:
    """Whether the GPU-decode rows name the backend that decoded, per decoder.

    The backend: the hardware JPEG engine, CUDA, ... (``bench_input.py``'s
    ``decoder_backends``, which also says how it knew).
    """
    name, target = "GPU decode: the backend that decoded is named", "every GPU decoder"
    named: dict[str, str | None] = {}
    for key, found in (training.get("rows") or {}).items():
        feed = found.get("feed", key)
        if feed in GPU_DECODE_FEEDS:
            named.setdefault(found.get("decoder") or GPU_DECODE_FEEDS[feed], found.get("backend"))
    if not named:
        return Goal(name, target, "no GPU-decode row" if training.get("rows") else "not run", None)
    if all(backend is None for backend in named.values()):
        return Goal(name, target, "not recorded (a bench_input.py from before)", None)
    measured = "; ".join(f"{decoder}: {backend or 'not recorded'}"
                         for decoder, backend in named.items())  # fmt: skip
    met = all(backend and not backend.startswith("unknown") for backend in named.values())
    return Goal(name, target, measured, met)


def _input_row(training: dict, feed: str, workers: int) -> dict | None:
    """``bench_input.json``'s training row of ``feed`` at ``workers`` workers or threads.

    Rows name their ``feed`` and ``workers``; in a file from before they did,
    each feed's row is named by it and ran at the part's ``workers`` (GPU
    decode on at most :data:`GPU_DECODE_THREADS`; its rows alone say theirs).
    """
    rows = training.get("rows") or {}
    for found in rows.values():
        if found.get("feed") == feed and found.get("workers") == workers:
            return found
    old = rows.get(feed)
    if old is None or "feed" in old:
        return None
    count = training.get("workers")
    if count and feed in GPU_DECODE_FEEDS:
        count = min(GPU_DECODE_THREADS, count)
    return old if old.get("workers", count) == workers else None


def _auto_goal(rows: dict[str, dict], why: str | None) -> Goal:
    """``TIACC_TRAINING_ALGORITHM=auto`` against the faster forced row.

    The faster of the flat and 2D rows is the one its start-up probe
    should have picked.
    """
    name, target = "2 x 2 cluster: tiacc auto vs the faster of flat and 2D", ">= 0.95x"
    auto, fixed = rows.get("tiacc auto"), [rows.get("tiacc flat"), rows.get("tiacc 2D")]
    if auto is None or None in fixed:
        return Goal(name, target, why or "no auto, flat or 2D row", None)
    best = min(row["median_ms"] for row in fixed if row is not None)
    ratio = best / auto["median_ms"]
    chose = re.search(r"auto: chose (\w+)", auto.get("auto_choice", ""))
    picked = f"picked {chose.group(1)}" if chose else "no auto line logged"
    return Goal(name, target, f"{ratio:.2f}x ({picked})", ratio >= 0.95)


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None

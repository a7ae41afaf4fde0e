"""Checks and measures the GPU path on a GPU machine without network access.

``make gpu-check`` runs this script with the machine's own Python (which
has torch, CUDA, pytest and pytest-xdist). It installs the abi3 wheel built
beforehand (``make wheel``) with ``--no-index``, plus the small wheels of
``make gpu-kit`` the machine lacks, then runs stages, each alone or all in
turn:

- ``tests``: the whole test suite with CUDA present, in parallel
  (pytest-xdist), with a JUnit XML;
- ``demo``: the end-to-end demo (``make demo-run``);
- ``nccl``: ``benches/bench_nccl.py`` (world-of-one overhead, the GPU
  codecs, the emulated 2 x 2 cluster);
- ``input``: ``benches/bench_input.py`` training ResNet-50 fed by CPU and
  by GPU decode.

Every log, the JUnit XML and the benchmark JSON go to one folder
(``--out``), with ``summary.md``: pass/fail counts, the skips with their
reasons, each goal against its measured value, and the GPU, driver, CUDA
and NCCL versions. The summary is rewritten after every stage from what the
folder holds, so stages run one by one add up to the same page.

``--nccl-library`` names an NCCL >= 2.30 to load (several ranks on one
GPU need it); without one, what the shipped NCCL cannot run skips with its
reason.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STAGES = ("tests", "demo", "nccl", "input")
# Small pure-Python wheels a GPU machine may lack (make gpu-kit fetches them):
# pytest-timeout honours the suite's per-test limit, pyroute2 builds the
# emulated cluster where iproute2 is missing.
KIT_PACKAGES = {"pytest_timeout": "pytest-timeout", "pyroute2": "pyroute2"}
# CPU decode threads for the input stage's CPU-decode row (the goal's 15).
CPU_DECODE_WORKERS = 15


@dataclass
class Goal:
    """One benchmark goal and what was measured for it."""

    name: str
    target: str
    measured: str
    met: bool | None  # None: not measured (``measured`` says why)


def main(argv: list[str] | None = None) -> int:
    """Runs the chosen stages; returns 0 when every stage passed."""
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stages = args.stage
    env = stage_environment(args.nccl_library, os.environ)
    if not args.dry_run:
        install(args, out)
        record_versions(args.python, env, out)
    failed = []
    for stage in stages:
        argv_list = stage_commands(stage, args.python, out, args.workers)
        if args.dry_run:
            for command in argv_list:
                print(f"{stage}: {shlex.join(command)}")
            continue
        if not run_stage(stage, argv_list, env, out, args.stage_timeout):
            failed.append(stage)
        (out / "summary.md").write_text(render_summary(out))
    if not args.dry_run:
        print(f"summary: {out / 'summary.md'}")
    if failed:
        print(f"failed stages: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--stage",
        default="all",
        type=_stages,
        help=f"'all' or a comma-separated list of {', '.join(STAGES)}",
    )
    p.add_argument("--out", type=Path, default=Path("gpu-check-out"))
    p.add_argument("--python", default=sys.executable, help="the Python to install into and run")
    p.add_argument("--wheel", type=Path, help="the abi3 wheel (default: newest in dist/)")
    p.add_argument("--kit", type=Path, default=REPO / ".gpu-kit", help="make gpu-kit's folder")
    p.add_argument("--nccl-library", default=os.environ.get("NCCL_LIBRARY") or None)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="pytest-xdist workers")
    p.add_argument("--stage-timeout", type=float, default=600.0, help="seconds per stage")
    p.add_argument("--dry-run", action="store_true", help="print the stages' commands only")
    return p.parse_args(argv)


def _stages(text: str) -> list[str]:
    if text.strip() in ("", "all"):
        return list(STAGES)
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown stage {', '.join(unknown)}: choose from all, {', '.join(STAGES)}"
        )
    return chosen


def stage_environment(nccl_library: str | None, base: dict[str, str]) -> dict[str, str]:
    """The environment of every stage: the given NCCL loaded by torch and the engine."""
    env = dict(base)
    env["PYTHONUNBUFFERED"] = "1"
    if nccl_library:
        library = str(Path(nccl_library).resolve())
        if not Path(library).is_file():
            raise SystemExit(f"NCCL_LIBRARY={nccl_library}: no such file")
        env["TIACC_TRAINING_NCCL_LIBRARY"] = library
        preload = env.get("LD_PRELOAD", "")
        env["LD_PRELOAD"] = f"{library}:{preload}" if preload else library
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    return env


def stage_commands(stage: str, python: str, out: Path, workers: int) -> list[list[str]]:
    """The commands of one stage, run from the repository root."""
    if stage == "tests":
        return [
            [python, "-m", "pytest", "tests", "-n", str(workers), "-ra",
             f"--junitxml={out / 'junit.xml'}"],
        ]  # fmt: skip
    if stage == "demo":
        return [["make", "demo-run", f"PY={python}", f"DEMO_DIR={out / 'demo-data'}"]]
    if stage == "nccl":
        return [[python, "benches/bench_nccl.py", "--out", str(out / "bench_nccl.json")]]
    if stage == "input":
        return [
            [python, "benches/bench_input.py", "--train", "--skip-loaders",
             "--train-workers", str(CPU_DECODE_WORKERS),
             "--workdir", str(out / "bench-input-data"), "--out", str(out / "bench_input.json")],
        ]  # fmt: skip
    raise ValueError(f"unknown stage {stage!r}")


def install(args: argparse.Namespace, out: Path) -> None:
    """Installs the wheel and the kit's missing wheels, with no index."""
    wheel = args.wheel or _newest_wheel()
    log = out / "install.log"
    commands = [
        [args.python, "-m", "pip", "install", "--no-index", "--no-deps", "--force-reinstall",
         str(wheel)],
    ]  # fmt: skip
    missing = [
        package for module, package in KIT_PACKAGES.items() if not _importable(args.python, module)
    ]
    wheels = args.kit / "wheels"
    if missing and wheels.is_dir():
        commands.append(
            [args.python, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
             *missing],
        )  # fmt: skip
    with log.open("w") as f:
        for command in commands:
            f.write(f"$ {shlex.join(command)}\n")
            f.flush()
            subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, check=True, cwd=REPO)
        if missing and not wheels.is_dir():
            f.write(f"not installed (no {wheels}: run make gpu-kit): {', '.join(missing)}\n")
    # The tests and scripts run from the source tree, which then imports
    # this same build rather than a missing one.
    engine = subprocess.run(
        [args.python, "-c", "import tiacc_training._engine as e; print(e.__file__)"],
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    target = REPO / "tiacc_training" / Path(engine).name
    if Path(engine).resolve() != target.resolve():
        shutil.copyfile(engine, target)


def _newest_wheel() -> Path:
    wheels = sorted(glob.glob(str(REPO / "dist" / "tiacc_training-*.whl")), key=os.path.getmtime)
    if not wheels:
        raise SystemExit("no wheel in dist/: run make wheel on a build machine first")
    return Path(wheels[-1])


def _importable(python: str, module: str) -> bool:
    probe = f"import importlib.util as u, sys; sys.exit(u.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def record_versions(python: str, env: dict[str, str], out: Path) -> None:
    """Writes ``versions.json``: GPU, driver, CUDA, torch's and the engine's NCCL."""
    probe = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(REPO / 'benches')!r})\n"
        "from _machine import gpu_info\n"
        "import torch\n"
        "info = gpu_info()\n"
        "info['torch'] = torch.__version__\n"
        "try:\n"
        "    from tiacc_training.torch.distributed import nccl_version\n"
        "    info['engine_nccl'] = '.'.join(map(str, nccl_version()))\n"
        "except Exception as e:\n"
        "    info['engine_nccl'] = f'none ({e})'\n"
        "print(json.dumps(info))\n"
    )
    result = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    info = json.loads(result.stdout) if result.returncode == 0 else {"error": result.stderr[-2000:]}
    (out / "versions.json").write_text(json.dumps(info, indent=2) + "\n")


def run_stage(
    stage: str, commands: list[list[str]], env: dict[str, str], out: Path, timeout: float
) -> bool:
    """Runs one stage's commands into ``<stage>.log``; records it in ``stages.json``."""
    start = time.monotonic()
    status = "passed"
    with (out / f"{stage}.log").open("w") as log:
        for command in commands:
            log.write(f"$ {shlex.join(command)}\n")
            log.flush()
            left = timeout - (time.monotonic() - start)
            try:
                code = subprocess.run(
                    command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=left
                ).returncode
            except subprocess.TimeoutExpired:
                status = f"timed out after {timeout:.0f} s"
                break
            if code != 0:
                status = f"failed (exit code {code})"
                break
    record = {"status": status, "seconds": round(time.monotonic() - start, 1)}
    stages_file = out / "stages.json"
    stages = json.loads(stages_file.read_text()) if stages_file.exists() else {}
    stages[stage] = record
    stages_file.write_text(json.dumps(stages, indent=2) + "\n")
    print(f"{stage}: {status} in {record['seconds']} s (log: {out / f'{stage}.log'})")
    return status == "passed"


# -- the summary: a pure function of the output folder ---------------------


def render_summary(out: Path) -> str:
    """``summary.md`` from what ``out`` holds (stages, versions, JUnit, JSON)."""
    stages = _load(out / "stages.json") or {}
    versions = _load(out / "versions.json") or {}
    tests = junit_counts(out / "junit.xml")
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
        "| stage | result | seconds |",
        "| --- | --- | --- |",
    ]
    for stage in STAGES:
        record = stages.get(stage)
        if record is None:
            lines.append(f"| {stage} | not run | - |")
        else:
            lines.append(f"| {stage} | {record['status']} | {record['seconds']} |")
    lines += ["", "## Tests", ""]
    if tests is None:
        lines.append("No JUnit XML (the tests stage did not run).")
    else:
        lines.append(
            f"{tests['tests']} tests: {tests['passed']} passed, {tests['failed']} failed, "
            f"{tests['errors']} errors, {tests['skipped']} skipped."
        )
        for title, key in (("Failed", "failures"), ("Skipped", "skips")):
            if tests[key]:
                lines += ["", f"{title}:", ""]
                lines += [f"- `{name}`: {reason}" for name, reason in tests[key]]
    lines += ["", "## Goals", "", "| goal | target | measured | met |", "| --- | --- | --- | --- |"]
    for goal in evaluate_goals(out, tests):
        met = "not measured" if goal.met is None else ("yes" if goal.met else "**no**")
        lines.append(f"| {goal.name} | {goal.target} | {goal.measured} | {met} |")
    return "\n".join(lines) + "\n"


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
        goals.append(Goal("world of one: overhead over native DDP", "<= 2%",
                          f"{worst * 100:.1f}% (worst of {len(ddp)})", worst <= 0.02))  # fmt: skip
    else:
        goals.append(Goal("world of one: overhead over native DDP", "<= 2%", "not run", None))
    training = (_load(out / "bench_input.json") or {}).get("training") or {}
    feeds = training.get("rows", {})
    for label, key, minimum in (
        (f"CPU decode, {CPU_DECODE_WORKERS} threads: share of the GPU-bound rate", "dropin", 0.97),
        ("GPU decode, <= 4 threads: share of the GPU-bound rate", "dropin_decode_device", 0.97),
    ):
        row = feeds.get(key)
        if row is None:
            goals.append(Goal(label, f">= {minimum:.0%}", "not run", None))
        else:
            share = row["fraction_of_synthetic"]
            goals.append(Goal(label, f">= {minimum:.0%}", f"{share:.1%}", share >= minimum))
    alone = feeds.get("decode_device_alone")
    goals.append(
        Goal(
            "GPU decode alone, 224 px",
            ">= 8000 images/s",
            "not run" if alone is None else f"{alone['images_per_s']:.0f} images/s",
            None if alone is None else alone["images_per_s"] >= 8000,
        )
    )
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


if __name__ == "__main__":
    sys.exit(main())

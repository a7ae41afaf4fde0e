"""Checks and measures the GPU path on a GPU machine without network access.

``make gpu-check`` runs this script with the machine's own Python (which
has torch, CUDA, pytest and pytest-xdist). It installs the abi3 wheel built
beforehand (``make wheel``) with ``--no-index``, plus the small wheels of
``make gpu-kit`` the machine lacks, then runs stages. The default plan fits
a short window on a GPU node (``--budget``, 420 s of stages):

- ``gpu-tests``: the tests marked ``gpu`` (every test that needs CUDA
  and NCCL), in parallel, with a JUnit XML; at most 180 s;
- ``one``: ``benches/bench_nccl.py --parts one``, 30 steps a row in 3
  interleaved rounds (the world-of-one overhead against native DDP, with
  each row's round medians and spread); at most 75 s;
- ``input``: a short ``benches/bench_input.py --train`` (ResNet-50 fed by
  stock ``ImageFolder`` and by CPU decode at 4, 8 and 15 workers, by GPU
  decode on 4 threads, and GPU decode alone, with the backend that decoded);
  at most 75 s;
- ``cluster``: the emulated 2 x 2 cluster's rows that carry goals (2D,
  2D + fp16, the bf16 hook, Top-K, flat, auto, after native NCCL's ring)
  with few steps, written as each finishes; at most 180 s, and what the
  budget leaves;
- ``scaling``: ResNet-50 (224 px, batch 32 per rank) trained end to end on
  the same cluster at 10 and 25 Gbit/s (``benches/bench_scaling.py
  --device cuda``): native NCCL, tiacc 2D (exact), 2D + fp16 and the
  default (``auto``), one round, its rows written as they finish; at most
  150 s, run where the budget leaves it time;
- ``fsdp``: FSDP2 over NCCL on the same cluster (``benches/bench_fsdp.py
  --device cuda``), native against the engine's 2D rows; at most 180 s,
  run where a larger budget leaves it time;
- ``amp``: the adaptive mixed-precision bench on CUDA
  (``benches/bench_amp.py --device cuda``: fp32, plain fp16 and bf16 AMP and
  the policy's schedules, one seed, 3 epochs); at most 90 s, run where a
  larger budget leaves it time.

Before each stage the plan checks the budget left: a stage that would
start with less than it needs is dropped, and ``stages.json`` and the
summary say so with the seconds left. ``--stage all`` runs the long check
instead (``tests``: the whole suite, the tests not marked ``gpu`` on every
core, then the GPU tests as ``gpu-tests`` runs them, even when the first
part failed; ``demo``; ``nccl``: every part of ``bench_nccl.py``;
``input``), and any stage also runs alone.

Each stage command runs in a session of its own; when it ends, or its
stage's time is up, every process it left running (its descendants and
its session's members: pytest-xdist workers, ranks, torchrun agents) gets
SIGTERM, then SIGKILL, and the stage's log says how many there were, so
the next stage starts on an idle machine.

Every log, the JUnit XMLs and the benchmark JSON go to one folder
(``--out``), with ``summary.md``: each stage's result, seconds, peak GPU
memory and the GPU processes already running at its start (``nvidia-smi``,
sampled every few seconds; ``-`` without it), pass/fail counts, the skips
with their reasons, each goal against its measured value, and the GPU,
driver, CUDA and NCCL versions. The test stages also append each test's
outcome and first error line to ``outcomes-<stage>.jsonl`` as the test
ends, and the summary is rewritten every few seconds while a stage runs and
after it, so a run that is cut off still leaves which tests ran and how
they ended.

``--nccl-library`` names an NCCL >= 2.30 to load (several ranks on one
GPU need it); without one, what the shipped NCCL cannot run skips with its
reason.

This file is the command line, the plan within the budget and the
installation; the stages' commands are ``_gpu_stages.py``'s, running one
is ``_gpu_stage_run.py``'s and the summary ``_gpu_summary.py``'s.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _gpu_stage_run import record_stage, run_stage
from _gpu_stages import LIMITS, LONG, PLAN, STAGES, stage_commands, stage_env, stage_environment
from _gpu_summary import render_summary

REPO = Path(__file__).resolve().parent.parent
# Small pure-Python wheels a GPU machine may lack (make gpu-kit fetches them):
# pytest-timeout honours the suite's per-test limit, pyroute2 builds the
# emulated cluster where iproute2 is missing.
KIT_PACKAGES = {"pytest_timeout": "pytest-timeout", "pyroute2": "pyroute2"}
# Command-line tools from the kit, by the command each installs: py-spy
# prints the native and Python stacks of a GPU test's rank that outlives
# its launch (tests/_launch.native_stacks), where no debugger runs.
KIT_TOOLS = {"py-spy": "py-spy"}


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
    if args.dry_run:
        for stage in stages:
            limit = args.stage_timeout or LIMITS[stage][0]
            for command in stage_commands(stage, args.python, out, args.workers):
                print(f"{stage} (at most {limit:.0f} s): {shlex.join(command)}")
        return 0
    failed = run_plan(
        stages,
        {stage: stage_commands(stage, args.python, out, args.workers) for stage in stages},
        env,
        out,
        args.budget,
        args.stage_timeout,
    )
    print(f"summary: {out / 'summary.md'}")
    if failed:
        print(f"failed stages: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def run_plan(
    stages: list[str],
    commands: dict[str, list[list[str]]],
    env: dict[str, str],
    out: Path,
    budget: float,
    stage_timeout: float | None = None,
    limits: dict[str, tuple[float, float]] = LIMITS,
) -> list[str]:
    """Runs ``stages`` in order within ``budget`` seconds; returns the failed ones.

    A stage gets at most its limit and what is left of the budget; one
    that would start with less than it needs (``limits``: limit, least)
    is dropped, recorded with the seconds left. The summary is rewritten
    after every stage (and while it runs).
    """
    failed = []
    start = time.monotonic()
    for stage in stages:
        limit, least = limits[stage]
        if stage_timeout is not None:
            limit = least = stage_timeout
        left = budget - (time.monotonic() - start)
        if left < least:
            why = (
                f"dropped: {max(left, 0):.0f} s of the {budget:.0f} s budget left, "
                f"needs {least:.0f} s"
            )
            record_stage(out, stage, why, 0.0)
            print(f"{stage}: {why}")
        elif not run_stage(
            stage, commands[stage], stage_env(stage, env, out), out, min(limit, left), _summarize
        ):
            failed.append(stage)
        _summarize(out)
    return failed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--stage",
        default="plan",
        type=_stages,
        help=f"'plan' ({', '.join(PLAN)}), 'all' ({', '.join(LONG)}) "
        f"or a comma-separated list of {', '.join(STAGES)}",
    )
    p.add_argument("--out", type=Path, default=Path("gpu-check-out"))
    p.add_argument("--python", default=sys.executable, help="the Python to install into and run")
    p.add_argument("--wheel", type=Path, help="the abi3 wheel (default: newest in dist/)")
    p.add_argument("--kit", type=Path, default=REPO / ".gpu-kit", help="make gpu-kit's folder")
    p.add_argument(
        "--decoder-wheels",
        type=Path,
        default=REPO / ".gpu-decoders",
        help="make gpu-decoders's folder: nvImageCodec and nvJPEG wheels, installed when there",
    )
    p.add_argument("--nccl-library", default=os.environ.get("NCCL_LIBRARY") or None)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="pytest-xdist workers")
    p.add_argument(
        "--stage-timeout", type=float, default=None, help="seconds per stage (default: its own)"
    )
    p.add_argument("--budget", type=float, default=420.0, help="seconds for all the stages")
    p.add_argument("--dry-run", action="store_true", help="print the stages' commands only")
    return p.parse_args(argv)


def _stages(text: str) -> list[str]:
    if text.strip() in ("", "plan"):
        return list(PLAN)
    if text.strip() == "all":
        return list(LONG)
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown stage {', '.join(unknown)}: choose from plan, all, {', '.join(STAGES)}"
        )
    return chosen


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
    missing += [pkg for tool, pkg in KIT_TOOLS.items() if not _tool_found(args.python, tool)]
    wheels = args.kit / "wheels"
    if missing and wheels.is_dir():
        commands.append(
            [args.python, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
             *missing],
        )  # fmt: skip
    decoders = sorted(args.decoder_wheels.glob("*.whl")) if args.decoder_wheels.is_dir() else []
    if decoders:
        # The optional GPU JPEG decoder (the input stage measures it).
        commands.append(
            [args.python, "-m", "pip", "install", "--no-index", "--no-deps",
             *map(str, decoders)],
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


def _tool_found(python: str, tool: str) -> bool:
    """Whether ``tool`` is on ``PATH`` or next to ``python`` (where pip puts it)."""
    home = Path(shutil.which(python) or python).parent
    return shutil.which(tool) is not None or shutil.which(tool, path=str(home)) is not None


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


def _summarize(out: Path) -> None:
    (out / "summary.md").write_text(render_summary(out))


if __name__ == "__main__":
    sys.exit(main())

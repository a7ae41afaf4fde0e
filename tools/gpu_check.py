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
from typing import Any, Callable

from _process_tree import POLL, exited, stage_processes, stop_processes

REPO = Path(__file__).resolve().parent.parent
STAGES = (
    "gpu-tests", "one", "input", "cluster", "scaling", "fsdp", "amp", "tests", "demo", "nccl"
)  # fmt: skip
# The default: one short window on a GPU node.
PLAN = ("gpu-tests", "one", "input", "cluster", "scaling", "fsdp", "amp")
# The long check (``--stage all``).
LONG = ("tests", "demo", "nccl", "input", "fsdp")
# Per stage: its limit and the least time worth starting it with (seconds).
LIMITS = {
    "gpu-tests": (180.0, 60.0),
    "one": (75.0, 45.0),
    "cluster": (180.0, 90.0),
    "input": (75.0, 45.0),
    "scaling": (150.0, 90.0),
    "fsdp": (180.0, 100.0),
    "amp": (90.0, 60.0),
    "tests": (600.0, 120.0),
    "demo": (300.0, 60.0),
    "nccl": (600.0, 120.0),
}
# The JUnit XMLs of each test stage: the whole suite runs the tests not
# marked ``gpu`` first, then the GPU tests as ``gpu-tests`` runs them.
JUNIT = {"gpu-tests": ("junit-gpu.xml",), "tests": ("junit.xml", "junit-tests-gpu.xml")}
# Stages whose commands do not depend on each other: one that fails does not
# stop the next (a timeout still ends the stage).
INDEPENDENT = {"tests"}
# The cluster rows that carry goals, by label, the most telling first (the
# bench writes its rows as they finish; native NCCL's ring runs first).
GOAL_ROWS = ",".join(
    (
        "tiacc 2D",
        "tiacc 2D + fp16",
        "torch bf16_compress_hook",
        "tiacc Top-K 1%",
        "tiacc flat",
        "tiacc auto",
    )
)
# The scaling rows besides native and the default (auto), which always run.
SCALING_ROWS = "tiacc 2D"
# The FSDP2 rows that carry goals (native always runs).
FSDP_ROWS = "tiacc 2d,tiacc 2d + bf16"
# The GPU tests run first (TIACC_TEST_FIRST, the suite's conftest).
GPU_FIRST = ",".join(
    (
        "tests/gpu/test_nccl_transport.py",
        "tests/gpu/test_data_gpu.py",
        "tests/gpu/test_nccl_init_bound.py",
        "tests/gpu/test_nccl_algorithms.py::test_a_nan",
    )
)
# pytest-xdist's switch that keeps --dist loadgroup in the collected order.
NO_REORDER = "--no-loadscope-reorder"
_pytest_options: dict[str, str] = {}
# How often the summary is rewritten and the GPU sampled while a stage runs (seconds).
TICK = 10.0
# Seconds the processes of a stage being stopped get between SIGTERM and SIGKILL.
GRACE = 5.0
# Small pure-Python wheels a GPU machine may lack (make gpu-kit fetches them):
# pytest-timeout honours the suite's per-test limit, pyroute2 builds the
# emulated cluster where iproute2 is missing.
KIT_PACKAGES = {"pytest_timeout": "pytest-timeout", "pyroute2": "pyroute2"}
# Command-line tools from the kit, by the command each installs: py-spy
# prints the native and Python stacks of a GPU test's rank that outlives
# its launch (tests/_launch.native_stacks), where no debugger runs.
KIT_TOOLS = {"py-spy": "py-spy"}
# CPU decode threads for the input stage's CPU-decode row (the goal's 15).
CPU_DECODE_WORKERS = 15
# The input stage's loader workers: hosts with few CPUs per GPU (4, 8) beside
# the CPU-decode goal's; GPU decode takes at most GPU_DECODE_THREADS of them.
INPUT_WORKERS = (4, 8, CPU_DECODE_WORKERS)
GPU_DECODE_THREADS = 4
# The input stage's loaders: those its goals read (torch's loader over the
# fused path and the drop-in loader's device output are left out, to fit).
INPUT_FEEDS = ",".join(
    ("dropin_decode_device", "stock_imagefolder", "dropin_nvimagecodec", "dropin",
     "decode_device_alone", "nvimagecodec_alone")
)  # fmt: skip
# bench_input.py's training rows that decode on the GPU, and their decoder.
GPU_DECODE_FEEDS = {
    "dropin_decode_device": "torchvision",
    "dropin_nvimagecodec": "nvimagecodec",
    "decode_device_alone": "torchvision",
    "nvimagecodec_alone": "nvimagecodec",
}


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


def stage_env(stage: str, env: dict[str, str], out: Path) -> dict[str, str]:
    """A stage's environment: a test stage's per-test outcomes file added.

    Every command of a test stage appends to the same outcomes file. The
    GPU tests start with the few that check whole features (the CUDA
    collectives, the transports, GPU decode, the init bound), then the
    algorithm matrices, so a stage cut short has run those first.
    """
    if stage not in JUNIT:
        return env
    extra = {"TIACC_TEST_OUTCOMES": str(out / f"outcomes-{stage}.jsonl")}
    extra["TIACC_TEST_FIRST"] = GPU_FIRST
    return {**env, **extra}


def stage_commands(stage: str, python: str, out: Path, workers: int) -> list[list[str]]:
    """The commands of one stage, run from the repository root."""
    if stage == "tests":  # the GPU tests apart: all cores at once run out of GPU memory
        return [
            [python, "-m", "pytest", "tests", "-m", "not gpu", "-n", str(workers), "-ra",
             f"--junitxml={out / JUNIT['tests'][0]}"],
            gpu_tests_command(python, out / JUNIT["tests"][1], workers),
        ]  # fmt: skip
    if stage == "gpu-tests":
        return [gpu_tests_command(python, out / JUNIT["gpu-tests"][0], workers)]
    if stage == "one":
        return [
            [python, "benches/bench_nccl.py", "--parts", "one", "--steps", "30", "--warmup", "3",
             "--one-rounds", "3", "--out", str(out / "bench_nccl_one.json")],
        ]  # fmt: skip
    if stage == "cluster":
        return [
            [python, "benches/bench_nccl.py", "--parts", "cluster", "--cluster-steps", "3",
             "--cluster-warmup", "1", "--only", GOAL_ROWS, "--out", str(out / "bench_nccl.json")],
        ]  # fmt: skip
    if stage == "demo":
        return [["make", "demo-run", f"PY={python}", f"DEMO_DIR={out / 'demo-data'}"]]
    if stage == "nccl":
        return [[python, "benches/bench_nccl.py", "--out", str(out / "bench_nccl.json")]]
    if stage == "input":
        return [
            [python, "benches/bench_input.py", "--train", "--skip-loaders",
             "--train-workers", ",".join(map(str, INPUT_WORKERS)), "--train-steps", "20",
             "--train-feeds", INPUT_FEEDS, "--images", "800",
             "--workdir", str(out / "bench-input-data"),
             "--out", str(out / "bench_input.json")],
        ]  # fmt: skip
    if stage == "scaling":
        return [
            [python, "benches/bench_scaling.py", "--device", "cuda", "--model", "resnet50",
             "--image-size", "224", "--batch", "32", "--rates", "10000,25000",
             "--only", SCALING_ROWS, "--rounds", "1", "--steps", "4", "--warmup", "2",
             "--out", str(out / "bench_scaling_cuda.json")],
        ]  # fmt: skip
    if stage == "fsdp":
        return [
            [python, "benches/bench_fsdp.py", "--device", "cuda", "--layouts", "link2x2",
             "--rows", FSDP_ROWS, "--rounds", "1", "--steps", "3", "--warmup", "1",
             "--out", str(out / "bench_fsdp_cuda.json")],
        ]  # fmt: skip
    if stage == "amp":
        return [
            [python, "benches/bench_amp.py", "--device", "cuda", "--seeds", "1", "--epochs", "3",
             "--out", str(out / "bench_amp_cuda.json")],
        ]  # fmt: skip
    raise ValueError(f"unknown stage {stage!r}")


def gpu_tests_command(python: str, junit: Path, workers: int) -> list[str]:
    """The tests marked ``gpu``: at most 8 workers, a matrix's cases on one worker.

    pytest-xdist 3.6 and later hand out the largest groups first under
    ``--dist loadgroup`` (the 9-case matrices), which put the whole-feature
    tests that ``TIACC_TEST_FIRST`` orders first behind every matrix: where
    this xdist has ``--no-loadscope-reorder``, it keeps the collected order.
    """
    command = [python, "-m", "pytest", "tests", "-m", "gpu", "-n", str(min(workers, 8)),
               "--dist", "loadgroup", "-ra", f"--junitxml={junit}"]  # fmt: skip
    if _pytest_has_option(python, NO_REORDER):
        command.append(NO_REORDER)
    return command


def _pytest_has_option(python: str, option: str) -> bool:
    """Whether ``python -m pytest --help`` lists ``option`` (read once per Python)."""
    if python not in _pytest_options:
        try:
            run = subprocess.run(
                [python, "-m", "pytest", "-p", "xdist", "--help"],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            _pytest_options[python] = run.stdout
        except (OSError, subprocess.SubprocessError):
            _pytest_options[python] = ""
    return re.search(rf"(^|\s){re.escape(option)}(?![\w-])", _pytest_options[python]) is not None


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


def run_stage(
    stage: str,
    commands: list[list[str]],
    env: dict[str, str],
    out: Path,
    timeout: float,
    tick: Callable[[Path], None] | None = None,
) -> bool:
    """Runs one stage's commands into ``<stage>.log``; records it in ``stages.json``.

    ``tick(out)`` runs every ``TICK`` seconds meanwhile (the summary), after
    the GPU is sampled, and the stage is recorded as running first, so a
    run cut off mid-stage still shows it. A command that fails ends the
    stage, unless the stage's commands are ``INDEPENDENT``; the timeout
    ends it always. Each command runs in a session of its own, and when it
    ends (exit or timeout) whatever it left running is stopped (see
    ``stop_processes``), so the next command starts on an idle machine.
    """
    start = time.monotonic()
    for name in (*JUNIT.get(stage, ()), f"outcomes-{stage}.jsonl"):  # no earlier run's results
        (out / name).unlink(missing_ok=True)
    gpu = GpuUse.at_start()
    record_stage(out, stage, "running (cut off here if nothing follows)", 0.0, gpu)
    failures: list[str] = []
    timed_out = False

    def every_tick() -> None:
        gpu.sample()
        seconds = round(time.monotonic() - start, 1)
        record_stage(out, stage, "running (cut off here if nothing follows)", seconds, gpu)
        if tick is not None:
            tick(out)

    with (out / f"{stage}.log").open("w") as log:
        for number, command in enumerate(commands, 1):
            log.write(f"$ {shlex.join(command)}\n")
            log.flush()
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )
            exited, seen = _wait(proc, start + timeout, every_tick)
            stopped = stop_processes(proc, seen, GRACE)
            code = proc.wait()
            if not exited:
                log.write(f"timed out after {timeout:.0f} s: the command was stopped\n")
            if stopped:
                log.write(f"stopped {stopped} process(es) the stage left running\n")
            log.flush()
            if not exited:
                timed_out = True
                break
            if code != 0:
                failures.append(
                    f"exit code {code}"
                    if len(commands) == 1
                    else f"command {number}: exit code {code}"
                )
                if stage not in INDEPENDENT:
                    break
    gpu.sample()
    status = "passed" if not failures else "failed"
    if timed_out:
        status = f"timed out after {timeout:.0f} s"
    if failures:
        status += f" ({'; '.join(failures)})"
    seconds = round(time.monotonic() - start, 1)
    record_stage(out, stage, status, seconds, gpu)
    print(f"{stage}: {status} in {seconds} s (log: {out / f'{stage}.log'})")
    return status == "passed"


def _wait(
    proc: subprocess.Popen, deadline: float, every_tick: Callable[[], None]
) -> tuple[bool, dict[int, int]]:
    """Waits for ``proc`` to exit, leaving it unreaped (its pid stays its own).

    Returns whether it exited before ``deadline``, and the processes it
    started that were seen meanwhile (pid: start time), looked for every
    ``TICK`` seconds, when ``every_tick()`` runs too.
    """
    seen: dict[int, int] = {}
    next_tick = time.monotonic() + TICK
    while not exited(proc):
        now = time.monotonic()
        if now >= deadline:
            return False, seen
        if now >= next_tick:
            seen.update(stage_processes(proc.pid))
            every_tick()
            next_tick = time.monotonic() + TICK
        time.sleep(max(0.0, min(POLL, deadline - now, next_tick - now)))
    return True, seen


# -- the GPU's memory and processes, sampled while a stage runs -------------


@dataclass
class GpuUse:
    """A stage's GPU memory and processes, from ``nvidia-smi`` (None: not sampled)."""

    processes_at_start: int | None = None
    peak_mib: int | None = None
    total_mib: int | None = None

    @classmethod
    def at_start(cls) -> GpuUse:
        """A first sample, before the stage's commands run."""
        found = gpu_sample()
        if found is None:
            return cls()
        used, total, processes = found
        return cls(processes, used, total)

    def sample(self) -> None:
        """Takes the peak of the memory used so far and now."""
        found = gpu_sample()
        if found is not None:
            self.peak_mib = max(found[0], self.peak_mib or 0)
            self.total_mib = found[1]

    def record(self) -> dict[str, int | None]:
        """The fields of the stage's record in ``stages.json``."""
        return {
            "gpu_memory_peak_mib": self.peak_mib,
            "gpu_memory_total_mib": self.total_mib,
            "gpu_processes_at_start": self.processes_at_start,
        }


def gpu_sample() -> tuple[int, int, int] | None:
    """The GPUs' memory used and total (MiB, summed) and their compute processes.

    ``None`` where ``nvidia-smi`` is missing, fails or says something else.
    """
    try:
        memory = _nvidia_smi(
            "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"
        )
        apps = _nvidia_smi("--query-compute-apps=pid", "--format=csv,noheader")
        rows = [[int(x) for x in line.split(",")] for line in memory.splitlines() if line.strip()]
        used, total = (sum(column) for column in zip(*rows))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return used, total, sum(line.strip().isdigit() for line in apps.splitlines())


def _nvidia_smi(*args: str) -> str:
    return subprocess.run(
        ["nvidia-smi", *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout


def record_stage(
    out: Path, stage: str, status: str, seconds: float, gpu: GpuUse | None = None
) -> None:
    """Writes one stage's result into ``stages.json``."""
    stages_file = out / "stages.json"
    stages = json.loads(stages_file.read_text()) if stages_file.exists() else {}
    stages[stage] = {"status": status, "seconds": seconds, **(gpu or GpuUse()).record()}
    stages_file.write_text(json.dumps(stages, indent=2) + "\n")


def _summarize(out: Path) -> None:
    (out / "summary.md").write_text(render_summary(out))


# -- the summary: a pure function of the output folder ---------------------


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


if __name__ == "__main__":
    sys.exit(main())

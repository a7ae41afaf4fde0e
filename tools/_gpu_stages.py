"""The GPU check's stages: what each runs, in which environment, and for how long.

``gpu_check.py`` runs them; the summary (``_gpu_summary.py``) reads the
files they write and the goals they carry.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

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

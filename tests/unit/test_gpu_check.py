"""The GPU check's stage logic and its summary, without a GPU.

The summary is read from a folder like the one a run leaves: a JUnit XML
that pytest itself wrote (a passing, a failing and a skipped test) and
benchmark JSON with the fields ``bench_nccl.py`` and ``bench_input.py``
write, with values on both sides of each goal.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "benches"))

import _gpu_stage_run  # noqa: E402
import _gpu_stages  # noqa: E402
import _gpu_summary  # noqa: E402
import gpu_check  # noqa: E402


def _real_junit(tmp_path: Path) -> Path:
    """A JUnit XML written by pytest for one pass, one failure, one skip."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok():\n    assert True\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='needs two GPUs')\n"
        "def test_two_gpus():\n    pass\n"
    )
    junit = tmp_path / "out" / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite),
         f"--junitxml={junit}"],
        capture_output=True,
        cwd=suite,
        timeout=120,
    )  # fmt: skip
    assert junit.exists()
    return junit


def _cluster_row(label: str, median_ms: float, native_ms: float) -> dict:
    return {"pipeline": label, "median_ms": median_ms, "native_over_this": native_ms / median_ms}


def _input_row(feed: str, workers: int, rate: float, **more: object) -> tuple[str, dict]:
    key = f"{feed}_{workers}" if workers else feed
    return key, {"images_per_s": rate, "fraction_of_synthetic": rate / 3000.0, "feed": feed,
                 "workers": workers, **more}  # fmt: skip


def _input_training() -> dict:
    """A training part of ``bench_input.py --train-workers 4,8,15`` on a GPU."""
    torchvision = {"decoder": "torchvision", "backend": "hardware"}
    nvimagecodec = {"decoder": "nvimagecodec", "backend": "CUDA"}
    rows = [
        _input_row("synthetic", 0, 3000.0),
        _input_row("dropin_decode_device", 4, 2850.0, **torchvision),  # 95%: short of 97%
        _input_row("stock_imagefolder", 4, 900.0),  # GPU decode 3.17x: met
        _input_row("dropin_nvimagecodec", 4, 2950.0, **nvimagecodec),  # 98.3%, faster: not met
        _input_row("dropin", 4, 1500.0),
        _input_row("decode_device_alone", 4, 9100.0, **torchvision),
        _input_row("nvimagecodec_alone", 4, 7900.0, **nvimagecodec),
        _input_row("stock_imagefolder", 15, 2600.0),
        _input_row("dropin", 15, 2940.0),  # 98%: met
        _input_row("stock_imagefolder", 8, 1700.0),
        _input_row("dropin", 8, 2500.0),
    ]
    return {"workers": 15, "worker_counts": [4, 8, 15], "rows": dict(rows), "complete": True}


def _write_sample(out: Path) -> None:
    native = 1000.0
    # bench_fsdp.py --device cuda: its link2x2 layout's ratios.
    (out / "bench_fsdp_cuda.json").write_text(
        json.dumps(
            {
                "benchmark": "bench_fsdp",
                "layouts": {
                    "link2x2": {"speedup_over_native": {"tiacc 2d": 1.45, "tiacc 2d + bf16": 1.8}}
                },
            }
        )
    )
    (out / "bench_nccl.json").write_text(
        json.dumps(
            {
                "benchmark": "bench_nccl",
                "cluster": {
                    "grad_bytes": 134_250_496,
                    "rows": [
                        _cluster_row("native NCCL (ring)", native, native),
                        _cluster_row("torch bf16_compress_hook", 500.0, native),
                        _cluster_row("tiacc flat", 700.0, native),
                        _cluster_row("tiacc 2D", 625.0, native),  # 1.6x: met
                        {
                            **_cluster_row("tiacc auto", 640.0, native),  # 625 / 640: met
                            "auto_choice": "tiacc-training: auto: chose 2d (a 4.0 MiB probe",
                        },
                        _cluster_row("tiacc 2D + fp16", 400.0, native),  # 2.5x: not met
                        _cluster_row("tiacc Top-K 1%", 80.0, native),  # 12.5x: met
                    ],
                },
                "ddp": [
                    {"pipeline": "native", "channels": None, "overhead_vs_native": 0.0},
                    {"pipeline": "tiacc nccl", "channels": 1, "overhead_vs_native": 0.012},
                    {"pipeline": "tiacc nccl", "channels": 4, "overhead_vs_native": 0.031},
                ],
            }
        )
    )
    # bench_input.py --train-workers 4,8,15: rows named with their workers.
    (out / "bench_input.json").write_text(json.dumps({"training": _input_training()}))
    (out / "versions.json").write_text(
        json.dumps(
            {"gpu": ["NVIDIA H100 80GB HBM3"], "cuda": "13.0", "nccl": "2.28.9",
             "engine_nccl": "2.30.3", "gpu_driver": "NVRM 580", "torch": "2.11.0"}
        )
    )  # fmt: skip
    (out / "stages.json").write_text(
        json.dumps({"tests": {"status": "failed (exit code 1)", "seconds": 312.5}})
    )


def test_summary_reports_counts_skips_goals_and_versions(tmp_path: Path) -> None:
    junit = _real_junit(tmp_path)
    out = junit.parent
    _write_sample(out)
    summary = _gpu_summary.render_summary(out)

    assert "3 tests: 1 passed, 1 failed, 0 errors, 1 skipped." in summary
    assert "needs two GPUs" in summary
    assert "test_bad" in summary and "one is not two" in summary
    assert "NVIDIA H100 80GB HBM3" in summary
    assert "torch's 2.28.9; the engine's 2.30.3" in summary
    assert "| tests | failed (exit code 1) | 312.5 |" in summary
    assert "| gpu-tests | not run | - |" in summary and "| demo |" not in summary

    measured = _gpu_summary.evaluate_goals(out, _gpu_summary.junit_counts(junit))
    goals = {(g.name, g.target): g for g in measured}
    cluster = "2 x 2 cluster: "
    assert goals[(cluster + "gradients", ">= 100 MB")].met is True
    assert goals[(cluster + "tiacc 2D vs native NCCL", ">= 1.4x")].measured == "1.60x"
    assert goals[(cluster + "tiacc 2D vs native NCCL", ">= 1.4x")].met is True
    assert goals[(cluster + "tiacc 2D + fp16 vs native NCCL", ">= 2.7x")].met is False
    # 2D + fp16 against torch's bf16 hook: 500 / 400 = 1.25x, short of 1.3x.
    vs_bf16 = goals[(cluster + "tiacc 2D + fp16 vs torch bf16_compress_hook", ">= 1.3x")]
    assert (vs_bf16.measured, vs_bf16.met) == ("1.25x", False)
    assert goals[(cluster + "tiacc Top-K 1% vs native NCCL", ">= 10.0x")].met is True
    auto = goals[(cluster + "tiacc auto vs the faster of flat and 2D", ">= 0.95x")]
    assert (auto.measured, auto.met) == ("0.98x (picked 2d)", True)
    overhead = goals[("world of one: overhead over native DDP", "<= 1%")]
    assert overhead.measured.startswith("3.1% (worst of 2;") and overhead.met is False
    cpu = goals[("CPU decode, 15 threads: share of the GPU-bound rate", ">= 97%")]
    gpu = goals[("GPU decode, 4 threads: share of the GPU-bound rate", ">= 97%")]
    assert (cpu.measured, cpu.met, gpu.measured, gpu.met) == ("98.0%", True, "95.0%", False)
    stock = goals[("GPU decode, 4 threads, vs stock ImageFolder with 4 workers", ">= 3.0x")]
    assert (stock.measured, stock.met) == ("3.17x", True)
    faster = "GPU decode in training, 4 threads: the default decoder is the faster"
    default = goals[(faster, ">= 1.00x the other")]
    assert default.measured == "0.97x nvImageCodec's (2850 vs 2950 images/s)"
    assert default.met is False
    named = goals[("GPU decode: the backend that decoded is named", "every GPU decoder")]
    assert (named.measured, named.met) == ("torchvision: hardware; nvimagecodec: CUDA", True)
    assert goals[("GPU decode alone, 224 px", ">= 8000 images/s")].met is True
    nv = goals[("GPU decode (nvImageCodec), 4 threads: share of the GPU-bound rate", ">= 97%")]
    assert (nv.measured, nv.met) == ("98.3%", True)
    nv = goals[("GPU decode alone (nvImageCodec), 224 px", ">= 8000 images/s")]
    assert (nv.measured, nv.met) == ("7900 images/s", False)
    suite = goals[("suite with CUDA present", "0 failures")]
    assert (suite.measured, suite.met) == ("1 failed of 3 (1 skipped, listed)", False)
    fsdp = "FSDP2 on 2 x 2: tiacc 2D"
    exact = goals[(fsdp + " (exact) vs native NCCL", ">= 1.3x")]
    assert (exact.measured, exact.met) == ("1.45x", True)
    bf16 = goals[(fsdp + ", reduce-scatters bf16 between nodes vs native NCCL", ">= 2.0x")]
    assert (bf16.measured, bf16.met) == ("1.80x", False)
    assert "| FSDP2 on 2 x 2: tiacc 2D (exact) vs native NCCL | >= 1.3x | 1.45x | yes |" in summary


def test_input_goals_of_a_file_from_before_several_worker_counts() -> None:
    """A ``bench_input.json`` with one row per loader, named by it, at 15
    workers (GPU decode on 4 threads; the H100 check of 2026-11-27): the
    goals it can answer, and why not the others."""
    old = {"images_per_s": 3000.0, "fraction_of_synthetic": 1.0}
    rows = {
        "synthetic": old,
        "stock_imagefolder": {"images_per_s": 2622.0, "fraction_of_synthetic": 0.874},
        "dropin": {"images_per_s": 2862.0, "fraction_of_synthetic": 0.954},
        "dropin_decode_device": {"images_per_s": 2628.0, "fraction_of_synthetic": 0.876},
        "dropin_nvimagecodec": {"images_per_s": 2520.0, "fraction_of_synthetic": 0.84},
        "decode_device_alone": {"images_per_s": 9538.0, "workers": 4},
        "nvimagecodec_alone": {"images_per_s": 5608.0, "workers": 4},
    }
    goals = {
        g.name: g for g in _gpu_summary.input_goals({"training": {"workers": 15, "rows": rows}})
    }
    assert goals["CPU decode, 15 threads: share of the GPU-bound rate"].measured == "95.4%"
    assert goals["GPU decode, 4 threads: share of the GPU-bound rate"].measured == "87.6%"
    stock = goals["GPU decode, 4 threads, vs stock ImageFolder with 4 workers"]
    assert (stock.measured, stock.met) == ("no stock_imagefolder row with 4 workers", None)
    default = goals["GPU decode in training, 4 threads: the default decoder is the faster"]
    assert default.met is True and default.measured.startswith("1.04x")
    named = goals["GPU decode: the backend that decoded is named"]
    assert named.met is None and named.measured.startswith("not recorded")
    assert goals["GPU decode alone (nvImageCodec), 224 px"].measured == "5608 images/s"


def test_missing_measurements_say_why(tmp_path: Path) -> None:
    (tmp_path / "bench_nccl.json").write_text(
        json.dumps({"cluster": {"skipped": "needs NCCL >= 2.30 for four ranks on one GPU"}})
    )
    goals = _gpu_summary.evaluate_goals(tmp_path, None)
    cluster = [g for g in goals if g.name.startswith("2 x 2 cluster")]
    assert cluster and all(g.met is None for g in cluster)
    assert all("needs NCCL >= 2.30" in g.measured for g in cluster)
    assert all(g.met is None for g in goals)
    fsdp = [g for g in goals if g.name.startswith("FSDP2")]
    assert len(fsdp) == 2 and all(g.measured == "not run" for g in fsdp)
    # nvImageCodec's rows appear only where it ran.
    assert not any("nvImageCodec" in g.name for g in goals)
    summary = _gpu_summary.render_summary(tmp_path)
    assert "No JUnit XML" in summary and "| met |" in summary


def test_stage_selection_and_commands(tmp_path: Path) -> None:
    assert gpu_check.parse_args([]).stage == [
        "gpu-tests", "one", "input", "cluster", "scaling", "fsdp", "amp"
    ]  # fmt: skip
    assert gpu_check.parse_args(["--stage", "all"]).stage == [
        "tests", "demo", "nccl", "input", "fsdp"
    ]  # fmt: skip
    assert gpu_check.parse_args(["--stage", "nccl,tests"]).stage == ["nccl", "tests"]
    # The plan fits its window: the limits of its stages add up to the budget's
    # order, each stage's least start time below its limit.
    # The stages before the cluster fit with the cluster's least time (its
    # rows are written as they finish); the scaling sweep and FSDP2 over
    # NCCL and the mixed-precision bench, last, run where a larger budget
    # leaves them time.
    plan, limits = _gpu_stages.PLAN, _gpu_stages.LIMITS
    assert plan[-4:] == ("cluster", "scaling", "fsdp", "amp")
    fixed = sum(limits[s][0] for s in plan[:-4]) + limits["cluster"][1]
    assert fixed <= gpu_check.parse_args([]).budget
    assert all(least < limit for limit, least in _gpu_stages.LIMITS.values())
    gpu = _gpu_stages.stage_commands("gpu-tests", "py", tmp_path, 16)[0]
    assert gpu[:6] == ["py", "-m", "pytest", "tests", "-m", "gpu"] and "8" in gpu
    cluster = _gpu_stages.stage_commands("cluster", "py", tmp_path, 16)[0]
    assert "--only" in cluster and str(tmp_path / "bench_nccl.json") in cluster
    amp = _gpu_stages.stage_commands("amp", "py", tmp_path, 16)[0]
    assert amp[1] == "benches/bench_amp.py" and amp[amp.index("--device") + 1] == "cuda"
    assert str(tmp_path / "bench_amp_cuda.json") in amp and limits["amp"][0] <= 90
    assert _gpu_stages.stage_env("tests", {}, tmp_path) == {
        "TIACC_TEST_OUTCOMES": str(tmp_path / "outcomes-tests.jsonl"),
        "TIACC_TEST_FIRST": _gpu_stages.GPU_FIRST,
    }
    assert _gpu_stages.stage_env("one", {"A": "1"}, tmp_path) == {"A": "1"}
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--stage", "bench"])
    # The whole suite: the tests not marked gpu on every core, then the GPU
    # tests exactly as the gpu-tests stage runs them (at most 8 workers).
    tests = _gpu_stages.stage_commands("tests", "py", tmp_path, 16)
    assert tests == [
        ["py", "-m", "pytest", "tests", "-m", "not gpu", "-n", "16", "-ra",
         f"--junitxml={tmp_path / 'junit.xml'}"],
        [*gpu[:-1], f"--junitxml={tmp_path / 'junit-tests-gpu.xml'}"],
    ]  # fmt: skip
    assert gpu == ["py", "-m", "pytest", "tests", "-m", "gpu", "-n", "8", "--dist", "loadgroup",
                   "-ra", f"--junitxml={tmp_path / 'junit-gpu.xml'}"]  # fmt: skip
    demo = _gpu_stages.stage_commands("demo", "py", tmp_path, 16)[0]
    assert demo[:2] == ["make", "demo-run"] and "PY=py" in demo
    made = subprocess.run(
        ["make", "-n", "demo-run", "PY=py", "DEMO_DIR=d"], cwd=REPO, capture_output=True, text=True
    )
    assert "py demo/pack_demo.py --workdir d" in made.stdout
    input_stage = _gpu_stages.stage_commands("input", "py", tmp_path, 16)[0]
    assert str(tmp_path / "bench_input.json") in input_stage
    workers = input_stage[input_stage.index("--train-workers") + 1]
    assert workers == "4,8,15"  # a host with few CPUs per GPU, and the CPU-decode goal's 15
    bench_input = importlib.import_module("bench_input")
    args = bench_input.parse_args(input_stage[2:])
    assert args.train_workers == [4, 8, 15]
    # The rows its goals read, those at 4 workers first (and only those fit
    # its limit: torch's loader over the fused path and the device output
    # are left out).
    training = importlib.import_module("_input_training")
    rows = training.train_plan(args.train_workers, True, True, args.train_feeds)
    assert [row.key for row in rows] == [
        "synthetic",
        "dropin_decode_device_4", "stock_imagefolder_4", "dropin_nvimagecodec_4", "dropin_4",
        "decode_device_alone_4", "nvimagecodec_alone_4",
        "stock_imagefolder_15", "dropin_15", "stock_imagefolder_8", "dropin_8",
    ]  # fmt: skip


def test_stage_environment_loads_the_given_nccl(tmp_path: Path) -> None:
    library = tmp_path / "libnccl.so.2"
    library.write_bytes(b"")
    env = _gpu_stages.stage_environment(str(library), {"LD_PRELOAD": "/lib/other.so"})
    assert env["TIACC_TRAINING_NCCL_LIBRARY"] == str(library)
    assert env["LD_PRELOAD"] == f"{library}:/lib/other.so"
    assert env["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
    assert "TIACC_TRAINING_NCCL_LIBRARY" not in _gpu_stages.stage_environment(None, {})
    with pytest.raises(SystemExit, match="no such file"):
        _gpu_stages.stage_environment(str(tmp_path / "absent.so"), {})


def test_a_stage_records_its_failure_and_the_summary_follows(tmp_path: Path) -> None:
    ok = _gpu_stage_run.run_stage("demo", [[sys.executable, "-c", "print('hi')"]], {}, tmp_path, 60)
    bad = _gpu_stage_run.run_stage(
        "nccl", [[sys.executable, "-c", "import sys; sys.exit(3)"]], {}, tmp_path, 60
    )
    slow = _gpu_stage_run.run_stage(
        "input", [[sys.executable, "-c", "import time; time.sleep(30)"]], {}, tmp_path, 0.5
    )
    assert (ok, bad, slow) == (True, False, False)
    assert "hi" in (tmp_path / "demo.log").read_text()
    summary = _gpu_summary.render_summary(tmp_path)
    assert "| nccl | failed (exit code 3) |" in summary
    assert "| input | timed out after 0 s |" in summary


def test_a_cut_off_test_stage_still_reports_each_finished_test(tmp_path: Path) -> None:
    """pytest writes each outcome as the test ends (TIACC_TEST_OUTCOMES, the
    suite's conftest); a stage killed mid-run leaves no JUnit XML, and the
    summary, rewritten while the stage runs, counts what finished from it."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (suite / "test_slow.py").write_text(
        "import time, pytest\n"
        "def test_ok():\n    assert True\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='needs two GPUs')\n"
        "def test_two_gpus():\n    pass\n"
        "def test_hangs():\n    time.sleep(600)\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    env = _gpu_stages.stage_env("gpu-tests", {**os.environ}, out)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite),
               f"--junitxml={out / 'junit-gpu.xml'}"]  # fmt: skip
    ticks: list[str] = []

    def tick(folder: Path) -> None:
        gpu_check._summarize(folder)
        ticks.append((folder / "summary.md").read_text())

    _gpu_stage_run.TICK = 1.0
    try:
        ok = _gpu_stage_run.run_stage("gpu-tests", [command], env, out, 20.0, tick=tick)
    finally:
        _gpu_stage_run.TICK = 10.0
    assert ok is False and not (out / "junit-gpu.xml").exists()
    assert ticks and "running (cut off here if nothing follows)" in ticks[0]
    summary = _gpu_summary.render_summary(out)
    assert "| gpu-tests | timed out after 20 s |" in summary
    assert "the stage did not finish" in summary
    assert "3 tests: 1 passed, 1 failed, 0 errors, 1 skipped." in summary
    assert "test_bad" in summary and "one is not two" in summary
    assert "needs two GPUs" in summary


def test_the_plan_drops_what_its_budget_cannot_fit(tmp_path: Path) -> None:
    """A stage that would start with less than it needs is not started;
    stages.json and the summary say what was dropped and why, and the
    stages after it that still fit run."""
    sleep = [[sys.executable, "-c", "import time; time.sleep(2)"]]
    failed = gpu_check.run_plan(
        ["one", "cluster", "input"],
        {"one": sleep, "cluster": sleep, "input": [[sys.executable, "-c", "pass"]]},
        {},
        tmp_path,
        budget=5.0,
        limits={"one": (10.0, 1.0), "cluster": (10.0, 4.0), "input": (10.0, 0.1)},
    )
    assert failed == []
    stages = json.loads((tmp_path / "stages.json").read_text())
    assert stages["one"]["status"] == "passed"
    dropped = stages["cluster"]["status"]
    assert dropped.startswith("dropped: ") and dropped.endswith(
        " s of the 5 s budget left, needs 4 s"
    )
    assert stages["input"]["status"] == "passed"
    assert f"| cluster | {dropped} | 0.0 |" in (tmp_path / "summary.md").read_text()


def test_the_gpu_stage_runs_its_telling_tests_first(tmp_path: Path) -> None:
    """TIACC_TEST_FIRST (set by the gpu-tests stage) puts the tests whose
    ids start with its prefixes first, in its order, the rest after."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    for name in ("test_a.py", "test_b.py", "test_c.py"):
        (suite / name).write_text("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    env = {**os.environ, "TIACC_TEST_FIRST": "test_c.py,test_b.py::test_two"}
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "."],
        capture_output=True,
        text=True,
        cwd=suite,
        env=env,
        timeout=120,
    ).stdout.splitlines()
    ids = [line for line in listed if "::" in line]
    assert ids == [
        "test_c.py::test_one",
        "test_c.py::test_two",
        "test_b.py::test_two",
        "test_a.py::test_one",
        "test_a.py::test_two",
        "test_b.py::test_one",
    ], listed
    assert "TIACC_TEST_FIRST" in _gpu_stages.stage_env("gpu-tests", {}, tmp_path)


def _dead(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _wait_dead(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while not _dead(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _dead(pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except OSError:
        pass


def _spawner(tmp_path: Path, then: str) -> tuple[Path, Path]:
    """A stage command's script: starts a child that sleeps 600 s in a session
    of its own, writes the child's pid to a file, then does ``then``."""
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "spawn.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "                         start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        f"{then}\n"
    )
    return script, pid_file


def test_a_timed_out_stage_stops_every_process_it_started(tmp_path: Path) -> None:
    """The stage's command is killed at its deadline with what it started,
    even a child in a session of its own (a torchrun agent, an xdist
    worker's rank), which would otherwise keep running as an orphan."""
    script, pid_file = _spawner(tmp_path, "time.sleep(600)")
    start = time.monotonic()
    try:
        ok = _gpu_stage_run.run_stage("one", [[sys.executable, str(script)]], {}, tmp_path, 2.0)
        child = int(pid_file.read_text())
        assert ok is False
        assert _wait_dead(child), f"the stage's child {child} still runs"
    finally:
        if pid_file.exists():
            _kill(int(pid_file.read_text()))
    assert time.monotonic() - start < 8.0  # SIGTERM sufficed: no grace period spent
    log = (tmp_path / "one.log").read_text()
    assert "timed out after 2 s" in log and "stopped 1 process(es) the stage left running" in log
    stages = json.loads((tmp_path / "stages.json").read_text())
    assert stages["one"]["status"] == "timed out after 2 s"


def test_a_finished_stage_stops_what_it_left_running(tmp_path: Path, monkeypatch) -> None:
    """A command that exits leaving processes behind: those still in its
    session, and those seen as its descendants while it ran (here a child
    in a session of its own), are stopped before the next command; a
    process that ignores SIGTERM gets SIGKILL after the grace period."""
    monkeypatch.setattr(_gpu_stage_run, "TICK", 0.2)
    monkeypatch.setattr(_gpu_stage_run, "GRACE", 1.0)
    same_session = tmp_path / "same.pid"
    then = (
        "stubborn = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        f"open({str(same_session)!r}, 'w').write(str(stubborn.pid))\n"
        "time.sleep(1.5)"
    )
    script, pid_file = _spawner(tmp_path, then)
    try:
        ok = _gpu_stage_run.run_stage("demo", [[sys.executable, str(script)]], {}, tmp_path, 60)
        left = [int(pid_file.read_text()), int(same_session.read_text())]
        assert ok is True
        assert all(_dead(pid) for pid in left), [p for p in left if not _dead(p)]
    finally:
        for path in (pid_file, same_session):
            if path.exists():
                _kill(int(path.read_text()))
    log = (tmp_path / "demo.log").read_text()
    assert "stopped 2 process(es) the stage left running" in log


def test_a_stage_that_leaves_nothing_running_logs_nothing_stopped(tmp_path: Path) -> None:
    ok = _gpu_stage_run.run_stage("demo", [[sys.executable, "-c", "print('hi')"]], {}, tmp_path, 60)
    assert ok is True and "stopped" not in (tmp_path / "demo.log").read_text()


def test_the_tests_stage_runs_its_gpu_part_after_the_first_part_fails(tmp_path: Path) -> None:
    """Both parts of the whole suite matter: the GPU part runs even when the
    part without the GPU failed; other stages stop at a failing command."""
    marker = tmp_path / "second-ran"
    commands = [
        [sys.executable, "-c", "import sys; sys.exit(1)"],
        [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"],
    ]
    assert _gpu_stage_run.run_stage("demo", commands, {}, tmp_path, 60) is False
    assert not marker.exists()
    assert _gpu_stage_run.run_stage("tests", commands, {}, tmp_path, 60) is False
    assert marker.exists()
    stages = json.loads((tmp_path / "stages.json").read_text())
    assert stages["tests"]["status"] == "failed (command 1: exit code 1)"
    assert stages["demo"]["status"] == "failed (command 1: exit code 1)"


def test_the_tests_stage_counts_both_parts(tmp_path: Path) -> None:
    """Both JUnit XMLs of the tests stage are added up; with one missing (the
    stage was cut off in its GPU part) the outcomes file both parts append
    to counts instead; with neither, the XML there is."""
    junit = _real_junit(tmp_path)
    out = junit.parent
    shutil.copyfile(junit, out / "junit-tests-gpu.xml")
    found = _gpu_summary.test_counts(out, "tests")
    assert found is not None and found["complete"] is True
    assert (found["tests"], found["passed"], found["failed"], found["skipped"]) == (6, 2, 2, 2)
    assert len(found["failures"]) == 2 and len(found["skips"]) == 2
    summary = _gpu_summary.render_summary(out)
    assert "`tests` (JUnit XML): 6 tests: 2 passed, 2 failed, 0 errors, 2 skipped." in summary

    (out / "junit-tests-gpu.xml").unlink()
    lines = [
        {"test": "tests/unit/test_a.py::test_one", "outcome": "passed"},
        {"test": "tests/gpu/test_b.py::test_two", "outcome": "failed", "first_line": "oom"},
    ]
    (out / "outcomes-tests.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    found = _gpu_summary.test_counts(out, "tests")
    assert found is not None and found["complete"] is False
    assert (found["tests"], found["passed"], found["failed"]) == (2, 1, 1)

    (out / "outcomes-tests.jsonl").unlink()
    found = _gpu_summary.test_counts(out, "tests")
    assert found is not None and (found["tests"], found["complete"]) == (3, False)


def test_a_test_stage_starts_without_an_earlier_runs_results(tmp_path: Path) -> None:
    """A folder used before: a stage cut off this time must not count the
    JUnit XML or outcomes an earlier run left there."""
    for name in ("junit.xml", "junit-tests-gpu.xml", "outcomes-tests.jsonl"):
        (tmp_path / name).write_text("old")
    _gpu_stage_run.run_stage("tests", [[sys.executable, "-c", "pass"]], {}, tmp_path, 60)
    assert not any((tmp_path / name).exists() for name in ("junit.xml", "outcomes-tests.jsonl"))
    assert _gpu_summary.test_counts(tmp_path, "tests") is None


def test_every_benchmark_stage_command_is_accepted_by_its_script(tmp_path: Path) -> None:
    """Each stage's command line of a benchmark script passes that script's
    own argument checks (its ``parse_args``)."""
    checked = set()
    for stage in _gpu_stages.STAGES:
        for command in _gpu_stages.stage_commands(stage, sys.executable, tmp_path, 8):
            script = command[1] if len(command) > 1 else ""
            if not (script.startswith("benches/") and script.endswith(".py")):
                continue
            module = importlib.import_module(Path(script).stem)
            try:
                module.parse_args(command[2:])
            except SystemExit as e:
                pytest.fail(f"{stage}: {script} refuses {command[2:]} (exit {e.code})")
            checked.add(stage)
    assert checked == {"one", "cluster", "nccl", "input", "scaling", "fsdp", "amp"}


def test_a_cut_off_stage_names_the_error_lines_of_a_failure(tmp_path: Path) -> None:
    """A failure whose first line says little (``rank 0 rc=3``) is listed with
    the error lines its outcome recorded (the suite's conftest)."""
    line = {
        "test": "tests/gpu/test_x.py::test_matrix[flat-4-4]",
        "outcome": "failed",
        "first_line": "AssertionError: --- rank 0 rc=3 after 38.6s",
        "error_lines": [
            "AssertionError: --- rank 0 rc=3 after 38.6s",
            "CASE flat-4 FAILED CommError: Cuda failure 2 'out of memory'",
        ],
    }
    path = tmp_path / "outcomes-gpu-tests.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps({**line, "error_lines": []}) + "\n")
    counts = _gpu_summary.outcome_counts(path)
    assert counts["failures"] == [
        (line["test"], "AssertionError: --- rank 0 rc=3 after 38.6s / CASE flat-4 FAILED "
         "CommError: Cuda failure 2 'out of memory'"),
        (line["test"], "AssertionError: --- rank 0 rc=3 after 38.6s"),
    ]  # fmt: skip


def test_bench_input_checks_the_image_count_only_where_it_matters() -> None:
    bench_input = importlib.import_module("bench_input")
    with pytest.raises(SystemExit):  # the loaders compare whole passes over >= 2000 images
        bench_input.parse_args(["--images", "800", "--no-train"])
    args = bench_input.parse_args(["--images", "800", "--skip-loaders", "--train"])
    assert (args.images, args.train) == (800, True)
    with pytest.raises(SystemExit):  # fewer images than one training batch
        bench_input.parse_args(["--images", "100", "--skip-loaders", "--train"])
    # A dataset smaller than the steps x the batch is read again, not ended.
    measure = importlib.import_module("_input_measure")
    assert list(itertools.islice(measure.cycle([1, 2]), 5)) == [1, 2, 1, 2, 1]
    with pytest.raises(ValueError, match="no batch"):
        next(measure.cycle([]))
    bench_nccl = importlib.import_module("bench_nccl")
    with pytest.raises(SystemExit):
        bench_nccl.parse_args(["--parts", "one,clusters"])


def _fake_nvidia_smi(folder: Path, script: str, monkeypatch) -> None:
    folder.mkdir()
    smi = folder / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + script)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")


def test_a_stage_records_its_gpu_memory_peak_and_the_gpu_processes_before_it(
    tmp_path: Path, monkeypatch
) -> None:
    """nvidia-smi is sampled at the stage's start (the processes already on
    the GPU) and every tick (the memory's peak); the summary shows both."""
    used = tmp_path / "used"
    used.write_text("1000")
    _fake_nvidia_smi(
        tmp_path / "bin",
        'case "$1" in\n'
        f'  --query-gpu=memory.used,memory.total) echo "$(cat {used}), 81559" ;;\n'
        "  --query-compute-apps=pid) printf '4242\\n4343\\n' ;;\n"
        "  *) exit 9 ;;\n"
        "esac\n",
        monkeypatch,
    )
    assert _gpu_stage_run.gpu_sample() == (1000, 81559, 2)
    monkeypatch.setattr(_gpu_stage_run, "TICK", 0.2)
    work = (
        f"import time, pathlib; p = pathlib.Path({str(used)!r}); p.write_text('52000'); "
        "time.sleep(1.5); p.write_text('3000'); time.sleep(0.5)"
    )
    assert _gpu_stage_run.run_stage("one", [[sys.executable, "-c", work]], {}, tmp_path, 60)
    record = json.loads((tmp_path / "stages.json").read_text())["one"]
    assert record["gpu_memory_peak_mib"] == 52000
    assert record["gpu_memory_total_mib"] == 81559
    assert record["gpu_processes_at_start"] == 2
    summary = _gpu_summary.render_summary(tmp_path)
    assert "| GPU memory peak | GPU processes at start |" in summary
    assert "| 52000 of 81559 MiB | 2 |" in summary


def test_a_failing_nvidia_smi_samples_nothing(tmp_path: Path, monkeypatch) -> None:
    _fake_nvidia_smi(tmp_path / "bin", "echo 'NVIDIA-SMI has failed' >&2\nexit 9\n", monkeypatch)
    assert _gpu_stage_run.gpu_sample() is None
    assert _gpu_stage_run.run_stage("one", [[sys.executable, "-c", "pass"]], {}, tmp_path, 60)
    record = json.loads((tmp_path / "stages.json").read_text())["one"]
    assert record["gpu_memory_peak_mib"] is None and record["gpu_processes_at_start"] is None
    assert "| one | passed |" in _gpu_summary.render_summary(tmp_path)
    assert (
        _gpu_summary.render_summary(tmp_path)
        .split("| one | passed | ")[1]
        .split("\n")[0]
        .endswith("| - | - |")
    )


def test_scaling_goals_read_the_sweep() -> None:
    assert [g.met for g in _gpu_summary.scaling_goals(None)] == [None, None, None]
    result = {
        "goals": {
            "per_rate": [
                {"rate_mbit": 10000, "native_efficiency": 0.5, "auto_over_native": 1.4,
                 "two_d_fp16_over_native": 1.8, "auto_efficiency_vs_bound": 0.93},
                {"rate_mbit": 25000, "native_efficiency": 0.9, "auto_over_native": 0.97,
                 "two_d_fp16_over_native": 1.0, "auto_efficiency_vs_bound": 0.88},
            ]
        }
    }  # fmt: skip
    auto, bound, regime = _gpu_summary.scaling_goals(result)
    assert not auto.met and "0.97x" in auto.measured and "25000" in auto.measured
    assert not bound.met and bound.measured == "88% (worst, at 25000 Mbit/s)"
    assert regime.met and regime.measured == "1.80x"
    # Results from before the bound: the goal says so instead of passing.
    for g in result["goals"]["per_rate"]:
        del g["auto_efficiency_vs_bound"]
    assert _gpu_summary.scaling_goals(result)[1].measured == "no bound in the results"

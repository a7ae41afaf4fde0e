"""What the GPU check keeps of a hang, and the order its GPU tests start in.

* ``gpu_check`` passes pytest-xdist's ``--no-loadscope-reorder`` where the
  node's xdist lists it (3.6 and later hand out the largest groups first,
  which ran every algorithm matrix before the whole-feature tests).
* The suite's outcome file keeps a failure's diagnosis: the engine's NCCL
  trace lines, Python's stack dumps and, where py-spy is installed (the GPU
  kit brings it), the native stacks of a rank that outlived its launch,
  which say where a hung rank waited.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tests"))

import _gpu_stages  # noqa: E402
import gpu_check  # noqa: E402
from _launch import py_spy, run_ranks  # noqa: E402

# The suite's own conftest, by its path (its module name may be taken).
_spec = importlib.util.spec_from_file_location("suite_conftest", REPO / "tests" / "conftest.py")
assert _spec is not None and _spec.loader is not None
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


def test_the_gpu_tests_keep_the_collected_order_where_xdist_can(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    junit = tmp_path / "junit.xml"
    monkeypatch.setitem(_gpu_stages._pytest_options, "new", "  --no-loadscope-reorder\n  Disable")
    monkeypatch.setitem(_gpu_stages._pytest_options, "old", "  --dist=distmode  ...\n")
    assert _gpu_stages.gpu_tests_command("new", junit, 16)[-1] == "--no-loadscope-reorder"
    assert "--no-loadscope-reorder" not in _gpu_stages.gpu_tests_command("old", junit, 16)
    # An option that only starts with the name is not the option.
    monkeypatch.setitem(_gpu_stages._pytest_options, "other", " --no-loadscope-reorder-x\n")
    assert "--no-loadscope-reorder" not in _gpu_stages.gpu_tests_command("other", junit, 16)
    # The probe asks the given Python: one without pytest lists nothing.
    assert not _gpu_stages._pytest_has_option(str(tmp_path / "no-python"), "--help")


def _failed(text: str) -> SimpleNamespace:
    return SimpleNamespace(passed=False, skipped=False, longreprtext=text)


def test_a_hangs_trace_and_stacks_reach_the_outcome_file() -> None:
    text = "\n".join(
        [
            "E   AssertionError: --- rank 0 rc=-9 after 120.2s",
            "E   BUILT_AT 1795818366.994 after 3.08s",
            "E   tiacc_training nccl trace 4.101s [watchdog]: watchdog: watching Some(3)",
            "E   Timeout (0:00:40)!",
            "E   Thread 0x00007ff423fff000 (most recent call first):",
            'E     File "tiacc_training/torch/distributed/_cuda.py", line 62 in allreduce',
            "E   --- rank 1 rc=3 after 120.2s",
            "E   WORKER_ERROR CommError: rank 1: bucket 0 holds a non-finite gradient",
        ]
    )
    lines = conftest._diagnosis_lines(_failed(text))
    assert lines == [
        "AssertionError: --- rank 0 rc=-9 after 120.2s",
        "tiacc_training nccl trace 4.101s [watchdog]: watchdog: watching Some(3)",
        "Timeout (0:00:40)!",
        "Thread 0x00007ff423fff000 (most recent call first):",
        '  File "tiacc_training/torch/distributed/_cuda.py", line 62 in allreduce',
        "--- rank 1 rc=3 after 120.2s",
    ]
    many = "\n".join(f"tiacc_training nccl trace {i}.000s [t]: x" for i in range(200))
    kept = conftest._diagnosis_lines(_failed(many))
    assert len(kept) == 150 and kept[-1].startswith("tiacc_training nccl trace 199.000s")
    assert conftest._diagnosis_lines(SimpleNamespace(passed=True, skipped=False)) == []


def test_a_rank_that_outlives_its_launch_leaves_its_native_stacks(tmp_path: Path) -> None:
    if py_spy() is None:
        pytest.skip("needs py-spy (make gpu-kit brings it to GPU nodes)")
    worker = tmp_path / "stuck.py"
    worker.write_text("import time\nprint('STARTED', flush=True)\ntime.sleep(60)\n")
    ranks = run_ranks(2, [], timeout=4, worker=worker)
    for r in ranks:
        assert r.returncode != 0 and r.seconds < 40
        dump = [x for x in r.stdout.splitlines() if x.startswith("py-spy| ")]
        assert dump and "sleep" in "\n".join(dump), r.stdout
        text = f"E   AssertionError: --- rank {r.rank} rc={r.returncode}\n" + r.stdout
        assert any("py-spy| " in x for x in conftest._diagnosis_lines(_failed(text)))


def test_the_kit_installs_a_tool_only_where_it_is_missing() -> None:
    assert gpu_check._tool_found(sys.executable, Path(sys.executable).name)
    assert not gpu_check._tool_found(sys.executable, "no-such-tool-of-the-kit")
    assert gpu_check.KIT_TOOLS["py-spy"] == "py-spy"

"""The per-test outcomes file (``TIACC_TEST_OUTCOMES``, the suite's conftest).

A failing test that ran ranks in subprocesses often fails with a first line
such as ``rank 0 rc=3``; its outcome line also carries the lines that say
why (a rank's ``WORKER_ERROR``, a case's ``FAILED``, CUDA's out of memory),
so a run cut off before pytest's own report still names the cause.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SUITE = """
import pytest

def test_ok():
    assert True

def test_ranks_failed():
    output = "\\n".join([
        "rank 1 started",
        "CASE flat-1 DONE",
        "CASE flat-4 FAILED CommError: ncclAllReduce failed: Cuda failure 2 'out of memory'",
        "WORKER_ERROR rank 0: CommError: the case flat-4 failed",
        "rank 1 exiting",
    ])
    # a comment naming an Exception in the source is not an error line
    assert False, "--- rank 0 rc=3 after 38.6s\\n" + output

@pytest.mark.skip(reason="needs two GPUs")
def test_two_gpus():
    pass
"""


def test_a_failure_records_the_lines_that_say_why(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (suite / "test_sample.py").write_text(SUITE)
    outcomes = tmp_path / "outcomes.jsonl"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
        env={**os.environ, "TIACC_TEST_OUTCOMES": str(outcomes)},
        capture_output=True,
        timeout=120,
    )
    lines = {
        line["test"].split("::")[-1]: line
        for line in map(json.loads, outcomes.read_text().splitlines())
    }
    assert set(lines) == {"test_ok", "test_ranks_failed", "test_two_gpus"}
    assert lines["test_ok"]["outcome"] == "passed" and lines["test_ok"]["error_lines"] == []
    failed = lines["test_ranks_failed"]
    assert failed["outcome"] == "failed"
    assert failed["first_line"].startswith("AssertionError: --- rank 0 rc=3"), failed
    assert failed["error_lines"] == [
        "AssertionError: --- rank 0 rc=3 after 38.6s",
        "CASE flat-4 FAILED CommError: ncclAllReduce failed: Cuda failure 2 'out of memory'",
        "WORKER_ERROR rank 0: CommError: the case flat-4 failed",
    ], failed
    skipped = lines["test_two_gpus"]
    assert skipped["outcome"] == "skipped" and skipped["first_line"] == "needs two GPUs"
    assert skipped["error_lines"] == []

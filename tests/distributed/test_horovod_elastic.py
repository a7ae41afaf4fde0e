"""Horovod's elastic mode: ``tiaccrun --host-discovery-script`` and ``hvd.elastic``.

The job runs ``user_scripts/horovod_elastic.py`` (Horovod's documented shape,
its import line changed) on this machine, where ``localhost`` and
``127.0.0.1`` are two hosts to the driver. The test edits the file the
discovery script prints while the job trains: a host is added, removed,
added again, and then its worker is killed. Every step trains on the same
global batch whatever the world's size, so the parameters at the end must
be the uninterrupted run's (within float rounding): no committed step was
lost or done twice, and workers that joined got the committed state.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from _launch import base_env, line_matching

SCRIPT = Path(__file__).parent / "user_scripts" / "horovod_elastic.py"
LAUNCH = [sys.executable, "-m", "tiacc_training.tools.tiaccrun"]
STEPS = 80


class _Job:
    """A tiaccrun job whose output lines are collected as they come."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        self.lines: list[str] = []
        self.log = cwd / "job.log"
        self.proc = subprocess.Popen(
            argv,
            env=base_env(),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _running(self) -> bool:
        return self.proc.poll() is None or self.reader.is_alive()

    def text(self) -> str:
        """Everything the job printed so far (also written to ``job.log``)."""
        text = "\n".join(self.lines)
        self.log.write_text(text)
        return text

    def wait_for(self, pattern: str, after: int = 0, limit: float = 90) -> int:
        """The index of the first line from ``after`` on matching ``pattern``."""
        found = line_matching(self.lines, pattern, after, limit, self._running)
        if found is None:
            self.proc.kill()
            raise AssertionError(f"no line matching {pattern!r}:\n" + self.text()[-6000:])
        return found

    def finish(self, limit: float = 120) -> int:
        try:
            self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(10)
        return self.proc.returncode


def _params(text: str) -> dict[int, list[float]]:
    done = re.findall(r"DONE rank (\d+) size \d+ step (\d+) PARAMS (\[.*\])", text)
    assert done, text[-6000:]
    assert all(int(step) == STEPS for _, step, _ in done), done
    return {int(rank): json.loads(params) for rank, _, params in done}


def _steps_of_size(job: _Job, size: int, count: int, after: int) -> int:
    """Waits until ``count`` steps ran with world size ``size`` from line ``after`` on."""
    line = after
    for _ in range(count):
        line = job.wait_for(rf"STEP \d+ SIZE {size} RANK 0$", line) + 1
    return line


def test_workers_lost_and_back_keep_the_committed_state(tmp_path: Path) -> None:
    """A host is added (3 workers, the new one synced from rank 0), removed
    (its worker leaves), added again (a new worker gets the state back), and
    its worker is killed (the others restore the last commit): the job ends
    with the uninterrupted run's parameters on every worker."""
    reference = subprocess.run(
        [*LAUNCH, "-np", "1", sys.executable, str(SCRIPT), "--steps", str(STEPS)],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    expected = _params(reference.stdout)[0]

    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    crash = tmp_path / "crash"
    argv = [
        *LAUNCH,
        "-np",
        "2",
        "--min-np",
        "1",
        "--max-np",
        "3",
        "--host-discovery-script",
        str(discover),
        "--elastic-timeout",
        "60",
        sys.executable,
        str(SCRIPT),
        "--steps",
        str(STEPS),
        "--step-seconds",
        "0.15",
        "--crash-file",
        str(crash),
        "--crash-host",
        "127.0.0.1",
    ]
    job = _Job(argv, tmp_path)
    line = _steps_of_size(job, 2, 3, 0)
    hosts.write_text("localhost:2\n127.0.0.1:1\n")  # a host added
    line = _steps_of_size(job, 3, 3, line)
    hosts.write_text("localhost:2\n")  # removed
    line = _steps_of_size(job, 2, 3, line)
    hosts.write_text("localhost:2\n127.0.0.1:1\n")  # back
    line = _steps_of_size(job, 3, 3, line)
    crash.touch()  # its worker is killed
    job.wait_for(r"CRASH$", line)
    code = job.finish()
    out = job.text()
    assert code == 0, out[-6000:]
    rounds = re.findall(r"^tiaccrun: round (\d+): (\d+) worker", out, re.M)
    assert [int(n) for _, n in rounds] == [2, 3, 2, 3, 2], out[-6000:]
    assert "is not in the job's new round" in out, out[-6000:]  # the removed worker left
    assert re.search(r"worker \d+ \(127\.0\.0\.1:0\) was killed by SIGKILL", out), out[-6000:]
    # Every reset resumed at a committed step; the one after the crash at
    # the step before it (the killed step is done again, not skipped).
    resets = re.findall(r"RESET size (\d+) step (\d+)", out)
    assert len(resets) >= 4 * 2, out[-6000:]
    finals = _params(out)
    assert sorted(finals) == [0, 1], finals.keys()
    for rank, params in finals.items():
        assert params == pytest.approx(expected, rel=1e-4, abs=1e-5), rank

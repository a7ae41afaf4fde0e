"""What a DDP step waited for communication, in stats() and the exit summary.

Two ranks on this host train a few steps with the engine and with it
switched off (``TIACC_TRAINING_DISABLE=1``, native DDP timed the same way);
both report every step, a wait of zero or more, and the exit summary says it.
Under torch's profiler the engine's hook is a span of its own, once a
bucket (none when the engine is off).
The wait's arithmetic is unit-tested in ``tests/unit/test_step_waiting.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import describe, results_of, run_ranks

WORKER = Path(__file__).resolve().parent / "waiting_worker.py"
STEPS = 5


@pytest.mark.parametrize("engine", ["tiacc", "native"])
def test_every_step_reports_its_wait(engine: str) -> None:
    env = {"TIACC_TRAINING_DISABLE": "1"} if engine == "native" else {}
    ranks = run_ranks(2, ["--steps", str(STEPS)], env=env, worker=WORKER)
    for result in results_of(ranks):
        assert result["steps"] == STEPS, result
        if engine == "native":
            assert result["hook_spans"] == 0, result
        else:
            assert result["buckets"] >= 1 and result["hook_spans"] == result["buckets"], result
        assert 0 <= result["exposed_ms_per_step"] <= result["max_step_ms"], result
        assert isinstance(result["link_bytes_per_step"], dict), result
    summary = [line for line in ranks[0].stderr.splitlines() if "summary" in line]
    assert summary and "waited for communication after backward" in summary[-1], describe(ranks)
    if engine == "native":
        assert "the engine is off" in summary[-1], summary

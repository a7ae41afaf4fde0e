"""The exposed communication of a step and the links' bytes (``_waiting``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tiacc_training.torch.distributed import _waiting


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    _waiting.reset()
    yield
    _waiting.reset()


def test_the_wait_runs_from_the_last_bucket_handed_to_the_last_result() -> None:
    clock = _waiting.StepClock()
    first, last = torch.futures.Future(), torch.futures.Future()
    a = _waiting.timed(clock, False, first)
    first.set_result(torch.ones(2))  # done while backward still runs: hidden
    b = _waiting.timed(clock, True, last)
    assert _waiting.report()["steps"] == 0
    time.sleep(0.05)
    last.set_result(torch.zeros(3))
    assert torch.equal(a.wait(), torch.ones(2)) and torch.equal(b.wait(), torch.zeros(3))
    measured = _waiting.report()
    assert measured["steps"] == 1
    assert 40 <= measured["exposed_ms_per_step"] <= 1000, measured
    assert measured["last_step_ms"] == measured["max_step_ms"] == measured["exposed_ms_per_step"]


def test_a_step_counts_once_all_its_buckets_are_done() -> None:
    clock = _waiting.StepClock()
    early, last = torch.futures.Future(), torch.futures.Future()
    _waiting.timed(clock, False, early)
    _waiting.timed(clock, True, last)
    last.set_result(torch.ones(1))
    assert _waiting.report()["steps"] == 0  # the first bucket is still out
    early.set_result(torch.ones(1))
    assert _waiting.report()["steps"] == 1
    for _ in range(2):  # two more steps, nothing left to wait for
        done = torch.futures.Future()
        done.set_result(torch.ones(1))
        _waiting.timed(clock, True, done)
    assert _waiting.report()["steps"] == 3
    assert "waited for communication after backward" in _waiting.describe()


def test_link_counters_read_received_plus_sent(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.write_text(
        "Inter-|   Receive                            |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes ...\n"
        "    lo: 1000 10 0 0 0 0 0 0 2000 20 0 0 0 0 0 0\n"
        "  eth0: 5 1 0 0 0 0 0 0 7 1 0 0 0 0 0 0\n"
    )
    assert _waiting.link_counters(str(dev)) == {"lo": 3000, "eth0": 12}
    assert _waiting.link_counters(str(tmp_path / "missing")) == {}


def test_nothing_measured_says_nothing() -> None:
    assert _waiting.report()["steps"] == 0 and _waiting.describe() == ""

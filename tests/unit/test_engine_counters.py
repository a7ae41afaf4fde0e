"""``tdist.stats()["engine"]``: the engines' own counters, kept when an engine
stops or is replaced, and the summary line that says them."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

import tiacc_training.torch.distributed as tdist
from tiacc_training.torch.distributed import _summary
from tiacc_training.torch.distributed._hook import totals
from tiacc_training.torch.distributed._state import state


def row(buckets: int, bytes_in: int, world: int, intra: int = 0, inter: int = 0) -> dict:
    """One (path, codec) entry as the engines give it."""
    wire = {"world": world, "intra": intra, "inter": inter}
    total = sum(wire.values())
    return {"buckets": buckets, "bytes_in": bytes_in, "wire_bytes": total, "wire": wire}


class Counting:
    """A stand-in engine whose ``counters()`` says what the test tells it."""

    def __init__(self, counters: dict[tuple[str, str], dict[str, Any]]) -> None:
        self.rows = counters

    def counters(self) -> dict[tuple[str, str], dict[str, Any]]:
        return self.rows


class Staging:
    """A stand-in CUDA path whose engine is ``engine``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine


@pytest.fixture
def clean_state() -> Iterator[None]:
    saved = {k: state.__dict__[k] for k in ("engine", "cuda", "retired_counters", "logged")}
    saved_steps = totals.steps
    state.__dict__.update(engine=None, cuda=None, retired_counters={})
    try:
        yield
    finally:
        state.__dict__.update(saved)
        totals.steps = saved_steps


def test_counters_of_engines_in_use_and_stopped_add_up(clean_state: None) -> None:
    first = Counting({("ring", "fp16"): row(3, 3000, 1500)})
    state.set_engine(first)
    assert tdist.stats()["engine"] == {("ring", "fp16"): row(3, 3000, 1500)}
    # The NCCL path's device engine adds its own.
    device = Counting({("2d", "none"): row(1, 400, 0, 400, 100)})
    state.set_cuda(Staging(device))
    first.rows = {("ring", "fp16"): row(5, 5000, 2500)}
    assert tdist.engine_counters() == {
        ("ring", "fp16"): row(5, 5000, 2500),
        ("2d", "none"): row(1, 400, 0, 400, 100),
    }
    # Stopped (destroy_process_group, exit): both keep counting in the totals.
    state.set_cuda(None)
    state.set_engine(None)
    want = {("ring", "fp16"): row(5, 5000, 2500), ("2d", "none"): row(1, 400, 0, 400, 100)}
    assert tdist.engine_counters() == want
    # A new engine adds to them.
    state.set_engine(Counting({("ring", "fp16"): row(1, 1000, 500)}))
    assert tdist.engine_counters()[("ring", "fp16")] == row(6, 6000, 3000)


def test_host_staging_is_counted_once_with_the_cpu_engine(clean_state: None) -> None:
    cpu = Counting({("ring", "none"): row(2, 800, 800)})
    state.set_engine(cpu)
    state.set_cuda(Staging(cpu))
    assert tdist.engine_counters() == {("ring", "none"): row(2, 800, 800)}
    # Stopped in close_all's order: the CUDA path, then the CPU engine.
    state.set_cuda(None)
    state.set_engine(None)
    assert tdist.engine_counters() == {("ring", "none"): row(2, 800, 800)}


def test_the_summary_line_says_bytes_on_the_wire(
    clean_state: None, caplog: pytest.LogCaptureFixture
) -> None:
    state.set_engine(
        Counting(
            {
                ("ring", "fp16"): row(120, 48 * 2**20, 24 * 2**20),
                ("2d", "none"): row(2, 2**20, 0, 2**20, 2**19),
            }
        )
    )
    state.logged, totals.steps = True, 60
    with caplog.at_level(logging.INFO, logger="tiacc_training"):
        _summary.report()
    line = caplog.messages[-1]
    assert "ring/fp16: 120 buckets, 48.0 MiB in, 24.0 MiB on the wire" in line, line
    assert "2d/none: 2 buckets, 1.0 MiB in, 1.5 MiB on the wire (MiB: intra 1.0, inter 0.5)" in line


def test_the_summary_is_said_once_per_change(
    clean_state: None, caplog: pytest.LogCaptureFixture
) -> None:
    # Said at the default group's destroy, then again at exit: once, unless
    # something happened in between.
    state.set_engine(Counting({("ring", "none"): row(4, 4000, 4000)}))
    state.logged, totals.steps = True, 2
    with caplog.at_level(logging.INFO, logger="tiacc_training"):
        _summary.report()
        _summary.report()
        totals.steps = 3
        _summary.report()
    said = [m for m in caplog.messages if "summary: " in m]
    assert len(said) == 2 and "summary: 3 backward pass(es)" in said[1], said

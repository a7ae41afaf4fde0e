"""The timeline reader: steps, skew, tail and link time from known traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiacc_training.tools import timeline_summary as ts


def x(name: str, ts_us: float, dur_us: float, tid: int = 1, **args: object) -> dict:
    return {"name": name, "ph": "X", "ts": ts_us, "dur": dur_us, "pid": 0, "tid": tid, "args": args}


def rank_trace(offset: float) -> list[dict]:
    """Two steps of two buckets; this rank hands each bucket over ``offset`` us late."""
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {}}]
    for step in range(2):
        t = step * 10_000.0
        for bucket, at in ((0, 1_000.0), (1, 3_000.0)):
            events.append(x("queued", t + at + offset, 10.0, bucket=bucket, bytes=8))
        # Both buckets start once every rank has them (the slowest is 500 us late).
        events.append(x("bucket", t + 1_510.0, 1_000.0, bucket=0, bytes=8))
        events.append(x("agree", t + 1_510.0, 10.0, bucket=0, group="intra-node"))
        events.append(x("allreduce", t + 1_600.0, 800.0, tid=2, bucket=0, group="inter-node"))
        events.append(x("bucket", t + 3_510.0, 2_000.0, bucket=1, bytes=8))
        events.append(x("allreduce", t + 3_600.0, 1_500.0, tid=2, bucket=1, group="inter-node"))
        events.append(x("queued collective", t + 6_000.0, 5.0, bucket=0))
        events.append(x("collective", t + 6_005.0, 5.0, bucket=0))
    return events


def test_each_step_says_its_span_skew_tail_and_link_time() -> None:
    lines = ts.summarize([rank_trace(0.0), rank_trace(500.0)])
    assert len(lines) == 2, lines  # torch's other collectives start no step
    first = lines[0]
    assert first["buckets"] == 2
    assert first["span_ms"] == pytest.approx((5_510.0 - 1_000.0) / 1e3, abs=0.1)
    assert first["skew_ms"] == pytest.approx(0.5, abs=0.01)
    assert first["tail_ms"] == pytest.approx((5_510.0 - 3_500.0) / 1e3, abs=0.01)
    # Both ranks' inter-node steps overlap exactly: their union, not their sum.
    assert first["link_ms"] == pytest.approx(2.3, abs=0.01)
    assert first["phases_ms"]["allreduce inter-node"] == pytest.approx(2.3, abs=0.01)


def test_busy_is_the_length_of_a_union() -> None:
    assert ts.busy([(0, 2), (1, 3), (5, 6)]) == 4
    assert ts.busy([]) == 0


def test_the_command_line_merges_and_refuses_what_is_not_a_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = []
    for rank, offset in enumerate((0.0, 500.0)):
        path = tmp_path / f"tl.rank{rank}.json"
        path.write_text(json.dumps(rank_trace(offset)))
        files.append(str(path))
    merged = tmp_path / "all.json"
    assert ts.main([*files, "--merge", str(merged)]) == 0
    assert "step 1: 2 buckets" in capsys.readouterr().out
    assert len(json.loads(merged.read_text())) == 2 * len(rank_trace(0.0))
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    with pytest.raises(SystemExit) as stop:
        ts.main([str(broken)])
    assert stop.value.code == 2
    assert f"{broken}: not a readable timeline" in capsys.readouterr().err

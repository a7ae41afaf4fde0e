"""The Horovod timeline writer (``tiacc_training.torch.horovod._timeline``).

These run without ``hvd.init()``: the module's view of it (initialized,
rank) is replaced by the fixture. The multi-rank path (``HOROVOD_TIMELINE``
under tiaccrun) is in ``tests/distributed/test_tiaccrun.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tiacc_training.torch.horovod import _timeline

REPO = Path(__file__).resolve().parents[2]
TIMELINE_SOURCE = REPO / "tiacc_training" / "torch" / "horovod" / "_timeline.py"


@pytest.fixture
def hvd_state(monkeypatch):
    """hvd.init() has run on rank 0 (set ``state[1]`` for another rank)."""
    state = [True, 0]
    monkeypatch.setattr(_timeline, "_state_source", lambda: (state[0], state[1]))
    yield state
    state[0] = True
    _timeline.stop_timeline()


def _events(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _rows(events: list[dict]) -> dict[int, str]:
    return {
        e["pid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name"
    }


def _by_row(events: list[dict]) -> dict[str, list[dict]]:
    rows = _rows(events)
    out: dict[str, list[dict]] = {name: [] for name in rows.values()}
    for e in events:
        if e["ph"] == "X":
            out[rows[e["pid"]]].append(e)
    return out


def test_concurrent_marks_from_threads(tmp_path, hvd_state):
    path = tmp_path / "timeline.json"
    _timeline.start_timeline(str(path))
    origin = _timeline._active.origin
    ops = ["ALLREDUCE", "BROADCAST", "ALLGATHER", "ALLTOALL"]
    per_thread = 30
    # Per tensor name, the times the test saw around each phase's mark.
    seen: dict[str, list[tuple[float, float]]] = {}
    seen_lock = threading.Lock()
    start = threading.Barrier(len(ops))

    def worker(k: int) -> None:
        start.wait()
        for j in range(per_thread):
            name = f"thread{k}.tensor{j % 3}.step{j}"
            times = []
            for phase in _timeline.PHASES:
                before = time.perf_counter()
                if phase == "done":
                    # Completion comes from another thread, as the engine's does.
                    t = threading.Thread(target=_timeline.mark, args=(name, ops[k], phase))
                    t.start()
                    t.join()
                else:
                    _timeline.mark(name, ops[k], phase)
                times.append((before, time.perf_counter()))
            with seen_lock:
                seen[name] = times

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(ops))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _timeline.stop_timeline()

    events = _events(path)
    rows = _rows(events)
    # One row per tensor name, each named once, with distinct ids.
    assert sorted(rows.values()) == sorted(seen)
    assert len(set(rows)) == len(rows)
    by_row = _by_row(events)
    slack = 2e-6  # the file rounds to nanoseconds
    for name, times in seen.items():
        op = ops[int(name[len("thread")])]
        got = sorted(by_row[name], key=lambda e: e["ts"])
        assert [e["name"] for e in got] == [f"NEGOTIATE_{op}", "QUEUE", op], name
        for event, (before, after), (next_before, next_after) in zip(got, times, times[1:]):
            begin = origin + event["ts"] / 1e6
            end = begin + event["dur"] / 1e6
            assert before - slack <= begin <= after + slack, (name, event)
            assert next_before - slack <= end <= next_after + slack, (name, event)
            assert event["dur"] >= 0
        # Contiguous phases: each starts where the previous ended.
        for a, b in zip(got, got[1:]):
            assert a["ts"] + a["dur"] == pytest.approx(b["ts"], abs=0.01)


def test_same_name_operations_in_flight_go_in_order(tmp_path, hvd_state):
    path = tmp_path / "t.json"
    _timeline.start_timeline(str(path))
    for phase in ("negotiate", "queue"):
        _timeline.mark("grad", "ALLREDUCE", phase)
    _timeline.mark("grad", "ALLREDUCE", "negotiate")  # a second one, same name
    for phase in ("communicate", "done"):
        _timeline.mark("grad", "ALLREDUCE", phase)  # the first one's
    for phase in ("queue", "communicate", "done"):
        _timeline.mark("grad", "ALLREDUCE", phase)  # the second one's
    _timeline.stop_timeline()
    events = _by_row(_events(path))["grad"]
    assert len(events) == 6
    first = sorted((e for e in events if e["tid"] == 0), key=lambda e: e["ts"])
    second = sorted((e for e in events if e["tid"] == 1), key=lambda e: e["ts"])
    assert [e["name"] for e in first] == ["NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE"]
    assert [e["name"] for e in second] == ["NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE"]
    # The second was negotiated while the first was queued.
    assert first[1]["ts"] < second[0]["ts"] < first[2]["ts"]


def test_missing_phases_and_unfinished_operations(tmp_path, hvd_state):
    path = tmp_path / "t.json"
    _timeline.start_timeline(str(path))
    # An operation marked only from the engine's side.
    _timeline.mark("b", "BARRIER", "communicate")
    _timeline.mark("b", "BARRIER", "done")
    # One still negotiating when the timeline stops.
    _timeline.mark("late", "JOIN", "negotiate")
    time.sleep(0.01)
    _timeline.stop_timeline()
    by_row = _by_row(_events(path))
    assert [e["name"] for e in by_row["b"]] == ["BARRIER"]
    assert "args" not in by_row["b"][0]
    (late,) = by_row["late"]
    assert late["name"] == "NEGOTIATE_JOIN"
    assert late["args"] == {"unfinished": True}
    assert late["dur"] >= 10_000  # it lasted until the stop, 10 ms later at least


def test_no_timeline_is_a_no_op(tmp_path, hvd_state):
    assert _timeline._active is None
    _timeline.mark("x", "ALLREDUCE", "negotiate")
    _timeline.mark("x", "NOT_AN_OP", "whatever")  # not checked while off
    assert list(tmp_path.iterdir()) == []


def test_bad_marks_name_the_value(tmp_path, hvd_state):
    _timeline.start_timeline(str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match="'allreduce'"):
        _timeline.mark("x", "allreduce", "negotiate")
    with pytest.raises(ValueError, match="'start'"):
        _timeline.mark("x", "ALLREDUCE", "start")


def test_start_twice_moves_to_the_new_file(tmp_path, hvd_state):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    _timeline.start_timeline(str(first))
    for phase in _timeline.PHASES:
        _timeline.mark("one", "ALLREDUCE", phase)
    _timeline.start_timeline(str(second))
    for phase in _timeline.PHASES:
        _timeline.mark("two", "BROADCAST", phase)
    # The first file was closed as valid JSON when the second started.
    assert set(_rows(_events(first)).values()) == {"one"}
    _timeline.stop_timeline()
    assert set(_rows(_events(second)).values()) == {"two"}


def test_stop_without_start_and_before_init(tmp_path, hvd_state):
    _timeline.stop_timeline()  # not started: nothing happens
    hvd_state[0] = False
    with pytest.raises(ValueError, match="hvd.init"):
        _timeline.start_timeline(str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match="hvd.init"):
        _timeline.stop_timeline()
    assert list(tmp_path.iterdir()) == []
    hvd_state[0] = True
    with pytest.raises(ValueError, match="file_path"):
        _timeline.start_timeline("")


def test_only_rank_0_writes(tmp_path, hvd_state):
    hvd_state[1] = 1
    path = tmp_path / "t.json"
    _timeline.start_timeline(str(path))
    _timeline.mark("x", "ALLREDUCE", "negotiate")
    _timeline.stop_timeline()
    assert not path.exists()


def test_mark_cycles_is_accepted(tmp_path, hvd_state):
    # There is no background cycle to mark: the trace holds the operations only.
    path = tmp_path / "t.json"
    _timeline.start_timeline(str(path), mark_cycles=True)
    for phase in _timeline.PHASES:
        _timeline.mark("x", "ALLREDUCE", phase)
    _timeline.stop_timeline()
    events = _events(path)
    assert [e["name"] for e in events if e["ph"] != "M"] == [
        "NEGOTIATE_ALLREDUCE",
        "QUEUE",
        "ALLREDUCE",
    ]


def test_written_while_running(tmp_path, hvd_state):
    path = tmp_path / "t.json"
    _timeline.start_timeline(str(path))
    for j in range(50):
        for phase in _timeline.PHASES:
            _timeline.mark(f"t{j}", "ALLREDUCE", phase)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "t49" not in path.read_text():
        time.sleep(0.1)
    assert '"t49"' in path.read_text()  # on disk before stop_timeline
    _timeline.stop_timeline()
    assert len(_rows(_events(path))) == 50


def test_start_from_env(tmp_path, hvd_state, monkeypatch):
    path = tmp_path / "env.json"
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")
    _timeline.start_from_env()
    assert _timeline._active is None and not list(tmp_path.iterdir())
    monkeypatch.setenv("HOROVOD_TIMELINE", str(path))
    monkeypatch.setenv("HOROVOD_TIMELINE_MARK_CYCLES", "yes-please")
    with pytest.raises(ValueError, match="HOROVOD_TIMELINE_MARK_CYCLES"):
        _timeline.start_from_env()
    monkeypatch.setenv("HOROVOD_TIMELINE_MARK_CYCLES", "1")
    _timeline.start_from_env()
    _timeline.mark("from.env", "BROADCAST", "negotiate")
    _timeline.mark("from.env", "BROADCAST", "done")
    _timeline.stop_timeline()
    assert set(_rows(_events(path)).values()) == {"from.env"}


def test_valid_json_at_exit_without_stop(tmp_path):
    path = tmp_path / "exit.json"
    # The module alone (it needs nothing but the standard library), without
    # the package and torch, so the process starts quickly.
    script = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_timeline", {str(TIMELINE_SOURCE)!r})
_timeline = importlib.util.module_from_spec(spec)
sys.modules["_timeline"] = _timeline
spec.loader.exec_module(_timeline)
_timeline._state_source = lambda: (True, 0)
_timeline.start_timeline({str(path)!r})
for phase in ("negotiate", "queue", "communicate", "done"):
    _timeline.mark("w", "ALLREDUCE", phase)
_timeline.mark("open", "ALLGATHER", "negotiate")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    by_row = _by_row(_events(path))
    assert [e["name"] for e in by_row["w"]] == ["NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE"]
    assert by_row["open"][0]["args"] == {"unfinished": True}


def test_a_failed_write_stops_the_timeline_not_the_job(tmp_path, hvd_state, caplog):
    class FullDisk:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    _timeline.start_timeline(str(tmp_path / "t.json"))
    running = _timeline._active
    running.file = FullDisk()
    _timeline.mark("x", "ALLREDUCE", "negotiate")
    _timeline.mark("x", "ALLREDUCE", "done")
    running.thread.join(timeout=30)
    assert not running.thread.is_alive()
    assert _timeline._active is None  # marks are no-ops again
    _timeline.mark("y", "ALLREDUCE", "negotiate")
    assert "writing failed" in caplog.text
    _timeline.stop_timeline()


def test_close_ends_the_file_and_later_marks_go_nowhere(tmp_path, hvd_state):
    """hvd.shutdown() closes the timeline (as Horovod's does)."""
    path = tmp_path / "timeline.json"
    _timeline.start_timeline(str(path))
    _timeline.mark("grad.0", "ALLREDUCE", "negotiate")
    _timeline.mark("grad.0", "ALLREDUCE", "done")
    _timeline.close()
    _timeline.mark("grad.1", "ALLREDUCE", "negotiate")
    _timeline.mark("grad.1", "ALLREDUCE", "done")
    rows = _by_row(_events(path))
    assert set(rows) == {"grad.0"}, rows
    _timeline.close()  # nothing running: no error

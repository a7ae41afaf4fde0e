"""The engine's timeline (``TIACC_TRAINING_TIMELINE``): a Chrome trace per rank."""

from __future__ import annotations

import json
from pathlib import Path

from _launch import describe, run_ranks


def events(path: Path) -> list[dict]:
    """The trace's events; the file must be one complete JSON array."""
    text = path.read_text()
    trace = json.loads(text)
    assert isinstance(trace, list), text[:200]
    return trace


def threads(trace: list[dict]) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace if e.get("name") == "thread_name"}


def test_a_pipelined_two_d_step_shows_every_phase_inside_its_bucket(tmp_path: Path) -> None:
    """2 emulated nodes x 2 ranks, buckets of 4 MB (cut into pipeline
    chunks): each rank's file names its rank and threads, and every step of
    a bucket lies inside that bucket's span, the inter-node chunks on the
    channel's inter-node thread."""
    env = {
        "LIGHT_2D_ALLREDUCE": "1",
        "TIACC_TRAINING_NUM_NCCL_STREAMS": "1",
        "TIACC_TRAINING_TIMELINE": str(tmp_path / "tl"),
    }
    args = ["--out", str(tmp_path), "--modes", "tiacc", "--steps", "2"]
    args += ["--width", "1024", "--bucket-cap-mb", "4"]
    ranks = run_ranks(4, args, env=env, local_size=2, timeout=180)
    assert all(r.returncode == 0 for r in ranks), describe(ranks)
    for rank in range(4):
        trace = events(tmp_path / f"tl.rank{rank}.json")
        names = threads(trace)
        assert {"rank": rank} == {
            "rank": next(e["pid"] for e in trace if e.get("name") == "process_name")
        }
        assert all(e["pid"] == rank for e in trace)
        done = [e for e in trace if e.get("ph") == "X"]
        buckets = [e for e in done if e["name"] == "bucket"]
        queued = [e for e in done if e["name"] == "queued"]
        assert buckets and len(queued) == len(buckets), sorted({e["name"] for e in done})
        assert {names[e["tid"]] for e in buckets} == {"tiacc-comm-0"}
        chunks = [e for e in done if e["name"] == "chunk"]
        assert chunks, sorted({e["name"] for e in done})
        assert {names[e["tid"]] for e in chunks} == {"tiacc-comm-0 inter-node"}
        assert len({e["args"]["chunk"] for e in chunks}) >= 2
        steps = {(e["name"], e["args"].get("group")) for e in done}
        assert ("reduce-scatter", "intra-node") in steps, steps
        assert ("allgather", "intra-node") in steps, steps
        assert ("allreduce", "inter-node") in steps, steps
        # torch's other collectives on the engine (the worker's barriers)
        # hold steps too.
        runs = buckets + [e for e in done if e["name"] == "collective"]
        slack_us = 50.0
        for e in done:
            if e["name"] in ("bucket", "queued", "collective", "queued collective"):
                continue
            if "bucket" not in e["args"]:
                continue
            inside = [
                b
                for b in runs
                if b["args"]["bucket"] == e["args"]["bucket"]
                and b["ts"] - slack_us <= e["ts"]
                and e["ts"] + e["dur"] <= b["ts"] + b["dur"] + slack_us
            ]
            assert inside, f"rank {rank}: {e} lies in no span of its bucket"


def test_a_file_that_cannot_be_written_is_reported_and_the_job_runs(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    env = {"TIACC_TRAINING_TIMELINE": str(blocked / "tl-{rank}.json")}
    args = ["--out", str(tmp_path), "--modes", "tiacc", "--steps", "2"]
    ranks = run_ranks(2, args, env=env, timeout=120)
    assert all(r.returncode == 0 for r in ranks), describe(ranks)
    for rank, r in enumerate(ranks):
        assert f"cannot write {blocked}/tl-{rank}.json" in r.stderr, describe(ranks)

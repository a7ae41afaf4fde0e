"""``benches/bench_amp.py`` end to end at its smallest: every run kind, one seed, two epochs.

Each run is its own process, as in the full benchmark; the results file
must hold every run with its per-epoch figures, the policy's decisions
from ``stats()``, the summary, the computed goals and the machine; the
chart is drawn from it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benches"))

import plot_amp  # noqa: E402

KINDS = ["fp32", "amp_bf16", "policy0_bf16", "policy1_bf16", "policy2_bf16"]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_smallest_configuration_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench_amp.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, str(REPO / "benches" / "bench_amp.py"), "--tiny", "--epochs", "2"]
        + ["--seeds", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())

    assert data["benchmark"] == "bench_amp" and data["tiny"] is True
    assert data["device"] == "cpu"
    assert isinstance(data["cpu_bf16_instructions"], list) and data["cpu_bf16_note"]
    assert data["setup"]["epochs"] == 2 and data["setup"]["seeds"] == 1
    assert [plot_amp.kind_name(r) for r in data["runs"]] == KINDS
    for run in data["runs"]:
        assert run["seed"] == 0 and len(run["epochs"]) == 2
        assert _is_number(run["train_images_per_s"]) and run["train_images_per_s"] > 0
        assert 0.0 <= run["final_heldout_accuracy"] <= 1.0
        for epoch in run["epochs"]:
            assert _is_number(epoch["heldout_accuracy"])
            assert 0.0 <= epoch["heldout_accuracy"] <= 1.0
            assert _is_number(epoch["wall_s"]) and epoch["wall_s"] >= epoch["train_s"] > 0
            assert isinstance(epoch["autocast"], bool)
        on = [e["epoch"] for e in run["epochs"] if e["autocast"]]
        assert run["epochs_autocast_on"] == on
        if run["kind"].startswith("policy"):
            decisions = run["policy"]["decisions"]
            assert [d["epoch"] for d in decisions] == [0, 1]
            assert [d["epoch"] for d in decisions if d["autocast"]] == on
            assert all(d["reason"] and d["detail"] for d in decisions)
        else:
            assert "policy" not in run
            assert on == ([] if run["kind"] == "fp32" else [0, 1])
    # At the documented defaults, per epoch: schedule 0 waits for epoch 10,
    # schedule 2 is on until its first trial's verdict.
    by_kind = {plot_amp.kind_name(r): r for r in data["runs"]}
    assert by_kind["policy0_bf16"]["policy"]["decisions"][0]["reason"] == "before_start"
    assert by_kind["policy2_bf16"]["epochs_autocast_on"] == [0, 1]

    assert list(data["summary"]) == KINDS
    for row in data["summary"].values():
        assert 0.0 <= row["final_heldout_accuracy_mean"] <= 1.0
        assert _is_number(row["train_images_per_s_mean"])
    goals = data["goals"]
    for name in KINDS[2:]:
        assert isinstance(goals[name]["throughput_goal_met"], bool)
        assert isinstance(goals[name]["accuracy_goal_met"], bool)
        assert _is_number(goals[name]["throughput_over_amp"])
        assert _is_number(goals[name]["accuracy_minus_fp32_points"])
    assert data["machine"]["load_average_1_5_15"] and isinstance(data["load"]["loaded"], bool)
    assert "stress" not in data

    chart = tmp_path / "bench_amp.png"
    plot_amp.draw(data, chart)
    assert chart.stat().st_size > 1000

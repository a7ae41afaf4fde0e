"""``benches/bench_amp.py`` end to end at its smallest: every run kind, one seed, two epochs.

Each run is its own process, as in the full benchmark; the results file
must hold every run with its per-epoch figures, the policy's decisions
from ``stats()``, the summary, the computed goals and the machine; the
chart is drawn from it. The stress case alone (``--stress --skip-main``)
at its smallest: the policy, given the model, restores the BatchNorm
statistics an fp16 overflow made NaN.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benches"))

import plot_amp  # noqa: E402

KINDS = ["fp32", "amp_bf16", "policy0_bf16", "policy1_bf16", "policy2_bf16"]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _run_bench(out: Path, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, str(REPO / "benches" / "bench_amp.py"), "--tiny", "--seeds", "1"]
        + list(args)
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_smallest_configuration_end_to_end(tmp_path: Path) -> None:
    data = _run_bench(tmp_path / "bench_amp.json", "--epochs", "2")

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
            # bf16 does not overflow here: nothing to repair, evaluated as trained
            assert epoch["nonfinite_buffers_repaired"] == 0
            assert epoch["eval_autocast"] is epoch["autocast"]
        on = [e["epoch"] for e in run["epochs"] if e["autocast"]]
        assert run["epochs_autocast_on"] == on
        if run["kind"].startswith("policy"):
            decisions = run["policy"]["decisions"]
            assert [d["epoch"] for d in decisions] == [0, 1]
            assert [d["epoch"] for d in decisions if d["autocast"]] == on
            assert all(d["reason"] and d["detail"] for d in decisions)
            assert run["policy"]["buffer_restores"] == 0 and run["policy"]["buffer_log"] == []
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
    assert "model=model" in data["policy_called"] and "repair_buffers" in data["policy_called"]

    chart = tmp_path / "bench_amp.png"
    plot_amp.draw(data, chart)
    assert chart.stat().st_size > 1000


def test_stress_case_alone_the_policy_restores_the_buffers(tmp_path: Path) -> None:
    out = tmp_path / "bench_amp.json"
    data = _run_bench(
        out, "--stress", "--skip-main", "--stress-epochs", "2", "--stress-probe-epochs", "1"
    )
    assert "runs" not in data and "summary" not in data  # no main section to keep
    stress = data["stress"]
    assert isinstance(stress["probes"], list) and stress["machine"] and stress["load"]
    if "chosen" not in stress:
        # whether fp32 learns in one tiny probe epoch is close to the line on some CPUs
        assert stress["note"]
        pytest.skip(f"no stress candidate at --tiny here: {stress['note']}")
    assert "model=model" in stress["policy_called"]
    names = [plot_amp.kind_name(r) for r in stress["runs"]]
    assert sorted(names) == sorted(
        ["fp32", "amp_fp16", "policy0_fp16", "policy1_fp16", "policy2_fp16", "amp_bf16"]
    )
    by_kind = {plot_amp.kind_name(r): r for r in stress["runs"]}
    # Plain fp16 AMP keeps NaN running statistics; schedule 2 (on at epoch 0)
    # meets the same overflow, repairs the buffers before the evaluation,
    # evaluates that epoch in fp32 and trains on in fp32.
    assert by_kind["amp_fp16"]["nonfinite_buffers"]
    policy2 = by_kind["policy2_fp16"]
    assert policy2["epochs_autocast_on"] == [0] and policy2["nonfinite_buffers"] == []
    first = policy2["epochs"][0]
    assert first["nonfinite_buffers_repaired"] > 0 and first["eval_autocast"] is False
    assert policy2["policy"]["buffer_restores"] == 1 and policy2["policy"]["guard_trips"] == 1
    log = policy2["policy"]["buffer_log"]
    assert [(e["epoch"], e["via"], e["restored"]) for e in log] == [(0, "repair_buffers", True)]
    assert policy2["policy"]["decisions"][1]["reason"] == "cooldown"
    assert _is_number(policy2["final_heldout_loss"])
    verdicts = stress["verdicts"]
    assert verdicts["policy2_fp16"]["buffer_restores_per_seed"] == [1]
    assert verdicts["policy2_fp16"]["nonfinite_buffers_per_seed"] == [0]
    assert stress["goal"]["policy2_fp16_met_the_overflow"] is True

"""MixedPrecision_TrainingPolicy: arguments, every rule at its boundaries,
the GradScaler guard, state_dict round trips and a CPU training run."""

from __future__ import annotations

import io
import json
import logging
import math
import re

import pytest
import torch

from tiacc_training import _engine
from tiacc_training.torch import _amp, adaptfp16, tiacc_torch_warp
from tiacc_training.torch.tiacc_torch_warp import MixedPrecision_TrainingPolicy as Policy


def decisions(policy: Policy, counters, **kwargs) -> list[bool]:
    return [policy.enable_mixed_precision(c, **kwargs) for c in counters]


class FakeScaler:
    """Stands in for torch.amp.GradScaler: only get_scale/is_enabled."""

    def __init__(self, scale: float = 65536.0, enabled: bool = True) -> None:
        self.scale = scale
        self.enabled = enabled

    def get_scale(self) -> float:
        return self.scale

    def is_enabled(self) -> bool:
        return self.enabled


# --- construction ---------------------------------------------------------


def test_both_module_names_export_the_class():
    assert adaptfp16.MixedPrecision_TrainingPolicy is tiacc_torch_warp.MixedPrecision_TrainingPolicy


def test_positional_order_follows_the_code_example():
    # (policy, start_step, hold_step, end_step, test_interval, test_step)
    p = Policy(1, 3, 7, 40, 500, 50)
    assert p.state_dict()["config"] == {
        "policy": 1,
        "start": 3,
        "hold": 7,
        "end": 40,
        "interval": 500,
        "interval_hold": 50,
        "cooldown": 100,
    }
    assert p.policy == 1
    assert "hold_time=7" in repr(p)


def test_defaults():
    c = Policy(0).state_dict()["config"]
    assert (c["start"], c["end"], c["hold"], c["interval"], c["interval_hold"]) == (
        10,
        None,
        None,
        1000,
        100,
    )


@pytest.mark.parametrize(
    ("doc", "table", "key", "value"),
    [
        ("start_step", "start_time", "start", 4),
        ("hold_step", "hold_time", "hold", 6),
        ("end_step", "end_time", "end", 90),
        ("test_interval", "interval_time", "interval", 300),
        ("test_step", "interval_hold_time", "interval_hold", 30),
    ],
)
def test_both_spellings(doc, table, key, value):
    base = {} if key == "hold" else {"hold_time": 2}  # policy 1 needs a hold
    a = Policy(1, **base, **{doc: value})
    b = Policy(1, **base, **{table: value})
    assert a.state_dict()["config"][key] == value
    assert b.state_dict()["config"] == a.state_dict()["config"]
    with pytest.raises(TypeError, match=f"{table} and {doc}"):
        Policy(1, **base, **{doc: value, table: value})


def test_positional_and_keyword_spelling_clash():
    with pytest.raises(TypeError, match="start_time and start_step"):
        Policy(0, 5, start_time=5)
    with pytest.raises(TypeError):
        Policy(0, 5, start_step=5)  # Python's own error: given twice


@pytest.mark.parametrize("bad", [3, -1, 10])
def test_bad_policy_number(bad):
    with pytest.raises(ValueError, match="policy must be 0"):
        Policy(bad)


@pytest.mark.parametrize("bad", [True, "0", 0.0, None])
def test_policy_must_be_an_int(bad):
    with pytest.raises(TypeError):
        Policy(bad)


def test_missing_required_parameters_are_named():
    with pytest.raises(ValueError, match=r"policy 1 requires hold_time \(hold_step\)"):
        Policy(1)
    with pytest.raises(ValueError, match=r"policy 0 requires start_time"):
        Policy(0, start_time=None)
    with pytest.raises(ValueError, match="start_time.*hold_time"):
        Policy(1, None)
    with pytest.raises(ValueError, match=r"policy 2 requires interval_time \(test_interval\)"):
        Policy(2, interval_time=None)
    with pytest.raises(ValueError, match=r"interval_hold_time \(test_step\)"):
        Policy(2, test_step=None)
    # Not needed by the policy: fine.
    Policy(2, start_time=None)
    Policy(0, interval_time=None, interval_hold_time=None)


def test_out_of_range_parameters():
    with pytest.raises(ValueError, match="end_time"):
        Policy(0, 10, None, 10)
    Policy(0, 10, None, 11)
    with pytest.raises(ValueError, match="hold_time must be at least 1"):
        Policy(1, hold_time=0)
    with pytest.raises(ValueError, match="interval_hold_time"):
        Policy(2, test_interval=100, test_step=100)
    Policy(2, test_interval=100, test_step=99)
    with pytest.raises(ValueError, match="start_time must be at least 0"):
        Policy(0, -1)
    with pytest.raises(ValueError, match="cooldown"):
        Policy(0, cooldown=-1)
    with pytest.raises(TypeError, match="start_time must be an int"):
        Policy(0, 1.5)
    with pytest.raises(TypeError):
        Policy(0, cooldown=None)


def test_call_argument_checks():
    p = Policy(0)
    with pytest.raises(ValueError, match="epoch"):
        p.enable_mixed_precision(-1)
    with pytest.raises(TypeError, match="epoch"):
        p.enable_mixed_precision(1.0)
    with pytest.raises(ValueError, match="lr must be finite"):
        p.enable_mixed_precision(1, lr=math.nan)
    with pytest.raises(TypeError, match="lr"):
        p.enable_mixed_precision(1, lr="0.1")
    with pytest.raises(ValueError, match="one-element"):
        p.enable_mixed_precision(1, loss=torch.ones(2))
    with pytest.raises(TypeError, match="scaler"):
        p.enable_mixed_precision(1, scaler=object())
    # Accepted forms.
    assert p.enable_mixed_precision(10, lr=torch.tensor(0.1), loss=torch.tensor([0.5])) is True


# --- policy 0 ----------------------------------------------------------------


def test_policy0_window_bounds():
    p = Policy(0, 10, None, 20)
    assert decisions(p, [0, 9, 10, 11, 19, 20, 21]) == [
        False,
        False,
        True,
        True,
        True,
        False,
        False,
    ]
    assert p.last_reason == "after_end"
    p = Policy(0, start_time=10)
    assert decisions(p, [9, 10, 10**12]) == [False, True, True]


# --- policy 1 ----------------------------------------------------------------


def test_policy1_lr_change_holds_for_hold_time():
    p = Policy(1, 0, 5)
    assert p.enable_mixed_precision(0, lr=1.0)
    assert p.enable_mixed_precision(1, lr=0.91)  # 9 %: not a change
    assert not p.enable_mixed_precision(3, lr=0.89)  # 11 %: hold 3..7
    assert p.last_reason == "hold"
    assert not p.enable_mixed_precision(7, lr=0.89)
    assert p.enable_mixed_precision(8, lr=0.89)


def test_policy1_hold_and_window_combine():
    p = Policy(1, 10, 5, 20)
    assert not p.enable_mixed_precision(8, lr=0.1)
    assert not p.enable_mixed_precision(9, lr=0.01)  # hold 9..13
    assert p.last_reason == "hold"
    assert not p.enable_mixed_precision(13, lr=0.01)
    assert p.enable_mixed_precision(14, lr=0.01)
    assert p.enable_mixed_precision(19, lr=0.01)
    assert not p.enable_mixed_precision(20, lr=0.01)


def test_policy1_abnormal_loss():
    def warmed() -> Policy:
        p = Policy(1, start_time=0, hold_time=4)
        for i in range(20):
            assert p.enable_mixed_precision(i, loss=1.1 if i % 2 else 0.9)  # mean 1, std 0.1
        return p

    assert warmed().enable_mixed_precision(20, loss=1.39)  # 3.9 std
    p = warmed()
    assert not p.enable_mixed_precision(20, loss=1.41)  # 4.1 std: hold 20..23
    assert not p.enable_mixed_precision(23)
    assert p.enable_mixed_precision(24)
    assert not warmed().enable_mixed_precision(20, loss=0.59)

    # Fewer than five losses: nothing is judged.
    p = Policy(1, start_time=0, hold_time=4)
    for i in range(4):
        p.enable_mixed_precision(i, loss=1.0)
    assert p.enable_mixed_precision(4, loss=100.0)


# --- policy 2 ----------------------------------------------------------------


def trial(p: Policy, base: int, slope: float, length: int = 4) -> list[bool]:
    out = [p.enable_mixed_precision(base, loss=50.0)]  # the previous window's loss: ignored
    for i in range(1, length + 1):
        out.append(p.enable_mixed_precision(base + i, loss=1.0 - slope * i))
    return out


def test_policy2_trial_windows_and_verdicts():
    p = Policy(2, test_interval=10, test_step=4)
    assert decisions(p, [0, 9]) == [True, True]
    assert p.last_reason == "trend_default"
    assert trial(p, 10, 0.2) == [True, True, True, True, False]  # r = 1.6: too fast
    assert p.last_reason == "trend_fast"
    assert not p.enable_mixed_precision(19)
    assert p.enable_mixed_precision(20)
    assert p.last_reason == "trial"


@pytest.mark.parametrize(
    ("slope", "reason"),
    [
        (0.094, "trend_ok"),  # r = 0.4915
        (0.097, "trend_fast"),  # r = 0.512
        (0.0026, "trend_ok"),  # r = 0.0105
        (0.0024, "trend_slow"),  # r = 0.0097
        (-0.05, "trend_slow"),  # rising
    ],
)
def test_policy2_thresholds(slope, reason):
    p = Policy(2, interval_time=10, interval_hold_time=4)
    trial(p, 10, slope)
    assert p.last_reason == reason
    assert p.enable_mixed_precision(15) is (reason == "trend_ok")


def test_policy2_keeps_verdict_without_enough_losses():
    p = Policy(2, interval_time=10, interval_hold_time=4)
    trial(p, 10, 0.0)
    assert p.last_reason == "trend_slow"
    assert p.enable_mixed_precision(20)
    p.enable_mixed_precision(21, loss=1.0)
    p.enable_mixed_precision(22, loss=0.5)
    assert not p.enable_mixed_precision(24)
    assert p.last_reason == "trend_slow"


# --- counter ---------------------------------------------------------------


def test_counter_going_backwards_restarts():
    p = Policy(2, interval_time=10, interval_hold_time=4)
    trial(p, 10, 0.0)
    assert not p.enable_mixed_precision(15)
    assert p.enable_mixed_precision(3)
    assert p.last_reason == "trend_default"
    assert p.state_dict()["state"]["resets"] == 1
    assert p.enable_mixed_precision(3)  # a repeat is not a restart
    assert p.state_dict()["state"]["resets"] == 1


# --- scaler guard ------------------------------------------------------------


def test_collapsing_scale_cools_down_then_retries():
    p = Policy(0, 0, cooldown=10)
    scaler = FakeScaler(65536.0)
    assert p.enable_mixed_precision(0, scaler=scaler)
    scaler.scale = 32.0  # 2048x below the peak
    assert not p.enable_mixed_precision(1, scaler=scaler)
    assert p.last_trip == "scale_collapse"
    assert p.cooling
    scaler.scale = 64.0
    assert not any(decisions(p, range(2, 11), scaler=scaler))
    assert p.last_reason == "cooldown"
    assert p.enable_mixed_precision(11, scaler=scaler)  # re-armed, peak = 64
    assert not p.cooling


def test_scale_floor_nonfinite_loss_and_overflows():
    p = Policy(0, 0, cooldown=5)
    assert not p.enable_mixed_precision(0, scaler=FakeScaler(0.5))
    assert p.last_trip == "scale_floor"

    p = Policy(0, 0, cooldown=5)
    assert not p.enable_mixed_precision(0, loss=torch.tensor(float("inf")))
    assert p.last_trip == "nonfinite_loss"
    assert not p.enable_mixed_precision(4)
    assert p.enable_mixed_precision(5)

    p = Policy(0, 0, cooldown=5)
    scaler = FakeScaler(65536.0)
    p.enable_mixed_precision(0, scaler=scaler)
    for step in range(1, 6):  # five overflowed steps
        scaler.scale /= 2
        assert p.enable_mixed_precision(step, scaler=scaler)
    scaler.scale /= 2
    assert not p.enable_mixed_precision(6, scaler=scaler)  # the sixth
    assert p.last_trip == "overflow"


def test_backoff_doubles_when_a_retry_fails_soon():
    p = Policy(0, 0, cooldown=10)
    nan = float("nan")
    assert not p.enable_mixed_precision(0, loss=nan)  # 0..9
    assert p.enable_mixed_precision(10)
    assert not p.enable_mixed_precision(12, loss=nan)  # 12..31
    assert not p.enable_mixed_precision(31)
    assert p.enable_mixed_precision(32)


def test_disabled_scaler_and_disabled_guard_are_ignored():
    p = Policy(0, 0)
    assert p.enable_mixed_precision(0, scaler=FakeScaler(0.5, enabled=False))
    p = Policy(0, 0, cooldown=0)
    assert p.enable_mixed_precision(0, loss=float("nan"), scaler=FakeScaler(0.5))


# --- state_dict --------------------------------------------------------------


def scripted(i: int) -> dict:
    loss = float("nan") if i == 37 else 2.0 / (1 + i / 10) + ((i * 7919) % 13) / 100
    return {
        "lr": 0.1 if i < 60 else 0.01,
        "loss": torch.tensor(loss),
        "scaler": FakeScaler(65536.0 / 2 ** ((i // 9) % 7)),
    }


@pytest.mark.parametrize(
    "make",
    [
        lambda: Policy(0, 10, None, 150, cooldown=7),
        lambda: Policy(1, 10, 5, 150, cooldown=7),
        lambda: Policy(2, test_interval=20, test_step=6, cooldown=7),
    ],
)
@pytest.mark.parametrize("cut", [1, 37, 64, 111])
def test_state_dict_resume_decides_identically(make, cut):
    whole = make()
    expected = [whole.enable_mixed_precision(i, **scripted(i)) for i in range(200)]
    assert any(expected) and not all(expected)

    first = make()
    got = [first.enable_mixed_precision(i, **scripted(i)) for i in range(cut)]
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    second = make()
    second.load_state_dict(torch.load(buf))
    got += [second.enable_mixed_precision(i, **scripted(i)) for i in range(cut, 200)]
    assert got == expected
    assert second.state_dict() == whole.state_dict()
    # Plain values only.
    assert json.loads(json.dumps(whole.state_dict())) == whole.state_dict()


def test_load_state_dict_checks():
    sd = Policy(1, 10, 5).state_dict()
    with pytest.raises(ValueError, match="hold="):
        Policy(1, 10, 6).load_state_dict(sd)
    with pytest.raises(ValueError, match="version"):
        Policy(1, 10, 5).load_state_dict({**sd, "version": 99})
    with pytest.raises(TypeError):
        Policy(1, 10, 5).load_state_dict([])
    bad = {**sd, "state": {**sd["state"], "losses": [math.nan]}}
    with pytest.raises(ValueError, match="invalid policy state"):
        Policy(1, 10, 5).load_state_dict(bad)
    bad = {**sd, "state": {**sd["state"], "losses": "x"}}
    with pytest.raises(TypeError, match="losses"):
        Policy(1, 10, 5).load_state_dict(bad)
    missing = {**sd, "state": {k: v for k, v in sd["state"].items() if k != "trips"}}
    with pytest.raises(ValueError, match="trips"):
        Policy(1, 10, 5).load_state_dict(missing)


# --- dtype helper and constants ---------------------------------------------


def test_autocast_dtype(monkeypatch):
    assert Policy.autocast_dtype("cpu") is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert Policy(0).autocast_dtype("cuda") is torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert Policy(0).autocast_dtype("cuda:1") is torch.bfloat16
    assert Policy.autocast_dtype("mps") is torch.float16
    with pytest.raises(TypeError):
        Policy.autocast_dtype(torch.device("cpu"))


def test_docstring_numbers_match_the_engine():
    c = _engine.amp_constants()
    doc = " ".join(Policy.__doc__.split())
    assert f"{c['LR_TOLERANCE']} * max" in doc
    assert f"{c['LOSS_MIN_SAMPLES']} of the last {c['LOSS_WINDOW']}" in doc
    assert f"max({c['LOSS_SIGMAS']:g} * std, {c['LOSS_REL_FLOOR']} * |mean|)" in doc
    assert f"r > {c['TREND_FAST']}" in doc and f"r < {c['TREND_SLOW']}" in doc
    assert f"Fewer than {c['TREND_MIN_POINTS']} losses" in doc
    assert f"one below {c['SCALE_FLOOR']}" in doc
    assert f"at least {c['SCALE_COLLAPSE']:g} times" in doc
    assert f"{c['OVERFLOW_LIMIT']} scale decreases" in doc
    assert f"the last {c['OVERFLOW_WINDOW']} calls" in doc
    assert f"up to {2 ** c['MAX_BACKOFF']} x" in doc


# --- a real CPU run ------------------------------------------------------------


@pytest.mark.skipif(
    not hasattr(torch.amp, "GradScaler"), reason="torch < 2.3 has no CPU GradScaler (torch.amp)"
)
def test_cpu_training_with_bf16_autocast_and_grad_scaler():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.1)
    scaler = torch.amp.GradScaler("cpu")
    policy = Policy(1, 5, 4, 40)
    dtype = policy.autocast_dtype("cpu")
    x = torch.randn(64, 8)
    y = x.sum(dim=1, keepdim=True)
    loss = None
    enabled, losses = [], []
    for step in range(48):
        on = policy.enable_mixed_precision(step, opt.param_groups[0]["lr"], loss, scaler=scaler)
        enabled.append(on)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=on):
            out = model(x)
            assert out.dtype == (torch.bfloat16 if on else torch.float32)
            loss = torch.nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    # Off before 5; the lr decay seen at step 25 holds 25..28; off from 40.
    assert not any(enabled[:5])
    assert enabled[24] and not any(enabled[25:29]) and enabled[29]
    assert not any(enabled[40:])
    assert sum(enabled) >= 20


@pytest.mark.gpu
def test_cuda_fp16_autocast_with_grad_scaler():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cuda")
    policy = Policy(0, 2, None, 30)
    x = torch.randn(64, 8, device="cuda")
    y = x.sum(dim=1, keepdim=True)
    loss = None
    for step in range(32):
        on = policy.enable_mixed_precision(step, 0.05, loss, scaler=scaler)
        assert on is (2 <= step < 30)
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16, enabled=on):
            out = model(x)
            assert out.dtype == (torch.float16 if on else torch.float32)
            loss = torch.nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert math.isfinite(loss.item())
    assert policy.autocast_dtype("cuda") in (torch.bfloat16, torch.float16)


# --- stats() and the log lines -------------------------------------------------

AMP_LOGGER = "tiacc_training.torch._amp"


def logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == AMP_LOGGER]


def reasons(policy: Policy) -> list[tuple[int, bool, str]]:
    return [(e["epoch"], e["autocast"], e["reason"]) for e in policy.stats()["epochs"]]


def test_stats_policy0_settings_counts_and_reasons():
    p = Policy(0, 2, None, 5, cooldown=7)
    s = p.stats()
    assert s["epochs_seen"] == 0 and s["last"] is None and s["epochs"] == []
    decisions(p, range(7))
    s = p.stats()
    assert (s["policy"], s["schedule"]) == (0, "time")
    assert s["settings"] == {"start_time": 2, "end_time": 5, "cooldown": 7}
    assert s["thresholds"] == {
        "scale_floor": 1.0,
        "scale_collapse": 1024.0,
        "overflow_window": 32,
        "overflow_limit": 6,
        "max_backoff": 4,
    }
    assert (s["epochs_seen"], s["epochs_on"], s["epochs_off"], s["changes"]) == (7, 3, 4, 2)
    assert (s["restarts"], s["guard_trips"], s["epochs_dropped"], s["changes_dropped"]) == (
        0,
        0,
        0,
        0,
    )
    assert reasons(p) == [
        (0, False, "before_start"),
        (1, False, "before_start"),
        (2, True, "window"),
        (3, True, "window"),
        (4, True, "window"),
        (5, False, "after_end"),
        (6, False, "after_end"),
    ]
    assert s["epochs"][0]["detail"] == "epoch 0 is before start_time 2"
    assert s["epochs"][3]["detail"] == "epoch 3 is inside start_time 2 <= epoch < end_time 5"
    assert s["last"] == s["epochs"][-1]
    assert s["last"]["detail"] == "epoch 6 is at or after end_time 5"
    assert [(c["epoch"], c["autocast"], c["message"]) for c in s["change_log"]] == [
        (2, True, "epoch 2: autocast on: epoch 2 is inside start_time 2 <= epoch < end_time 5"),
        (5, False, "epoch 5: autocast off: epoch 5 is at or after end_time 5"),
    ]
    # Without a guard, no guard thresholds; without an end, the open window.
    p = Policy(0, 3, cooldown=0)
    p.enable_mixed_precision(4)
    s = p.stats()
    assert s["thresholds"] == {} and s["settings"] == {
        "start_time": 3,
        "end_time": None,
        "cooldown": 0,
    }
    assert s["last"]["detail"] == "epoch 4 is at or after start_time 3 (no end_time)"
    assert json.loads(json.dumps(s)) == s


def test_stats_policy1_names_the_event_and_its_numbers():
    p = Policy(1, 0, 3)
    for i in range(20):
        p.enable_mixed_precision(i, lr=0.1, loss=1.1 if i % 2 else 0.9)  # mean 1, std 0.1
    assert not p.enable_mixed_precision(20, lr=0.1, loss=1.5)  # 0.5 from the mean > 0.4
    assert not p.enable_mixed_precision(22, lr=0.1)
    assert p.enable_mixed_precision(23, lr=0.1)
    assert not p.enable_mixed_precision(24, lr=0.08)  # 20 % change
    assert not p.enable_mixed_precision(27, lr=0.1)  # back up: 20 % of the larger
    s = p.stats()
    assert (s["policy"], s["schedule"]) == (1, "time + learning rate")
    assert s["settings"] == {"start_time": 0, "end_time": None, "hold_time": 3, "cooldown": 100}
    assert s["thresholds"]["lr_tolerance"] == 0.1
    assert s["thresholds"]["loss_window"] == 20 and s["thresholds"]["loss_min_samples"] == 5
    assert s["thresholds"]["loss_sigmas"] == 4.0 and s["thresholds"]["loss_rel_floor"] == 0.02
    assert (s["epochs_seen"], s["epochs_on"], s["epochs_off"], s["changes"]) == (25, 21, 4, 4)
    by_epoch = {e["epoch"]: e for e in s["epochs"]}
    assert by_epoch[20]["reason"] == "hold"
    assert by_epoch[20]["detail"] == (
        "loss 1.5 is 0.5 from the mean 1 of the last 20 losses "
        "(limit 0.4 = max(4 x std 0.1, 2% of the mean)): fp32 hold through epoch 22"
    )
    assert by_epoch[22]["detail"].startswith("fp32 hold through epoch 22 (since epoch 20: loss 1.5")
    assert by_epoch[23]["detail"] == (
        "the fp32 hold is over; epoch 23 is at or after start_time 0 (no end_time)"
    )
    assert by_epoch[24]["detail"] == (
        "learning rate changed from 0.1 to 0.08 (by 20.0%, more than 10%): "
        "fp32 hold through epoch 26"
    )
    assert by_epoch[27]["detail"] == (
        "learning rate changed from 0.08 to 0.1 (by 20.0%, more than 10%): "
        "fp32 hold through epoch 29"
    )
    assert [(c["epoch"], c["autocast"], c["reason"]) for c in s["change_log"]] == [
        (0, True, "window"),
        (20, False, "hold"),
        (23, True, "window"),
        (24, False, "hold"),
    ]


def trend_run(slopes: list[float]) -> Policy:
    p = Policy(2, interval_time=10, interval_hold_time=4)
    decisions(p, range(10))
    for k, slope in enumerate(slopes, start=1):
        trial(p, 10 * k, slope)
        decisions(p, range(10 * k + 5, 10 * k + 10))
    return p


def test_stats_policy2_reports_the_trend_and_its_verdict():
    p = trend_run([0.2, 0.05, -0.05, 0.001])
    s = p.stats()
    assert (s["policy"], s["schedule"]) == (2, "loss trend")
    assert s["settings"] == {"interval_time": 10, "interval_hold_time": 4, "cooldown": 100}
    assert {k: s["thresholds"][k] for k in ("trend_min_points", "trend_fast", "trend_slow")} == {
        "trend_min_points": 3,
        "trend_fast": 0.5,
        "trend_slow": 0.01,
    }
    by_epoch = {e["epoch"]: e for e in s["epochs"]}
    assert by_epoch[0]["reason"] == "trend_default"
    assert by_epoch[0]["detail"] == "no loss-trend verdict yet (next trial at epoch 10)"
    assert by_epoch[10]["detail"] == (
        "loss-trend trial 1: mixed precision for epochs 10-13 while the losses are measured"
    )
    # Losses 0.8, 0.6, 0.4, 0.2: slope -0.2, mean 0.5, r = 0.2 * 4 / 0.5 = 1.6.
    assert by_epoch[14]["reason"] == "trend_fast"
    assert by_epoch[14]["detail"] == (
        "over trial 1 (epochs 10-13, 4 losses) the fitted loss fell 160.0%, "
        "more than 50%: falling too fast (until the next trial at epoch 20)"
    )
    # 0.95 ... 0.8: r = 0.05 * 4 / 0.875.
    assert by_epoch[24]["reason"] == "trend_ok"
    assert by_epoch[24]["detail"].startswith("over trial 2 (epochs 20-23, 4 losses) the fitted ")
    assert "loss fell 22.9%, between 1% and 50%" in by_epoch[24]["detail"]
    assert by_epoch[34]["reason"] == "trend_slow"
    assert "loss rose 17.8%, less than a 1% fall: too slow" in by_epoch[34]["detail"]
    assert "loss fell 0.4%, less than a 1% fall" in by_epoch[44]["detail"]
    assert [(c["epoch"], c["autocast"], c["reason"]) for c in s["change_log"]] == [
        (0, True, "trend_default"),
        (14, False, "trend_fast"),
        (20, True, "trial"),
        (34, False, "trend_slow"),
        (40, True, "trial"),
        (44, False, "trend_slow"),
    ]
    assert s["changes"] == 6 and s["epochs_seen"] == 50 and s["epochs_on"] == 32

    # A trial with too few losses keeps the verdict and says so.
    p = trend_run([0.0])
    decisions(p, [20])
    p.enable_mixed_precision(21, loss=1.0)
    p.enable_mixed_precision(22, loss=0.5)
    assert not p.enable_mixed_precision(24)
    assert p.stats()["last"]["detail"] == (
        "trial 2 (epochs 20-23) gave 2 usable losses, fewer than 3: no new verdict; "
        "over trial 1 (epochs 10-13, 4 losses) the fitted loss stayed flat (0.0%), "
        "less than a 1% fall: too slow (until the next trial at epoch 30)"
    )


def test_stats_scaler_guard_trips_with_their_numbers():
    p = Policy(0, 0, cooldown=10)
    scaler = FakeScaler(65536.0)
    p.enable_mixed_precision(0, scaler=scaler)
    scaler.scale = 32.0
    assert not p.enable_mixed_precision(1, scaler=scaler)
    assert not p.enable_mixed_precision(5, scaler=scaler)
    assert p.enable_mixed_precision(11, scaler=scaler)
    s = p.stats()
    assert s["guard_trips"] == 1
    detail = [e["detail"] for e in s["epochs"]]
    assert detail[1] == (
        "scaler guard tripped: the loss scale 32 is 2048x below its peak 65536 "
        "(limit 1024x): fp32 for a cool-down of 10 epochs, through epoch 10"
    )
    assert s["epochs"][1]["reason"] == "cooldown"
    assert detail[2] == (
        "the scaler guard's cool-down runs through epoch 10 (tripped at epoch 1: "
        "the loss scale 32 is 2048x below its peak 65536 (limit 1024x))"
    )
    assert detail[3] == (
        "the scaler guard's cool-down is over (it ran through epoch 10) and the guard "
        "re-armed; epoch 11 is at or after start_time 0 (no end_time)"
    )

    # A second trip soon after: the cool-down doubles, and the line says why.
    assert not p.enable_mixed_precision(12, loss=math.inf)
    assert p.stats()["last"]["detail"] == (
        "scaler guard tripped: the loss is inf: fp32 for a cool-down of 20 epochs "
        "(2 x cooldown 10: less than 10 epochs after the previous cool-down, which ran "
        "through epoch 10), through epoch 31"
    )
    assert p.enable_mixed_precision(32)
    assert not p.enable_mixed_precision(45, loss=math.nan)
    assert p.stats()["last"]["detail"] == (
        "scaler guard tripped: the loss is nan: fp32 for a cool-down of 40 epochs "
        "(4 x cooldown 10: less than 20 epochs after the previous cool-down, which ran "
        "through epoch 31), through epoch 84"
    )

    p = Policy(0, 0, cooldown=5)
    assert not p.enable_mixed_precision(0, scaler=FakeScaler(0.5))
    assert "the loss scale 0.5 is below 1" in p.stats()["last"]["detail"]
    p = Policy(0, 0, cooldown=5)
    assert not p.enable_mixed_precision(0, scaler=FakeScaler(math.inf))
    assert "the loss scale is inf" in p.stats()["last"]["detail"]
    p = Policy(0, 0, cooldown=5)
    scaler = FakeScaler(65536.0)
    for step in range(7):
        p.enable_mixed_precision(step, scaler=scaler)
        scaler.scale /= 2
    assert p.last_trip == "overflow"
    assert p.stats()["last"]["detail"].startswith(
        "scaler guard tripped: the loss scale fell on 6 of the last 7 calls "
        "(overflowed steps; limit 6): fp32 for a cool-down of 5 epochs"
    )


def test_a_log_line_per_change_and_none_while_unchanged(caplog):
    caplog.set_level(logging.INFO, logger="tiacc_training")
    p = Policy(1, 2, 3, 30, cooldown=4)
    decisions(p, [0, 1], lr=0.1)
    assert logged(caplog) == []  # off before the first call, off now: no change
    decisions(p, range(2, 8), lr=0.1)
    assert logged(caplog) == [
        "epoch 2: autocast on: epoch 2 is inside start_time 2 <= epoch < end_time 30"
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == AMP_LOGGER)
    caplog.clear()
    decisions(p, range(8, 12), lr=0.05)  # the first call fires a hold through 10
    p.enable_mixed_precision(12, lr=0.05, loss=math.nan)  # a trip: off through 15
    decisions(p, range(13, 20), lr=0.05)
    assert logged(caplog) == [
        "epoch 8: autocast off: learning rate changed from 0.1 to 0.05 (by 50.0%, more "
        "than 10%): fp32 hold through epoch 10",
        "epoch 11: autocast on: the fp32 hold is over; epoch 11 is inside start_time 2 <= "
        "epoch < end_time 30",
        "epoch 12: autocast off: scaler guard tripped: the loss is nan: fp32 for a cool-down "
        "of 4 epochs, through epoch 15",
        "epoch 16: autocast on: the scaler guard's cool-down is over (it ran through epoch 15) "
        "and the guard re-armed; epoch 16 is inside start_time 2 <= epoch < end_time 30",
    ]
    assert [c["message"] for c in p.stats()["change_log"]][1:] == logged(caplog)
    caplog.clear()
    decisions(p, range(20, 30), lr=0.05)
    decisions(p, [29, 29])  # a repeated counter, unchanged
    assert logged(caplog) == []
    assert p.stats()["changes"] == 5


def test_restart_resume_and_history_limit(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="tiacc_training")
    p = Policy(0, 2, None, 5)
    decisions(p, range(5))
    assert p.enable_mixed_precision(4)
    caplog.clear()
    assert not p.enable_mixed_precision(1)
    assert logged(caplog) == [
        "epoch 1: autocast off: the counter went back from 4 to 1: the policy restarted; "
        "epoch 1 is before start_time 2"
    ]
    s = p.stats()
    assert (s["restarts"], s["changes"], s["epochs_seen"]) == (1, 2, 7)
    # A restart that trips the guard at once: counted and explained.
    p = Policy(0, 0, cooldown=3)
    decisions(p, [0, 1], loss=math.nan)
    decisions(p, [5, 6])
    assert not p.enable_mixed_precision(2, loss=math.nan)
    s = p.stats()
    assert (s["restarts"], s["guard_trips"]) == (1, 2)
    assert s["last"]["detail"] == (
        "the counter went back from 6 to 2: the policy restarted; scaler guard tripped: "
        "the loss is nan: fp32 for a cool-down of 3 epochs, through epoch 4"
    )

    # A resumed policy compares with the saved answer: on stays on, silently.
    p = Policy(0, 2, None, 5)
    decisions(p, range(4))
    q = Policy(0, 2, None, 5)
    q.load_state_dict(p.state_dict())
    caplog.clear()
    assert q.enable_mixed_precision(4)
    assert logged(caplog) == [] and q.stats()["changes"] == 0
    assert not q.enable_mixed_precision(5)
    assert logged(caplog) == ["epoch 5: autocast off: epoch 5 is at or after end_time 5"]

    # Loading a state forgets what the explanations knew of the old one.
    p = Policy(1, 0, 5)
    decisions(p, [0, 1], lr=0.1)
    p.enable_mixed_precision(2, lr=0.01)  # a hold through 6, explained
    other = Policy(1, 0, 5)
    decisions(other, [0, 1], lr=0.1)
    other.enable_mixed_precision(3, lr=0.5)  # a hold through 7
    p.load_state_dict(other.state_dict())
    assert not p.enable_mixed_precision(4, lr=0.5)
    assert p.stats()["last"]["detail"] == (
        "fp32 hold through epoch 7 after a learning-rate change or an abnormal loss"
    )

    # The lists keep the newest entries; the counts cover every call.
    monkeypatch.setattr(_amp._policy, "_HISTORY_LIMIT", 1)
    p = Policy(0, 2, None, 5)
    decisions(p, range(10))
    s = p.stats()
    assert [e["epoch"] for e in s["epochs"]] == [9]
    assert [c["epoch"] for c in s["change_log"]] == [5]
    assert (s["epochs_seen"], s["epochs_dropped"], s["changes"], s["changes_dropped"]) == (
        10,
        9,
        2,
        1,
    )


FALLBACKS = (
    "after a learning-rate change or an abnormal loss",
    "the last loss-trend verdict was",
    "cool-down runs through epoch \\d+ after",
)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Policy(0, 10, None, 150, cooldown=7),
        lambda: Policy(1, 10, 5, 150, cooldown=7),
        lambda: Policy(2, test_interval=20, test_step=6, cooldown=7),
    ],
)
def test_stats_explain_each_engine_decision(make):
    p = make()
    answers, events, trips = [], [], []
    state = p.state_dict()["state"]
    for i in range(200):
        call = scripted(i)
        if i in (90, 91):
            call["loss"] = torch.tensor(10.0 * (i - 89))  # loss spikes
        answers.append(p.enable_mixed_precision(i, **call))
        previous, state = state, p.state_dict()["state"]
        if state["hold_until"] is not None and state["hold_until"] != previous["hold_until"]:
            events.append(i)
        if state["trips"] > previous["trips"]:
            trips.append(i)
    s = p.stats()
    assert [(e["epoch"], e["autocast"]) for e in s["epochs"]] == list(enumerate(answers))
    flips = [i for i, on in enumerate(answers) if on != (answers[i - 1] if i else False)]
    assert [c["epoch"] for c in s["change_log"]] == flips and s["changes"] == len(flips)
    assert s["epochs_on"] == sum(answers)
    assert trips and s["guard_trips"] == len(trips)
    for e in s["epochs"]:
        assert not any(re.search(f, e["detail"]) for f in FALLBACKS), e
        named = re.search(r"(changed from|from the mean).*\): fp32 hold through", e["detail"])
        assert bool(named) is (e["epoch"] in events), e
        assert ("scaler guard tripped" in e["detail"]) is (e["epoch"] in trips), e
    if s["policy"] == 1:
        assert 60 in events and 90 in events and 91 in events
    if s["policy"] == 2:
        assert any("the fitted loss" in e["detail"] for e in s["epochs"])


# --- buffer protection (model=, repair_buffers) ---------------------------------


class WithStats(torch.nn.Module):
    """Linear -> BatchNorm1d -> Linear, plus a float buffer of its own and an int one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 2)
        self.register_buffer("ema", torch.zeros(8))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc(x))
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * h.detach().float().mean(dim=0))
                self.seen += 1
        return self.head(torch.relu(h))


# named_buffers(): the module's own first
FLOAT_BUFFERS = ["ema", "bn.running_mean", "bn.running_var"]


def buffer_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def warnings_logged(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == AMP_LOGGER and r.levelno == logging.WARNING
    ]


def test_nonfinite_buffers_are_restored_from_the_last_finite_copy(caplog):
    caplog.set_level(logging.INFO, logger="tiacc_training")
    torch.manual_seed(0)
    model = WithStats()
    p = Policy(0, 0, None, None, cooldown=5)
    for step in range(4):
        assert p.enable_mixed_precision(step, 0.1, 1.0, model=model) is True
        model(torch.randn(16, 4))
    copy = buffer_values(model)  # what the call at step 4 copies
    assert p.enable_mixed_precision(4, 0.1, 1.0, model=model) is True
    model(torch.randn(16, 4))  # moves every buffer on
    model.bn.running_var[3] = math.inf
    model.ema[0] = math.nan
    storage = {name: (b.data_ptr(), b.device) for name, b in model.named_buffers()}
    seen = int(model.seen)
    assert warnings_logged(caplog) == []

    assert p.enable_mixed_precision(5, 0.1, 1.0, model=model) is False
    for name, b in model.named_buffers():
        assert (b.data_ptr(), b.device) == storage[name]  # in place
        if name in FLOAT_BUFFERS:
            assert torch.equal(b, copy[name]), name  # every float buffer, exactly
    assert int(model.seen) == seen  # integer buffers are left alone
    s = p.stats()
    assert s["buffer_restores"] == 1 and s["guard_trips"] == 1
    assert s["buffer_checks"] == 6 and s["buffers_watched"] == 3
    assert s["buffer_log"] == [
        {
            "epoch": 5,
            "via": "enable_mixed_precision",
            "buffers": ["ema", "bn.running_var"],
            "watched": 3,
            "restored": True,
            "copy_epoch": 4,
            "copy_via": "enable_mixed_precision",
        }
    ]
    assert p.cooling and p.last_reason == "cooldown" and p.last_trip == "nonfinite_buffers"
    # the engine records it as a non-finite loss; the loss passed was finite
    assert p.state_dict()["state"]["last_trip"] == "nonfinite_loss"
    restore = (
        "2 non-finite model buffers (ema, bn.running_var): restored all 3 floating-point "
        "buffers from the copy taken at epoch 4"
    )
    assert warnings_logged(caplog) == [f"epoch 5: {restore} (buffer_restores=1)"]
    assert s["last"]["detail"] == (
        f"scaler guard tripped: {restore}: fp32 for a cool-down of 5 epochs, through epoch 9"
    )
    assert logged(caplog)[-1] == f"epoch 5: autocast off: {s['last']['detail']}"

    # Finite again: nothing is restored, the copy follows the buffers.
    caplog.clear()
    model(torch.randn(16, 4))
    later = buffer_values(model)
    assert p.enable_mixed_precision(6, 0.1, 1.0, model=model) is False  # cooling down
    model.bn.running_mean.fill_(math.nan)
    assert p.enable_mixed_precision(7, 0.1, 1.0, model=model) is False
    assert all(torch.equal(b, later[n]) for n, b in model.named_buffers() if n in FLOAT_BUFFERS)
    s = p.stats()
    assert s["buffer_restores"] == 2 and s["guard_trips"] == 1  # no new trip while cooling
    assert "(no new trip)" in s["last"]["detail"]
    assert len(warnings_logged(caplog)) == 1


def test_buffers_and_a_nonfinite_loss_trip_as_a_nonfinite_loss():
    model = WithStats()
    p = Policy(0, 0, None, None, cooldown=3)
    p.enable_mixed_precision(0, model=model)
    model.bn.running_mean[0] = math.nan
    assert p.enable_mixed_precision(1, loss=math.inf, model=model) is False
    assert p.last_trip == "nonfinite_loss"
    detail = p.stats()["last"]["detail"]
    assert detail.startswith("scaler guard tripped: the loss is inf and 1 non-finite model buffer")


def test_model_argument_checks():
    p = Policy(0, 0, None, None)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        p.enable_mixed_precision(0, model="resnet")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got OrderedDict"):
        p.enable_mixed_precision(0, model=WithStats().state_dict())
    with pytest.raises(TypeError, match="got NoneType|got None"):
        p.repair_buffers(None)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got list"):
        p.repair_buffers([torch.zeros(2)])
    with pytest.raises(TypeError):  # keyword only: the reference's positions are unchanged
        p.enable_mixed_precision(0, 0.1, 1.0, None, WithStats())
    assert p.stats()["epochs_seen"] == 0  # a refused call decides nothing
    # an empty container is a model too (and has nothing to protect)
    assert p.enable_mixed_precision(0, model=torch.nn.Sequential()) is True
    assert p.stats()["buffer_checks"] == 0


def test_repair_buffers_before_an_epoch_end_evaluation(caplog):
    caplog.set_level(logging.WARNING, logger="tiacc_training")
    torch.manual_seed(0)
    model = WithStats()
    p = Policy(0, 0, None, None, cooldown=2)
    assert p.repair_buffers(model) == []  # a check before the first call copies too
    assert p.enable_mixed_precision(0, 0.1, None, model=model) is True
    model(torch.randn(16, 4))
    assert p.repair_buffers(model) == []  # end of epoch 0: finite, copied
    epoch0 = buffer_values(model)
    assert p.enable_mixed_precision(1, 0.1, 1.0, model=model) is True
    model(torch.randn(16, 4))
    model.bn.running_var.fill_(math.inf)  # epoch 1 overflowed
    assert p.repair_buffers(model) == ["bn.running_var"]
    assert all(torch.equal(b, epoch0[n]) for n, b in model.named_buffers() if n in FLOAT_BUFFERS)
    assert not p.cooling  # the trip comes with the next decision
    assert warnings_logged(caplog) == [
        "repair_buffers() after epoch 1: 1 non-finite model buffer (bn.running_var): restored "
        "all 3 floating-point buffers from the copy taken at epoch 1 (buffer_restores=1)"
    ]
    assert p.enable_mixed_precision(2, 0.1, 1.0, model=model) is False
    assert p.cooling and p.last_trip == "nonfinite_buffers"
    s = p.stats()
    assert s["guard_trips"] == 1 and s["buffer_restores"] == 1
    assert s["buffer_log"][0]["via"] == "repair_buffers" and s["buffer_log"][0]["epoch"] == 1
    assert "(found by repair_buffers() after epoch 1)" in s["last"]["detail"]
    # The restore is reported once: the next call neither restores nor trips again.
    assert p.enable_mixed_precision(3, 0.1, 1.0, model=model) is False
    assert p.enable_mixed_precision(4, 0.1, 1.0, model=model) is True
    assert p.stats()["guard_trips"] == 1 and len(warnings_logged(caplog)) == 1


def test_no_finite_copy_nothing_restored_but_the_guard_trips(caplog):
    caplog.set_level(logging.WARNING, logger="tiacc_training")
    model = WithStats()
    model.ema[2] = -math.inf  # bad before the first check
    p = Policy(2, cooldown=4)
    assert p.enable_mixed_precision(0, model=model) is False
    assert torch.isinf(model.ema[2])
    s = p.stats()
    assert s["buffer_restores"] == 0 and s["guard_trips"] == 1
    assert s["buffer_log"][0]["restored"] is False and s["buffer_log"][0]["copy_epoch"] is None
    assert warnings_logged(caplog) == [
        "epoch 0: 1 non-finite model buffer (ema): no finite copy of these buffers to restore "
        "(buffer_restores=0)"
    ]
    # A copy of other buffers (another model) is not used either.
    p2 = Policy(0, 0, None, None)
    p2.enable_mixed_precision(0, model=torch.nn.BatchNorm1d(3))
    assert p2.repair_buffers(model) == ["ema"] and p2.stats()["buffer_restores"] == 0


def test_load_state_dict_drops_the_copy_and_state_dict_is_unchanged():
    model = WithStats()
    p = Policy(0, 0, None, None, cooldown=3)
    p.enable_mixed_precision(0, model=model)
    saved = p.state_dict()
    assert saved == Policy(0, 0, None, None, cooldown=3).state_dict() | {"state": saved["state"]}
    q = Policy(0, 0, None, None, cooldown=3)
    q.enable_mixed_precision(0)
    assert saved == q.state_dict()  # model= adds nothing to the state
    json.dumps(saved)
    p.load_state_dict(saved)
    model.bn.running_mean[0] = math.nan
    assert p.repair_buffers(model) == ["bn.running_mean"]
    assert p.stats()["buffer_log"][-1]["restored"] is False  # the copy went with the load


def test_cooldown_zero_restores_without_a_trip():
    model = WithStats()
    p = Policy(0, 0, None, None, cooldown=0)
    copy = buffer_values(model)
    p.enable_mixed_precision(0, model=model)
    model.bn.running_var[0] = math.nan
    assert p.enable_mixed_precision(1, model=model) is True
    assert torch.equal(model.bn.running_var, copy["bn.running_var"])
    s = p.stats()
    assert s["buffer_restores"] == 1 and s["guard_trips"] == 0 and p.last_trip is None
    assert "(the guard is off: cooldown=0)" in s["last"]["detail"]


def test_per_step_training_without_trouble_never_restores(caplog):
    caplog.set_level(logging.WARNING, logger="tiacc_training")
    answers = {}
    for protect in (False, True):
        torch.manual_seed(0)
        model = WithStats()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        policy = Policy(1, 3, 4, 40, cooldown=5)
        x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
        loss, on = None, []
        for step in range(30):
            lr = 0.05 if step < 15 else 0.005
            extra = {"model": model} if protect else {}
            on.append(policy.enable_mixed_precision(step, lr, loss, **extra))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on[-1]):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()
        answers[protect] = on
        s = policy.stats()
        assert s["buffer_restores"] == 0 and s["buffer_log"] == [] and s["guard_trips"] == 0
        assert s["buffer_checks"] == (30 if protect else 0)
    assert answers[True] == answers[False]  # the decisions are untouched
    assert warnings_logged(caplog) == []


def _fp16_autocast_on_cpu() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            out = torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2))
    except (RuntimeError, ValueError):
        return False
    return out.dtype == torch.float16 and hasattr(torch.amp, "GradScaler")


@pytest.mark.parametrize(
    "device",
    [
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                not _fp16_autocast_on_cpu(), reason="no fp16 autocast and GradScaler on CPU"
            ),
        ),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ],
)
def test_fp16_overflow_leaves_batchnorm_finite_only_with_model(device):
    """The stress case in small: inputs that overflow fp16 in the first layer."""
    x = (torch.randn(64, 4) * 3e4).to(device)
    y = (x[:, 0] > 0).long()
    finals = {}
    for protect in (False, True):
        torch.manual_seed(0)
        model = WithStats().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler(device)
        policy = Policy(0, 0, None, None, cooldown=8)
        loss = None
        for step in range(20):
            extra = {"model": model} if protect else {}
            on = policy.enable_mixed_precision(step, 0.01, loss, scaler=scaler, **extra)
            opt.zero_grad()
            with torch.autocast(device, dtype=torch.float16, enabled=on):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if protect:
            policy.repair_buffers(model)  # the last step may have overflowed
        model.eval()
        with torch.no_grad():
            finals[protect] = model(x)
        s = policy.stats()
        assert s["guard_trips"] >= 1  # the overflow was met
        assert (s["buffer_restores"] >= 1) is protect
    assert not torch.isfinite(finals[False]).all()  # NaN running statistics
    assert torch.isfinite(finals[True]).all()


def test_buffers_of_several_dtypes_and_layouts_are_restored_exactly():
    model = WithStats()
    model.register_buffer("low", torch.linspace(-1, 1, 5, dtype=torch.float16))
    model.register_buffer("wide", torch.arange(12.0, dtype=torch.float64).view(3, 4).t())
    model.register_buffer("empty", torch.zeros(0))
    assert not model.wide.is_contiguous()
    p = Policy(0, 0, None, None, cooldown=2)
    p.enable_mixed_precision(0, model=model)
    copy = buffer_values(model)
    model.low[1] = math.inf
    model.wide[2, 1] = math.nan
    model.bn.running_mean.add_(1.0)  # finite, but restored with the others
    assert p.repair_buffers(model) == ["low", "wide"]
    for name, b in model.named_buffers():
        assert b.dtype == copy[name].dtype and torch.equal(b, copy[name]), name
    assert not model.wide.is_contiguous()
    assert p.stats()["buffers_watched"] == 6
    # The buffers changed dtype: a new copy is taken, the old one is not used.
    model.double()
    p.enable_mixed_precision(1, model=model)
    model.bn.running_var[0] = math.nan
    assert p.repair_buffers(model) == ["bn.running_var"]
    assert model.bn.running_var.dtype == torch.float64
    assert torch.equal(model.bn.running_var, copy["bn.running_var"].double())

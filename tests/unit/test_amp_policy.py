"""MixedPrecision_TrainingPolicy: arguments, every rule at its boundaries,
the GradScaler guard, state_dict round trips and a CPU training run."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from tiacc_training import _engine
from tiacc_training.torch import adaptfp16, tiacc_torch_warp
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

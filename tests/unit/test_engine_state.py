"""``tdist.state_dict()`` / ``tdist.load_state_dict()``: the engines' state in a checkpoint.

Engines of a world of one (both kinds: the CPU engine, and the device
engine on CPU tensors with torch's kernels) run Top-K with the momentum
correction; a state saved after some steps and loaded into fresh engines
continues bit for bit. Then the error paths: a malformed dict names its
key, another rank's state names both ranks, a state that does not fit an
engine names the setting or bucket and both values, and a state loaded
before its engine exists is held and applied when it is built.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tiacc_training.torch.distributed as tdist
from tiacc_training import _engine
from tiacc_training.torch.distributed import _engine_state
from tiacc_training.torch.distributed._kernels import TorchKernels
from tiacc_training.torch.distributed._state import state

TOPK = {
    "LIGHT_TOPK_ALLREDUCE": "1",
    "LIGHT_TOPK_RATIO": "0.1",
    "LIGHT_TOPK_THRESHOLD": "0",
    "TIACC_TRAINING_TOPK_MOMENTUM": "0.9",
    "TIACC_TRAINING_TOPK_WARMUP_STEPS": "4",
    "TIACC_TRAINING_NUM_NCCL_STREAMS": "2",
}
LENS = (200, 77, 130)


@pytest.fixture
def config(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name, value in TOPK.items():
        monkeypatch.setenv(name, value)
    return _engine.CommConfig.from_env()


@pytest.fixture
def clean_state() -> Iterator[None]:
    keys = ("engine", "cuda", "retired_counters", "launch")
    saved = {k: state.__dict__[k] for k in keys}
    pending = dict(_engine_state.pending)
    state.__dict__.update(engine=None, cuda=None, retired_counters={}, launch=None)
    _engine_state.expected_sizes.clear()
    _engine_state.pending.clear()
    try:
        yield
    finally:
        state.__dict__.update(saved)
        _engine_state.expected_sizes.clear()
        _engine_state.pending.clear()
        _engine_state.pending.update(pending)


def cpu_engine(config: Any, rank: int = 0) -> Any:
    engine = _engine.CommEngine(config, rank, rank + 1, "127.0.0.1")
    if rank == 0:
        engine.connect_store(dist.HashStore(), "t", 30.0)
    return engine


def current_cpu_engine(config: Any, ran: int) -> Any:
    """A CPU engine (rank 0 of 1) that allreduced every bucket of steps 0 to
    ``ran``, set as the job's current engine (``state.engine``)."""
    engine = cpu_engine(config)
    steps(engine, 0, ran)
    state.engine = engine
    return engine


def device_engine(config: Any) -> Any:
    kernels = TorchKernels(torch.device("cpu"))
    engine = _engine.DeviceEngine(config, 0, 1, kernels, "tcp", host="127.0.0.1")
    engine.connect_store(dist.HashStore(), "t", 30.0)
    return engine


def gradient(step: int, bucket: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + bucket)
    return torch.randn(n, generator=g) * (1 + step % 3)


def steps(engine: Any, first: int, last: int) -> list[torch.Tensor]:
    """Every bucket's allreduce of steps ``first`` to ``last``, as the engine left it."""
    out = []
    for step in range(first, last):
        for bucket, n in enumerate(LENS):
            buf = gradient(step, bucket, n)
            if isinstance(engine, _engine.CommEngine):
                engine.allreduce(buf.data_ptr(), n * 4, "float32", bucket, True)
            else:
                engine.allreduce(buf.view(torch.uint8), "float32", bucket, True)
            out.append(buf)
    return out


def saved_and_loaded(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` through ``torch.save`` and ``torch.load(weights_only=True)``."""
    file = io.BytesIO()
    torch.save(value, file)
    file.seek(0)
    return torch.load(file, weights_only=True)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_fresh_engines_continue_bit_for_bit_from_a_saved_state(
    kind: str, config: Any, clean_state: None
) -> None:
    make = cpu_engine if kind == "cpu" else device_engine
    whole = make(config)
    want = steps(whole, 0, 6)
    whole.shutdown()

    first = make(config)
    steps(first, 0, 3)
    if kind == "cpu":
        state.engine = first
    else:
        state.cuda = type("Channels", (), {"engine": first})()
    saved = saved_and_loaded(tdist.state_dict())
    assert (saved["format"], saved["rank"], saved["world_size"]) == (1, 0, 1)
    assert list(saved["engines"]) == [kind]
    buckets = saved["engines"][kind]["buckets"]
    assert sorted(buckets) == [0, 1, 2]
    assert buckets[1]["steps"] == 3
    assert buckets[1]["residual"].dtype == torch.float32 and buckets[1]["residual"].numel() == 77
    assert set(buckets[1]) == {"steps", "residual", "velocity", "previous_sum"}
    first.shutdown()

    resumed = make(config)
    entry = _engine_state._from_torch(saved)[2][kind]
    resumed.load_state(entry)
    got = steps(resumed, 3, 6)
    fresh = make(config)
    other = steps(fresh, 3, 6)
    for i, (g, w) in enumerate(zip(got, want[3 * len(LENS) :])):
        assert torch.equal(g, w), f"bucket run {i} differs"
    assert not all(torch.equal(o, w) for o, w in zip(other, want[3 * len(LENS) :]))
    resumed.shutdown()
    fresh.shutdown()


def test_a_state_loaded_before_its_engine_is_held_then_applied(
    config: Any, clean_state: None
) -> None:
    first = current_cpu_engine(config, ran=2)
    saved = saved_and_loaded(tdist.state_dict())
    first.shutdown()
    state.engine = None

    tdist.load_state_dict(saved)
    assert set(_engine_state.pending) == {"cpu"}
    # Held, it is what state_dict() returns.
    again = tdist.state_dict()
    held = again["engines"]["cpu"]["buckets"][0]
    assert torch.equal(held["residual"], saved["engines"]["cpu"]["buckets"][0]["residual"])
    assert _engine_state.expected_sizes == {0: 800, 1: 308, 2: 520}

    engine = cpu_engine(config)
    state.set_engine(engine)
    _engine_state.apply_held("cpu", engine)  # as _runtime does once it built it
    assert _engine_state.pending == {}
    applied = engine.state()
    assert applied["buckets"][2]["steps"] == 2
    engine.shutdown()


def test_loading_replaces_an_engine_s_state_and_an_empty_state_resets_it(
    config: Any, clean_state: None
) -> None:
    engine = current_cpu_engine(config, ran=2)
    empty = {"format": 1, "rank": 0, "world_size": 1, "engines": {}}
    tdist.load_state_dict(empty)
    assert engine.state()["buckets"] == {}
    engine.shutdown()


def test_the_first_bucket_of_another_size_is_warned_about_once(clean_state: None) -> None:
    _engine_state.expected_sizes.update({0: 800, 1: 308})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _engine_state.check_bucket(0, 800)
        _engine_state.check_bucket(1, 1108)
        _engine_state.check_bucket(2, 40)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "bucket 1 has 1108 bytes" in text and "bucket of 308 bytes" in text, text
    assert "find_unused_parameters=True" in text
    assert _engine_state.expected_sizes == {}


def good_state() -> dict[str, Any]:
    return {
        "format": 1,
        "rank": 0,
        "world_size": 1,
        "engines": {
            "cpu": {
                "settings": {"topk": "on"},
                "buckets": {0: {"steps": 2, "residual": torch.zeros(4)}},
            }
        },
    }


def broken(change: Any) -> dict[str, Any]:
    s = good_state()
    change(s)
    return s


@pytest.mark.parametrize(
    ("change", "error", "names"),
    [
        (lambda s: s.pop("rank"), ValueError, "missing key(s) ['rank']"),
        (lambda s: s.update(extra=1), ValueError, "unknown key(s) ['extra']"),
        (lambda s: s.update(format=2), ValueError, "state_dict['format'] is 2"),
        (lambda s: s.update(rank="0"), TypeError, "state_dict['rank'] must be an int"),
        (lambda s: s.update(rank=3), ValueError, "rank'] 3 is not a rank of a world of 1"),
        (lambda s: s.update(engines=[]), TypeError, "state_dict['engines'] must be a dict"),
        (
            lambda s: s["engines"].update(gpu={}),
            ValueError,
            "state_dict['engines']['gpu']: unknown engine",
        ),
        (
            lambda s: s["engines"]["cpu"]["settings"].update(topk=1),
            TypeError,
            "['settings']['topk'] must map a str to a str",
        ),
        (
            lambda s: s["engines"]["cpu"]["buckets"].update({-1: {"steps": 0}}),
            ValueError,
            "['buckets'] key -1 must be at least 0",
        ),
        (
            lambda s: s["engines"]["cpu"]["buckets"][0].update(steps=-1),
            ValueError,
            "['buckets'][0]['steps'] must be at least 0",
        ),
        (
            lambda s: s["engines"]["cpu"]["buckets"][0].pop("steps"),
            ValueError,
            "['buckets'][0]: no 'steps'",
        ),
        (
            lambda s: s["engines"]["cpu"]["buckets"][0].update(momentum=torch.zeros(4)),
            ValueError,
            "['buckets'][0]: unknown key(s) ['momentum']",
        ),
        (
            lambda s: s["engines"]["cpu"]["buckets"][0].update(residual=[0.0]),
            TypeError,
            "['buckets'][0]['residual'] must be a tensor, not list",
        ),
        (
            lambda s: s["engines"]["cpu"]["buckets"][0].update(residual=torch.zeros(2, 2)),
            ValueError,
            "['buckets'][0]['residual'] must be a 1-D float32 tensor, not 2-D torch.float32",
        ),
        (
            lambda s: s["engines"]["cpu"]["buckets"][0].update(residual=torch.zeros(4).half()),
            ValueError,
            "must be a 1-D float32 tensor, not 1-D torch.float16",
        ),
    ],
)
def test_a_malformed_state_names_its_key(
    change: Any, error: type, names: str, clean_state: None
) -> None:
    with pytest.raises(error) as caught:
        tdist.load_state_dict(broken(change))
    assert names in str(caught.value)
    assert _engine_state.pending == {}


def test_another_rank_s_state_names_both_ranks(
    monkeypatch: pytest.MonkeyPatch, clean_state: None
) -> None:
    dist = _engine_state.dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    s = good_state()
    s["world_size"] = 2
    with pytest.raises(ValueError, match="saved by rank 0; this is rank 1"):
        tdist.load_state_dict(s)
    s["rank"] = 1
    s["world_size"] = 4
    with pytest.raises(ValueError, match="world of 4 ranks; this one has 2"):
        tdist.load_state_dict(s)
    assert _engine_state.pending == {}


def test_an_engine_built_later_checks_the_rank_and_the_fit(config: Any, clean_state: None) -> None:
    # Held before the group existed: the engine of rank 0 refuses rank 1's.
    s = good_state()
    s.update(rank=1, world_size=2)
    tdist.load_state_dict(s)
    engine = cpu_engine(config)
    state.set_engine(engine)
    with pytest.raises(ValueError) as caught:
        _engine_state.apply_held("cpu", engine)
    assert "rank: expected rank 0 (this engine's), found rank 1" in str(caught.value)
    assert caught.value.key == "rank"
    # A bucket whose buffers do not go together, and a setting of another value.
    first = current_cpu_engine(config, ran=1)
    saved = tdist.state_dict()
    bucket = saved["engines"]["cpu"]["buckets"][1]
    bucket["velocity"] = bucket["velocity"][:-1]
    with pytest.raises(ValueError) as caught:
        tdist.load_state_dict(saved)
    assert str(caught.value).endswith(
        "bucket 1 velocity: expected 308 bytes (its residual's; the momentum correction is on), "
        "found 304 bytes"
    )
    saved = tdist.state_dict()
    saved["engines"]["cpu"]["settings"]["topk_ratio"] = "0.5"
    with pytest.raises(ValueError, match='setting topk_ratio: expected "0.1"'):
        tdist.load_state_dict(saved)
    for e in (engine, first):
        e.shutdown()

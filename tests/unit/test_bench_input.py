"""``benches/bench_input.py``'s training part: its rows, their order and bookkeeping.

A GPU window may cut the benchmark short; the rows measured by then must be
on disk (``"complete": false``), each with its share of the synthetic rate.
``--train-workers`` takes one worker count or several, each row named with
its count; each GPU-decode row names its decoder and the backend that
decoded. The loaders are not run: ``train_rate`` is replaced by a stand-in.
"""

from __future__ import annotations

import argparse
import copy
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))

import _input_decoders  # noqa: E402
import _input_training  # noqa: E402
import bench_input  # noqa: E402


def _train(tmp_path: Path, workers: str, rates: list[float]) -> list[dict[str, Any]]:
    """The parts saved by a CPU training part whose rows measure ``rates`` in turn;
    the row after the last rate raises ``KeyboardInterrupt`` (the window closes)."""
    left = iter(rates)

    def stand_in(make: Any, device: Any, model: str, steps: int, batch: int) -> float:
        rate = next(left, None)
        if rate is None:
            raise KeyboardInterrupt
        return rate

    args = bench_input.parse_args(
        ["--train", "--skip-loaders", "--train-device", "cpu", "--train-workers", workers]
    )
    saved: list[dict[str, Any]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_input_training, "train_rate", stand_in)
        try:
            saved.append(
                _input_training.train_part(
                    args, tmp_path, tmp_path / "x.index", lambda p: saved.append(copy.deepcopy(p))
                )  # fmt: skip
            )
        except KeyboardInterrupt:
            pass
    return saved


def test_training_rows_are_saved_as_they_finish(tmp_path: Path) -> None:
    saved = _train(tmp_path, "1", [200.0, 50.0, 150.0])
    assert [list(part["rows"]) for part in saved] == [
        ["synthetic"],
        ["synthetic", "dropin_decode_device"],
        ["synthetic", "dropin_decode_device", "stock_imagefolder"],
    ]
    last = saved[-1]
    assert last["complete"] is False and last["device"] == "cpu"
    shares = {name: row["fraction_of_synthetic"] for name, row in last["rows"].items()}
    assert shares == {"synthetic": 1.0, "dropin_decode_device": 0.25, "stock_imagefolder": 0.75}
    gpu = last["rows"]["dropin_decode_device"]
    assert (gpu["feed"], gpu["workers"], gpu["decoder"]) == (
        "dropin_decode_device",
        1,
        "torchvision",
    )
    assert gpu["backend"] == "CPU (libjpeg)"


def test_several_worker_counts_in_one_run(tmp_path: Path) -> None:
    """``--train-workers 4,8,2``: every row once, named with its workers or
    threads, the fewest workers' rows first; the last part is complete."""
    saved = _train(tmp_path, "4,8,2", [1000.0] + [500.0] * 20)
    final = saved[-1]
    assert final["complete"] is True and len(saved) == len(final["rows"]) + 1
    assert (final["workers"], final["worker_counts"]) == (8, [2, 4, 8])
    assert list(final["rows"]) == [
        "synthetic",
        "dropin_decode_device_2", "stock_imagefolder_2", "dropin_2",
        "dropin_decode_device_4", "stock_imagefolder_8", "dropin_8",
        "stock_imagefolder_4", "dropin_4",
        "fused_torch_loader_8", "dropin_device_8",
    ]  # fmt: skip
    for key, row in final["rows"].items():
        assert (
            key == row["feed"] if key == "synthetic" else key == f"{row['feed']}_{row['workers']}"
        )
        assert row["fraction_of_synthetic"] == (1.0 if key == "synthetic" else 0.5)
    assert final["rows"]["dropin_decode_device_4"]["decoder"] == "torchvision"


def test_the_plan_puts_the_goals_first() -> None:
    keys = [r.key for r in _input_training.train_plan([15, 4, 8], nvimagecodec=True, alone=True)]
    assert keys == [
        "synthetic",
        "dropin_decode_device_4", "stock_imagefolder_4", "dropin_nvimagecodec_4", "dropin_4",
        "decode_device_alone_4", "nvimagecodec_alone_4",
        "stock_imagefolder_15", "dropin_15", "stock_imagefolder_8", "dropin_8",
        "fused_torch_loader_15", "dropin_device_15",
    ]  # fmt: skip
    # One count: the loaders' own names (as before several counts were taken);
    # GPU decode still on at most 4 threads.
    plan = _input_training.train_plan([15], nvimagecodec=False, alone=True)
    assert [r.key for r in plan] == [
        "synthetic", "dropin_decode_device", "stock_imagefolder", "dropin",
        "decode_device_alone", "fused_torch_loader", "dropin_device",
    ]  # fmt: skip
    assert {r.key: r.workers for r in plan}["dropin_decode_device"] == 4
    assert all(r.alone == r.key.endswith("_alone") for r in plan)
    # --train-feeds: only those loaders, and synthetic data (their reference).
    only = _input_training.train_plan([4, 8], False, False, feeds=["dropin", "stock_imagefolder"])
    assert [r.key for r in only] == [
        "synthetic", "stock_imagefolder_4", "dropin_4", "stock_imagefolder_8", "dropin_8"
    ]  # fmt: skip


def test_train_workers_takes_one_count_or_several() -> None:
    def workers(*argv: str) -> list[int]:
        return bench_input.parse_args(["--skip-loaders", "--images", "800", *argv]).train_workers

    assert workers() == []  # the cores - 1
    assert workers("--train-workers", "15") == [15]
    assert workers("--train-workers", "15,4,8,4") == [4, 8, 15]
    for bad in ("4,x", "0,4", "-1", ","):
        with pytest.raises(SystemExit):
            workers("--train-workers", bad)
    with pytest.raises(argparse.ArgumentTypeError):
        bench_input.worker_counts("")
    assert bench_input.parse_args(["--train-feeds", "dropin, stock_imagefolder"]).train_feeds == [
        "dropin", "stock_imagefolder"
    ]  # fmt: skip
    for bad in ("dropin,imagefolder", ","):
        with pytest.raises(SystemExit):
            bench_input.parse_args(["--train-feeds", bad])


class _FakeNvImageCodec(types.ModuleType):
    """nvImageCodec's calls the backend probe makes; ``decodes`` says which backend kinds decode."""

    def __init__(self, decodes: set[str]) -> None:
        super().__init__("nvidia.nvimgcodec")
        self.BackendKind = types.SimpleNamespace(
            HW_GPU_ONLY="HW_GPU_ONLY", GPU_ONLY="GPU_ONLY", HYBRID_CPU_GPU="HYBRID_CPU_GPU"
        )
        self.ColorSpec = types.SimpleNamespace(SRGB=1)
        self.SampleFormat = types.SimpleNamespace(I_RGB=1)
        self.DecodeParams = lambda **kwargs: kwargs
        self.Backend = lambda kind: kind
        self.CodeStream = lambda array: array

        class Decoder:
            def __init__(self, device_id: int, backends: list[str]) -> None:
                if backends == ["HYBRID_CPU_GPU"]:
                    raise RuntimeError("no hybrid backend in this build")
                self.kind = backends[0]

            def decode(self, streams: list[Any], params: Any) -> list[Any]:
                return [object() if self.kind in decodes else None for _ in streams]

        self.Decoder = Decoder


@pytest.mark.parametrize(
    "decodes, backend",
    [
        ({"HW_GPU_ONLY", "GPU_ONLY"}, "hardware"),
        ({"GPU_ONLY"}, "CUDA"),
        (set(), "unknown"),
    ],
)
def test_nvimagecodec_backend_is_the_first_that_decodes(
    monkeypatch: pytest.MonkeyPatch, decodes: set[str], backend: str
) -> None:
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", _FakeNvImageCodec(decodes))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    found = _input_decoders.nvimagecodec_backend(
        [b"\xff\xd8a", b"\xff\xd8b"], torch.device("cuda", 0)
    )
    assert found["backend"] == backend
    assert found["backend_basis"].startswith("inferred: nvImageCodec does not report it")
    per = found["backends"]
    assert per["hardware"]["decoded"] == (2 if "HW_GPU_ONLY" in decodes else 0)
    assert "RuntimeError: no hybrid backend" in per["hybrid"]["error"]
    assert ("images_per_s" in per["CUDA"]) == ("GPU_ONLY" in decodes)


def test_backend_names() -> None:
    assert _input_decoders._backend_name(64, 64, "CUDA") == "hardware"
    assert _input_decoders._backend_name(0, 64, "CUDA") == "CUDA"
    assert _input_decoders._backend_name(60, 64, "CUDA") == (
        "hardware for 60 of 64 images, CUDA for the rest"
    )
    assert _input_decoders._backend_name(0, 64, None) == "unknown"


def test_nvjpeg_probe_answers_without_a_gpu(tmp_path: Path) -> None:
    """The nvJPEG probe on the libnvjpeg torchvision loaded: on a machine
    without a GPU nvJPEG declines, and the probe says so rather than failing."""
    jpeg = tmp_path / "a.jpg"
    Image.new("RGB", (32, 24), (200, 10, 10)).save(jpeg, quality=90)
    found = _input_decoders.nvjpeg_backend([jpeg.read_bytes()], torch.device("cpu"))
    assert isinstance(found["backend"], str) and found["backend_basis"]

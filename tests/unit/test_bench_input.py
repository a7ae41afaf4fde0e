"""``benches/bench_input.py``'s training part keeps each row as it finishes.

A GPU window may cut the benchmark short; the rows measured by then must be
on disk (``"complete": false``), each with its share of the synthetic rate.
The loaders are not run: ``train_rate`` is replaced by a stand-in.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))

import bench_input  # noqa: E402


def test_training_rows_are_saved_as_they_finish(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rates = iter([200.0, 50.0, 150.0])

    def stand_in(make: Any, device: Any, model: str, steps: int, batch: int) -> float:
        rate = next(rates, None)
        if rate is None:
            raise KeyboardInterrupt  # the window closes during the fourth row
        return rate

    monkeypatch.setattr(bench_input, "train_rate", stand_in)
    args = bench_input.parse_args(
        ["--train", "--skip-loaders", "--train-device", "cpu", "--train-workers", "1"]
    )
    saved: list[dict[str, Any]] = []
    with pytest.raises(KeyboardInterrupt):
        bench_input.train_part(args, tmp_path, tmp_path / "x.index", lambda p: saved.append(
            copy.deepcopy(p)))  # fmt: skip
    assert [list(part["rows"]) for part in saved] == [
        ["synthetic"],
        ["synthetic", "stock_imagefolder"],
        ["synthetic", "stock_imagefolder", "fused_torch_loader"],
    ]
    last = saved[-1]
    assert last["complete"] is False and last["device"] == "cpu"
    shares = {name: row["fraction_of_synthetic"] for name, row in last["rows"].items()}
    assert shares == {"synthetic": 1.0, "stock_imagefolder": 0.25, "fused_torch_loader": 0.75}

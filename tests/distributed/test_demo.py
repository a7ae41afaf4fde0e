"""The end-to-end demo (``make demo``'s training) on a tiny dataset."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _launch import REPO, base_env


def test_demo_trains_with_all_three_parts_and_compares_with_stock(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "demo/pytorch_native_ddp_demo.py"),
            "--workdir",
            str(tmp_path),
            "--per-class",
            "20",
            "--epochs",
            "3",
            "--batch",
            "16",
            "--image-size",
            "32",
            "--workers",
            "0",
            "--compare",
        ],  # fmt: skip
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    # The data was generated and packed with the command-line tools.
    assert (tmp_path / "train_tfrecord/train.index").is_file()
    assert (tmp_path / "val_tfrecord/val.index").is_file()
    assert "[tiacc] communication: tiacc engine: 2 channel(s)" in out, out
    assert "[tiacc] data: IndexTFRDataset over TFRecord shards (fused Rust" in out, out
    assert "[tiacc] mixed precision: MixedPrecision_TrainingPolicy(policy 0" in out, out
    assert "[stock] communication: native DDP" in out, out
    # Policy 0 with start 1: off in epoch 0, on afterwards.
    assert "[tiacc] epoch 0:" in out and "mixed precision off" in out.split("[tiacc] epoch 1")[0]
    assert "mixed precision on" in out.split("[tiacc] epoch 1")[1].split("\n")[0], out
    assert "speed-up of tiacc over stock PyTorch" in out, out

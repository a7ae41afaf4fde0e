"""Shared fixtures: small image folders, and the GPU marker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def write_image(path: Path, width: int, height: int, seed: int, fmt: str = "JPEG") -> None:
    """Writes a small noisy RGB image."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """An ImageFolder-style tree: 3 classes, 6 images each, JPEG and PNG mixed."""
    root = tmp_path / "imgs"
    seed = 0
    for cls in ["ant", "bee", "cat"]:
        for i in range(6):
            fmt, ext = ("PNG", "png") if i % 3 == 2 else ("JPEG", "JPEG")
            write_image(root / cls / f"{cls}_{i:03d}.{ext}", 20 + i, 16 + seed % 5, seed, fmt)
            seed += 1
    return root


def run_tool(module: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs ``python -m tiacc_training.tools.<module> args`` and captures output."""
    return subprocess.run(
        [sys.executable, "-m", f"tiacc_training.tools.{module}", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def pack_folder(root: Path, records_per_shard: int) -> Path:
    """Lists ``root / "imgs"`` and packs it into ``root / "tfr"`` with the
    command-line tools' code, as a user would; returns the index path."""
    from tiacc_training.tools import general_image_list, img2tfrecord

    folder, img_list = root / "imgs", root / "list.txt"
    general_image_list.main(["--img_dir", str(folder), "--img_list", str(img_list)])
    items = img2tfrecord.read_image_list(str(folder), str(img_list))
    img2tfrecord.pack(
        items, str(root / "tfr"), "ds", records_per_shard=records_per_shard, show_progress=False
    )
    return root / "tfr" / "ds.index"

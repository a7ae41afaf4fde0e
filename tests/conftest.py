"""Shared fixtures: small image folders, and the GPU marker."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # TIACC_TEST_FIRST=<prefix>,...: the tests whose ids start with one of
    # these run first, in that order (a run that may be cut off does the
    # most telling tests before the long matrices).
    first = [p.strip() for p in os.environ.get("TIACC_TEST_FIRST", "").split(",") if p.strip()]
    if first:

        def rank(item: pytest.Item) -> int:
            found = [i for i, p in enumerate(first) if item.nodeid.startswith(p)]
            return found[0] if found else len(first)

        items.sort(key=rank)  # stable: the order inside each group stays
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


# TIACC_TEST_OUTCOMES=<file>: each test's outcome is appended there as one
# JSON line the moment it is known, so a run that is cut off (a GPU node's
# short window) still says which tests passed and how the others failed.
# Under pytest-xdist the controller writes, as the workers report.
_outcomes_file = os.environ.get("TIACC_TEST_OUTCOMES")
_xdist_worker = False


def pytest_configure(config: pytest.Config) -> None:
    global _xdist_worker
    _xdist_worker = hasattr(config, "workerinput")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not _outcomes_file or _xdist_worker:
        return
    # One line per test: its call, or the setup/teardown that did not pass.
    if report.when != "call" and report.outcome == "passed":
        return
    if report.when == "teardown" and report.outcome == "skipped":
        return
    outcome = report.outcome if report.when == "call" or report.skipped else "error"
    line = {
        "test": report.nodeid,
        "outcome": outcome,
        "when": report.when,
        "seconds": round(report.duration, 2),
        "first_line": _first_line(report),
        "error_lines": _error_lines(report),
        "diagnosis": _diagnosis_lines(report),
    }
    with open(_outcomes_file, "a") as f:  # one write per line: appends do not interleave
        f.write(json.dumps(line) + "\n")


def _first_line(report: pytest.TestReport) -> str:
    """The skip reason, or the failure's error line (``E ...``), else ``""``."""
    longrepr = report.longrepr
    if longrepr is None or report.passed:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[-1]).removeprefix("Skipped: ")[:300]
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", ""):
        return crash.message.strip().splitlines()[0][:300]
    for text in str(longrepr).splitlines():
        if text.startswith("E "):
            return text[1:].strip()[:300]
    return str(longrepr).strip().splitlines()[-1][:300] if str(longrepr).strip() else ""


# The lines of a failure's text that name what went wrong: a rank's
# WORKER_ERROR, a case's FAILED line, an exception, CUDA's out of memory.
# A subprocess failure's first line is often only "rank 0 rc=3"; these are
# the ones that say why.
_ERROR_LINE = re.compile(
    r"WORKER_ERROR|FAILED|[A-Za-z]+(Error|Exception)\b|out of memory|panicked|timed out|Timeout"
)


def _error_lines(report: pytest.TestReport, keep: int = 4) -> list[str]:
    """Up to ``keep`` distinct error lines of a failure's text, the last ones.

    pytest marks the lines of the failure itself with ``E``; the test's
    source around it is not searched.
    """
    if report.passed or report.skipped:
        return []
    lines = report.longreprtext.splitlines()
    marked = [text[1:] for text in lines if text.startswith("E ")]
    found: list[str] = []
    for text in marked or lines:
        text = text.strip()
        if not _ERROR_LINE.search(text) or text.startswith(("File ", "raise ", "Traceback")):
            continue
        text = text[:300]
        if text in found:
            found.remove(text)
        found.append(text)
    return found[-keep:]


# The lines of a failure's text that say where a hung rank waited: the
# engine's NCCL trace (TIACC_TRAINING_NCCL_TRACE) and Python's stack dumps
# (faulthandler, TIACC_TEST_STACKS_AFTER in the GPU workers), and py-spy's
# native stacks of a rank that outlived its launch (tests/_launch.py).
_DIAGNOSIS_LINE = re.compile(
    r'tiacc_training nccl trace|py-spy\||^\s*Thread 0x|^\s+File "|^\s*Timeout \(|--- rank \d+ rc='
)


def _diagnosis_lines(report: pytest.TestReport, keep: int = 150) -> list[str]:
    """The last ``keep`` trace, stack and rank-header lines of a failure's text."""
    if report.passed or report.skipped:
        return []
    # pytest marks the failure's own lines with "E   ".
    lines = [text.removeprefix("E   ") for text in report.longreprtext.splitlines()]
    return [text[:300] for text in lines if _DIAGNOSIS_LINE.search(text)][-keep:]


def write_image(path: Path, width: int, height: int, seed: int, fmt: str = "JPEG") -> None:
    """Writes a small noisy RGB image."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))


def coco_instances(
    images: list[tuple[int, str, int, int]],
    boxes: list[tuple[int, int, int, list[float], float, int]],
    categories: dict[int, str],
) -> dict:
    """A COCO instances file's content: ``images`` as (id, file name, width,
    height), ``boxes`` as annotations (id, image id, category id, ``[x, y,
    width, height]`` in pixels, area, iscrowd), ``categories`` by id."""
    return {
        "images": [{"id": i, "file_name": f, "width": w, "height": h} for i, f, w, h in images],
        "annotations": [
            {"id": i, "image_id": image, "category_id": category, "bbox": bbox, "area": area,
             "iscrowd": crowd}
            for i, image, category, bbox, area, crowd in boxes
        ],
        "categories": [{"id": i, "name": name} for i, name in categories.items()],
    }  # fmt: skip


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

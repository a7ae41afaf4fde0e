"""What every benchmark records about the machine it ran on, and how its results travel.

A worker process hands its result to the bench on a ``RESULT`` line
(``print_result``, read back by ``last_result``); the bench writes its
results file whole, with the machine's description (``machine_info``,
``write_results``).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# What starts a worker's result line on its standard output.
RESULT_MARK = "RESULT "


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def gpu_info() -> dict[str, Any]:
    """The GPU, CUDA, NCCL and driver the benchmark could use ("none" without)."""
    try:
        import torch
    except ImportError:
        return {"gpu": "none", "cuda": None, "nccl": None, "gpu_driver": None}
    if not torch.cuda.is_available():
        return {"gpu": "none", "cuda": torch.version.cuda, "nccl": None, "gpu_driver": None}
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # no NCCL in this build
        nccl = None
    driver = _read("/proc/driver/nvidia/version").split("\n", 1)[0].strip() or None
    return {"gpu": names, "cuda": torch.version.cuda, "nccl": nccl, "gpu_driver": driver}


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages now, to two decimals."""
    return [round(x, 2) for x in os.getloadavg()]


def machine_info(packages: Sequence[str] = ()) -> dict[str, Any]:
    """CPU, memory, GPU, OS, git state, and the versions of ``packages``."""
    cpuinfo = _read("/proc/cpuinfo").splitlines()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
        platform.processor() or None,
    )
    mem_kb = next(
        (
            int(line.split()[1])
            for line in _read("/proc/meminfo").splitlines()
            if line.startswith("MemTotal:")
        ),
        None,
    )
    flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    status = _git("status", "--porcelain", "--untracked-files=no")
    info: dict[str, Any] = {
        "cpu_model": cpu,
        "logical_cores": os.cpu_count(),
        "virtual_machine": " hypervisor" in flags,
        "memory_gb": round(mem_kb * 1024 / 1e9, 1) if mem_kb else None,
        "os": platform.platform(),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    for dist in ("numpy", "torch", "tiacc-training", *packages):
        info[dist.replace("-", "_")] = version(dist)
    info.update(gpu_info())
    info.update(
        {
            "load_average_1_5_15": load_average(),
            "git_commit": _git("rev-parse", "--short", "HEAD"),
            "git_dirty": bool(status) if status is not None else None,
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
    )
    return info


def write_json(path: Path, result: dict[str, Any]) -> None:
    """Writes ``result`` to ``path`` whole or not at all (a run stopped
    midway leaves the previous file, never half of one).

    Two-space indented JSON and a final newline; a value JSON has no type
    for (a path) is written as its ``str``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=2, default=str) + "\n")
    partial.replace(path)


def write_results(path: Path, result: dict[str, Any]) -> None:
    """Writes a bench's results file (see :func:`write_json`) and says where."""
    write_json(path, result)
    print(f"wrote {path}")


def print_result(result: dict[str, Any]) -> None:
    """Prints a worker's result as its ``RESULT`` line, for the bench to read."""
    print(RESULT_MARK + json.dumps(result), flush=True)


def last_result(stdout: str) -> dict[str, Any] | None:
    """The last ``RESULT`` line of a worker's output, decoded (None: none)."""
    lines = [x for x in stdout.splitlines() if x.startswith(RESULT_MARK)]
    return json.loads(lines[-1].removeprefix(RESULT_MARK)) if lines else None

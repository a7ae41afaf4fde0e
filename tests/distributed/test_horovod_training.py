"""Horovod's training API on the engine: DistributedOptimizer and friends.

Real jobs (plain processes with torchrun's variables): the worker
``horovod_training_worker.py`` runs its checks, each against a reference
it computes with plain torch from every rank's inputs, and prints
``CHECK <name> ok``. The Horovod-style script
``user_scripts/horovod_mnist.py`` runs under torchrun and under
``tiaccrun -np 2``; its losses must match its DDP twin's
(``horovod_mnist_ddp.py``, tiacc's DDP path).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import describe, free_port, launcher_env, run_ranks, unmix

HERE = Path(__file__).resolve().parent
WORKER = HERE / "horovod_training_worker.py"
SCRIPTS = HERE / "user_scripts"
# Small buckets, so that each model spans several of them.
ENV = {"TIACC_TRAINING_FUSION_THRESHOLD": "512"}


def _run_checks(world: int, checks: list[str], env: dict[str, str] = ENV) -> None:
    ranks = run_ranks(world, ["--checks", ",".join(checks)], env=env, worker=WORKER)
    out = describe(ranks)
    for r in ranks:
        assert r.returncode == 0, out
        done = re.findall(r"^CHECK (\S+) ok$", r.stdout, re.M)
        assert done == checks, f"rank {r.rank} finished {done} of {checks}:\n{out}"


def test_distributed_optimizer_on_2_ranks() -> None:
    _run_checks(
        2,
        [
            "train",
            "passes",
            "fp16",
            "sum",
            "adasum",
            "groups",
            "sparse",
            "broadcast",
            "syncbn",
            "api",
        ],
    )


def test_distributed_optimizer_on_4_ranks_and_a_process_set() -> None:
    # Horovod's name for the fusion threshold sizes the buckets too.
    _run_checks(
        4, ["train", "broadcast", "syncbn", "process_set"], {"HOROVOD_FUSION_THRESHOLD": "1024"}
    )


def _losses(out: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"LOSS (\S+) (\S+)$", out, re.M)}


def _run(command: list[str], cwd: Path) -> str:
    proc = subprocess.run(
        command, env=launcher_env(), cwd=cwd, capture_output=True, text=True, timeout=240
    )
    out = unmix(proc.stdout, ("LOSS ",)) + proc.stderr
    assert proc.returncode == 0, f"{' '.join(command)} failed:\n{out[-6000:]}"
    return out


def _torchrun(script: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        str(SCRIPTS / script),
    ]


def _same(ours: dict[str, float], reference: dict[str, float]) -> None:
    assert ours and ours.keys() == reference.keys(), (ours, reference)
    for key in ours:
        assert ours[key] == pytest.approx(reference[key], rel=2e-4, abs=1e-5), (
            key,
            ours,
            reference,
        )


def test_a_horovod_mnist_script_matches_its_ddp_twin(tmp_path: Path) -> None:
    reference = _losses(_run(_torchrun("horovod_mnist_ddp.py"), tmp_path))
    assert len(reference) == 4, reference
    # The loss falls: the run trains.
    assert reference["train2"] < reference["train1"], reference
    hvd = _run(_torchrun("horovod_mnist.py"), tmp_path)
    _same(_losses(hvd), reference)
    # The DistributedOptimizer's buckets went through the engine: rank 0's summary.
    summary = re.search(r"summary: (\d+) backward pass\(es\); through the engine: (.*)", hvd)
    assert summary and int(summary[1]) > 0 and "cpu bucket" in summary[2], hvd[-3000:]
    assert "left to torch: 0" in hvd, hvd[-3000:]
    tiaccrun = shutil.which("tiaccrun", path=str(Path(sys.executable).parent))
    if tiaccrun is None:
        command = [sys.executable, "-m", "tiacc_training.tools.tiaccrun"]
    else:
        command = [tiaccrun]
    command += ["-np", "2", sys.executable, str(SCRIPTS / "horovod_mnist.py")]
    _same(_losses(_run(command, tmp_path)), reference)

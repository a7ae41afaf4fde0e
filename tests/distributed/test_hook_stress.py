"""No intermittent bypass: a reference-shaped script, run many times, never warns.

``user_scripts/classification_ddp.py`` (an image-classification reference
script's shape on the CPU: its own ``init_process_group``, DataLoader
workers, DDP, ``model.train()``/``eval()``, evaluation under
``torch.inference_mode()``, a checkpoint on rank 0) runs under torchrun on
two ranks, again and again, each process starting after a random delay and
a CPU-bound process loading the machine; every other run adds the backward
passes DDP does not sync (``torch.autograd.grad``, a backward through the
wrapped module, a forward under ``no_sync()``). Each run must have sent
every synced backward pass through the engine on every rank
(``stats()["steps"]`` equal to the script's count, ``stats()["native"]``
empty) and never said that the comm hook did not run.

``TIACC_TEST_STRESS_RUNS`` sets the number of runs (3 by default: about
25 s on two cores).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import free_port, json_lines, launcher_env, unmix

SCRIPT = Path(__file__).resolve().parent / "user_scripts" / "classification_ddp.py"
RUNS = int(os.environ.get("TIACC_TEST_STRESS_RUNS", "3"))
BYPASS = "comm hook did not run"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("folder")
    subprocess.run([sys.executable, str(SCRIPT), "--make-data", str(root)], check=True)
    return root


def _run(data: Path, out: Path, extra: bool) -> str:
    env = launcher_env({"TIACC_TEST_START_JITTER": "1.0"})
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        str(SCRIPT),
        "--data",
        str(data),
        "--out",
        str(out),
        *(["--extra-passes"] if extra else []),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    output = unmix(proc.stdout, ("LOSS ", "RESULT ")) + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def _train_losses(output: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^LOSS (\d+) (\S+)$", output, re.M)}


def test_every_synced_backward_pass_goes_through_the_engine_in_every_run(
    data: Path, tmp_path: Path
) -> None:
    # A CPU-bound process of our own: the ranks start and step under load.
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        outputs = []
        for run in range(RUNS):
            out = tmp_path / f"run{run}"
            out.mkdir()
            output = _run(data, out, extra=run % 2 == 1)
            assert BYPASS not in output, f"run {run}:\n{output[-6000:]}"
            results = json_lines(output)
            assert sorted(r["rank"] for r in results) == [0, 1], output[-6000:]
            for result in results:
                assert result["synced"] > 0, result
                assert result["stats"]["steps"] == result["synced"], (run, result)
                assert result["stats"]["native"] == {}, (run, result)
                assert not any(BYPASS in w for w in result["warnings"]), (run, result)
            assert (out / "checkpoint.pth").exists()
            outputs.append(output)
    finally:
        burner.kill()
        burner.wait()
    # The passes DDP does not sync leave training as it was.
    losses = [_train_losses(o) for o in outputs]
    assert losses[0] and all(x.keys() == losses[0].keys() for x in losses), losses
    for x in losses[1:]:
        for epoch, value in x.items():
            assert value == pytest.approx(losses[0][epoch], rel=1e-5), losses

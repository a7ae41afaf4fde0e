"""The scripts in examples/ run as documented, on tiny data, on the CPU.

The ImageNet-style training runs with 2 ranks under torchrun, under mpirun
(through its launch script) and through its sbatch file, with stand-ins for
``srun`` and ``scontrol`` that start the tasks on this machine with the
variables SLURM gives them. The COCO packing runs on a generated COCO split.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _launch import REPO, base_env, free_port, launcher_env
from conftest import coco_instances, write_image

EXAMPLES = REPO / "examples"
TRAIN_ARGS = ["--arch", "tiny", "--epochs", "2", "--max-steps", "2", "--batch-size", "4",
              "--image-size", "32", "--workers", "1"]  # fmt: skip


def pack(images: Path, out: Path, name: str) -> None:
    from tiacc_training.tools import general_image_list, img2tfrecord

    listing = out.parent / f"{name}_list"
    general_image_list.main(["--img_dir", str(images), "--img_list", str(listing)])
    img2tfrecord.main(["--img_dir", str(images), "--img_list", str(listing), "--quiet",
                       "--tfrecords_name", name, "--dataset_type", "ImageFold",
                       "--output_dir", str(out)])  # fmt: skip


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """``packed/train`` (2 classes x 8 images) and ``packed/val`` (2 x 2), as the
    launch scripts expect them."""
    root = tmp_path_factory.mktemp("examples")
    for split, per_class in (("train", 8), ("val", 2)):
        for c in range(2):
            for i in range(per_class):
                write_image(root / f"{split}_images" / f"c{c}" / f"{i}.jpg", 48, 40, 100 * c + i)
        pack(root / f"{split}_images", root / "packed" / split, split)
    return root / "packed"


def check_training(proc: subprocess.CompletedProcess, launcher: str, checkpoint: Path) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert f"launcher={launcher}" in proc.stderr, proc.stderr[-3000:]
    # The script trains on the GPU where there is one (both ranks share it).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"2 ranks on {device}; 16 training images (2 classes, fused path); tiny" in proc.stdout
    assert "epoch 0: loss" in proc.stdout and "epoch 1: loss" in proc.stdout, proc.stdout
    assert "val top-1" in proc.stdout
    state = torch.load(checkpoint, map_location="cpu")
    assert state["epoch"] == 1 and set(state) >= {"model", "optimizer", "amp_policy"}


def test_train_imagenet_under_torchrun(packed, tmp_path):
    checkpoint = tmp_path / "ckpt.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(EXAMPLES / "train_imagenet.py"), "--train", str(packed / "train/train.index"),
           "--val", str(packed / "val/val.index"), "--checkpoint", str(checkpoint),
           *TRAIN_ARGS]  # fmt: skip
    proc = subprocess.run(cmd, env=launcher_env(), capture_output=True, text=True, timeout=300)
    check_training(proc, "torchrun", checkpoint)
    # the policy's state came back with the checkpoint: epoch 2 resumes after 1
    cmd[cmd.index("--epochs") + 1] = "3"
    proc = subprocess.run([*cmd, "--resume"], env=launcher_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "epoch 0:" not in proc.stdout and "epoch 2: loss" in proc.stdout, proc.stdout


def test_train_imagenet_under_mpirun(packed, tmp_path):
    if shutil.which("mpirun") is None:
        if os.environ.get("TIACC_TEST_REQUIRE_MPIRUN") == "1":
            pytest.fail("mpirun is required here (install openmpi-bin: make setup)")
        pytest.skip("mpirun not installed (make setup installs openmpi-bin)")
    checkpoint = tmp_path / "ckpt.pt"
    env = launcher_env({"DATA": str(packed), "NPROC": "2", "PYTHON": sys.executable,
                    "MASTER_PORT": str(free_port()), "MPIRUN_ARGS": "--oversubscribe",
                    "OMPI_MCA_plm_rsh_agent": ""})  # fmt: skip
    cmd = ["bash", str(EXAMPLES / "train_imagenet_mpirun.sh"), "--checkpoint", str(checkpoint),
           *TRAIN_ARGS]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    check_training(proc, "mpirun", checkpoint)


FAKE_SRUN = """#!/usr/bin/env bash
# Test stand-in for srun on one node: starts SLURM_NTASKS copies of the command
# with the task variables srun sets, and fails if any task fails.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_LAUNCH_NODE_IPADDR=127.0.0.1 "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# Test stand-in for `scontrol show hostnames`: this machine only.
echo 127.0.0.1
"""


def test_train_imagenet_through_the_sbatch_file(packed, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = launcher_env({
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "DATA": str(packed), "PYTHON": sys.executable, "MASTER_PORT": str(free_port()),
        "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1",
        "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "2",
    })  # fmt: skip
    cmd = ["bash", str(EXAMPLES / "train_imagenet.sbatch"), *TRAIN_ARGS]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    check_training(proc, "slurm", tmp_path / "checkpoint-7.pt")


def test_pack_coco(tmp_path):
    images = tmp_path / "val2017"
    sizes = {3: (40, 30), 1: (32, 24), 2: (20, 20)}
    for image_id, (w, h) in sizes.items():
        write_image(images / f"{image_id:012d}.jpg", w, h, image_id)
    coco = coco_instances(
        [(i, f"{i:012d}.jpg", w, h) for i, (w, h) in sizes.items()],
        [
            (10, 1, 18, [4, 6, 10, 8], 80, 0),
            (11, 1, 1, [0, 0, 16, 12], 192, 0),
            (12, 3, 1, [5, 5, 0, 4], 0, 0),
        ],
        {1: "person", 18: "dog"},
    )
    annotations = tmp_path / "instances_val2017.json"
    annotations.write_text(json.dumps(coco))
    out = tmp_path / "packed"
    cmd = [sys.executable, str(EXAMPLES / "pack_coco.py"), "--images", str(images),
           "--annotations", str(annotations), "--name", "val2017", "--output-dir", str(out),
           "--workers", "2"]  # fmt: skip
    proc = subprocess.run(cmd, env=base_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "packed 3 images (0 skipped) with 2 boxes (1 empty dropped" in proc.stdout
    assert "OK: 3 records in 1 shards" in proc.stdout
    # image-id order: image 1 comes first, its boxes back in pixels
    assert "first record: image id 1 (000000000001.jpg)" in proc.stdout
    assert "  dog: x 4.0, y 6.0, 10.0 x 8.0 px" in proc.stdout
    assert "  person: x 0.0, y 0.0, 16.0 x 12.0 px" in proc.stdout
    assert (out / "val2017.index").exists()

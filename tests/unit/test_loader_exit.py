"""Every loader kind ends its process cleanly: run to the end, or left early.

Each case is a script in its own interpreter, as a training script is: it
iterates a loader over a packed folder (to completion, or breaking out after
one batch and keeping the iterator alive until exit), then returns. The
process must exit 0 with no ``terminate called`` (a C++ thread torn down
while the interpreter finalises).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import pack_folder

SCRIPT = """
import sys
import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader as TorchLoader

from tiacc_training.torch.data import DataLoader
from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset

kind, ending, index = sys.argv[1], sys.argv[2], sys.argv[3]
transform = T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToTensor(),
                       T.Normalize([0.5] * 3, [0.2] * 3)])
ds = IndexTFRDataset(index.rsplit("/", 1)[0], index, transform)
common = dict(batch_size=4, shuffle=True)
loaders = {
    "dropin_threads": lambda: DataLoader(ds, num_workers=2, **common),
    "dropin_persistent": lambda: DataLoader(ds, num_workers=2, persistent_workers=True, **common),
    "dropin_main_thread": lambda: DataLoader(ds, num_workers=0, **common),
    "torch_loader_processes": lambda: TorchLoader(ds, num_workers=2, **common),
    "dropin_device_output": lambda: DataLoader(ds, num_workers=2, device="cuda", **common),
    "dropin_gpu_decode": lambda: DataLoader(ds, num_workers=2, decode_device="cuda", **common),
}
loader = loaders[kind]()
kept = []
for epoch in range(2):
    it = iter(loader)
    for x, y in it:
        assert x.shape[1:] == (3, 16, 16), x.shape
        if ending == "break":
            kept.append(it)  # alive until the interpreter exits
            break
print("DONE", kind, ending, flush=True)
"""

CPU_KINDS = ["dropin_threads", "dropin_persistent", "dropin_main_thread", "torch_loader_processes"]
GPU_KINDS = ["dropin_device_output", "dropin_gpu_decode"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import write_image

    root = tmp_path_factory.mktemp("exit")
    for i in range(24):
        write_image(root / "imgs" / f"c{i % 3}" / f"{i:03d}.JPEG", 40 + i, 30 + i % 7, i)
    return pack_folder(root, 10)


@pytest.mark.parametrize("ending", ["complete", "break"])
@pytest.mark.parametrize(
    "kind",
    CPU_KINDS
    + [
        pytest.param(
            k,
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available(), reason=f"{k} needs a CUDA device"
                ),
            ],
        )
        for k in GPU_KINDS
    ],
)
def test_the_process_exits_cleanly(packed: Path, kind: str, ending: str, tmp_path: Path) -> None:
    script = tmp_path / "loader_exit.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.run(
        [sys.executable, str(script), kind, ending, str(packed)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"DONE {kind} {ending}" in out, out[-3000:]
    assert "terminate called" not in out, out[-3000:]

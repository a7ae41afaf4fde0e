"""The mixed-precision policy works where torchvision and PIL are not installed, and the
dataset's PIL path works without torchvision: checked in a subprocess whose imports of
those packages fail as if they were absent."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import pack_folder, write_image

BLOCK = """
import importlib.abc
import sys

BLOCKED = {blocked!r}


class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, Absent())
"""


def run_without(blocked: tuple[str, ...], body: str) -> subprocess.CompletedProcess:
    code = BLOCK.format(blocked=blocked) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_policy_needs_neither_torchvision_nor_pil():
    result = run_without(
        ("torchvision", "PIL"),
        """
        import torch
        import tiacc_training.torch.tiacc_torch_warp as warp
        from tiacc_training.torch.adaptfp16 import MixedPrecision_TrainingPolicy

        assert warp.MixedPrecision_TrainingPolicy is MixedPrecision_TrainingPolicy
        policy = warp.MixedPrecision_TrainingPolicy(0, 2, end_step=4)
        on = [policy.enable_mixed_precision(step, 0.1, 1.0) for step in range(6)]
        assert on == [False, False, True, True, False, False], on
        try:
            import torchvision  # noqa: F401
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("the blocker did not block")
        assert not any(m.split(".")[0] in ("torchvision", "PIL") for m in sys.modules)
        print("ok")
        """,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_pil_path_needs_no_torchvision(tmp_path):
    for i in range(4):
        write_image(tmp_path / "imgs" / f"c{i % 2}" / f"{i}.jpg", 12, 10, i)
    index = pack_folder(tmp_path, records_per_shard=4)
    result = run_without(
        ("torchvision",),
        f"""
        import numpy as np
        from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset

        ds = IndexTFRDataset({str(index.parent)!r}, {str(index)!r}, np.asarray)
        assert not ds.uses_fused_path
        image, label = ds[3]
        assert image.shape == (10, 12, 3) and label == 1, (image.shape, label)
        assert not any(m.split(".")[0] == "torchvision" for m in sys.modules)
        print("ok")
        """,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_submodules_load_on_attribute_access_as_the_ti_acc_documents_show():
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import sys
                import tiacc_training.torch

                assert "torch" not in sys.modules, "importing the package imported torch"
                assert "torchvision" not in sys.modules
                warp = tiacc_training.torch.tiacc_torch_warp
                assert warp.IndexTFRDataset is warp.IndexedDataset
                policy = tiacc_training.torch.adaptfp16.MixedPrecision_TrainingPolicy
                assert policy is warp.MixedPrecision_TrainingPolicy
                assert "torchvision" not in sys.modules
                init = tiacc_training.torch.distributed.init_tiacc_training
                assert callable(init)
                assert callable(tiacc_training.torch.data.DataLoader)
                assert "distributed" in dir(tiacc_training.torch)
                try:
                    tiacc_training.torch.no_such_module
                except AttributeError as e:
                    assert "no_such_module" in str(e)
                else:
                    raise AssertionError("an unknown name did not raise AttributeError")
                print("ok")
                """
            ),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr

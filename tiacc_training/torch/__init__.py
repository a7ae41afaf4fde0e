"""PyTorch integration of tiacc-training.

``tiacc_training.torch.tiacc_torch_warp`` holds ``IndexTFRDataset`` and
``MixedPrecision_TrainingPolicy`` (also in ``tiacc_training.torch.adaptfp16``),
and ``tiacc_training.torch.distributed`` holds ``init_tiacc_training`` (the
names follow the TI-ACC documents).

The submodules load on first access, so both spellings work::

    import tiacc_training.torch
    tiacc_training.torch.tiacc_torch_warp.IndexTFRDataset(...)

    from tiacc_training.torch import tiacc_torch_warp

and ``import tiacc_training.torch`` alone imports neither torch nor
torchvision.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("adaptfp16", "data", "distributed", "horovod", "tiacc_torch_warp")

__all__ = list(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_SUBMODULES])

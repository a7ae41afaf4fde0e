"""torchvision's random draws for the fused path, with less per-image overhead.

``RandomResizedCrop.get_params`` and ``RandomHorizontalFlip`` cost tens of
microseconds per image in tensor allocations, a stand-in image, and a
logarithm recomputed on every call. The classes here make the same torch
random calls, in the same order, on the same dtypes (``uniform_`` on a
default-dtype tensor, ``random_`` on an int64 one: what ``torch.empty(1)``,
``torch.randint`` and ``torch.rand`` do), so they consume PyTorch's random
stream identically and return identical parameters; only the work around the
calls is gone. ``tests/unit/test_random_params.py`` checks that equality.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Optional

import torch


class _Buffers(threading.local):
    """One-element tensors reused by the draws, per thread.

    A shared one could hand one thread's value to another.
    """

    def __init__(self) -> None:
        self.dtype = torch.get_default_dtype()
        self.real = torch.empty(1)
        self.int64 = torch.empty(1, dtype=torch.int64)

    def uniform(
        self, low: float, high: float, generator: Optional[torch.Generator] = None
    ) -> torch.Tensor:
        """``torch.empty(1).uniform_(low, high)`` (default dtype), reusing a tensor."""
        dtype = torch.get_default_dtype()
        if dtype != self.dtype:
            self.dtype, self.real = dtype, torch.empty(1)
        return self.real.uniform_(low, high, generator=generator)

    def randint(self, high: int, generator: Optional[torch.Generator] = None) -> int:
        """``torch.randint(0, high, size=(1,)).item()``, reusing a tensor."""
        return int(self.int64.random_(0, high, generator=generator).item())


_BUFFERS = _Buffers()


class ResizedCropParams:
    """``RandomResizedCrop.get_params(img, scale, ratio)`` for images of any size.

    Args:
        scale: The transform's ``scale``.
        ratio: The transform's ``ratio``.
    """

    def __init__(self, scale: Sequence[float], ratio: Sequence[float]) -> None:
        self.scale = (float(scale[0]), float(scale[1]))
        # As get_params computes it: float32 logs, passed on as Python floats.
        log_ratio = torch.log(torch.tensor(ratio))
        self.log_ratio = (float(log_ratio[0]), float(log_ratio[1]))
        self.min_ratio, self.max_ratio = min(ratio), max(ratio)

    def __call__(
        self, width: int, height: int, generator: Optional[torch.Generator] = None
    ) -> tuple[int, int, int, int]:
        """Draws ``(top, left, height, width)`` of a crop of a ``width x height`` image.

        Args:
            width: The image's width.
            height: The image's height.
            generator: Where to draw from (default: torch's global generator).
        """
        area = height * width
        draw = _BUFFERS
        for _ in range(10):
            target_area = area * draw.uniform(*self.scale, generator).item()
            aspect_ratio = draw.uniform(*self.log_ratio, generator).exp_().item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                top = draw.randint(height - h + 1, generator)
                left = draw.randint(width - w + 1, generator)
                return top, left, h, w
        # Fallback to a central crop (no draws).
        in_ratio = float(width) / float(height)
        if in_ratio < self.min_ratio:
            w = width
            h = int(round(w / self.min_ratio))
        elif in_ratio > self.max_ratio:
            h = height
            w = int(round(h * self.max_ratio))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w


def flip_draw(p: float, generator: Optional[torch.Generator] = None) -> bool:
    """``bool(torch.rand(1) < p)``, as ``RandomHorizontalFlip`` draws it.

    The comparison happens in the tensor's dtype, as torch's does (``p`` is
    rounded to float32 first under the default dtype).

    Args:
        p: The flip probability.
        generator: Where to draw from (default: torch's global generator).
    """
    value = _BUFFERS.uniform(0.0, 1.0, generator)
    return bool(value.item() < _rounded(p, value.dtype))


_ROUNDED: dict[tuple[float, torch.dtype], float] = {}


def _rounded(p: float, dtype: torch.dtype) -> float:
    """``p`` as a tensor of ``dtype`` holds it."""
    key = (p, dtype)
    if key not in _ROUNDED:
        _ROUNDED[key] = float(torch.tensor(p, dtype=dtype).item())
    return _ROUNDED[key]

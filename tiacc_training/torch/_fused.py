"""Recognising torchvision transform chains the engine can run in one pass.

A ``transforms.Compose`` qualifies when it is, in order:

1. geometry on the PIL image, one of
   ``RandomResizedCrop``, ``Resize(size) [+ CenterCrop]``, ``CenterCrop``
   (bilinear interpolation), each optionally followed by
   ``RandomHorizontalFlip``, with a fixed output size;
2. ``ToTensor`` or ``PILToTensor`` [+ ``ConvertImageDtype(torch.float32)``];
3. optionally ``Normalize``.

The random parameters are drawn with the same torch random calls, in the same
order, as ``RandomResizedCrop.get_params`` and ``RandomHorizontalFlip`` make
(see ``_random_params``), so the fused path consumes PyTorch's random stream
exactly as the PIL path does: with the same seed both produce the same crops
and flips. Only exact classes qualify (a
subclass may change behaviour); anything else runs the ordinary PIL path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torchvision.transforms as T
from torchvision.transforms import InterpolationMode

from tiacc_training.torch._random_params import ResizedCropParams, flip_draw

Geometry = tuple[tuple[int, int, int, int], tuple[int, int], tuple[int, int, int, int], bool]


def _pair(size: Union[int, tuple[int, ...], list[int]]) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    if len(size) == 1:
        return size[0], size[0]
    return int(size[0]), int(size[1])


def _bilinear(t: Any) -> bool:
    mode = t.interpolation
    return mode in (InterpolationMode.BILINEAR, 2)


def _resized_size(
    height: int, width: int, size: Union[int, list[int]], max_size: Optional[int]
) -> tuple[int, int]:
    """``Resize``'s output (height, width), as torchvision computes it for PIL."""
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return int(size[0]), int(size[1])
    requested = size if isinstance(size, int) else size[0]
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = requested, int(requested * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _center_window(height: int, width: int, crop: tuple[int, int]) -> tuple[int, int, int, int]:
    """``CenterCrop``'s window (left, top, width, height), padding included."""
    ch, cw = crop
    pl = (cw - width) // 2 if cw > width else 0
    pt = (ch - height) // 2 if ch > height else 0
    pr = (cw - width + 1) // 2 if cw > width else 0
    pb = (ch - height + 1) // 2 if ch > height else 0
    ph, pw = height + pt + pb, width + pl + pr
    if (ph, pw) == (ch, cw):
        return -pl, -pt, cw, ch
    top = int(round((ph - ch) / 2.0))
    left = int(round((pw - cw) / 2.0))
    return left - pl, top - pt, cw, ch


@dataclass
class FusedPlan:
    """A transform chain the engine can run; see the module docstring."""

    kind: str
    """``"rrc"``, ``"resize"`` or ``"center"``."""
    geometry_step: Any
    center_crop: Optional[tuple[int, int]]
    flip_p: Optional[float]
    to_float: bool
    mean: Optional[tuple[float, float, float]]
    std: Optional[tuple[float, float, float]]
    output_size: tuple[int, int]
    """(height, width) of every output."""
    crop_params: Optional[ResizedCropParams] = None
    """The crop draw of a ``"rrc"`` plan (its scale and ratio as planned)."""

    @classmethod
    def from_transform(cls, transform: Any) -> Optional[FusedPlan]:
        """The plan for ``transform``, or None if it does not qualify."""
        if type(transform) is not T.Compose:
            return None
        steps = list(transform.transforms)
        if not steps:
            return None
        first = steps.pop(0)
        center = None
        if type(first) is T.RandomResizedCrop and _bilinear(first):
            kind, out = "rrc", _pair(first.size)
        elif type(first) is T.Resize and _bilinear(first):
            kind = "resize"
            out = None
            if isinstance(first.size, (list, tuple)) and len(first.size) == 2:
                out = _pair(first.size)
            if steps and type(steps[0]) is T.CenterCrop:
                center = _pair(steps.pop(0).size)
                out = center
            if out is None:
                return None  # output size varies per image: nothing to batch
        elif type(first) is T.CenterCrop:
            kind, center = "center", _pair(first.size)
            out = center
        else:
            return None
        flip_p = None
        if steps and type(steps[0]) is T.RandomHorizontalFlip:
            flip_p = float(steps.pop(0).p)
        if not steps:
            return None  # ends in a PIL image: the PIL path is the right one
        conv = steps.pop(0)
        if type(conv) is T.ToTensor:
            to_float = True
        elif type(conv) is T.PILToTensor:
            to_float = False
            if steps and type(steps[0]) is T.ConvertImageDtype:
                if steps[0].dtype != torch.float32:
                    return None
                steps.pop(0)
                to_float = True
        else:
            return None
        mean = std = None
        if steps and type(steps[0]) is T.Normalize and to_float:
            norm = steps.pop(0)
            mean = tuple(float(v) for v in torch.as_tensor(norm.mean).expand(3))
            std = tuple(float(v) for v in torch.as_tensor(norm.std).expand(3))
        if steps:
            return None
        crop_params = ResizedCropParams(first.scale, first.ratio) if kind == "rrc" else None
        return cls(kind, first, center, flip_p, to_float, mean, std, out, crop_params)

    def sample(self, width: int, height: int) -> Geometry:
        """Draws this image's parameters (torch's RNG, torchvision's order)."""
        step = self.geometry_step
        if self.crop_params is not None:
            top, left, h, w = self.crop_params(width, height)
            oh, ow = self.output_size
            crop, resize, window = (left, top, w, h), (ow, oh), (0, 0, ow, oh)
        else:
            rh, rw = height, width
            if self.kind == "resize":
                rh, rw = _resized_size(height, width, step.size, step.max_size)
            crop, resize = (0, 0, width, height), (rw, rh)
            if self.center_crop is not None:
                window = _center_window(rh, rw, self.center_crop)
            else:
                window = (0, 0, rw, rh)
        flip = False
        if self.flip_p is not None:
            flip = flip_draw(self.flip_p)
        return crop, resize, window, flip

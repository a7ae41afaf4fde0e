"""Recognising torchvision transform chains the engine can run in one pass.

A ``Compose`` (``torchvision.transforms`` or ``torchvision.transforms.v2``;
nested ``Compose`` steps are read as the steps they hold) qualifies when it
is, in order:

1. geometry on the PIL image, one of
   ``RandomResizedCrop``, ``Resize(size) [+ CenterCrop]``, ``CenterCrop``
   (bilinear interpolation), each optionally followed by
   ``RandomHorizontalFlip``, with a fixed output size;
2. the conversion to a tensor: ``ToTensor`` (float in [0, 1]), or
   ``PILToTensor`` / v2 ``ToImage`` (uint8), optionally followed by
   ``ConvertImageDtype(torch.float32)`` or v2
   ``ToDtype(torch.float32, scale=True)`` (float in [0, 1]);
3. optionally ``Normalize`` (after a float conversion).

Each step may come from either API: on a PIL image, and on the tensors the
conversions make, the v1 and v2 classes of these steps compute the same thing
and draw the same random numbers. v2's ``antialias`` does not matter here:
for PIL images torchvision always resamples with Pillow, antialiased. v2's
``ToDtype``/``ConvertImageDtype`` scale by multiplying with ``1 / 255``
where ``ToTensor`` divides by 255; the engine divides, so those two steps
agree with the PIL path to within one float32 rounding (about 6e-8 before
``Normalize``) instead of bit for bit. Geometry placed after the conversion
does not qualify: on a tensor torchvision resamples with torch's
interpolation, which differs from Pillow's. The fused path returns plain
tensors where v2's ``ToImage`` would return ``tv_tensors.Image``.

The random parameters are drawn with the same torch random calls, in the same
order, as ``RandomResizedCrop.get_params`` / v2's ``make_params`` and
``RandomHorizontalFlip`` make (see ``_random_params``), so the fused path
consumes PyTorch's random stream exactly as the PIL path does: with the same
seed both produce the same crops and flips. Only exact classes qualify (a
subclass may change behaviour); anything else runs the ordinary PIL path, and
:meth:`FusedPlan.explain` says which step prevented fusing.

torchvision is optional: it is imported when the first transform is planned,
not with this module, and without it nothing fuses (no transform can be one
of its ``Compose``).
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional, Union

import torch

from tiacc_training import _engine

from . import _random_params

Geometry = _random_params.Geometry


class _Classes:
    """The transform classes the parser knows: torchvision's v1 and, where present, v2.

    Args:
        v1: ``torchvision.transforms``.
        v2: ``torchvision.transforms.v2``, or None (torchvision < 0.15).
    """

    def __init__(self, v1: ModuleType, v2: Optional[ModuleType]) -> None:
        def classes(*names: str) -> tuple[type, ...]:
            found = []
            for module in (v1, v2):
                for name in names:
                    cls = getattr(module, name, None) if module is not None else None
                    if isinstance(cls, type):
                        found.append(cls)
            return tuple(found)

        self.compose = classes("Compose")
        self.resized_crop = classes("RandomResizedCrop")
        self.resize = classes("Resize")
        self.center_crop = classes("CenterCrop")
        self.hflip = classes("RandomHorizontalFlip")
        self.geometry = self.resized_crop + self.resize + self.center_crop
        self.to_float = classes("ToTensor")  # v2's ToTensor calls v1's to_tensor
        self.to_uint8 = classes("PILToTensor", "ToImage")
        self.convert_dtype = classes("ConvertImageDtype")
        self.to_dtype = classes("ToDtype")
        self.normalize = classes("Normalize")
        self.known = (
            self.compose + self.geometry + self.hflip + self.to_float + self.to_uint8
            + self.convert_dtype + self.to_dtype + self.normalize
        )  # fmt: skip
        self.interpolation_mode: type = v1.InterpolationMode
        self.bilinear = (v1.InterpolationMode.BILINEAR, "bilinear", 2)
        """The spellings of bilinear: the enum, v2's string default, Pillow's constant."""


@functools.cache
def _torchvision() -> Optional[_Classes]:
    """The classes of torchvision's transforms, imported on first use; None without it."""
    try:
        import torchvision.transforms as v1  # optional dependency: imported on first use
    except ImportError:
        return None
    try:
        import torchvision.transforms.v2 as v2
    except ImportError:  # torchvision < 0.15 has no v2 API
        v2 = None
    return _Classes(v1, v2)


def _pair(size: Union[int, Sequence[int]]) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    if len(size) == 1:
        return size[0], size[0]
    return int(size[0]), int(size[1])


def _bilinear(tv: _Classes, t: Any) -> bool:
    mode = t.interpolation
    return isinstance(mode, (tv.interpolation_mode, str, int)) and mode in tv.bilinear


def _resize_error(step: Any) -> Optional[str]:
    """Why torchvision would reject this ``Resize`` when called, or None."""
    size, max_size = step.size, step.max_size
    if size is None:
        return None if isinstance(max_size, int) else "size=None needs an int max_size"
    if max_size is None:
        return None
    if not isinstance(size, int) and len(size) != 1:
        return "max_size needs a single size"
    if max_size <= (size if isinstance(size, int) else size[0]):
        return "max_size must exceed size"
    return None


def _channel_triple(values: Any) -> Optional[tuple[float, float, float]]:
    """``Normalize``'s mean or std for 3 channels, or None if it cannot apply to RGB."""
    v = torch.as_tensor(values).flatten()
    if v.numel() not in (1, 3):
        return None
    return tuple(float(x) for x in v.expand(3))  # type: ignore[return-value]


def _describe(tv: _Classes, step: Any, limit: int = 200) -> str:
    """``repr(step)`` on one line, shortened to about ``limit`` characters."""
    if type(step) in tv.to_dtype:  # its repr leaves the dtype out
        text = f"ToDtype(dtype={step.dtype!r}, scale={step.scale!r})"
    else:
        text = " ".join(repr(step).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _flatten(tv: _Classes, compose: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """The steps of ``compose`` as ``(label, step)``, nested ``Compose`` steps inlined.

    Labels count from 1; a step of a nested ``Compose`` at step 2 is ``"2.1"``.
    """
    steps: list[tuple[str, Any]] = []
    for k, step in enumerate(compose.transforms, 1):
        label = f"{prefix}{k}"
        if type(step) in tv.compose:
            steps.extend(_flatten(tv, step, label + "."))
        else:
            steps.append((label, step))
    return steps


class _Steps:
    """A cursor over the flattened steps of a ``Compose``, for the parser."""

    def __init__(self, tv: _Classes, steps: list[tuple[str, Any]]) -> None:
        self.tv = tv
        self.steps = steps
        self.pos = 0

    def peek(self) -> Any:
        """The next step, or None at the end."""
        return self.steps[self.pos][1] if self.pos < len(self.steps) else None

    def take(self) -> Any:
        """Consumes and returns the next step."""
        step = self.steps[self.pos][1]
        self.pos += 1
        return step

    def where(self, pos: Optional[int] = None) -> str:
        """``"Resize(...) (step 2 of Compose)"`` for the step at ``pos`` (default: next)."""
        label, step = self.steps[self.pos if pos is None else pos]
        return f"{_describe(self.tv, step)} (step {label} of Compose)"

    def cannot(self, why: str = "", pos: Optional[int] = None) -> str:
        """The reason the step at ``pos`` (default: the next) stops fusing."""
        step = self.steps[self.pos if pos is None else pos][1]
        why = why or _hint(self.tv, step)
        return self.where(pos) + (f": {why}" if why else "")


def _hint(tv: _Classes, step: Any) -> str:
    """Why an unexpected step cannot fuse, where something more can be said."""
    for known in tv.known:
        if isinstance(step, known) and type(step) is not known:
            return (
                f"a subclass of {known.__module__}.{known.__name__} "
                "(only torchvision's own classes are fused)"
            )
    return ""


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
    sampler: Any = None
    """The engine's ``Sampler``: each image's geometry (see ``_random_params``)."""

    @classmethod
    def from_transform(cls, transform: Any, warn: bool = False) -> Optional[FusedPlan]:
        """The plan for ``transform``, or None if it does not qualify.

        Args:
            transform: The dataset's transform.
            warn: Warn (once per distinct reason, see :func:`warn_unfused`)
                when ``transform`` is not None and does not qualify.
        """
        plan, reason = cls.explain(transform)
        if warn and reason is not None:
            warn_unfused(reason)
        return plan

    @classmethod
    def explain(cls, transform: Any) -> tuple[Optional[FusedPlan], Optional[str]]:
        """The plan for ``transform`` and, when there is none, why.

        Args:
            transform: The dataset's transform.

        Returns:
            ``(plan, None)`` when ``transform`` qualifies, ``(None, None)`` when
            it is None or torchvision is not installed (nothing to fuse, nothing
            wrong), else ``(None, reason)``
            where ``reason`` names the step that prevented fusing, e.g.
            ``"GaussianBlur(...) (step 3 of Compose)"``.
        """
        tv = None if transform is None else _torchvision()
        if tv is None:
            return None, None
        if type(transform) not in tv.compose:
            why = _hint(tv, transform) or "it is not a torchvision Compose"
            return None, f"{_describe(tv, transform)}: {why}"
        steps = _Steps(tv, _flatten(tv, transform))
        if not steps.steps:
            return None, f"{_describe(tv, transform)}: the Compose has no steps"
        return cls._parse(steps)

    @classmethod
    def _parse(cls, steps: _Steps) -> tuple[Optional[FusedPlan], Optional[str]]:
        tv = steps.tv
        first = steps.peek()
        first_pos = steps.pos
        kind = type(first)
        center = None
        out: Optional[tuple[int, int]] = None
        if (kind in tv.resized_crop or kind in tv.resize) and not _bilinear(tv, first):
            return None, steps.cannot("only bilinear interpolation is fused")
        if kind in tv.resized_crop:
            steps.take()
            crop_kind, out = "rrc", _pair(first.size)
        elif kind in tv.resize:
            error = _resize_error(first)
            if error is not None:
                return None, steps.cannot(error)
            steps.take()
            crop_kind = "resize"
            if isinstance(first.size, (list, tuple)) and len(first.size) == 2:
                out = _pair(first.size)
            if type(steps.peek()) in tv.center_crop:
                center = _pair(steps.take().size)
                out = center
            if out is None:
                why = "its output size differs per image (add a CenterCrop to batch it)"
                return None, steps.cannot(why, pos=first_pos)
        elif kind in tv.center_crop:
            steps.take()
            crop_kind, center = "center", _pair(first.size)
            out = center
        else:
            if kind in tv.to_float or kind in tv.to_uint8:
                for pos in range(steps.pos + 1, len(steps.steps)):
                    if type(steps.steps[pos][1]) in tv.geometry:
                        return None, steps.cannot(_AFTER_CONVERSION, pos=pos)
            why = _hint(tv, first) or (
                "the fused path starts with RandomResizedCrop, Resize or CenterCrop "
                "on the PIL image"
            )
            return None, steps.cannot(why)
        flip_p = None
        if type(steps.peek()) in tv.hflip:
            flip_p = float(steps.take().p)
        if steps.peek() is None:
            why = "the Compose ends here, with a PIL image (no tensor conversion to fuse)"
            return None, steps.cannot(why, pos=steps.pos - 1)
        to_float, reason = _conversion(steps)
        if reason is not None:
            return None, reason
        mean = std = None
        if type(steps.peek()) in tv.normalize:
            norm = steps.peek()
            if not to_float:
                return None, steps.cannot("it needs a float tensor, the conversion gives uint8")
            mean, std = _channel_triple(norm.mean), _channel_triple(norm.std)
            if mean is None or std is None:
                return None, steps.cannot("its mean and std must have 1 or 3 values")
            steps.take()
        rest = type(steps.peek())
        if rest in tv.geometry or rest in tv.hflip:
            return None, steps.cannot(_AFTER_CONVERSION)
        if steps.peek() is not None:
            return None, steps.cannot()
        if crop_kind == "rrc":
            sampler = _random_params.crop_sampler(
                first.scale, first.ratio, out, flip_p, _random_params.log_ratio_of(first)
            )
        elif crop_kind == "resize":
            size = first.size
            sizes = None if size is None else [size] if isinstance(size, int) else list(size)
            sampler = _engine.Sampler(
                "resize", size=sizes, max_size=first.max_size, center=center, flip_p=flip_p
            )
        else:
            sampler = _engine.Sampler("center", center=center, flip_p=flip_p)
        plan = cls(crop_kind, first, center, flip_p, to_float, mean, std, out, sampler)
        return plan, None

    def sample(
        self, sizes: Sequence[tuple[int, int]], generator: Optional[torch.Generator] = None
    ) -> list[Geometry]:
        """Draws each image's parameters (torch's RNG, torchvision's order).

        Args:
            sizes: ``(width, height)`` of each image, in batch order.
            generator: Where to draw from (default: torch's global generator,
                as torchvision draws).
        """
        return _random_params.sample(self.sampler, sizes, generator)


def _conversion(steps: _Steps) -> tuple[bool, Optional[str]]:
    """Consumes the tensor conversion: ``(to_float, None)``, or ``(False, reason)``."""
    tv = steps.tv
    conv = steps.peek()
    kind = type(conv)
    if kind in tv.to_float:
        steps.take()
        return True, None
    if kind not in tv.to_uint8:
        why = ""
        if kind in tv.geometry or kind in tv.hflip:
            why = "only one crop or resize, then at most one RandomHorizontalFlip, are fused"
        elif kind in tv.convert_dtype or kind in tv.to_dtype or kind in tv.normalize:
            why = "it needs a tensor, and the image is still a PIL image here"
        return False, steps.cannot(why)
    steps.take()
    nxt = steps.peek()
    kind = type(nxt)
    if kind in tv.convert_dtype:
        if nxt.dtype != torch.float32:
            return False, steps.cannot("only ConvertImageDtype(torch.float32) is fused")
        steps.take()
        return True, None
    if kind in tv.to_dtype:
        if not (isinstance(nxt.dtype, torch.dtype) and nxt.dtype == torch.float32 and nxt.scale):
            return False, steps.cannot("only ToDtype(torch.float32, scale=True) is fused")
        steps.take()
        return True, None
    if kind in tv.geometry or kind in tv.hflip:
        return False, steps.cannot(_AFTER_CONVERSION)
    return False, None


_AFTER_CONVERSION = (
    "it comes after the tensor conversion, where torchvision works on a tensor "
    "(resizing with torch, not Pillow); the fused path needs the crop, resize and "
    "flip before ToImage, PILToTensor or ToTensor"
)


_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def warn_unfused(reason: str) -> None:
    """Warns, once per distinct ``reason``, that items take the PIL path.

    The warning points at the first caller outside ``tiacc_training`` (the
    line that built the dataset or set its transform).

    Args:
        reason: What :meth:`FusedPlan.explain` returned.
    """
    with _WARNED_LOCK:
        if reason in _WARNED:
            return
        _WARNED.add(reason)
    level, frame = 1, sys._getframe(0)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("tiacc_training."):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"IndexTFRDataset: the fused path cannot run {reason}; items take the PIL path",
        stacklevel=level,
    )

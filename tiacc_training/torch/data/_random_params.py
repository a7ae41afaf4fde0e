"""The fused path's random draws: torchvision's, from PyTorch's random stream.

Each image's geometry is computed by the engine (``_engine.Sampler``: the
logic of ``RandomResizedCrop.get_params``, v2's ``make_params``,
``RandomHorizontalFlip``, ``Resize`` and ``CenterCrop``, written once). Its
random numbers come from one of two sources, which give identical results:

* **the engine's reproduction** of PyTorch's CPU generator: the generator's
  state is handed over (``get_state()``), the whole batch is drawn without
  Python, and the state after the draws is set back. A batch then holds the
  GIL for two state copies instead of several torch calls per image. (An
  image whose crop hangs on the last bits of torch's ``exp``, about one in
  five thousand, is drawn by torch: see the engine's ``image/sampling.rs``.)
* **torch itself** (:class:`TorchDraws`): one torch call per draw, the same
  calls torchvision makes, on the same dtypes.

The reproduction is used only where it was checked against the running
torch (:func:`reproduction`, once per process: a few thousand draws compared
bit for bit, ``exp`` to two units in the last place), the default dtype is
float32, and every random range is ordered (torch's own error is raised for
the others). Anything else draws from torch.
``tests/unit/test_random_params.py`` checks both sources
against torchvision.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Optional

import numpy
import torch

from tiacc_training import _engine

Geometry = tuple[tuple[int, int, int, int], tuple[int, int], tuple[int, int, int, int], bool]


class _Buffers(threading.local):
    """One-element tensors reused by the draws, per thread.

    A shared one could hand one thread's value to another.
    """

    def __init__(self) -> None:
        self.dtype = torch.get_default_dtype()
        self.real = torch.empty(1)
        self.int64 = torch.empty(1, dtype=torch.int64)

    def uniform(
        self, low: float, high: float, generator: Optional[torch.Generator]
    ) -> torch.Tensor:
        """``torch.empty(1).uniform_(low, high)`` (default dtype), reusing a tensor."""
        dtype = torch.get_default_dtype()
        if dtype != self.dtype:
            self.dtype, self.real = dtype, torch.empty(1)
        return self.real.uniform_(low, high, generator=generator)


_BUFFERS = _Buffers()


class TorchDraws:
    """torchvision's draws, each one torch call: the source ``Sampler.sample_with`` calls.

    Args:
        generator: Where to draw from (default: torch's global generator).
    """

    def __init__(self, generator: Optional[torch.Generator] = None) -> None:
        self.generator = generator

    def uniform(self, low: float, high: float) -> float:
        """``torch.empty(1).uniform_(low, high).item()``."""
        return _BUFFERS.uniform(low, high, self.generator).item()

    def exp_uniform(self, low: float, high: float) -> float:
        """``torch.exp(torch.empty(1).uniform_(low, high)).item()``."""
        return _BUFFERS.uniform(low, high, self.generator).exp_().item()

    def randint(self, high: int) -> int:
        """``torch.randint(0, high, size=(1,)).item()``."""
        return int(_BUFFERS.int64.random_(0, high, generator=self.generator).item())

    def flip(self, p: float) -> bool:
        """``bool(torch.rand(1) < p)``, compared in the tensor's dtype as torch does."""
        value = _BUFFERS.uniform(0.0, 1.0, self.generator)
        return bool(value.item() < _rounded(p, value.dtype))


_ROUNDED: dict[tuple[float, torch.dtype], float] = {}


def _rounded(p: float, dtype: torch.dtype) -> float:
    """``p`` as a tensor of ``dtype`` holds it."""
    key = (p, dtype)
    if key not in _ROUNDED:
        _ROUNDED[key] = float(torch.tensor(p, dtype=dtype).item())
    return _ROUNDED[key]


def crop_sampler(
    scale: Sequence[float],
    ratio: Sequence[float],
    output: tuple[int, int],
    flip_p: Optional[float] = None,
    log_ratio: Optional[tuple[float, float]] = None,
) -> Any:
    """The engine's sampler of a ``RandomResizedCrop`` (then an optional flip).

    Args:
        scale: The transform's ``scale``.
        ratio: The transform's ``ratio``.
        output: ``(height, width)`` of the output.
        flip_p: ``RandomHorizontalFlip``'s ``p``, if one follows.
        log_ratio: The logarithms the transform drew with (v2 keeps them);
            default: as v1's ``get_params`` computes them, in float32.
    """
    if log_ratio is None:
        logs = torch.log(torch.tensor([float(r) for r in ratio]))
        log_ratio = (float(logs[0]), float(logs[1]))
    return _engine.Sampler(
        "rrc",
        output=output,
        scale=(float(scale[0]), float(scale[1])),
        log_ratio=log_ratio,
        ratio=(float(ratio[0]), float(ratio[1])),
        flip_p=flip_p,
    )


_CHECKED: dict[str, Optional[bool]] = {}
_CHECK_LOCK = threading.Lock()


def reproduction() -> Optional[bool]:
    """Whether the engine reproduces this torch's CPU draws, and how.

    Returns:
        The ``fused_multiply_add`` flag under which every checked draw
        matched torch bit for bit, or None when neither did (the engine
        then draws from torch). Checked once per process.
    """
    with _CHECK_LOCK:
        if "flag" not in _CHECKED:
            _CHECKED["flag"] = _check()
        return _CHECKED["flag"]


def _check() -> Optional[bool]:
    log = torch.log(torch.tensor([3 / 4, 4 / 3]))
    ranges = [(0.08, 1.0, False), (0.9, 1.0, False), (0.0, 1.0, False),
              (float(log[0]), float(log[1]), True), (-1.6094379, 1.6094379, True)]  # fmt: skip
    samplers = [
        crop_sampler((0.08, 1.0), (3 / 4, 4 / 3), (8, 8), flip_p=0.5),
        crop_sampler((0.9, 1.0), (0.2, 5.0), (8, 8), flip_p=0.3),
    ]
    sizes = [(500, 375), (375, 500), (90, 70), (1, 1), (3000, 20), (20, 3000), (224, 224)] * 10
    for flag in (False, True):
        try:
            if _matches(flag, ranges, samplers, sizes):
                return flag
        except Exception:  # a state this build cannot read: draw from torch
            return None
    return None


def _matches(flag: bool, ranges: list, samplers: list, sizes: list) -> bool:
    for seed, (low, high, exp) in enumerate(ranges):
        generator = torch.Generator().manual_seed(1000 + seed)
        got = _engine.torch_cpu_uniform(generator.get_state().numpy(), flag, low, high, 400, exp)
        draws = TorchDraws(generator)
        want = [draws.exp_uniform(low, high) if exp else draws.uniform(low, high) for _ in got]
        if exp:
            # torch's exp may differ from the C library's in the last bits;
            # the sampler allows two units in the last place (see the engine).
            ulps = numpy.abs(
                numpy.array(got, numpy.float32).view(numpy.int32)
                - numpy.array(want, numpy.float32).view(numpy.int32)
            )
            if ulps.max() > 2:
                return False
        elif got != want:
            return False
    for seed, sampler in enumerate(samplers):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = sampler.sample_with(sizes, TorchDraws(theirs))
        got = sampler.sample(sizes, ours, TorchDraws(ours), flag)
        if got != want or not torch.equal(ours.get_state(), theirs.get_state()):
            return False
    return True


def reproducible(sampler: Any) -> Optional[bool]:
    """How to draw ``sampler``'s batches: the engine's flag, or None for torch.

    The flag is ``reproduction()``'s, where the module docs allow it.
    """
    if not sampler.ranges_ordered or torch.get_default_dtype() != torch.float32:
        return None
    return reproduction()


def sample(
    sampler: Any, sizes: Sequence[tuple[int, int]], generator: Optional[torch.Generator]
) -> list[Geometry]:
    """The geometries of images of ``sizes`` (``(width, height)`` each).

    Args:
        sampler: The plan's ``_engine.Sampler``.
        sizes: Each image's width and height.
        generator: Where to draw from (default: torch's global generator).
    """
    flag = reproducible(sampler)
    if flag is None:
        return sampler.sample_with(list(sizes), TorchDraws(generator))
    source = generator if generator is not None else torch.default_generator
    return sampler.sample(list(sizes), source, TorchDraws(generator), flag)


def log_ratio_of(step: Any) -> Optional[tuple[float, float]]:
    """The logarithms v2's ``RandomResizedCrop`` keeps (drawn with exactly those), or None."""
    log_ratio = getattr(step, "_log_ratio", None)
    if isinstance(log_ratio, torch.Tensor) and log_ratio.numel() == 2:
        return float(log_ratio[0]), float(log_ratio[1])
    return None


__all__ = ["TorchDraws", "crop_sampler", "reproduction", "sample"]

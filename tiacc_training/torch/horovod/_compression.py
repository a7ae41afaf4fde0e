"""Gradient compression for ``DistributedOptimizer`` (Horovod's ``Compression``).

A compressor has Horovod's shape: a class with two static methods,
``compress(tensor) -> (compressed, context)`` and
``decompress(compressed, context) -> tensor``. The optimizer compresses
each gradient before it is reduced and decompresses the reduced value into
``.grad``; a compressed gradient of a dtype the engine carries (float32,
float64, float16, bfloat16) travels in the engine's fused buckets.

This is compression of the values the ranks reduce (the reduction itself
runs in the compressed dtype, as in Horovod), not the engine's wire
compression (``TIACC_TRAINING_COMPRESSION``), which keeps the sum in the
gradient's own dtype; both can be on at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """The interface: compress before the reduction, decompress after."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Returns the tensor to reduce and what ``decompress`` needs."""
        raise NotImplementedError("a Compressor subclass defines compress()")

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Returns the reduced tensor in the gradient's own form."""
        raise NotImplementedError("a Compressor subclass defines decompress()")


class NoneCompressor(Compressor):
    """No compression: the gradient is reduced as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Returns ``tensor`` unchanged (no context)."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Returns ``tensor`` unchanged."""
        return tensor


class FP16Compressor(Compressor):
    """Floating-point gradients are reduced in float16.

    Each rank rounds its gradient to float16, the ranks reduce the float16
    values (so the sum is rounded to float16 too), and the result is cast
    back to the gradient's dtype. Other dtypes pass unchanged.
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Returns ``tensor`` in float16 and its original dtype."""
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != torch.float16:
            return tensor.to(torch.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Returns ``tensor`` cast back to the dtype ``compress`` saw."""
        if ctx is not None and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class Compression:
    """The built-in compressors, as Horovod names them."""

    none = NoneCompressor
    fp16 = FP16Compressor


def compressed(
    compression: Any,
    tensors: Sequence[torch.Tensor],
    run: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """``run``'s results for ``tensors`` sent compressed, in the tensors' own form.

    Args:
        compression: a compressor (``Compression.fp16``, ...), or ``None``:
            ``run`` takes the tensors as they are.
        tensors: the operation's inputs.
        run: the operation, from the (compressed) inputs to its results,
            one per input.

    Returns:
        ``run``'s results, each decompressed with its input's context.
    """
    if compression is None:
        return run(tensors)
    pairs = [compression.compress(t) for t in tensors]
    results = run([t for t, _ in pairs])
    return [compression.decompress(r, c) for r, (_, c) in zip(results, pairs)]

"""The protection of a model's floating-point buffers (``model=``, ``repair_buffers``).

A flat copy per (device, dtype) of the buffers, taken and checked for
non-finite values in a handful of kernels, and copied back into the same
tensors when an overflowed forward pass left NaN or inf in them. Torch
work, no decision: the policy turns a finding into a guard trip.
"""

from __future__ import annotations

from typing import Any

import torch


def _float_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's floating-point buffers with their names (BatchNorm's running statistics...)."""
    return [(name, b) for name, b in model.named_buffers() if b.is_floating_point()]


class _Layout:
    """Where each floating-point buffer of a model sits in the policy's flat copies.

    One flat copy per (device, dtype) of the buffers, in ``named_buffers()``
    order; ``key`` says which buffers (name, shape, dtype, device) it is for.
    """

    def __init__(self, buffers: list[tuple[str, torch.Tensor]]) -> None:
        self.key = _layout_key(buffers)
        by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, (_, b) in enumerate(buffers):
            by_kind.setdefault((b.device, b.dtype), []).append(i)
        # Per group: the buffers' indices, their start offsets in the flat
        # copy and their end offsets as a tensor on the group's device.
        self.groups: list[tuple[list[int], list[int], torch.Tensor]] = []
        for (device, _), index in by_kind.items():
            starts, ends, total = [], [], 0
            for i in index:
                starts.append(total)
                total += buffers[i][1].numel()
                ends.append(total)
            self.groups.append((index, starts, torch.tensor(ends, device=device)))


def _layout_key(buffers: list[tuple[str, torch.Tensor]]) -> tuple[Any, ...]:
    """What a flat copy must match to restore ``buffers``: name, shape, dtype, device each."""
    return tuple((name, tuple(b.shape), b.dtype, b.device) for name, b in buffers)


def _flat_copies(
    buffers: list[tuple[str, torch.Tensor]], layout: _Layout
) -> tuple[list[torch.Tensor], list[bool]]:
    """Flat copies of the buffers (one per group of ``layout``) and which are non-finite.

    Per group a handful of kernels, whatever the number of buffers: the
    concatenation (the copy), ``isfinite``, a running count of the
    non-finite elements read at each buffer's end; the counts of a device
    are read back together: one device-to-host read (a synchronisation on
    CUDA) per device the buffers live on.

    Returns:
        The flat copies, and per buffer whether it holds a NaN or an inf.
    """
    flats: list[torch.Tensor] = []
    counts: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
    with torch.no_grad():
        for index, _, ends in layout.groups:
            flat = torch.cat([buffers[i][1].reshape(-1) for i in index])
            flats.append(flat)
            running = torch.cumsum(~torch.isfinite(flat), 0)
            running = torch.cat([running.new_zeros(1), running])
            per = torch.diff(running.index_select(0, ends), prepend=running.new_zeros(1))
            counts.setdefault(flat.device, []).append((index, per))
    bad = [False] * len(buffers)
    for parts in counts.values():
        values = iter(torch.cat([per for _, per in parts]).tolist())
        for index, _ in parts:
            for i in index:
                bad[i] = next(values) > 0
    return flats, bad


def _restore(
    buffers: list[tuple[str, torch.Tensor]], layout: _Layout, copies: list[torch.Tensor]
) -> None:
    """Copies every buffer back from the flat copies of ``layout``, in place.

    Args:
        buffers: The model's floating-point buffers, as :func:`_float_buffers`
            lists them (they must match ``layout.key``).
        layout: Where each buffer sits in ``copies``.
        copies: The flat copies, one per group of ``layout``.
    """
    with torch.no_grad():
        for (index, starts, _), copy in zip(layout.groups, copies):
            for i, start in zip(index, starts):
                b = buffers[i][1]
                b.copy_(copy[start : start + b.numel()].view(b.shape))

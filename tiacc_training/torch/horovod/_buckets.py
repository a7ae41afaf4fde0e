"""The buckets of ``DistributedOptimizer``: which gradients are reduced together.

Parameters are cut into buckets of the engine's fusion size (as DDP's
buckets are), or grouped as the ``groups``/``num_groups`` arguments say;
and the optimizer's parameters get their names, checked as Horovod checks
``named_parameters`` (or generated as Horovod generates them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from tiacc_training.torch.distributed import _config

from ._common import check_pairs

__all__ = ["Bucket", "Plan", "cut", "first_plan", "fusion_bytes", "named_parameters_of"]


@dataclass
class Bucket:
    """Parameters whose gradients are reduced together."""

    number: int
    params: list[torch.nn.Parameter]
    ready: int = 0
    # What is in flight: ("engine", future, contexts) or ("ops", handle, contexts).
    pending: tuple[Any, ...] | None = None
    # The flat buffer the engine reduces, kept from step to step (the
    # engine is done with it once synchronize() has waited for it).
    flat: torch.Tensor | None = None


@dataclass
class Plan:
    """The buckets of one optimizer and where each parameter is."""

    buckets: list[Bucket] = field(default_factory=list)
    bucket_of: dict[torch.nn.Parameter, Bucket] = field(default_factory=dict)


def fusion_bytes(params: list[torch.nn.Parameter]) -> int:
    """The engine's bucket size for these gradients (as DDP's buckets get)."""
    config = _config.current()
    if config is None:
        config = _config.effective_config()
    gradient_bytes = sum(p.numel() * p.element_size() for p in params)
    return max(1, int(config.bucket_bytes(gradient_bytes)))


def cut(params: list[torch.nn.Parameter], threshold: int) -> Plan:
    """Buckets of consecutive parameters of one dtype and device, up to ``threshold`` bytes."""
    plan = Plan()
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        if current and (
            size >= threshold or p.dtype != current[0].dtype or p.device != current[0].device
        ):
            add_bucket(plan, current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        add_bucket(plan, current)
    return plan


def add_bucket(plan: Plan, params: list[torch.nn.Parameter]) -> None:
    bucket = Bucket(len(plan.buckets), list(params))
    plan.buckets.append(bucket)
    for p in params:
        plan.bucket_of[p] = bucket


def first_plan(
    params: list[torch.nn.Parameter],
    groups: list[list[torch.nn.Parameter]] | int | None,
    threshold: int,
) -> Plan:
    """The first buckets.

    Explicit groups, or the threshold over the reversed parameters (the
    order backward usually produces gradients in).
    """
    if groups is None:
        return cut(list(reversed(params)), threshold)
    plan = Plan()
    if isinstance(groups, int):
        for chunk in split(params, groups):
            add_bucket(plan, chunk)
        return plan
    grouped: set[torch.nn.Parameter] = set()
    wanted = set(params)
    for group in groups:
        members = [p for p in group if p in wanted]
        if members:
            add_bucket(plan, members)
            grouped.update(members)
    for p in params:
        if p not in grouped:
            add_bucket(plan, [p])
    return plan


def split(params: list[torch.nn.Parameter], n: int) -> list[list[torch.nn.Parameter]]:
    """``params`` in ``n`` consecutive chunks of nearly equal length."""
    n = max(1, min(n, len(params)))
    base, extra = divmod(len(params), n)
    chunks, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        chunks.append(params[start:end])
        start = end
    return [c for c in chunks if c]


def named_parameters_of(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
) -> list[tuple[str, torch.nn.Parameter]]:
    """The optimizer's parameters with names, checked as Horovod checks them.

    Raises:
        ValueError: an entry is not a ``(name, parameter)`` pair, a name
            repeats, or a parameter of the optimizer has no name.
    """
    if named_parameters is None:
        return [
            (f"allreduce.noname.{i}.{j}", p)
            for i, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])
        ]
    named = list(named_parameters)
    check_pairs(
        named,
        "named_parameters should be a sequence of (name, parameter) tuples, as "
        "model.named_parameters() yields",
    )
    counts: dict[str, int] = {}
    for name, _ in named:
        counts[name] = counts.get(name, 0) + 1
    duplicates = sorted(name for name, n in counts.items() if n > 1)
    if duplicates:
        raise ValueError(
            "parameter names in named_parameters must be unique; duplicates: "
            + ", ".join(duplicates)
        )
    named_ids = {id(p) for _, p in named}
    unnamed = [
        id(p) for group in optimizer.param_groups for p in group["params"] if id(p) not in named_ids
    ]
    if unnamed:
        raise ValueError(
            "named_parameters was given, but some of the optimizer's parameters are not in it "
            "(Python object ids: " + ", ".join(str(i) for i in unnamed) + ")"
        )
    return named

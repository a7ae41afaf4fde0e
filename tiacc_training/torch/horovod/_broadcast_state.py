"""``broadcast_parameters`` and ``broadcast_optimizer_state``.

The root's parameters and optimizer state, copied in place into every
rank's, through the package's broadcasts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import _basics
from ._broadcast import broadcast_async_, broadcast_object
from ._common import check_pairs
from ._handles import synchronize
from ._process_sets import global_process_set

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(
    params: Any, root_rank: int, process_set: Any = global_process_set
) -> None:
    """Copies ``root_rank``'s tensors into every rank's, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or a
            list of ``(name, tensor)`` pairs.
        root_rank: the rank whose values every rank takes.
        process_set: the ranks taking part.

    Raises:
        ValueError: ``params`` is of another type, or holds a non-tensor.
    """
    if isinstance(params, dict):
        items = sorted(params.items()) if all(isinstance(k, str) for k in params) else None
        items = items if items is not None else list(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        items = list(params)
        check_pairs(items, "params must be a state_dict or a list of (name, tensor) pairs")
    else:
        raise ValueError(f"params must be a state_dict or (name, tensor) pairs, not {type(params)}")
    handles = []
    for name, value in items:
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"params[{name!r}] is a {type(value).__name__}, not a tensor: use "
                "hvd.broadcast_object for other values"
            )
        handles.append(
            broadcast_async_(
                value.detach(),
                root_rank,
                name=f"broadcast_parameters.{name}",
                process_set=process_set,
            )
        )
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: Any = None,
    process_set: Any = global_process_set,
) -> None:
    """Makes every rank's optimizer state ``root_rank``'s.

    The state (tensors such as momentum buffers, and scalars such as step
    counts) and each parameter group's options (``lr``, ``momentum``, ...)
    become the root's. A rank whose optimizer has no state yet (before its
    first step) gets the root's all the same: the root sends the layout,
    every rank allocates it, then the tensors are broadcast in place. When
    this rank's optimizer has no state yet, its parameters that take
    gradients and have none get zero gradients, as Horovod leaves them.

    Args:
        optimizer: a torch optimizer (``DistributedOptimizer`` or not), with
            the same parameter groups on every rank.
        root_rank: the rank whose state every rank takes.
        model: unused (Horovod's argument, kept for its signature).
        process_set: the ranks taking part.

    Raises:
        ValueError: ``optimizer`` is not a torch optimizer, or the ranks'
            parameter groups differ in length.
    """
    del model
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("broadcast_optimizer_state does not support torch.optim.LBFGS")
    mine = optimizer.state_dict()
    if not mine["state"]:
        # As Horovod: a new optimizer's parameters that take gradients get
        # zero ones (Horovod then steps to create the state; here the root's
        # layout creates it, so the parameters do not move).
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    layout = None
    if _basics.rank() == root_rank:
        layout = {
            "state": {k: _layout(v) for k, v in mine["state"].items()},
            "param_groups": mine["param_groups"],
        }
    layout = broadcast_object(
        layout,
        root_rank=root_rank,
        name="broadcast_optimizer_state.layout",
        process_set=process_set,
    )
    sizes = [len(g["params"]) for g in layout["param_groups"]]
    if sizes != [len(g["params"]) for g in mine["param_groups"]]:
        raise ValueError(
            f"rank {_basics.rank()}: the optimizer's parameter groups hold "
            f"{[len(g['params']) for g in mine['param_groups']]} parameters, rank "
            f"{root_rank}'s hold {sizes}"
        )
    devices = {}
    for group, indices in zip(optimizer.param_groups, (g["params"] for g in mine["param_groups"])):
        for p, index in zip(group["params"], indices):
            devices[index] = p.device
    state = {}
    tensors = []
    for key in sorted(layout["state"], key=str):
        entry = {}
        for name, spec in layout["state"][key].items():
            if isinstance(spec, _TensorSpec):
                own = mine["state"].get(key, {}).get(name)
                device = spec.device_of(devices.get(key))
                if (
                    isinstance(own, torch.Tensor)
                    and own.shape == spec.shape
                    and own.dtype == spec.dtype
                ):
                    tensor = own
                else:
                    tensor = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
                entry[name] = tensor
                tensors.append((f"{key}.{name}", tensor))
            else:
                entry[name] = spec
        state[key] = entry
    handles = [
        broadcast_async_(
            t, root_rank, name=f"broadcast_optimizer_state.{n}", process_set=process_set
        )
        for n, t in tensors
    ]
    for handle in handles:
        synchronize(handle)
    optimizer.load_state_dict({"state": state, "param_groups": layout["param_groups"]})


@dataclass(frozen=True)
class _TensorSpec:
    """A state tensor's shape and dtype, as the root sends it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool

    def device_of(self, param_device: torch.device | None) -> torch.device:
        """Where this rank keeps the tensor: the CPU, or its parameter's device."""
        if self.on_cpu or param_device is None:
            return torch.device("cpu")
        return param_device


def _layout(entry: dict[str, Any]) -> dict[str, Any]:
    """One parameter's state with each tensor replaced by its spec."""
    return {
        name: _TensorSpec(tuple(v.shape), v.dtype, v.device.type == "cpu")
        if isinstance(v, torch.Tensor)
        else v
        for name, v in entry.items()
    }

"""torch's method names of a backend, onto the "tiacc" collectives of the call's device.

torch calls a backend's collectives by its own method names, which differ
between its Backend and its ProcessGroup classes for some of them. Both
forms of the backend (``_backend``) take every name to the group's
CpuCollectives: the ones the engine serves to its method of that name,
the others to gloo (counted).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ._collectives import NOT_IN_ENGINE, CpuCollectives, GroupCollectives

# Names the engine serves, the same in both classes.
SERVED = {name: name for name in ("allreduce", "broadcast", "allgather", "reduce_scatter")}
# Names the engine serves, as the Backend class spells them.
SERVED_BACKEND = {
    **SERVED,
    "all_gather_single": "allgather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "all_to_all_single": "all_to_all_single",
    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
}
# Names the engine serves, as the ProcessGroup class spells them: the older
# names, and the newer ones a newer torch's ProcessGroup looks up first.
# Every name must reach Python: torch's trampoline calls the C++ default of a
# name the subclass lacks while holding the GIL, and gloo's worker thread,
# freeing an earlier work's tensors, waits for that GIL while holding the
# lock the call needs (a 2 x 2 job hung so in all_gather_into_tensor).
SERVED_GROUP = {
    **SERVED_BACKEND,
    "_allgather_base": "allgather_into_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "alltoall_base": "all_to_all_single",
    "allgather_into_tensor_coalesced": "allgather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
}
# Names gloo serves: torch's name -> (the op as counted, gloo's method).
GLOO = {
    "allreduce_coalesced": ("allreduce_coalesced", "allreduce_coalesced"),
    "reduce": ("reduce", "reduce"),
    "allgather_coalesced": ("allgather_coalesced", "allgather_coalesced"),
    "gather": ("gather", "gather"),
    "scatter": ("scatter", "scatter"),
    "alltoall": ("alltoall", "alltoall"),
    "send": ("send", "send"),
    "recv": ("recv", "recv"),
    "recv_anysource": ("recv", "recv_anysource"),
}
GLOO_BACKEND = {**GLOO, "allreduce_sparse": ("allreduce", "allreduce")}
GLOO_GROUP = {**GLOO, "recvAnysource": ("recv", "recv_anysource")}


# The options each collective takes, for torch's own Python calls that leave
# them out (torch 2.0's all_gather calls ``allgather(outputs, inputs)``; on
# a ProcessGroup subclass that call reaches our method, not the binding
# whose default fills them in).
OPTIONS = {
    "allreduce": "AllreduceOptions",
    "broadcast": "BroadcastOptions",
    "allgather": "AllgatherOptions",
    "allgather_into_tensor": "AllgatherOptions",
    "allgather_into_tensor_coalesced": "AllgatherOptions",
    "reduce_scatter": "ReduceScatterOptions",
    "reduce_scatter_tensor": "ReduceScatterOptions",
    "reduce_scatter_tensor_coalesced": "ReduceScatterOptions",
    "all_to_all_single": "AllToAllOptions",
}


def served(name: str, ours: str, c10d: Any) -> Callable[..., Any]:
    """Method ``name`` of torch's: the engine's ``ours`` (``c10d``: the module of its options)."""
    wanted = len(inspect.signature(getattr(CpuCollectives, ours)).parameters) - 1
    options = getattr(c10d, OPTIONS[ours], None)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) == wanted - 1 and "opts" not in kwargs and options is not None:
            args = (*args, options())
        return getattr(self.collectives_for(args), ours)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"torch's ``{name}``: the engine's ``{ours}``, or gloo's."
    return method


def forwarded(name: str, op: str, gloo_method: str) -> Callable[..., Any]:
    """Method ``name`` of torch's: counted as ``op``, forwarded to ``gloo_method`` underneath."""

    def method(self: Any, *args: Any) -> Any:
        collectives = self.collectives_for(args)
        underneath = getattr(collectives.fallback, gloo_method)
        return collectives.forward(op, NOT_IN_ENGINE, underneath, *args)

    method.__name__ = name
    method.__doc__ = f"torch's ``{name}``: forwarded to gloo, or NCCL (counted)."
    return method


def by_device(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` for the tensors "tiacc" serves; the device's own backend for the others."""

    def dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = device_of(args)
        if device is not None and device != "cpu":
            backend = self.device_backend(device)
            if not isinstance(backend, GroupCollectives):
                return getattr(backend, name)(*args, **kwargs)
        return method(self, *args, **kwargs)

    dispatch.__name__ = name
    dispatch.__doc__ = method.__doc__
    return dispatch


def device_of(args: Any) -> str | None:
    """The device type of the first tensor in a call's arguments."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
        if isinstance(arg, (list, tuple)):
            found = device_of(arg)
            if found is not None:
                return found
    return None

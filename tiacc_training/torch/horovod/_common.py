"""What every family of Horovod operations shares: reductions, dtypes, argument checks.

Nothing here talks to the other ranks; :mod:`._negotiation` does that, and
the operation modules (:mod:`._allreduce`, :mod:`._allgather`, ...) use
both.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tiacc_training import _engine
from tiacc_training.torch.distributed import _backend

from ._process_sets import ProcessSet, global_process_set

__all__ = ["Adasum", "Average", "Max", "Min", "Product", "ReduceOp", "Sum"]

T = TypeVar("T")


class ReduceOp(int):
    """A Horovod reduction (an ``int``, as Horovod's constants are)."""

    label: str

    def __new__(cls, value: int, label: str) -> ReduceOp:
        op = super().__new__(cls, value)
        op.label = label
        return op

    def __repr__(self) -> str:
        return self.label


Average = ReduceOp(0, "Average")
Sum = ReduceOp(1, "Sum")
Adasum = ReduceOp(2, "Adasum")
Min = ReduceOp(3, "Min")
Max = ReduceOp(4, "Max")
Product = ReduceOp(5, "Product")
OPS = {int(op): op for op in (Average, Sum, Adasum, Min, Max, Product)}
TORCH_OPS = {
    int(Sum): dist.ReduceOp.SUM,
    int(Min): dist.ReduceOp.MIN,
    int(Max): dist.ReduceOp.MAX,
    int(Product): dist.ReduceOp.PRODUCT,
}

# Element types, by code in the exchanges between ranks.
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
DTYPE_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}
MAX_DIMS = 8
# One tensor's description: dtype code, number of dimensions, MAX_DIMS sizes, device.
DESCRIPTION = MAX_DIMS + 3


def describe(tensor: torch.Tensor, skip_first: bool = False) -> list[int]:
    """The tensor as the ranks compare it (``skip_first``: the first size is free).

    Raises:
        ValueError: more than ``MAX_DIMS`` dimensions.
        TypeError: a dtype the collectives do not carry.
    """
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"tensors of more than {MAX_DIMS} dimensions are not supported")
    code = DTYPE_CODE.get(tensor.dtype)
    if code is None:
        raise TypeError(f"tensor dtype {tensor.dtype} is not supported")
    shape = list(tensor.shape)
    if skip_first and shape:
        shape[0] = -1
    return [code, tensor.dim(), *shape, *([-2] * (MAX_DIMS - len(shape))), int(tensor.is_cuda)]


def show(row: list[int]) -> str:
    """A description from :func:`describe`, in words."""
    dtype = DTYPES[row[0]] if 0 <= row[0] < len(DTYPES) else row[0]
    shape = ["*" if s == -1 else str(s) for s in row[2 : 2 + max(0, min(row[1], MAX_DIMS))]]
    where = "cuda" if row[MAX_DIMS + 2] else "cpu"
    return f"{dtype} of shape [{', '.join(shape)}] on {where}"


def check_tensor(tensor: Any, what: str = "tensor") -> torch.Tensor:
    """``tensor``, checked to be a dense torch tensor.

    Raises:
        TypeError: not a tensor.
        ValueError: a sparse tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError(f"{what} is sparse: use sparse_allreduce_async or densify it")
    return tensor


def check_list(tensors: Any) -> list[torch.Tensor]:
    """The tensors of a grouped operation, checked.

    Raises:
        ValueError: not a non-empty list, or a sparse tensor in it.
        TypeError: an entry is not a tensor.
    """
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("tensors must be a non-empty list of tensors")
    return [check_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]


def op_of(average: bool | None, op: Any, default: ReduceOp = Average) -> ReduceOp:
    """The reduction from Horovod's ``average=`` (deprecated) and ``op=``.

    Raises:
        ValueError: both given, or ``op`` is not a Horovod reduction.
    """
    if average is not None and op is not None:
        raise ValueError("average= and op= cannot both be given (average is deprecated: use op=)")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return default
    if isinstance(op, bool) or not isinstance(op, int) or int(op) not in OPS:
        raise ValueError(f"op={op!r} is not a Horovod reduction (Average, Sum, Min, Max, ...)")
    return OPS[int(op)]


def check_pairs(entries: Iterable[Any], what: str) -> None:
    """Raises ``ValueError`` unless every entry is a ``(name, value)`` pair.

    Args:
        entries: the entries to check.
        what: what the entries should be, the message's start (the type of
            the first entry that is not a pair follows it).
    """
    for entry in entries:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise ValueError(f"{what}; got an entry of type {type(entry).__name__}")


def check_scales(prescale_factor: Any, postscale_factor: Any) -> None:
    """Raises ``TypeError`` unless both factors are numbers."""
    for what, value in (
        ("prescale_factor", prescale_factor),
        ("postscale_factor", postscale_factor),
    ):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{what} must be a number, not {type(value).__name__}")


def check_root(root_rank: Any, process_set: ProcessSet) -> int:
    """``root_rank``, checked to be a global rank of the set.

    Raises:
        TypeError: not an int.
        ValueError: not a rank of the set.
    """
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise TypeError(f"root_rank must be an int, not {type(root_rank).__name__}")
    if root_rank not in process_set.ranks:
        if process_set is global_process_set:
            raise ValueError(
                f"root_rank={root_rank} is out of range: the job has ranks 0 to "
                f"{len(process_set.ranks) - 1}"
            )
        raise ValueError(
            f"root_rank={root_rank} is not in the process set {process_set.ranks} "
            "(root ranks are global ranks)"
        )
    return root_rank


def scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiplies in place; integers in float64, rounded toward zero."""
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    elif tensor.dtype == torch.bool:
        raise ValueError("prescale_factor/postscale_factor cannot scale a bool tensor")
    else:
        tensor.copy_(tensor.double().mul_(factor).trunc_())


def group_of(group: Any) -> Any:
    """The group object (``WORLD`` resolved to the default group)."""
    if group is None or group is dist.GroupMember.WORLD:
        return dist.distributed_c10d._get_default_group()
    return group


def native_average(tensor: torch.Tensor, group: Any) -> bool:
    """Whether the group's backend averages this tensor itself (the engine, NCCL)."""
    if tensor.dtype == torch.bool:
        return False
    if tensor.is_cuda:
        if _backend.cuda_collectives_of(group_of(group)) is not None:
            # The device engine averages floating-point tensors.
            return tensor.is_floating_point()
        try:
            backend = group_of(group)._get_backend(tensor.device)
        except Exception:
            return False
        return isinstance(backend, getattr(dist, "ProcessGroupNCCL", ()))
    if _backend.cpu_backend_of(group) is None:
        return False
    return str(tensor.dtype).removeprefix("torch.") in _engine.collective_dtypes()


def form_of(
    template: Callable[..., Any],
    body: Callable[..., T],
    name: str,
    doc: str,
    returns: str,
    grouped: bool = False,
) -> Callable[..., T]:
    """Another form of a Horovod operation, with ``template``'s parameters.

    Horovod gives each operation several forms (in place, asynchronous,
    grouped) that take the same arguments. Each family writes its parameters
    once, on ``template``; the other forms are made here, so that they show
    the same signature (``help()``, ``inspect.signature``) and take the same
    positional and keyword arguments.

    Args:
        template: the form whose parameters (names, order, defaults) this one takes.
        body: runs the call, given every argument in ``template``'s order,
            defaults filled in.
        name: the form's public name.
        doc: its docstring.
        returns: what it returns (its return annotation).
        grouped: the first parameter is ``tensors`` (a list) instead of ``tensor``.

    Returns:
        The public function.
    """
    signature = inspect.signature(template).replace(return_annotation=returns)
    if grouped:
        first, *rest = signature.parameters.values()
        tensors = first.replace(name="tensors", annotation="Sequence[torch.Tensor]")
        signature = signature.replace(parameters=[tensors, *rest])

    def form(*args: Any, **kwargs: Any) -> T:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{name}(): {error}") from None
        bound.apply_defaults()
        return body(*bound.args)

    form.__signature__ = signature  # type: ignore[attr-defined]
    form.__name__ = form.__qualname__ = name
    form.__doc__ = doc
    form.__module__ = template.__module__
    return form

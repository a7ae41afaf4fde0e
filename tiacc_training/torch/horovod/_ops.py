"""Horovod's collectives on torch.distributed groups served by the engine.

Each operation runs on its process set's group: CPU tensors on the "tiacc"
backend (the engine over shared memory or TCP; what it does not run goes to
gloo underneath), CUDA tensors on NCCL. The asynchronous functions return
an integer handle; :func:`synchronize` waits for it and returns the result,
:func:`poll` says whether it is done.

Semantics as in Horovod:

* Reductions: ``Average`` (the default), ``Sum``, ``Min``, ``Max``,
  ``Product``, ``Adasum`` (``_adasum``). ``prescale_factor`` multiplies
  the input before the reduction, ``postscale_factor`` the result after.
  The average of integer tensors is the sum divided by the set's size,
  rounded toward zero (the engine's integer mean; with a postscale factor,
  ``sum * postscale / size`` rounded toward zero), and integer tensors are
  scaled in float64 and rounded toward zero.
* ``allgather`` and ``alltoall`` take tensors whose first dimensions differ
  across ranks; ``reducescatter`` splits the first dimension as Horovod
  does (the first ``rows % size`` ranks get one row more).
* Before the data moves, the ranks compare each tensor's dtype and shape
  (a small allgather): a mismatch raises ``ValueError`` on every rank,
  naming the ranks and shapes where it can. On the global set this
  exchange runs for every operation and also carries what :func:`join`
  needs (the kind of operation and its fused buffers), so ranks inside
  ``join()`` take part in the others' allreduces; an allreduce whose name
  was seen before with the same dtypes and shapes queues this exchange
  ahead of its data without waiting for it (checked at ``synchronize``),
  so named allreduces in a backward pass do not stop for each other. On
  another process set the exchange runs the first time a name is seen
  with a dtype and shape, after which the same name and shape go straight
  to the data; unnamed operations there are compared every time.
* Asynchronous means the data moves in the background: the shape exchange
  (and, for ``allgather`` and ``alltoall``, the exchange of sizes) happens
  in the call, and Adasum runs to the end in the call.
* Uneven ``alltoall`` and ``allgather`` blocks travel padded to the widest
  block, so every rank makes the same equal-split call, which the engine
  runs.
* Gradients flow through ``allreduce``, ``allgather``, ``broadcast`` and
  ``alltoall`` (not their in-place or asynchronous forms).
* A collective that fails because a peer left or timed out raises
  :class:`HorovodInternalError`, its cause the engine's ``CommError``.
"""

from __future__ import annotations

import itertools
import pickle
import struct
import threading
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from tiacc_training import _engine
from tiacc_training.errors import CommError
from tiacc_training.torch.distributed import _backend

from . import _adasum, _basics
from ._exceptions import HorovodInternalError, wait
from ._process_sets import ProcessSet, global_process_set, resolve

try:
    from . import _timeline
except ImportError:  # pragma: no cover - the timeline module ships with the package
    _timeline = None  # type: ignore[assignment]

__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
]


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
_OPS = {int(op): op for op in (Average, Sum, Adasum, Min, Max, Product)}
_TORCH_OPS = {
    int(Sum): dist.ReduceOp.SUM,
    int(Min): dist.ReduceOp.MIN,
    int(Max): dist.ReduceOp.MAX,
    int(Product): dist.ReduceOp.PRODUCT,
}

# Element types, by code in the shape comparisons.
_DTYPES = [
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
_DTYPE_CODE = {dtype: i for i, dtype in enumerate(_DTYPES)}
_MAX_DIMS = 8


# -- handles -----------------------------------------------------------------


@dataclass
class _Pending:
    """An operation in flight: its works, and what turns them into the result."""

    works: list[Any]
    finish: Callable[[], Any]
    name: str
    op: str
    result: Any = None
    finished: bool = False
    # An allgather's first dimensions per tensor and rank (set order).
    sizes: list[list[int]] | None = None


_handles: dict[int, _Pending] = {}
_handle_ids = itertools.count(1)
_names: Counter[str] = Counter()
_lock = threading.Lock()
# (process set id, op, name) -> the dtype and shape the ranks agreed on.
_agreed: dict[tuple[int, str, str], tuple[int, ...]] = {}


def forget_handles() -> None:
    """``shutdown()``: drops handles and the shapes agreed on."""
    with _lock:
        _handles.clear()
        _agreed.clear()


def _register(pending: _Pending) -> int:
    with _lock:
        handle = next(_handle_ids)
        _handles[handle] = pending
    return handle


def _mark(name: str, op: str, phase: str) -> None:
    if _timeline is not None:
        _timeline.mark(name, op, phase)


def _name(kind: str, name: str | None) -> str:
    if name is None:
        with _lock:
            number = _names[kind]
            _names[kind] += 1
        return f"{kind}.noname.{number}"
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    return name


def _wait(work: Any, what: str) -> None:
    """Waits for one work; a failed collective becomes ``HorovodInternalError``."""
    wait(work, what)


def _submit(
    name: str, op: str, start: Callable[[], list[Any]], finish: Callable[[], Any]
) -> _Pending:
    """Runs ``start`` (which submits the works) with the timeline's marks around it."""
    _mark(name, op, "queue")
    try:
        works = start()
    except HorovodInternalError:
        raise
    except CommError as error:
        raise HorovodInternalError(f"{name} failed: {error}") from error
    _mark(name, op, "communicate")
    _on_done([w for w in works if w is not None], lambda: _mark(name, op, "done"))
    return _Pending([w for w in works if w is not None], finish, name, op)


def _on_done(works: list[Any], callback: Callable[[], None]) -> None:
    if _timeline is None:
        return
    if not works:
        callback()
        return
    try:
        works[-1].get_future().then(lambda _: callback())
    except Exception:  # a work without a future: the mark comes at synchronize
        pass


def _complete(pending: _Pending) -> Any:
    if not pending.finished:
        for work in pending.works:
            _wait(work, pending.name)
        pending.result = pending.finish()
        pending.finished = True
    return pending.result


def synchronize(handle: int) -> Any:
    """Waits for an asynchronous operation and returns its result.

    Args:
        handle: what an ``*_async`` function returned.

    Returns:
        The output tensor (a list of them for grouped operations; for
        ``alltoall_async`` the output and the received splits).

    Raises:
        ValueError: ``handle`` is unknown (already synchronised, or never issued).
        HorovodInternalError: the collective failed.
    """
    with _lock:
        pending = _handles.pop(handle, None)
    if pending is None:
        raise ValueError(f"handle {handle!r} is unknown: already synchronized, or never issued")
    return _complete(pending)


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` has finished (``synchronize`` will not wait).

    Raises:
        ValueError: ``handle`` is unknown.
    """
    with _lock:
        pending = _handles.get(handle)
    if pending is None:
        raise ValueError(f"handle {handle!r} is unknown: already synchronized, or never issued")
    return all(_done(work) for work in pending.works)


def _done(work: Any) -> bool:
    """Whether a work finished (works made from a future say so only through it)."""
    if work.is_completed():
        return True
    try:
        return work.get_future().done()
    except Exception:  # a work without a future
        return False


# -- checks ------------------------------------------------------------------


def _tensor(tensor: Any, what: str = "tensor") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError(f"{what} is sparse: use sparse_allreduce_async or densify it")
    return tensor


def _small_device(process_set: ProcessSet, like: torch.Tensor | None = None) -> torch.device:
    """Where small control tensors of this set go: the CPU unless the group has none."""
    group = process_set.group
    try:
        backend = str(dist.get_backend(group))
    except Exception:
        return torch.device("cpu")
    if backend.strip().lower() != "nccl":  # any group with a CPU backend
        return torch.device("cpu")
    if like is not None and like.is_cuda:
        return like.device
    return torch.device("cuda", torch.cuda.current_device())


def _describe(tensor: torch.Tensor, skip_first: bool) -> list[int]:
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"tensors of more than {_MAX_DIMS} dimensions are not supported")
    shape = list(tensor.shape)
    if skip_first and shape:
        shape[0] = -1
    code = _DTYPE_CODE.get(tensor.dtype)
    if code is None:
        raise TypeError(f"tensor dtype {tensor.dtype} is not supported")
    return [code, tensor.dim(), *shape, *([-2] * (_MAX_DIMS - len(shape)))]


def _gather_ints(
    values: list[int], process_set: ProcessSet, like: torch.Tensor | None
) -> list[list[int]]:
    """Every rank's ``values`` (the same length everywhere), in set order."""
    n = len(process_set.ranks)
    mine = torch.tensor(values, dtype=torch.int64, device=_small_device(process_set, like))
    if n == 1:
        return [values]
    out = torch.empty(n * len(values), dtype=torch.int64, device=mine.device)
    _wait(
        lambda: dist.all_gather_into_tensor(out, mine, group=process_set.group, async_op=True),
        "exchanging tensor shapes",
    )
    return out.view(n, len(values)).tolist()


def _show(row: list[int]) -> str:
    dtype = _DTYPES[row[0]] if 0 <= row[0] < len(_DTYPES) else row[0]
    shape = ["*" if s == -1 else str(s) for s in row[2 : 2 + row[1]]]
    return f"{dtype} of shape [{', '.join(shape)}]"


def _agree(
    kind: str,
    name: str,
    named: bool,
    tensors: Sequence[torch.Tensor],
    process_set: ProcessSet,
    skip_first: bool = False,
    extra: Sequence[int] = (),
) -> None:
    """Checks that every rank of the set passes the same dtype and shape.

    Raises:
        ValueError: on every rank, naming the ranks that differ.
    """
    rows = [v for t in tensors for v in _describe(t, skip_first)] + list(extra)
    key = (int(process_set.process_set_id or 0), kind, name)
    if named and _agreed.get(key) == tuple(rows):
        return
    every = _gather_ints(rows, process_set, tensors[0] if tensors else None)
    if any(row != every[0] for row in every):
        width = _MAX_DIMS + 2
        for index in range(len(tensors)):
            part = [row[index * width : (index + 1) * width] for row in every]
            if any(p != part[0] for p in part):
                described = "; ".join(
                    f"rank {process_set.ranks[i]}: {_show(p)}" for i, p in enumerate(part)
                )
                raise ValueError(
                    f"{kind} {name!r}: the ranks' tensors differ in dtype or shape ({described})"
                )
        described = "; ".join(
            f"rank {process_set.ranks[i]}: {row[-len(extra) :]}" for i, row in enumerate(every)
        )
        raise ValueError(f"{kind} {name!r}: the ranks' arguments (op, root) differ ({described})")
    if named:
        _agreed[key] = tuple(rows)


# The control exchange of the global set: every operation on it starts with
# one allgather of a fixed-size row per rank, so that ranks inside join()
# (which only run these exchanges) learn what the others do.
_ACTIVE, _JOINED = 0, 1
_KINDS = {
    "allreduce": 1,
    "grouped_allreduce": 1,
    "allgather": 2,
    "grouped_allgather": 2,
    "broadcast": 3,
    "alltoall": 4,
    "reducescatter": 5,
    "grouped_reducescatter": 5,
    "barrier": 6,
}
_ALLREDUCE_KIND = 1
_MAX_BUFFERS = 6
_HEADER = 6


def _control_row(
    flag: int, kind: int, op: int, digest: int, unit_post: bool, buffers: Sequence[Sequence[int]]
) -> list[int]:
    """``[flag, kind, op, digest, unit postscale, buffers, (dtype, numel, tensors, device)...]``."""
    row = [flag, kind, op, digest, int(unit_post), len(buffers)]
    for buffer in buffers:
        row.extend(buffer)
    return row + [0] * (_HEADER + 4 * _MAX_BUFFERS - len(row))


def _check(
    kind: str,
    name: str,
    named: bool,
    tensors: Sequence[torch.Tensor],
    process_set: ProcessSet,
    skip_first: bool = False,
    extra: Sequence[int] = (),
    buffers: Sequence[Sequence[int]] = (),
    unit_post: bool = True,
) -> Callable[[], None] | None:
    """Checks the ranks agree on the operation (and, on the global set, on join).

    On a process set of its own this is :func:`_agree`. On the global set
    every operation exchanges a control row: the kind, op, a digest of the
    dtypes and shapes, and the fused buffers an allreduce will reduce, so
    that ranks waiting in :func:`join` can take part in allreduces with
    zeros. Other operations raise while a rank has joined.

    An allreduce whose name was seen before with the same dtypes and shapes
    does not wait for the exchange: it is queued ahead of the data on the
    same group, and the returned function (run before the result is
    handed out) checks it.

    Returns:
        ``None`` when checked, or the deferred check.

    Raises:
        ValueError: the ranks' tensors or arguments differ, or an operation
            other than allreduce runs while a rank has joined.
    """
    if process_set is not global_process_set:
        _agree(kind, name, named, tensors, process_set, skip_first, extra)
        return None
    rows = [v for t in tensors for v in _describe(t, skip_first)] + list(extra)
    # The same on every rank whatever its interpreter (hash() may not be).
    digest = zlib.crc32(struct.pack(f"<{len(rows)}q", *rows))
    if len(buffers) > _MAX_BUFFERS:
        raise ValueError(
            f"{kind} {name!r}: tensors of more than {_MAX_BUFFERS} dtypes/devices in one operation"
        )
    mine = _control_row(
        _ACTIVE, _KINDS[kind], int(extra[0]) if extra else 0, digest, unit_post, buffers
    )
    key = (0, kind, name)
    if named and _KINDS[kind] == _ALLREDUCE_KIND and _agreed.get(key) == tuple(mine):
        n = len(process_set.ranks)
        row = torch.tensor(mine, dtype=torch.int64, device=_small_device(process_set, tensors[0]))
        out = torch.empty(n * len(mine), dtype=torch.int64, device=row.device)
        try:
            work = dist.all_gather_into_tensor(out, row, group=process_set.group, async_op=True)
        except (CommError, RuntimeError) as error:
            raise HorovodInternalError(f"{kind} {name!r} failed: {error}") from error

        def later() -> None:
            _wait(work, f"{kind} {name!r}")
            _judge(kind, name, out.view(n, len(mine)).tolist(), process_set)

        return later
    every = _gather_ints(mine, process_set, tensors[0] if tensors else None)
    try:
        _judge(kind, name, every, process_set)
    except _Differ:
        # Every rank saw the difference: one more exchange names it.
        _agree(kind, name, False, tensors, process_set, skip_first, extra)
        raise ValueError(f"{kind} {name!r}: the ranks' tensors or arguments differ") from None
    if named:
        _agreed[key] = tuple(mine)
    return None


class _Differ(ValueError):
    """The ranks' control rows differ (and no rank has joined)."""


def _judge(kind: str, name: str, every: list[list[int]], process_set: ProcessSet) -> None:
    """Raises when the control rows say the operation cannot run as the ranks issued it.

    Raises:
        ValueError: a rank has joined and this is not an allreduce, or the
            working ranks' rows differ while a rank has joined.
        _Differ: the rows differ and no rank has joined.
    """
    joined = [process_set.ranks[i] for i, row in enumerate(every) if row[0] == _JOINED]
    if joined and _KINDS[kind] != _ALLREDUCE_KIND:
        raise ValueError(
            f"{kind} {name!r}: rank(s) {joined} called hvd.join(); after a join only "
            "allreduce runs until every rank has joined"
        )
    active = [row for row in every if row[0] == _ACTIVE]
    if all(row == active[0] for row in active):
        return
    if joined:
        raise ValueError(f"{kind} {name!r}: the ranks' tensors or arguments differ")
    raise _Differ(f"{kind} {name!r}: the ranks' tensors or arguments differ")


def _op_of(average: bool | None, op: Any, default: ReduceOp = Average) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError("average= and op= cannot both be given (average is deprecated: use op=)")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return default
    if int(op) not in _OPS:
        raise ValueError(f"op={op!r} is not a Horovod reduction (Average, Sum, Min, Max, ...)")
    return _OPS[int(op)]


def _scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiplies in place; integers in float64, rounded toward zero."""
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    elif tensor.dtype == torch.bool:
        raise ValueError("prescale_factor/postscale_factor cannot scale a bool tensor")
    else:
        tensor.copy_(tensor.double().mul_(factor).trunc_())


def _native_average(tensor: torch.Tensor, group: Any) -> bool:
    """Whether the group's backend averages this tensor itself (the engine, NCCL)."""
    if tensor.dtype == torch.bool:
        return False
    if tensor.is_cuda:
        try:
            backend = group_of(group)._get_backend(tensor.device)
        except Exception:
            return False
        return isinstance(backend, getattr(dist, "ProcessGroupNCCL", ()))
    if _backend.cpu_backend_of(group) is None:
        return False
    return str(tensor.dtype).removeprefix("torch.") in _engine.collective_dtypes()


def group_of(group: Any) -> Any:
    """The group object (``WORLD`` resolved to the default group)."""
    if group is None or group is dist.GroupMember.WORLD:
        return dist.distributed_c10d._get_default_group()
    return group


def _check_scales(prescale_factor: float, postscale_factor: float) -> None:
    for what, value in (
        ("prescale_factor", prescale_factor),
        ("postscale_factor", postscale_factor),
    ):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{what} must be a number, not {type(value).__name__}")


# -- allreduce ---------------------------------------------------------------


def _allreduce_start(
    tensors: list[torch.Tensor],
    outputs: list[torch.Tensor],
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    name: str,
    named: bool,
    kind: str,
    serving: bool = False,
) -> _Pending:
    """Reduces ``tensors`` into ``outputs`` (which may be the same tensors).

    Tensors of one dtype and device are fused into one flat buffer and one
    collective. ``serving``: a rank inside :func:`join` taking part with
    zeros (the control exchange already ran).
    """
    _check_scales(prescale_factor, postscale_factor)
    _mark(name, "ALLREDUCE", "negotiate")
    n = len(process_set.ranks)
    group = process_set.group
    if op == Adasum:
        bad = [t.dtype for t in tensors if not t.is_floating_point()]
        if bad:
            raise ValueError(f"Adasum reduces floating-point tensors only, not {bad[0]}")
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    deferred = None
    if not serving:
        buffers = [
            [
                _DTYPE_CODE.get(dtype, -1),
                sum(tensors[i].numel() for i in members),
                len(members),
                int(device.type == "cuda"),
            ]
            for (dtype, device), members in groups.items()
        ]
        deferred = _check(
            kind,
            name,
            named,
            tensors,
            process_set,
            extra=[int(op)],
            buffers=buffers,
            unit_post=postscale_factor == 1.0,
        )
    plans: list[tuple[torch.Tensor, list[int], float]] = []

    def start() -> list[Any]:
        works = []
        for (_, _), members in groups.items():
            if len(members) == 1 and outputs[members[0]].is_contiguous():
                buffer = outputs[members[0]]
                if buffer is not tensors[members[0]]:
                    buffer.copy_(tensors[members[0]])
                buffer = buffer.view(-1)
            else:
                buffer = torch.cat([tensors[i].reshape(-1) for i in members])
            _scale_(buffer, prescale_factor)
            post = postscale_factor
            if op == Adasum:
                _adasum.adasum_(
                    buffer,
                    [tensors[i].numel() for i in members],
                    process_set.ranks,
                    process_set.ranks.index(_basics.rank()),
                    group,
                )
                work = None
            elif op == Average:
                if (buffer.is_floating_point() or post == 1.0) and _native_average(buffer, group):
                    work = dist.all_reduce(buffer, dist.ReduceOp.AVG, group=group, async_op=True)
                else:
                    post = post / n
                    work = dist.all_reduce(buffer, dist.ReduceOp.SUM, group=group, async_op=True)
            else:
                work = dist.all_reduce(buffer, _TORCH_OPS[int(op)], group=group, async_op=True)
            works.append(work)
            plans.append((buffer, members, post))
        return works

    def finish() -> list[torch.Tensor]:
        if deferred is not None:
            deferred()
        for buffer, members, post in plans:
            _scale_(buffer, post)
            offset = 0
            for i in members:
                out = outputs[i]
                count = out.numel()
                if buffer.data_ptr() != out.data_ptr() or not out.is_contiguous():
                    out.copy_(buffer[offset : offset + count].view(out.shape))
                offset += count
        return outputs

    return _submit(name, "ALLREDUCE", start, finish)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts reducing ``tensor`` over the set into a new tensor.

    Args:
        tensor: this rank's input (unchanged).
        average: deprecated; ``True`` is ``op=Average``, ``False`` ``op=Sum``.
        name: the operation's name (the timeline's row; generated if ``None``).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        process_set: the ranks taking part (default: all).

    Returns:
        A handle for :func:`synchronize` (the reduced tensor) and :func:`poll`.
    """
    _tensor(tensor)
    process_set = resolve(process_set)
    op = _op_of(average, op)
    label = _name("allreduce", name)
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    pending = _allreduce_start(
        [tensor],
        [output],
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        label,
        name is not None,
        "allreduce",
    )
    inner = pending.finish
    pending.finish = lambda: inner()[0]
    return _register(pending)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts reducing ``tensor`` in place; arguments as :func:`allreduce_async`.

    Returns:
        A handle; :func:`synchronize` returns ``tensor`` itself, reduced.
    """
    _tensor(tensor)
    process_set = resolve(process_set)
    op = _op_of(average, op)
    label = _name("allreduce", name)
    pending = _allreduce_start(
        [tensor],
        [tensor],
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        label,
        name is not None,
        "allreduce",
    )
    inner = pending.finish
    pending.finish = lambda: inner()[0]
    return _register(pending)


class _AllreduceFunction(torch.autograd.Function):
    """Allreduce whose gradient is the allreduce of the gradient (same op, same scales)."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        op: ReduceOp,
        pre: float,
        post: float,
        name: str | None,
        process_set: ProcessSet,
    ) -> torch.Tensor:  # noqa: D102
        ctx.args = (op, pre, post, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, pre, post, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # noqa: D102
        op, pre, post, process_set = ctx.args
        reduced = synchronize(
            allreduce_async(grad.contiguous(), None, None, op, pre, post, process_set)
        )
        return reduced, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduces ``tensor`` over the set; gradients flow through it.

    Args:
        tensor: this rank's input (unchanged).
        average: deprecated; ``True`` is ``op=Average``, ``False`` ``op=Sum``.
        name: the operation's name.
        compression: a Horovod compressor (``Compression.fp16``, ...): the
            tensor travels compressed and comes back in its own dtype.
        op: the reduction (default ``Average``).
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        process_set: the ranks taking part (default: all).

    Returns:
        A new tensor holding the reduction.
    """
    _tensor(tensor)
    op = _op_of(average, op)
    context = None
    if compression is not None:
        tensor, context = compression.compress(tensor)
    result = _AllreduceFunction.apply(
        tensor, op, prescale_factor, postscale_factor, name, process_set
    )
    if compression is not None:
        result = compression.decompress(result, context)
    return result


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduces ``tensor`` in place; arguments as :func:`allreduce_async`.

    Returns:
        ``tensor``, reduced.
    """
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def _grouped(tensors: Any) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("tensors must be a non-empty list of tensors")
    return [_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts reducing a list of tensors as one operation (one fused buffer per dtype).

    Returns:
        A handle; :func:`synchronize` returns the list of reduced tensors.
    """
    tensors = _grouped(tensors)
    process_set = resolve(process_set)
    op = _op_of(average, op)
    label = _name("grouped_allreduce", name)
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return _register(
        _allreduce_start(
            tensors,
            outputs,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
            label,
            name is not None,
            "grouped_allreduce",
        )
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """In-place :func:`grouped_allreduce_async`; ``synchronize`` returns ``tensors``."""
    tensors = _grouped(tensors)
    process_set = resolve(process_set)
    op = _op_of(average, op)
    label = _name("grouped_allreduce", name)
    return _register(
        _allreduce_start(
            tensors,
            list(tensors),
            op,
            prescale_factor,
            postscale_factor,
            process_set,
            label,
            name is not None,
            "grouped_allreduce",
        )
    )


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduces a list of tensors as one operation; returns new tensors.

    Gradients flow through each tensor as through :func:`allreduce`.
    """
    tensors = _grouped(tensors)
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [
            allreduce(
                t,
                None,
                None if name is None else f"{name}.{i}",
                compression,
                op,
                prescale_factor,
                postscale_factor,
                process_set,
            )
            for i, t in enumerate(tensors)
        ]
    contexts = None
    if compression is not None:
        pairs = [compression.compress(t) for t in tensors]
        tensors, contexts = [p[0] for p in pairs], [p[1] for p in pairs]
    results = synchronize(
        grouped_allreduce_async(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )
    if contexts is not None:
        results = [compression.decompress(r, c) for r, c in zip(results, contexts)]
    return results


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduces a list of tensors in place as one operation; returns them."""
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


# -- allgather ---------------------------------------------------------------


def _allgather_start(
    tensors: list[torch.Tensor], process_set: ProcessSet, name: str, named: bool
) -> _Pending:
    """Gathers each tensor along its first dimension (sizes may differ across ranks)."""
    _mark(name, "ALLGATHER", "negotiate")
    if process_set is global_process_set:
        _check("allgather", name, named, [], process_set)
    flat = [t.reshape(1) if t.dim() == 0 else t.contiguous() for t in tensors]
    rows = [v for t in flat for v in _describe(t, skip_first=True)]
    firsts = [t.shape[0] for t in flat]
    every = _gather_ints(rows + firsts, process_set, flat[0])
    width = len(rows)
    for i, row in enumerate(every):
        if row[:width] != every[0][:width]:
            index = next(
                k
                for k in range(len(flat))
                if row[k * (_MAX_DIMS + 2) : (k + 1) * (_MAX_DIMS + 2)]
                != every[0][k * (_MAX_DIMS + 2) : (k + 1) * (_MAX_DIMS + 2)]
            )
            mine = every[0][index * (_MAX_DIMS + 2) : (index + 1) * (_MAX_DIMS + 2)]
            theirs = row[index * (_MAX_DIMS + 2) : (index + 1) * (_MAX_DIMS + 2)]
            raise ValueError(
                f"allgather {name!r}: the ranks' tensors differ in dtype or in a dimension "
                f"other than the first (rank {process_set.ranks[0]}: {_show(mine)}; "
                f"rank {process_set.ranks[i]}: {_show(theirs)})"
            )
    n = len(process_set.ranks)
    sizes = [[row[width + k] for row in every] for k in range(len(flat))]
    gathered: list[torch.Tensor] = []

    def start() -> list[Any]:
        works = []
        for k, t in enumerate(flat):
            widest = max(sizes[k])
            if t.shape[0] != widest:
                padded = t.new_zeros((widest, *t.shape[1:]))
                padded[: t.shape[0]] = t
                t = padded
            out = t.new_empty((n * widest, *t.shape[1:]))
            gathered.append(out)
            if n == 1:
                out.copy_(t)
                continue
            works.append(
                dist.all_gather_into_tensor(out, t, group=process_set.group, async_op=True)
            )
        return works

    def finish() -> list[torch.Tensor]:
        results = []
        for k, out in enumerate(gathered):
            widest = max(sizes[k])
            if all(s == widest for s in sizes[k]):
                results.append(out)
            else:
                blocks = out.view(n, widest, *out.shape[1:])
                results.append(torch.cat([blocks[r, : sizes[k][r]] for r in range(n)]))
        return results

    pending = _submit(name, "ALLGATHER", start, finish)
    pending.sizes = sizes
    return pending


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts concatenating every rank's ``tensor`` along the first dimension.

    The first dimension may differ across ranks; the others and the dtype
    may not.

    Returns:
        A handle; :func:`synchronize` returns the concatenation, in rank order.
    """
    _tensor(tensor)
    process_set = resolve(process_set)
    pending = _allgather_start([tensor], process_set, _name("allgather", name), name is not None)
    inner = pending.finish
    pending.finish = lambda: inner()[0]
    return _register(pending)


class _AllgatherFunction(torch.autograd.Function):
    """Allgather whose gradient is this rank's rows of the summed gradient."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:  # noqa: D102
        process_set = resolve(process_set)
        pending = _allgather_start(
            [tensor], process_set, _name("allgather", name), name is not None
        )
        result = _complete(pending)[0]
        sizes = pending.sizes[0]
        me = process_set.ranks.index(_basics.rank())
        ctx.rows = (sum(sizes[:me]), sizes[me], tensor.dim() == 0)
        ctx.process_set = process_set
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # noqa: D102
        offset, count, scalar = ctx.rows
        summed = synchronize(
            allreduce_async(grad.contiguous(), None, None, Sum, 1.0, 1.0, ctx.process_set)
        )
        mine = summed.narrow(0, offset, count)
        return (mine.reshape(()) if scalar else mine), None, None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` along the first dimension; gradients flow.

    The gradient of this rank's input is its rows of the sum over the ranks
    of the output's gradient.
    """
    _tensor(tensor)
    return _AllgatherFunction.apply(tensor, name, process_set)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an allgather of each tensor, as one operation (one size exchange).

    Returns:
        A handle; :func:`synchronize` returns the list of concatenations.
    """
    tensors = _grouped(tensors)
    process_set = resolve(process_set)
    return _register(
        _allgather_start(tensors, process_set, _name("grouped_allgather", name), name is not None)
    )


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allgathers each tensor of the list, as one operation."""
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts reducing a sparse COO tensor: every rank's entries, gathered.

    The indices and values of all ranks are allgathered (one operation) and
    make one uncoalesced sparse tensor of the input's shape, whose repeated
    indices add up when it is coalesced or used; ``Average`` divides the
    values by the set's size.

    Args:
        tensor: a sparse COO tensor (the same shape and dtype on every rank;
            the number of entries may differ).
        name: the operation's name.
        op: ``Average`` (default) or ``Sum``.
        process_set: the ranks taking part.

    Returns:
        A handle; :func:`synchronize` returns the sparse result.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError("sparse_allreduce_async takes a sparse COO tensor")
    op = _op_of(None, op)
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async takes Average or Sum, not {op!r}")
    process_set = resolve(process_set)
    label = _name("sparse_allreduce", name)
    indices = tensor._indices().t().contiguous()
    values = tensor._values().contiguous()
    pending = _allgather_start([indices, values], process_set, label, name is not None)
    inner, n = pending.finish, len(process_set.ranks)

    def finish() -> torch.Tensor:
        all_indices, all_values = inner()
        if op == Average:
            all_values = all_values / n
        return torch.sparse_coo_tensor(all_indices.t(), all_values, tensor.shape)

    pending.finish = finish
    return _register(pending)


# -- broadcast ---------------------------------------------------------------


def _check_root(root_rank: Any, process_set: ProcessSet) -> int:
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


def _broadcast_start(
    tensor: torch.Tensor,
    output: torch.Tensor,
    root_rank: int,
    process_set: ProcessSet,
    name: str,
    named: bool,
) -> _Pending:
    _mark(name, "BROADCAST", "negotiate")
    _check("broadcast", name, named, [tensor], process_set, extra=[root_rank])
    buffer = output if output.is_contiguous() else output.contiguous()
    if buffer is not tensor and _basics.rank() == root_rank:
        buffer.copy_(tensor)

    def start() -> list[Any]:
        if len(process_set.ranks) == 1:
            return []
        return [dist.broadcast(buffer, root_rank, group=process_set.group, async_op=True)]

    def finish() -> torch.Tensor:
        if buffer is not output:
            output.copy_(buffer)
        return output

    return _submit(name, "BROADCAST", start, finish)


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts copying the root's ``tensor`` to every rank of the set, into a new tensor.

    Args:
        tensor: the value on the root; on the others, its shape and dtype.
        root_rank: the global rank that sends.
        name: the operation's name.
        process_set: the ranks taking part.

    Returns:
        A handle; :func:`synchronize` returns the root's value.
    """
    _tensor(tensor)
    process_set = resolve(process_set)
    _check_root(root_rank, process_set)
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _register(
        _broadcast_start(
            tensor, output, root_rank, process_set, _name("broadcast", name), name is not None
        )
    )


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts overwriting ``tensor`` with the root's; ``synchronize`` returns ``tensor``."""
    _tensor(tensor)
    process_set = resolve(process_set)
    _check_root(root_rank, process_set)
    return _register(
        _broadcast_start(
            tensor, tensor, root_rank, process_set, _name("broadcast", name), name is not None
        )
    )


class _BroadcastFunction(torch.autograd.Function):
    """Broadcast whose gradient is the averaged gradient on the root, zero elsewhere."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:  # noqa: D102
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # noqa: D102
        reduced = synchronize(
            allreduce_async(grad.contiguous(), None, None, Average, 1.0, 1.0, ctx.process_set)
        )
        if _basics.rank() != ctx.root_rank:
            reduced.zero_()
        return reduced, None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """The root's ``tensor`` on every rank of the set, as a new tensor; gradients flow.

    The gradient reaching the root's input is the average over the ranks of
    the output's gradient; the other ranks' inputs get zero.
    """
    _tensor(tensor)
    return _BroadcastFunction.apply(tensor, root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Overwrites ``tensor`` with the root's, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall ----------------------------------------------------------------


def _alltoall_start(
    tensor: torch.Tensor, splits: Any, process_set: ProcessSet, name: str
) -> _Pending:
    _mark(name, "ALLTOALL", "negotiate")
    if process_set is global_process_set:
        _check("alltoall", name, False, [], process_set)
    n = len(process_set.ranks)
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    rows = tensor.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(
                f"alltoall {name!r}: the first dimension ({rows}) is not divisible by the "
                f"set's size {n}; pass splits="
            )
        send = [rows // n] * n
    else:
        if isinstance(splits, torch.Tensor):
            splits = splits.tolist()
        send = [int(s) for s in splits]
        if len(send) != n:
            raise ValueError(
                f"alltoall {name!r}: splits has {len(send)} entries, the set {n} ranks"
            )
        if any(s < 0 for s in send) or sum(send) != rows:
            raise ValueError(
                f"alltoall {name!r}: splits {send} must be non-negative and add up to the "
                f"first dimension {rows}"
            )
    description = _describe(tensor, skip_first=True)
    # Every rank's splits and dtype and shape, in one allgather.
    every = _gather_ints([*send, *description], process_set, tensor)
    for r, row in enumerate(every):
        if row[n:] != description:
            raise ValueError(
                f"alltoall {name!r}: the ranks' tensors differ in dtype or in a dimension "
                f"other than the first (rank {_basics.rank()}: {_show(description)}; "
                f"rank {process_set.ranks[r]}: {_show(row[n:])})"
            )
    me = process_set.ranks.index(_basics.rank())
    matrix = [row[:n] for row in every]  # matrix[src][dst]: rows src sends dst
    received = [matrix[src][me] for src in range(n)]
    widest = max(max(row) for row in matrix)
    uniform = all(v == widest for row in matrix for v in row)
    trailing = tuple(tensor.shape[1:])
    # Uneven splits travel padded to the widest block, so every rank makes the
    # same equal-split call (which the engine runs) whatever its own splits.
    outgoing = tensor
    if not uniform:
        outgoing = tensor.new_zeros((n * widest, *trailing))
        offset = 0
        for dst, rows_to in enumerate(send):
            outgoing[dst * widest : dst * widest + rows_to] = tensor[offset : offset + rows_to]
            offset += rows_to
    incoming = tensor.new_empty((n * widest, *trailing))

    def start() -> list[Any]:
        if n == 1 or widest == 0:
            incoming.copy_(outgoing)
            return []
        return [dist.all_to_all_single(incoming, outgoing, group=process_set.group, async_op=True)]

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        if uniform:
            output = incoming
        else:
            output = torch.cat(
                [incoming[src * widest : src * widest + received[src]] for src in range(n)]
            )
        return output, torch.tensor(received, dtype=torch.int32)

    return _submit(name, "ALLTOALL", start, finish)


def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts sending rows of ``tensor`` to every rank: ``splits[i]`` rows to the i-th.

    Args:
        tensor: the rows to send, in order of destination.
        splits: rows for each rank of the set (a list or tensor); ``None``
            splits the first dimension equally.
        name: the operation's name.
        process_set: the ranks taking part.

    Returns:
        A handle; :func:`synchronize` returns ``(output, received_splits)``:
        the rows received, in rank order, and how many came from each rank
        (an int32 tensor).
    """
    _tensor(tensor)
    process_set = resolve(process_set)
    return _register(_alltoall_start(tensor, splits, process_set, _name("alltoall", name)))


class _AlltoallFunction(torch.autograd.Function):
    """Alltoall whose gradient is the alltoall of the gradient, with the received splits."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet
    ) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set, ctx.shape = received, process_set, tensor.shape
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[Any, ...]:  # noqa: D102
        back, _ = synchronize(
            alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set)
        )
        return back.reshape(ctx.shape), None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Sends rows of ``tensor`` to every rank of the set; gradients flow.

    Returns:
        The rows received (in rank order); with ``splits`` given, the pair
        ``(output, received_splits)``, as Horovod returns.
    """
    _tensor(tensor)
    output, received = _AlltoallFunction.apply(tensor, splits, name, process_set)
    if splits is None:
        return output
    return output, received


# -- reducescatter -----------------------------------------------------------


def _reducescatter_start(
    tensors: list[torch.Tensor],
    op: ReduceOp,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    name: str,
    named: bool,
) -> _Pending:
    """Reduces each tensor and leaves this rank its block of the first dimension."""
    if op not in (Sum, Average, Min, Max, Product):
        raise ValueError(f"reducescatter takes Sum, Average, Min, Max or Product, not {op!r}")
    _check_scales(prescale_factor, postscale_factor)
    _mark(name, "REDUCESCATTER", "negotiate")
    flat = [t.reshape(1) if t.dim() == 0 else t for t in tensors]
    _check("reducescatter", name, named, flat, process_set, extra=[int(op)])
    n = len(process_set.ranks)
    me = process_set.ranks.index(_basics.rank())
    plans: list[tuple[torch.Tensor, int, float]] = []

    def start() -> list[Any]:
        works = []
        for t in flat:
            rows = t.shape[0]
            base, extra = divmod(rows, n)
            counts = [base + (1 if r < extra else 0) for r in range(n)]
            widest = base + (1 if extra else 0)
            if extra:
                padded = t.new_zeros((n, widest, *t.shape[1:]))
                offset = 0
                for r, c in enumerate(counts):
                    padded[r, :c] = t[offset : offset + c]
                    offset += c
                source = padded.view(n * widest, *t.shape[1:])
            else:
                source = t.contiguous().clone()
            _scale_(source, prescale_factor)
            out = t.new_empty((widest, *t.shape[1:]))
            post = postscale_factor
            torch_op = _TORCH_OPS.get(int(op))
            if op == Average:
                torch_op, post = dist.ReduceOp.SUM, post / n
            if n == 1:
                out.copy_(source)
            else:
                works.append(
                    dist.reduce_scatter_tensor(
                        out, source, torch_op, group=process_set.group, async_op=True
                    )
                )
            plans.append((out, counts[me], post))
        return works

    def finish() -> list[torch.Tensor]:
        results = []
        for out, count, post in plans:
            result = out[:count] if out.shape[0] != count else out
            result = result.contiguous()
            _scale_(result, post)
            results.append(result)
        return results

    return _submit(name, "REDUCESCATTER", start, finish)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts reducing ``tensor`` over the set, keeping this rank's block of rows.

    The first dimension is cut into ``size`` blocks, the first
    ``rows % size`` ranks of the set one row longer.

    Args:
        tensor: this rank's input (the same shape on every rank).
        name: the operation's name.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        process_set: the ranks taking part.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.

    Returns:
        A handle; :func:`synchronize` returns this rank's block.
    """
    _tensor(tensor)
    process_set = resolve(process_set)
    pending = _reducescatter_start(
        [tensor],
        _op_of(None, op),
        prescale_factor,
        postscale_factor,
        process_set,
        _name("reducescatter", name),
        name is not None,
    )
    inner = pending.finish
    pending.finish = lambda: inner()[0]
    return _register(pending)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduces ``tensor`` over the set and returns this rank's block of rows."""
    context = None
    if compression is not None:
        tensor, context = compression.compress(tensor)
    result = synchronize(
        reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor)
    )
    if compression is not None:
        result = compression.decompress(result, context)
    return result


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts a reducescatter of each tensor, as one operation.

    Returns:
        A handle; :func:`synchronize` returns the list of this rank's blocks.
    """
    tensors = _grouped(tensors)
    process_set = resolve(process_set)
    return _register(
        _reducescatter_start(
            tensors,
            _op_of(None, op),
            prescale_factor,
            postscale_factor,
            process_set,
            _name("grouped_reducescatter", name),
            name is not None,
        )
    )


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Any = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reducescatters each tensor of the list, as one operation."""
    contexts = None
    if compression is not None:
        pairs = [compression.compress(t) for t in tensors]
        tensors, contexts = [p[0] for p in pairs], [p[1] for p in pairs]
    results = synchronize(
        grouped_reducescatter_async(
            tensors, name, op, process_set, prescale_factor, postscale_factor
        )
    )
    if contexts is not None:
        results = [compression.decompress(r, c) for r, c in zip(results, contexts)]
    return results


# -- barrier, join, objects --------------------------------------------------


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of the set has entered it."""
    process_set = resolve(process_set)
    name = _name("barrier", None)
    _mark(name, "BARRIER", "negotiate")
    if len(process_set.ranks) == 1:
        _mark(name, "BARRIER", "done")
        return
    if process_set is global_process_set:
        _check("barrier", name, False, [], process_set)
    pending = _submit(
        name,
        "BARRIER",
        lambda: [dist.barrier(group=process_set.group, async_op=True)],
        lambda: None,
    )
    _complete(pending)


_join_rounds = itertools.count()


def join(device: int = -1) -> int:
    """Says this rank has finished its work; returns the rank that finished last.

    Every rank of the job calls it. Until every rank has, the ranks inside
    ``join()`` take part in the allreduces (and grouped allreduces) the
    others still run on the global set, with zeros, as in Horovod: a sum
    is the sum over the ranks still working, an average that sum divided
    by the job's size, Adasum that of the working ranks (a zero vector
    changes nothing), Min/Max/Product include the zeros. Any other
    operation on the global set raises ``ValueError`` on the working ranks
    while a rank has joined; operations on other process sets cannot see
    the joined ranks and must not include them.

    Args:
        device: accepted for Horovod's signature; unused.

    Returns:
        The global rank that joined last, on every rank.
    """
    _basics.check_initialized()
    name = f"join.{next(_join_rounds)}"
    _mark(name, "JOIN", "negotiate")
    size = _basics.size()
    if size == 1:
        _mark(name, "JOIN", "done")
        return 0
    store = dist.distributed_c10d._get_default_store()
    key = f"tiacc_training/horovod/{name}"
    _mark(name, "JOIN", "queue")
    arrived = store.add(f"{key}/count", 1)
    if arrived == size:
        store.set(f"{key}/last", str(_basics.rank()))
    _mark(name, "JOIN", "communicate")
    while True:
        every = _gather_ints(_control_row(_JOINED, 0, 0, 0, True, []), global_process_set, None)
        active = [row for row in every if row[0] == _ACTIVE]
        if not active:
            break
        if active[0][1] == _ALLREDUCE_KIND and all(row == active[0] for row in active):
            _serve_allreduce(active[0], name)
    try:
        last = int(store.get(f"{key}/last"))
    except RuntimeError as error:
        raise HorovodInternalError(f"join: not every rank joined in time ({error})") from error
    _mark(name, "JOIN", "done")
    return last


def _serve_allreduce(row: list[int], name: str) -> None:
    """A joined rank's part in the others' allreduce: zeros of the same buffers."""
    op = _OPS[row[2]]
    tensors: list[torch.Tensor] = []
    for b in range(row[5]):
        code, numel, count, cuda = row[_HEADER + 4 * b : _HEADER + 4 * b + 4]
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype = _DTYPES[code]
        # The same fused length and number of tensors (Adasum's dot products are per tensor).
        tensors.append(torch.zeros(numel, dtype=dtype, device=device))
        tensors.extend(torch.zeros(0, dtype=dtype, device=device) for _ in range(count - 1))
    post = 1.0 if row[4] else 0.5  # only whether it is 1 matters (the choice of reduction)
    pending = _allreduce_start(
        tensors,
        tensors,
        op,
        1.0,
        post,
        global_process_set,
        f"{name}.allreduce",
        False,
        "allreduce",
        serving=True,
    )
    _complete(pending)


def _object_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """The root's picklable object, on every rank of the set.

    Returns:
        The root's object (a copy on the other ranks; the object itself on the root).
    """
    process_set = resolve(process_set)
    _check_root(root_rank, process_set)
    label = _name("broadcast_object", name)
    device = _small_device(process_set)
    is_root = _basics.rank() == root_rank
    payload = _object_bytes(obj, device) if is_root else None
    length = torch.tensor(
        [payload.numel() if payload is not None else 0], dtype=torch.int64, device=device
    )
    _complete(_broadcast_start(length, length, root_rank, process_set, f"{label}.size", False))
    if payload is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    _complete(_broadcast_start(payload, payload, root_rank, process_set, f"{label}.data", False))
    if is_root:
        return obj
    return pickle.loads(payload.cpu().numpy().tobytes())


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Every rank's picklable object, in rank order of the set."""
    process_set = resolve(process_set)
    label = _name("allgather_object", name)
    payload = _object_bytes(obj, _small_device(process_set))
    pending = _allgather_start([payload], process_set, label, False)
    gathered = _complete(pending)[0]
    sizes = pending.sizes[0]
    raw = gathered.cpu().numpy().tobytes()
    objects, offset = [], 0
    for count in sizes:
        objects.append(pickle.loads(raw[offset : offset + count]))
        offset += count
    return objects

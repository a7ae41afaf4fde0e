"""The CPU collectives of one group: the engine where it can, gloo otherwise.

One :class:`CpuCollectives` per group that uses the "tiacc" backend: an
engine of one channel (so collectives run in the order they are issued, as
gloo runs them), connected over the store torch hands the backend, and a
gloo backend underneath on the same store. Whatever form torch takes the
backend in (``_backend``: a c10d ``Backend`` subclass, or a
``ProcessGroup`` subclass on a torch that cannot subclass ``Backend``),
its CPU collectives are these methods.

The engine runs ``all_reduce`` (sum, product, min, max, and the average
of floating-point tensors), ``broadcast``, ``all_gather`` /
``all_gather_into_tensor``, ``reduce_scatter`` / ``reduce_scatter_tensor``
(the average included, as FSDP2 asks), ``all_to_all_single`` with equal
splits, and ``barrier``; every call returns work that waits on the engine
(:class:`EngineWork`). The element types and reductions it carries are the
engine's own (``_engine.collective_dtypes()``, ``_engine.collective_ops()``);
anything else is forwarded to gloo, so every call that works on gloo works
here, with gloo's results, and is counted with its reason
(``forwarded_in_process``). Results are exact (no Top-K, and no compression
unless ``TIACC_TRAINING_REDUCE_SCATTER_COMPRESSION`` asks for it on summing
reduce-scatters). When the group's ranks form whole nodes and the 2D
algorithm applies (forced, or ``auto``'s choice), reduce-scatters and
all-gathers go over the 2D groups, which cross nodes once per block.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import datetime
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from tiacc_training import _engine

from ._addresses import advertised_host, gloo_backend
from ._config import current
from ._dynamo import eager
from ._engines import group_engine
from ._state import add_counters

try:  # torch builds without distributed support lack them
    from torch._C._distributed_c10d import Work as _C10dWork
    from torch._C._distributed_c10d import _create_work_from_future as _C10dWorkFromFuture
except ImportError:  # pragma: no cover - depends on the torch build
    _C10dWork = object  # type: ignore[assignment,misc]
    _C10dWorkFromFuture = None

# Collectives the engine served in this process, by op, over every group
# and generation (a group's own counts go with it when it is destroyed).
served_in_process: collections.Counter[str] = collections.Counter()
# Collectives forwarded to gloo in this process, by (op, reason).
forwarded_in_process: collections.Counter[tuple[str, str]] = collections.Counter()
# Engines made per group name in this process: successive groups of one
# name (a script that creates the default group again) rendezvous apart.
_generations: collections.Counter[str] = collections.Counter()


def forget_generations() -> None:
    """Counts the engines of each group name from 0 again (``create_group`` on a new store)."""
    _generations.clear()


# The groups' collectives alive in this process (every device type), stopped at exit.
_live: weakref.WeakSet[GroupCollectives] = weakref.WeakSet()
# The counters of the groups' engines that stopped, per device type (see
# counters_in_process).
_retired: collections.defaultdict[str, dict[tuple[str, str], dict[str, Any]]] = (
    collections.defaultdict(dict)
)

# Why a call goes to gloo (the reasons ``stats()`` counts).
NOT_IN_ENGINE = "an op the engine does not run"
LAYOUT = "several tensors, or a tensor that is not dense, contiguous and real"
SHAPES = "outputs that are not one equal piece per rank"
SPLITS = "all_to_all with split sizes"


@dataclasses.dataclass(frozen=True)
class GroupArgs:
    """What torch hands a backend for one group, as every layer passes it on.

    Attributes:
        store: the group's store (a ``PrefixStore`` torch made for it).
        rank: this process's rank in the group.
        size: the group's number of ranks.
        timeout: the group's timeout.
        name: the group's name (keeps the rendezvous of groups apart).
    """

    store: Any
    rank: int
    size: int
    timeout: datetime.timedelta
    name: str

    def under(self, prefix: str) -> GroupArgs:
        """The same group over a store of its own, under ``prefix``."""
        return dataclasses.replace(self, store=dist.PrefixStore(prefix, self.store))


@dataclasses.dataclass(frozen=True)
class EngineCall:
    """One collective handed to an engine (see ``GroupCollectives._start``).

    Attributes:
        name: the collective (``"allreduce"``, ``"broadcast"``, ...).
        buffer: the tensor the engine works on, in place.
        result: the work's value (it holds ``buffer``).
        dtype: the engine's element type (``"uint8"``: as bytes).
        reduce: the reduction.
        root: the broadcast's root.
    """

    name: str
    buffer: torch.Tensor
    result: Any
    dtype: str | None
    reduce: str
    root: int


def _op_names() -> dict[Any, str]:
    """The reduce operations of torch, by their enum, to the engine's names."""
    kinds = dist.ReduceOp.RedOpType
    return {
        kinds.SUM: "sum",
        kinds.PRODUCT: "product",
        kinds.MIN: "min",
        kinds.MAX: "max",
        kinds.AVG: "avg",
    }


class GroupCollectives:
    """One group's collectives on one device type: the engine, or the backend underneath.

    The choice of what the engine runs, the checks of every call and the
    counts live here once; :class:`CpuCollectives` (the CPU engine, gloo
    underneath) and ``_device_collectives.DeviceCollectives`` (the device
    engine, NCCL underneath) say how a collective runs (``_run``).

    Attributes:
        rank: this process's rank in the group.
        size: the group's number of ranks.
        device_type: the tensors served (``"cpu"``, ``"cuda"``).
        served: collectives the engine ran, by op (``"allreduce"``, ...).
        forwarded: collectives forwarded underneath, by ``(op, reason)``.
        fallback: the backend underneath.
        timeout: the group's timeout.
    """

    device_type = "cpu"
    # The collectives the engine runs; the others go underneath.
    engine_runs = frozenset(
        {"allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall", "barrier"}
    )
    # The process's counts of this device type (see served_in_process).
    served_total = served_in_process
    forwarded_total = forwarded_in_process
    rank: int
    size: int
    fallback: Any
    timeout: datetime.timedelta
    synchronous = False

    def _init_group(self, group: GroupArgs, ops: frozenset[str], dtypes: frozenset[str]) -> None:
        """Takes the group's rank, size and timeout, the engine's reductions and element types."""
        self.rank, self.size, self.timeout = group.rank, group.size, group.timeout
        self.served: collections.Counter[str] = collections.Counter()
        self.forwarded: collections.Counter[tuple[str, str]] = collections.Counter()
        self._dtypes = dtypes
        self._ops = ops
        self._op_names = _op_names()

    # -- collectives the engine runs ---------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """``all_reduce``: the engine's reduction, or gloo's."""
        op = self._op_name(opts.reduceOp)
        tensor = self._single(tensors)
        why = self._why_not(tensor, op)
        if why is not None:
            return self.forward("allreduce", why, self.fallback.allreduce, tensors, opts)
        return self._run("allreduce", tensor, tensors, reduce=op)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """``broadcast`` from ``opts.rootRank``, as bytes."""
        if "broadcast" not in self.engine_runs:
            return self.forward("broadcast", NOT_IN_ENGINE, self.fallback.broadcast, tensors, opts)
        tensor = self._single(tensors)
        if tensor is None or opts.rootTensor != 0:
            return self.forward("broadcast", LAYOUT, self.fallback.broadcast, tensors, opts)
        return self._run("broadcast", tensor, tensors, as_bytes=True, root=opts.rootRank)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        """``all_gather`` into a list of tensors (equal pieces, any dtype)."""
        tensor = self._single(inputs)
        if tensor is None:
            return self.forward("allgather", LAYOUT, self.fallback.allgather, outputs, inputs, opts)
        equal = (
            len(outputs) == 1
            and len(outputs[0]) == self.size
            and all(
                self._plain(o) and o.shape == tensor.shape and o.dtype == tensor.dtype
                for o in outputs[0]
            )
        )
        if not equal:
            return self.forward("allgather", SHAPES, self.fallback.allgather, outputs, inputs, opts)
        flat = torch.empty(self.size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        flat.view(self.size, -1)[self.rank].copy_(tensor.reshape(-1))
        pieces = outputs[0]

        def scatter_back(future: torch.futures.Future) -> list[list[torch.Tensor]]:
            future.value()  # raises the engine's error, if any
            for piece, part in zip(pieces, flat.view(self.size, -1)):
                piece.copy_(part.view(piece.shape))
            return outputs

        return self._run("allgather", flat, [flat], as_bytes=True, then=scatter_back)

    def allgather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:  # noqa: A002
        """``all_gather_into_tensor``: equal pieces into one tensor."""
        if not (self._plain(output) and self._plain(input)):
            return self.forward(
                "allgather", LAYOUT, self.fallback._allgather_base, output, input, opts
            )
        if output.dtype != input.dtype or output.numel() != self.size * input.numel():
            return self.forward(
                "allgather", SHAPES, self.fallback._allgather_base, output, input, opts
            )
        output.view(-1).view(self.size, -1)[self.rank].copy_(input.view(-1))
        return self._run("allgather", output, [output], as_bytes=True)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> Any:
        """``reduce_scatter`` of a list of equal tensors."""
        op = self._op_name(opts.reduceOp)
        out = self._single(outputs)
        why = self._why_not(out, op)
        if why is None and not (
            len(inputs) == 1
            and len(inputs[0]) == self.size
            and all(
                self._plain(t) and t.shape == out.shape and t.dtype == out.dtype for t in inputs[0]
            )
        ):
            why = SHAPES
        if why is not None:
            return self.forward(
                "reduce_scatter", why, self.fallback.reduce_scatter, outputs, inputs, opts
            )
        flat = torch.cat([t.reshape(-1) for t in inputs[0]])
        return self._reduce_scatter_into(out, flat, outputs, op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:  # noqa: A002
        """``reduce_scatter_tensor``: this rank's block of the reduced tensor."""
        op = self._op_name(opts.reduceOp)
        why = self._why_not(output if self._plain(output) and self._plain(input) else None, op)
        if why is None and (
            output.dtype != input.dtype or input.numel() != self.size * output.numel()
        ):
            why = SHAPES
        if why is not None:
            return self.forward(
                "reduce_scatter", why, self.fallback._reduce_scatter_base, output, input, opts
            )
        # The engine uses the rest of the buffer as scratch: reduce a copy.
        return self._reduce_scatter_into(output, input.reshape(-1).clone(), [output], op)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        output_splits: list[int],
        input_splits: list[int],
        opts: Any,
    ) -> Any:
        """``all_to_all_single`` without split sizes (given ones go underneath)."""
        args = (output, input, output_splits, input_splits, opts)
        why = self._alltoall_why_not(output, input, bool(output_splits or input_splits))
        if why is not None:
            return self.forward("alltoall", why, self.fallback.alltoall_base, *args)
        output.view(-1).copy_(input.view(-1))
        return self._run("alltoall", output, [output], as_bytes=True)

    def _alltoall_why_not(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        split: bool,
    ) -> str | None:
        """Why the engine cannot run an ``all_to_all_single`` (``None``: it can).

        Every rank must take the same way. Without split sizes the blocks
        are equal on every rank of a valid call; with them (``split``), a
        rank sees only its own row and column of the job's split matrix, so
        it cannot know whether the others' are even: such calls always go
        underneath.
        """
        if "alltoall" not in self.engine_runs:
            return NOT_IN_ENGINE
        if split:
            return SPLITS
        if not (self._plain(output) and self._plain(input)):
            return LAYOUT
        rows = input.shape[0] if input.dim() else 0
        if output.dtype != input.dtype or output.numel() != input.numel() or rows % self.size != 0:
            return SHAPES
        return None

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        """Each pair through :meth:`allgather_into_tensor`, in order."""
        return _last([self.allgather_into_tensor(o, i, opts) for o, i in zip(outputs, inputs)])

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        """Each pair through :meth:`reduce_scatter_tensor`, in order."""
        return _last([self.reduce_scatter_tensor(o, i, opts) for o, i in zip(outputs, inputs)])

    # -- everything else: gloo ------------------------------------------------

    def forward(self, name: str, why: str, method: Callable[..., Any], *args: Any) -> Any:
        """Runs a call on the backend underneath, counted as ``(name, why)``."""
        self.forwarded[name, why] += 1
        self.forwarded_total[name, why] += 1
        return method(*args)

    # -- helpers --------------------------------------------------------------

    def _op_name(self, op: Any) -> str | None:
        return self._op_names.get(getattr(op, "op", op))

    def _dtype(self, tensor: torch.Tensor) -> str | None:
        name = str(tensor.dtype).removeprefix("torch.")
        return name if name in self._dtypes else None

    def _why_not(self, tensor: torch.Tensor | None, op: str | None) -> str | None:
        """Why the engine cannot reduce ``tensor`` with ``op`` (``None``: it can)."""
        if tensor is None:
            return LAYOUT
        if op not in self._ops:
            return "a reduction the engine does not run"
        if self._dtype(tensor) is None:
            return f"{str(tensor.dtype).removeprefix('torch.')} elements"
        if op == "avg" and tensor.dtype == torch.bool:
            return "the average of bool elements"
        return None

    def _single(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """The one plain tensor of a call, or ``None`` (the backend underneath takes the rest)."""
        if len(tensors) != 1 or not self._plain(tensors[0]):
            return None
        return tensors[0]

    def _count_served(self, name: str) -> None:
        self.served[name] += 1
        self.served_total[name] += 1

    def _run(
        self,
        name: str,
        buffer: torch.Tensor,
        result: Any,
        *,
        reduce: str = "sum",
        as_bytes: bool = False,
        root: int = 0,
        then: Any = None,
    ) -> Any:
        """Runs ``name`` on the engine over ``buffer``; returns its work.

        ``result`` (which holds ``buffer``) is the work's value, after
        ``then`` (a future callback) when given; ``as_bytes`` carries the
        elements as ``uint8``.
        """
        dtype = "uint8" if as_bytes else self._dtype(buffer)
        future = self._start(EngineCall(name, buffer, result, dtype, reduce, root))
        return self._work(future, future.then(then or _value))

    def _start(self, call: EngineCall) -> torch.futures.Future:
        """Hands ``call`` to the engine, counted as served.

        Returns:
            The future the engine completes with ``call.result``, or with
            its error.
        """
        raise NotImplementedError

    def counters(self) -> dict[tuple[str, str], dict[str, Any]]:
        """What this group's engine counted (nothing before it exists)."""
        engine = getattr(self, "_engine", None)
        return engine.counters() if engine is not None else {}

    def shutdown(self) -> None:
        """Stops the engine (once it exists) and the backend underneath."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()
        if self in _live:
            _live.discard(self)
            add_counters(_retired[self.device_type], self.counters())
        self._stop_fallback()

    def _stop_fallback(self) -> None:
        """Stops the backend underneath."""
        raise NotImplementedError

    def _new_engine(self, group: GroupArgs, key: str, device: Any = None) -> Any:
        """The group's engine, rendezvousing apart from earlier ones of ``key`` (a group name)."""
        config = current() or _engine.CommConfig.from_env()
        _generations[key] += 1
        prefix = f"tiacc_training/backend/{key}/{_generations[key]}"
        return group_engine(config, group.store, prefix, group.rank, group.size, device=device)

    def _plain(self, tensor: Any) -> bool:
        """A dense, contiguous, real tensor of this device type (what the engine takes)."""
        return _plain(tensor) and tensor.device.type == self.device_type

    def _work(self, engine_future: torch.futures.Future, future: torch.futures.Future) -> Any:
        """The work torch gets: :class:`EngineWork`, or (synchronous) a finished one."""
        if self.synchronous:
            return _finished(engine_future, future)
        return EngineWork(engine_future, future)

    def _reduce_scatter_into(
        self, out: torch.Tensor, flat: torch.Tensor, result: Any, op: str
    ) -> Any:
        block = flat.view(self.size, -1)[self.rank]

        def copy_out(future: torch.futures.Future) -> Any:
            future.value()
            out.copy_(block.view(out.shape))
            return result

        return self._run("reduce_scatter", flat, [flat], reduce=op, then=copy_out)


class CpuCollectives(GroupCollectives):
    """The CPU collectives of one group.

    Args:
        group: the group, as torch handed it to the backend.
        form: the form torch holds them in (``"backend"``, ``"process-group"``).
        synchronous: finish each engine collective before returning its
            work (see :func:`_finished`).

    Attributes:
        form: as given.
        served: collectives the engine ran, by op (``"allreduce"``, ...).
        forwarded: collectives forwarded to gloo, by ``(op, reason)``.
        gloo: the gloo backend underneath.
        timeout: the group's timeout.
        transport: what carries the engine's bytes (``"shared memory"``,
            ``"tcp"``).
    """

    def __init__(self, group: GroupArgs, form: str, synchronous: bool = False) -> None:
        self.form = form
        self.synchronous = synchronous
        self._init_group(
            group, frozenset(_engine.collective_ops()), frozenset(_engine.collective_dtypes())
        )
        store = dist.PrefixStore("gloo/", group.store)
        # Bound where the engine binds, not where the hostname resolves.
        address = advertised_host(current() or _engine.CommConfig.from_env(), group.store)
        self.gloo = gloo_backend(store, group.rank, group.size, group.timeout, address)
        self.fallback = self.gloo
        self._engine = self._new_engine(group, group.name)
        self.transport = self._engine.transports.get("world", "")
        _live.add(self)

    def barrier(self, opts: Any = None) -> Any:
        """``barrier``: returns once every rank has entered it."""
        self._count_served("barrier")
        future = torch.futures.Future()
        self._engine.collective_async("barrier", [], 0, 0, "uint8", future)
        return self._work(future, future.then(_value))

    def _stop_fallback(self) -> None:
        """Stops the gloo backend underneath."""
        try:
            self.gloo.shutdown()
        except Exception:  # an older gloo backend without shutdown
            pass

    def _start(self, call: EngineCall) -> torch.futures.Future:
        """Queues ``call`` on the engine.

        The engine keeps ``call.result`` (which holds the buffer) alive
        until the collective is done, then completes the future with it, or
        with its error (see :class:`EngineWork`).
        """
        self._count_served(call.name)
        future = torch.futures.Future()
        self._engine.collective_async(
            call.name,
            call.result,
            call.buffer.data_ptr(),
            call.buffer.numel() * call.buffer.element_size(),
            call.dtype,
            future,
            reduce=call.reduce,
            root=call.root,
        )
        return future


def counters_in_process(device_type: str = "cpu") -> dict[tuple[str, str], dict[str, Any]]:
    """What the engines of every group's collectives on ``device_type`` counted so far.

    Per ``(path, codec)``, as ``tdist.engine_counters()`` gives them: path
    ``"collective"`` (the world ring; codec other than ``"none"`` for a
    compressed reduce-scatter) or ``"collective-2d"`` (reduce-scatters and
    all-gathers over the 2D groups), summed over live and stopped groups.
    """
    total: dict[tuple[str, str], dict[str, Any]] = {}
    add_counters(total, _retired[device_type])
    for collectives in list(_live):
        if collectives.device_type == device_type:
            add_counters(total, collectives.counters())
    return total


def _plain(tensor: Any) -> bool:
    """A dense, contiguous, real tensor (what an engine takes as memory)."""
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.layout == torch.strided
        and tensor.is_contiguous()
        and not tensor.is_complex()
    )


def stop_all() -> None:
    """Stops, at exit, the collectives of groups the script never destroyed.

    Many scripts end without ``destroy_process_group``. Their engine and
    gloo threads would then stop during the interpreter's finalization,
    when a thread that still reaches for Python aborts the process
    ("terminate called without an active exception", exit code -6).
    Registered when the package loads, so it runs after the handlers the
    script and its libraries register later.
    """
    for collectives in list(_live):
        try:
            collectives.shutdown()
        except Exception:  # noqa: S110 - exiting: nothing left to report to
            pass


atexit.register(stop_all)


class EngineWork(_C10dWork):  # type: ignore[misc,valid-type]
    """The work of one collective the engine runs.

    The engine completes its future with the result or with its error
    (``set_exception``). That error lives only in the future's Python
    wrapper: a work made by torch from the future (``_create_work_from_future``)
    returns from ``wait()`` as if it had succeeded, leaving the output
    unfilled. This work's ``wait()`` raises the engine's error itself, and
    the future it hands out (``get_future()``, DDP's and the user's
    callbacks) is completed with that error at torch's level.

    Args:
        engine_future: the future the engine completes.
        future: ``engine_future`` followed by the collective's last step
            (a ``then`` callback that reads ``engine_future.value()``).
    """

    def __init__(self, engine_future: torch.futures.Future, future: torch.futures.Future) -> None:
        super().__init__()
        self._engine_future = engine_future
        self._future = future

    @eager
    def wait(self, timeout: Any = None) -> bool:
        """Waits for the collective; raises the engine's error if it failed."""
        self._engine_future.wait()  # raises the engine's CommError as it is
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        """Whether the collective has finished (successfully or not)."""
        return self._future.done()

    def is_success(self) -> bool:
        """Whether the collective finished without an error."""
        if not self._future.done():
            return False
        try:
            self._future.wait()
        except Exception:
            return False
        return True

    def exception(self) -> Any:
        """The collective's error, or ``None``."""
        try:
            self._engine_future.wait()
            self._future.wait()
        except Exception as error:
            return error
        return None

    def get_future(self) -> torch.futures.Future:
        """A future completed with the result, or failed with the engine's error."""
        return self._future


def _finished(engine_future: torch.futures.Future, future: torch.futures.Future) -> Any:
    """Waits for a collective here, then hands torch finished work.

    A ``ProcessGroup`` written in Python returns work that torch's C++ code
    (DDP's parameter check and start-up broadcast) waits on too. Not every
    torch keeps the Python side of such work alive once it crossed into
    C++ (2.0 does not): C++ then waits on a bare c10d ``Work`` that nothing
    completes, and the job hangs. So in that form the call itself waits
    (raising the engine's error, as a synchronous call does) and returns
    torch's own work over the finished future, which C++ and Python can
    both wait on; ``async_op=True`` then returns finished work.
    """
    engine_future.wait()  # raises the engine's CommError as it is
    future.wait()
    return _C10dWorkFromFuture(future)


def _value(future: torch.futures.Future) -> Any:
    """The future's result; raises the engine's error if it failed."""
    return future.value()


def _last(works: list[Any]) -> Any:
    """Waits for all but the last work (in order) and returns the last."""
    for work in works[:-1]:
        work.wait()
    return works[-1] if works else None

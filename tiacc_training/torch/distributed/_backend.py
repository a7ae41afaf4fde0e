"""torch.distributed's "tiacc" backend: CPU collectives through the engine.

A c10d backend written in Python (a subclass of torch's ``Backend``, which
torch 2.x lets Python override) and registered under the name ``"tiacc"``
for CPU tensors. Each group that uses it gets its own engine (one channel,
so collectives run in the order they are issued, as gloo runs them),
connected over the store torch hands the backend, and a gloo backend
underneath on the same store.

The engine runs ``all_reduce`` (sum, product, min, max, and the average of
floating-point tensors), ``broadcast``, ``all_gather`` /
``all_gather_into_tensor``, ``reduce_scatter`` / ``reduce_scatter_tensor``,
``all_to_all_single`` with equal splits, and ``barrier``, with
``async_op=True`` returning work that waits on the engine. The element
types and reductions it carries are the engine's own
(``_engine.collective_dtypes()``, ``_engine.collective_ops()``); anything
else (another type or reduction, several tensors per call, tensors that
are not contiguous, ``gather``, ``scatter``, ``send``/``recv``, uneven
splits, ...) is forwarded to the gloo backend underneath, so every call
that works on gloo works here, with gloo's results. Results are exact: no
compression, Top-K or 2D algorithm applies to these collectives.

``register()`` registers the name once per process (importing
``tiacc_training.torch.distributed`` calls it); ``cpu_backend()`` turns the
backend string a script asks for into the one to create, and
``describe_cpu_collectives()`` says which serves the CPU collectives.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import functools
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from tiacc_training import _engine

# The backend's name, as ``init_process_group`` takes it.
NAME = "tiacc"

_lock = threading.Lock()
_registered: bool | None = None
_reason: str | None = None
# Backends made per group name in this process: successive groups of one
# name (a script that creates the default group again) rendezvous apart.
_generations: collections.Counter[str] = collections.Counter()
# The backends alive in this process, stopped at exit (see _stop_all).
_live: weakref.WeakSet[Any] = weakref.WeakSet()
# Collectives the engine served in this process, over every group and
# generation (a group's own counts go with it when it is destroyed).
served_in_process: collections.Counter[str] = collections.Counter()

try:  # torch builds without distributed support lack these
    from torch._C._distributed_c10d import Backend as _C10dBackend
    from torch._C._distributed_c10d import Work as _C10dWork
except ImportError as error:  # pragma: no cover - depends on the torch build
    _C10dBackend = object  # type: ignore[assignment,misc]
    _C10dWork = object  # type: ignore[assignment,misc]
    _import_error: str | None = f"this torch has no Python c10d backends ({error})"
else:
    _import_error = None


def register() -> bool:
    """Registers the "tiacc" backend with torch.distributed (once per process).

    Returns:
        Whether "tiacc" can be used; when not, ``unavailable_reason()`` says why.
    """
    global _registered, _reason
    with _lock:
        if _registered is not None:
            return _registered
        _registered, _reason = _register()
        return _registered


def _register() -> tuple[bool, str | None]:
    if _import_error is not None:
        return False, _import_error
    if not dist.is_available() or not dist.is_gloo_available():
        return False, "this torch has no gloo backend to forward collectives to"
    plugins = getattr(dist.Backend, "_plugins", {})
    if NAME.upper() in plugins:
        return True, None
    try:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
    except TypeError:  # a torch whose register_backend takes no devices
        try:
            dist.Backend.register_backend(NAME, _create, extended_api=True)
        except Exception as error:
            return False, f"torch refused to register a Python backend ({error})"
    except Exception as error:
        return False, f"torch refused to register a Python backend ({error})"
    _route_monitored_barrier()
    return True, None


def _route_monitored_barrier() -> None:
    """``dist.monitored_barrier`` of a "tiacc" group runs on its gloo backend.

    torch sends it to the group's CPU backend's own implementation, which
    only gloo has; a Python backend cannot provide it.
    """
    from torch.distributed import distributed_c10d

    original = distributed_c10d.monitored_barrier

    @functools.wraps(original)
    def monitored_barrier(
        group: Any = distributed_c10d.GroupMember.WORLD,
        timeout: datetime.timedelta | float | None = None,
        wait_all_ranks: bool = False,
    ) -> Any:
        backend = cpu_backend_of(group)
        if backend is None:
            return original(group, timeout, wait_all_ranks)
        if timeout is None:
            timeout = backend.timeout
        elif not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
        return backend.gloo.monitored_barrier(timeout, wait_all_ranks)

    for module in (dist, distributed_c10d):
        module.monitored_barrier = monitored_barrier  # type: ignore[assignment]


def unavailable_reason() -> str | None:
    """Why "tiacc" cannot be used in this process, or ``None`` when it can."""
    register()
    return _reason


def serves(config: Any) -> bool:
    """Whether "tiacc" serves the CPU collectives a script asks gloo for.

    Args:
        config: the engine configuration (``CommConfig``), or ``None`` for
            the environment's.

    Returns:
        False where ``TIACC_TRAINING_COLLECTIVES=gloo`` or the backend could
        not be registered.
    """
    if config is None:
        config = _engine.CommConfig.from_env()
    return config.collectives == NAME and register()


def cpu_backend(requested: str | None, config: Any) -> str:
    """The backend string to hand to ``init_process_group``.

    CPU tensors go to "tiacc" where the script asked for gloo, or for
    nothing (torch's default is gloo for CPU tensors), unless
    ``TIACC_TRAINING_COLLECTIVES=gloo`` or this torch cannot register the
    backend. Every other device keeps what the script asked for; ``None``
    means torch's default there too (NCCL for CUDA tensors where CUDA is
    available). An explicit "tiacc" is kept as asked.

    Args:
        requested: what the script passed (``None``, ``"gloo"``, ``"nccl"``,
            ``"cpu:gloo,cuda:nccl"``, ``"tiacc"``, ...).
        config: the engine configuration, or ``None`` for the environment's.

    Returns:
        For example ``"cpu:tiacc,cuda:nccl"`` for ``None`` on a CUDA
        machine, ``"cpu:tiacc"`` for ``"gloo"`` without CUDA, ``"nccl"`` for
        ``"nccl"``.
    """
    if requested is not None and not isinstance(requested, str):
        requested = str(requested)  # a ``dist.Backend`` value
    use = serves(config)
    if requested is None or requested.strip() == "" or requested.strip().lower() == "undefined":
        devices = {"cpu": NAME if use else "gloo"}
        if torch.cuda.is_available():
            devices["cuda"] = "nccl"
        return _join(devices) if use else ("gloo" if len(devices) == 1 else _join(devices))
    text = requested.strip()
    if ":" not in text:
        name = text.lower()
        if name == "gloo" and use:
            # gloo also serves CUDA tensors: keep it there.
            return f"cpu:{NAME},cuda:gloo" if torch.cuda.is_available() else f"cpu:{NAME}"
        return requested
    devices = {}
    for part in text.split(","):
        device, sep, backend = part.partition(":")
        if not sep or not device.strip() or not backend.strip():
            raise ValueError(
                f"init_process_group(backend={requested!r}): {part!r} is not 'device:backend'"
            )
        devices[device.strip().lower()] = backend.strip()
    if use and devices.get("cpu", "").lower() == "gloo":
        devices["cpu"] = NAME
        return _join(devices)
    return requested


def _join(devices: dict[str, str]) -> str:
    return ",".join(f"{device}:{backend}" for device, backend in devices.items())


def cpu_backend_of(group: Any = None) -> TiaccBackend | None:
    """The "tiacc" backend serving ``group``'s CPU tensors (default group), or ``None``."""
    if not dist.is_initialized():
        return None
    if group is None or group is dist.GroupMember.WORLD:
        group = dist.distributed_c10d._get_default_group()
    try:
        backend = group._get_backend(torch.device("cpu"))
    except Exception:  # no CPU backend in this group
        return None
    return backend if isinstance(backend, TiaccBackend) else None


def describe_cpu_collectives(config: Any = None, group: Any = None) -> str:
    """One start-up line: what serves the default group's CPU collectives.

    Args:
        config: the engine configuration, or ``None`` for the environment's.
        group: the group (default: the default group).

    Returns:
        For example ``"CPU collectives: tiacc (the engine over shared
        memory; other ops forwarded to gloo)"`` or ``"CPU collectives: gloo
        (TIACC_TRAINING_COLLECTIVES=gloo)"``.
    """
    backend = cpu_backend_of(group)
    if backend is not None:
        medium = backend.transport
        where = f"the engine over {medium}" if medium else "the engine"
        return f"CPU collectives: {NAME} ({where}; other ops forwarded to gloo)"
    if config is None:
        config = _engine.CommConfig.from_env()
    if config.collectives != NAME:
        why = "TIACC_TRAINING_COLLECTIVES=gloo"
    elif not register():
        why = f"the {NAME} backend is unavailable: {_reason}"
    else:
        why = "as the script's init_process_group asked"
    name = "none" if dist.is_initialized() and not _has_cpu(group) else "gloo"
    return f"CPU collectives: {name} ({why})"


def _has_cpu(group: Any) -> bool:
    group = group or dist.distributed_c10d._get_default_group()
    return torch.device("cpu") in getattr(group, "_device_types", [torch.device("cpu")])


def _create(options: Any, backend_options: Any = None) -> TiaccBackend:
    """The factory torch calls (extended API): one backend per group."""
    return TiaccBackend(
        options.store,
        options.group_rank,
        options.group_size,
        options.timeout,
        str(getattr(options, "group_id", "") or "group"),
    )


# torch's reduce operations, by their enum, to the engine's names.
def _op_names() -> dict[Any, str]:
    kinds = dist.ReduceOp.RedOpType
    return {
        kinds.SUM: "sum",
        kinds.PRODUCT: "product",
        kinds.MIN: "min",
        kinds.MAX: "max",
        kinds.AVG: "avg",
    }


class TiaccBackend(_C10dBackend):  # type: ignore[misc,valid-type]
    """The backend of one group's CPU tensors.

    Args:
        store: the group's store (a ``PrefixStore`` torch made for it).
        rank: this process's rank in the group.
        size: the group's number of ranks.
        timeout: the group's timeout.
        group_name: the group's name (keeps the rendezvous of groups apart).

    Attributes:
        served: collectives the engine ran, by name (``"allreduce"``, ...).
        forwarded: collectives forwarded to gloo, by name.
        gloo: the gloo backend underneath.
        timeout: the group's timeout.
        transport: what carries the engine's bytes (``"shared memory"``,
            ``"tcp"``).
    """

    def __init__(
        self, store: Any, rank: int, size: int, timeout: datetime.timedelta, group_name: str
    ) -> None:
        super().__init__(rank, size)
        from ._engines import advertised_host
        from ._rendezvous import FailureBoard, board_store, connect_tcp
        from ._state import state

        self._rank, self._size = rank, size
        self.served: collections.Counter[str] = collections.Counter()
        self.forwarded: collections.Counter[str] = collections.Counter()
        self._dtypes = frozenset(_engine.collective_dtypes())
        self._ops = frozenset(_engine.collective_ops())
        self._op_names = _op_names()
        self.timeout = timeout
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        config = state.config if state.config is not None else _engine.CommConfig.from_env()
        _generations[group_name] += 1
        prefix = f"tiacc_training/backend/{group_name}/{_generations[group_name]}"
        client, address = board_store(store)
        self._engine = _engine.CommEngine(
            config,
            rank,
            size,
            advertised_host(config, store),
            board=FailureBoard(client, prefix, address),
            channels=1,
        )
        wait = max(config.timeout, 60.0)
        connect_tcp(self._engine, store, "tiacc", rank, size, wait)
        self.transport = self._engine.transports.get("world", "")
        _live.add(self)

    # -- what torch asks of every backend --------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The name torch reports for this backend."""
        return NAME

    def shutdown(self) -> None:
        """Stops the engine's channel (torch calls it on ``destroy_process_group``)."""
        self._engine.shutdown()
        try:
            self.gloo.shutdown()
        except Exception:  # an older gloo backend without shutdown
            pass

    def abort(self) -> None:
        """Stops at once (torch's abort)."""
        self.shutdown()

    # -- collectives the engine runs ---------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """``all_reduce``: the engine's reduction, or gloo's."""
        op = self._op_name(opts.reduceOp)
        tensor = self._single(tensors)
        if tensor is None or op not in self._ops or self._dtype(tensor) is None:
            return self._forward("allreduce", self.gloo.allreduce, tensors, opts)
        if op == "avg" and tensor.dtype == torch.bool:
            return self._forward("allreduce", self.gloo.allreduce, tensors, opts)
        return self._run("allreduce", tensor, tensors, reduce=op)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """``broadcast`` from ``opts.rootRank``, as bytes."""
        tensor = self._single(tensors)
        if tensor is None or opts.rootTensor != 0:
            return self._forward("broadcast", self.gloo.broadcast, tensors, opts)
        return self._run("broadcast", tensor, tensors, as_bytes=True, root=opts.rootRank)

    def barrier(self, opts: Any = None) -> Any:
        """``barrier``: returns once every rank has entered it."""
        self.served["barrier"] += 1
        served_in_process["barrier"] += 1
        future = torch.futures.Future()
        self._engine.collective_async("barrier", [], 0, 0, "uint8", future)
        return _EngineWork(future, future.then(_value))

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        """``all_gather`` into a list of tensors (equal pieces, any dtype)."""
        tensor = self._single(inputs)
        ok = (
            tensor is not None
            and len(outputs) == 1
            and len(outputs[0]) == self._size
            and all(
                _plain(o) and o.shape == tensor.shape and o.dtype == tensor.dtype
                for o in outputs[0]
            )
        )
        if not ok:
            return self._forward("allgather", self.gloo.allgather, outputs, inputs, opts)
        flat = torch.empty(self._size * tensor.numel(), dtype=tensor.dtype)
        flat.view(self._size, -1)[self._rank].copy_(tensor.reshape(-1))
        pieces = outputs[0]

        def scatter_back(future: torch.futures.Future) -> list[list[torch.Tensor]]:
            future.value()  # raises the engine's error, if any
            for piece, part in zip(pieces, flat.view(self._size, -1)):
                piece.copy_(part.view(piece.shape))
            return outputs

        return self._run("allgather", flat, [flat], as_bytes=True, then=scatter_back)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:  # noqa: A002
        """``all_gather_into_tensor``: equal pieces into one tensor."""
        ok = (
            _plain(output)
            and _plain(input)
            and output.dtype == input.dtype
            and output.numel() == self._size * input.numel()
        )
        if not ok:
            return self._forward("allgather", self.gloo._allgather_base, output, input, opts)
        output.view(-1).view(self._size, -1)[self._rank].copy_(input.view(-1))
        return self._run("allgather", output, [output], as_bytes=True)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> Any:
        """``reduce_scatter`` of a list of equal tensors."""
        op = self._op_name(opts.reduceOp)
        out = self._single(outputs)
        ok = (
            out is not None
            and op in self._ops
            and op != "avg"
            and self._dtype(out) is not None
            and len(inputs) == 1
            and len(inputs[0]) == self._size
            and all(_plain(t) and t.shape == out.shape and t.dtype == out.dtype for t in inputs[0])
        )
        if not ok:
            return self._forward("reduce_scatter", self.gloo.reduce_scatter, outputs, inputs, opts)
        flat = torch.cat([t.reshape(-1) for t in inputs[0]])
        return self._reduce_scatter_into(out, flat, outputs, op)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:  # noqa: A002
        """``reduce_scatter_tensor``: this rank's block of the reduced tensor."""
        op = self._op_name(opts.reduceOp)
        ok = (
            _plain(output)
            and _plain(input)
            and op in self._ops
            and op != "avg"
            and self._dtype(output) is not None
            and output.dtype == input.dtype
            and input.numel() == self._size * output.numel()
        )
        if not ok:
            return self._forward(
                "reduce_scatter", self.gloo._reduce_scatter_base, output, input, opts
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
        """``all_to_all_single`` without split sizes (given ones go to gloo).

        Every rank must take the same way. Without split sizes the blocks
        are equal on every rank of a valid call; with them, a rank sees only
        its own row and column of the job's split matrix, so it cannot know
        whether the others' are even: such calls always go to gloo.
        """
        rows = input.shape[0] if input.dim() else 0
        equal = (
            not output_splits
            and not input_splits
            and _plain(output)
            and _plain(input)
            and output.dtype == input.dtype
            and output.numel() == input.numel()
            and rows % self._size == 0
        )
        if not equal:
            return self._forward(
                "alltoall",
                self.gloo.alltoall_base,
                output,
                input,
                output_splits,
                input_splits,
                opts,
            )
        output.view(-1).copy_(input.view(-1))
        return self._run("alltoall", output, [output], as_bytes=True)

    # -- collectives gloo runs ----------------------------------------------

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """Forwarded to gloo."""
        return self._forward("allreduce_coalesced", self.gloo.allreduce_coalesced, tensors, opts)

    def allreduce_sparse(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """Forwarded to gloo (sparse tensors)."""
        return self._forward("allreduce", self.gloo.allreduce, tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """Forwarded to gloo."""
        return self._forward("reduce", self.gloo.reduce, tensors, opts)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        """Forwarded to gloo."""
        return self._forward(
            "allgather_coalesced", self.gloo.allgather_coalesced, outputs, inputs, opts
        )

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        """Each pair through ``all_gather_single``, in order."""
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _last(works)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        """Each pair through ``reduce_scatter_single``, in order."""
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _last(works)

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        """Forwarded to gloo."""
        return self._forward("gather", self.gloo.gather, outputs, inputs, opts)

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> Any:
        """Forwarded to gloo."""
        return self._forward("scatter", self.gloo.scatter, outputs, inputs, opts)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> Any:
        """Forwarded to gloo."""
        return self._forward("alltoall", self.gloo.alltoall, outputs, inputs, opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        """Forwarded to gloo."""
        return self._forward("send", self.gloo.send, tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        """Forwarded to gloo."""
        return self._forward("recv", self.gloo.recv, tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        """Forwarded to gloo."""
        return self._forward("recv", self.gloo.recv_anysource, tensors, tag)

    # -- helpers --------------------------------------------------------------

    def _op_name(self, op: Any) -> str | None:
        return self._op_names.get(getattr(op, "op", op))

    def _dtype(self, tensor: torch.Tensor) -> str | None:
        name = str(tensor.dtype).removeprefix("torch.")
        return name if name in self._dtypes else None

    @staticmethod
    def _single(tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """The one plain CPU tensor of a call, or ``None`` (gloo takes the rest)."""
        if len(tensors) != 1 or not _plain(tensors[0]):
            return None
        return tensors[0]

    def _forward(self, name: str, method: Any, *args: Any) -> Any:
        self.forwarded[name] += 1
        return method(*args)

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
        """Queues ``name`` on the engine over ``buffer``; returns its work.

        The engine keeps ``result`` (which holds ``buffer``) alive until the
        collective is done, then completes the work's future with it, or
        with its error (see :class:`_EngineWork`).
        """
        self.served[name] += 1
        served_in_process[name] += 1
        dtype = "uint8" if as_bytes else self._dtype(buffer)
        future = torch.futures.Future()
        self._engine.collective_async(
            name,
            result,
            buffer.data_ptr(),
            buffer.numel() * buffer.element_size(),
            dtype,
            future,
            reduce=reduce,
            root=root,
        )
        return _EngineWork(future, future.then(then or _value))

    def _reduce_scatter_into(
        self, out: torch.Tensor, flat: torch.Tensor, result: Any, op: str
    ) -> Any:
        block = flat.view(self._size, -1)[self._rank]

        def copy_out(future: torch.futures.Future) -> Any:
            future.value()
            out.copy_(block.view(out.shape))
            return result

        return self._run("reduce_scatter", flat, [flat], reduce=op, then=copy_out)


def _plain(tensor: Any) -> bool:
    """A dense, contiguous CPU tensor (what the engine takes as memory)."""
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and tensor.is_contiguous()
        and not tensor.is_complex()
    )


def _stop_all() -> None:
    """Stops, at exit, the backends of groups the script never destroyed.

    Many scripts end without ``destroy_process_group``. Their backends'
    engine and gloo threads would then stop during the interpreter's
    finalization, when a thread that still reaches for Python aborts the
    process ("terminate called without an active exception", exit code
    -6). Registered when the package loads, so it runs after the handlers
    the script and its libraries register later.
    """
    for backend in list(_live):
        try:
            backend.shutdown()
        except Exception:  # noqa: S110 - exiting: nothing left to report to
            pass


atexit.register(_stop_all)


class _EngineWork(_C10dWork):  # type: ignore[misc,valid-type]
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


def _value(future: torch.futures.Future) -> Any:
    """The future's result; raises the engine's error if it failed."""
    return future.value()


def _last(works: list[Any]) -> Any:
    """Waits for all but the last work (in order) and returns the last."""
    for work in works[:-1]:
        work.wait()
    return works[-1] if works else None

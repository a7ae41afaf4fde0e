"""The CUDA collectives of one group: the device engine where it can, NCCL otherwise.

The CUDA side of the "tiacc" backend (``init_process_group("cpu:tiacc,cuda:tiacc")``,
or ``TIACC_TRAINING_CUDA_COLLECTIVES=tiacc`` after the two lines). What the
engine runs, the checks of every call and the counts are the CPU side's
(``_collectives.GroupCollectives``); this module says how a collective runs
on the device engine (``_engine.DeviceEngine``, over NCCL): the engine's
channels, its 2D groups and its reduce-scatter compression apply, and the
engine counts the bytes.

The engine runs ``all_reduce``, ``reduce_scatter`` / ``reduce_scatter_tensor``
and ``all_gather`` / ``all_gather_into_tensor`` with a sum, or the average of
floating-point tensors (FSDP2's and DDP's reductions), on the element types
NCCL carries. Everything else (``broadcast``, ``barrier``, ``all_to_all``,
``min``/``max``/``product``, point-to-point) goes to an NCCL backend
underneath, counted with its reason.

Stream semantics, as torch's NCCL backend gives them: the channel's stream
waits on the caller's current stream (an event, no host wait), the engine
enqueues the collective there, the tensors are marked as used on that
stream (``record_stream``), and the work's future is CUDA-aware: ``wait()``
makes the caller's current stream wait on the channel's, never the host.
The engine is built on the group's first CUDA collective, on that tensor's
device (scripts set their device after ``init_process_group``).

On the CPU (``device_type="cpu"``) the same code runs over the device
engine's TCP rings with gloo underneath: how the tests check it where no
GPU is.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from tiacc_training import _engine

from ._collectives import NOT_IN_ENGINE, EngineCall, GroupArgs, GroupCollectives, _live

# Collectives the device engines served in this process, by op.
served_in_process: collections.Counter[str] = collections.Counter()
# Collectives forwarded to the backend underneath, by (op, reason).
forwarded_in_process: collections.Counter[tuple[str, str]] = collections.Counter()

# The reductions the device engine runs.
_OPS = frozenset({"sum", "avg"})
# The element types NCCL carries (torch's names).
_NCCL_DTYPES = frozenset(
    {"float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"}
)


class DeviceCollectives(GroupCollectives):
    """One group's collectives on a device, through the device engine.

    Args:
        group: the group, over a store of its own (the CPU side may use
            the group's store).
        fallback: the backend underneath (NCCL; gloo on the CPU).
        device_type: the tensors served (``"cuda"``; ``"cpu"`` in the tests).

    Attributes:
        served, forwarded, fallback, timeout: as for ``GroupCollectives``.
        device: the device the engine runs on, once it exists.
    """

    engine_runs = frozenset({"allreduce", "reduce_scatter", "allgather"})
    served_total = served_in_process
    forwarded_total = forwarded_in_process

    def __init__(self, group: GroupArgs, fallback: Any, device_type: str = "cuda") -> None:
        self.device_type = device_type
        self.fallback = fallback
        self.device: torch.device | None = None
        self._group = group
        self._init_group(group, _OPS, frozenset(_engine.collective_dtypes()) & _NCCL_DTYPES)
        self._engine: Any = None
        self._streams: list[Any] = []
        self._index = 0
        _live.add(self)

    @property
    def transport(self) -> str:
        """What carries the engine's bytes (``""`` before its first collective)."""
        return self._engine.transport if self._engine is not None else ""

    def engine_for(self, device: torch.device) -> Any:
        """The group's device engine, built on ``device`` by the first collective.

        Raises:
            ValueError: a later collective's tensor is on another device.
        """
        if self._engine is None:
            key = f"{self._group.name}/{self.device_type}"
            self._engine = self._new_engine(self._group, key, device=device)
            self.device = device
            if device.type == "cuda":
                self._streams = [
                    torch.cuda.Stream(device=device) for _ in range(self._engine.num_channels)
                ]
        elif device != self.device:
            raise ValueError(
                f"rank {self.rank}: this group's {self.device_type} collectives run on "
                f"{self.device} (its first collective's device), not on {device}: "
                "one device per rank and group, as NCCL has it"
            )
        return self._engine

    def barrier(self, opts: Any = None) -> Any:
        """``barrier``: NCCL's own (``broadcast`` and ``all_to_all_single`` go there too)."""
        args = () if opts is None else (opts,)
        return self.forward("barrier", NOT_IN_ENGINE, self.fallback.barrier, *args)

    def _why_not(self, tensor: torch.Tensor | None, op: str | None) -> str | None:
        why = super()._why_not(tensor, op)
        if why is None and op == "avg" and tensor is not None and not tensor.is_floating_point():
            return "the average of integer elements"
        return why

    # -- how a collective runs ------------------------------------------------

    def _start(self, call: EngineCall) -> torch.futures.Future:
        """Enqueues ``call`` on the engine's channel (on the CPU: runs it)."""
        if call.name not in self.engine_runs:
            raise AssertionError(f"the device engine does not run {call.name}")
        buffer = call.buffer
        engine = self.engine_for(buffer.device)
        self._count_served(call.name)
        index, self._index = self._index, self._index + 1
        flat = buffer.view(-1).view(torch.uint8)
        if buffer.device.type != "cuda":
            # The TCP rings: done when the call returns.
            engine.collective(call.name, flat, call.dtype, index, call.reduce, 0)
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(call.result)
            return future
        device = buffer.device
        channel = engine.channel_of(index)
        stream = self._streams[channel]
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            engine.collective(call.name, flat, call.dtype, index, call.reduce, stream.cuda_stream)
            done = torch.cuda.Event()
            done.record(stream)
            future = torch.futures.Future(devices=[device])
            future.set_result(call.result)
        # The buffer (and the engine's scratch, allocated on this stream) is
        # used on the channel's stream: the allocator must not hand its
        # memory out again before that stream gets past this point.
        buffer.record_stream(stream)
        engine.watch(channel, done.query)
        return future

    def _stop_fallback(self) -> None:
        """Stops the backend underneath (the engine's communicators are aborted first)."""
        stop = getattr(self.fallback, "shutdown", None) or getattr(self.fallback, "_shutdown", None)
        if stop is not None:
            try:
                stop()
            except Exception:  # noqa: S110 - an older backend; stopping anyway
                pass

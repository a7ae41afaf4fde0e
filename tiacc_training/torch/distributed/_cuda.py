"""CUDA buckets: the channel streams, events and futures around the engines.

Stream ordering, for both transports: the hook runs on the thread that runs
backward, after DDP copied the gradients into the bucket on torch's current
stream. Each channel has its own CUDA stream; the hook makes it wait on the
current stream (an event recorded there; no host wait), enqueues the work
on the channel stream, marks the bucket as used there (``record_stream``,
for the caching allocator) and returns a CUDA-aware future
(``torch.futures.Future(devices=[device])``) completed from inside
``torch.cuda.stream(channel_stream)``: completing it records an event on
the channel stream, and whoever consumes the result (DDP copying the bucket
back into ``.grad``) makes its own stream wait on that event instead of
blocking the host.

* :class:`NcclChannels`: the device engine runs the algorithm on the
  channel stream (NCCL collectives and torch kernels, enqueued in order)
  and its watchdog bounds the wait.
* :class:`HostStaging`: the bucket is copied to pinned host memory and the
  CPU engine runs the same algorithm there, on a worker thread per channel.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch


class NcclChannels:
    """CUDA buckets through the device engine over NCCL.

    Args:
        engine: a connected ``_engine.DeviceEngine`` (transport ``nccl``).
        device: the CUDA device of the model.
    """

    # How ``stats()`` names this path.
    kind = "nccl"

    def __init__(self, engine: Any, device: torch.device) -> None:
        self.engine = engine
        self.device = device
        self.streams = [torch.cuda.Stream(device=device) for _ in range(engine.num_channels)]

    def matches(self, config: Any, device: torch.device) -> bool:
        """Whether these channels serve a model built with ``config`` on ``device``."""
        return (
            self.device == device
            and self.engine.connected
            and self.engine.config.same_settings(config)
        )

    def allreduce(self, buf: torch.Tensor, index: int) -> torch.futures.Future:
        """Averages ``buf`` over the world on its channel; returns at once."""
        channel = self.engine.channel_of(index)
        stream = self.streams[channel]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.engine.allreduce(
                buf.view(torch.uint8), str(buf.dtype), index, True, stream.cuda_stream
            )
            done = torch.cuda.Event()
            done.record(stream)
            future: torch.futures.Future = torch.futures.Future(devices=[self.device])
            future.set_result(buf)
        # The bucket (and the engine's scratch tensors, allocated on this
        # stream) is used on the channel stream: the allocator must not hand
        # its memory out again before that stream gets past this point.
        buf.record_stream(stream)
        self.engine.watch(channel, done.query)
        return future

    def load_engine_state(self, state: dict[str, Any]) -> None:
        """Loads the device engine's state across steps (``_engine_state``).

        Each channel's buffers are allocated on its own stream, the one its
        buckets use them on (so the caching allocator orders their reuse
        with that stream's work), after the work already queued on the
        current stream.

        Args:
            state: the engine's dict (``DeviceEngine.load_state``'s form).
        """
        current = torch.cuda.current_stream(self.device)
        for channel, stream in enumerate(self.streams):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                self.engine.load_state(state, channel=channel)

    def close(self) -> None:
        """Aborts the communicators (never waits on peers)."""
        self.engine.shutdown()


@dataclass
class _StagedJob:
    """One CUDA bucket on its way through host memory."""

    buf: torch.Tensor
    host: torch.Tensor
    ready: Any
    future: torch.futures.Future
    index: int


class HostStaging:
    """CUDA buckets over the CPU engine, through pinned host memory.

    Per channel: a CUDA stream, a worker thread and pinned buffers (one per
    bucket index). The hook enqueues the device-to-host copy on the channel
    stream and an event after it, then returns; the worker waits for that
    event (``Event.synchronize`` releases the GIL; the training thread is
    never blocked), runs the engine's allreduce on the host buffer (GIL
    released: averaging, compression, 2D, Top-K and the NaN check all apply
    there), enqueues the host-to-device copy on the channel stream and
    completes the CUDA-aware future there.

    Reusing a pinned buffer is safe by stream order: the next device-to-host
    copy into it is enqueued after this step's future completed, so after
    the host-to-device copy that reads it, and the host only writes it
    after waiting for that next copy's event.

    Args:
        engine: the connected CPU engine (``_engine.CommEngine``).
        device: the CUDA device of the model.
    """

    # How ``stats()`` names this path.
    kind = "host staging"

    def __init__(self, engine: Any, device: torch.device) -> None:
        self.engine = engine
        self.device = device
        n = engine.num_channels
        self.streams = [torch.cuda.Stream(device=device) for _ in range(n)]
        self.pinned: dict[tuple[int, int], torch.Tensor] = {}
        self.queues: list[queue.SimpleQueue[_StagedJob | None]] = [
            queue.SimpleQueue() for _ in range(n)
        ]
        self.threads = [
            threading.Thread(target=self._run, args=(c,), name=f"tiacc-staging-{c}", daemon=True)
            for c in range(n)
        ]
        for t in self.threads:
            t.start()

    def matches(self, engine: Any, device: torch.device) -> bool:
        """Whether this staging serves ``engine`` on ``device``."""
        return self.engine is engine and self.device == device

    def _host_buffer(self, channel: int, index: int, like: torch.Tensor) -> torch.Tensor:
        key = (channel, index)
        host = self.pinned.get(key)
        if host is None or host.dtype != like.dtype or host.numel() != like.numel():
            host = torch.empty(like.numel(), dtype=like.dtype, pin_memory=True)
            self.pinned[key] = host
        return host

    def allreduce(self, buf: torch.Tensor, index: int) -> torch.futures.Future:
        """Averages ``buf`` over the world on its channel; returns at once."""
        channel = self.engine.channel_of(index)
        stream = self.streams[channel]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host = self._host_buffer(channel, index, buf)
            host.copy_(buf.view(-1), non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        buf.record_stream(stream)
        future: torch.futures.Future = torch.futures.Future(devices=[self.device])
        self.queues[channel].put(_StagedJob(buf, host, ready, future, index))
        return future.then(unwrap)

    def _run(self, channel: int) -> None:
        stream = self.streams[channel]
        while True:
            job = self.queues[channel].get()
            if job is None:
                return
            try:
                job.ready.synchronize()
                self.engine.allreduce(
                    job.host.data_ptr(),
                    job.host.numel() * job.host.element_size(),
                    str(job.host.dtype),
                    job.index,
                    True,
                )
                with torch.cuda.device(self.device), torch.cuda.stream(stream):
                    job.buf.view(-1).copy_(job.host, non_blocking=True)
                    job.future.set_result(job.buf)
            except Exception as exc:  # handed to DDP through the future
                job.future.set_exception(exc)

    def close(self) -> None:
        """Stops the worker threads after the jobs already queued."""
        for q in self.queues:
            q.put(None)


def unwrap(future: torch.futures.Future) -> torch.Tensor:
    """The future's value, raising its exception.

    DDP reads a hook's future from C++, where a Python-level
    ``set_exception`` is just a value; unwrapping in a callback turns it
    into a real error, so backward raises with the engine's message.
    """
    return future.wait()

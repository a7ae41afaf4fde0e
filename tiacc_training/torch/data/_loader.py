"""The drop-in ``DataLoader``: the class, its threaded iterator and its worker threads.

The package's ``__init__`` describes what it keeps of torch's loader and
what it adds; ``_dataset`` holds the dataset it recognises, ``_device_decode``
the batches decoded on a GPU.
"""

from __future__ import annotations

import atexit
import queue
import threading
import warnings
import weakref
from typing import Any, Optional

import torch
import torch.utils.data
from torch.utils.data._utils.collate import default_collate

from ._dataset import IndexedDataset
from ._device_decode import DeviceDecoder, normalize_

__all__ = ["DataLoader"]


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` with a threaded fast path.

    Takes every argument of torch's ``DataLoader`` (passed to it unchanged,
    so they are checked exactly as there), plus:

    Args:
        *args: As for ``torch.utils.data.DataLoader``.
        device: ``"cuda"`` (or a CUDA device) to ship uint8 batches and
            normalise them on that device; ``None`` (default) yields
            float32 batches on the host, as torch's loader does. Only the
            fast path honours it; elsewhere it is an error to ask for it.
        decode_device: ``"cuda"`` to decode and augment on the GPU (see
            the module docs); batches are then yielded there.
        jpeg_decoder: With ``decode_device``: ``"torchvision"`` (default)
            or ``"nvimagecodec"`` (needs ``nvidia-nvimgcodec-cu13`` and
            ``nvidia-nvjpeg``, or the ``-cu12`` build).
        **kwargs: As for ``torch.utils.data.DataLoader``.

    Raises:
        ValueError: ``device`` or ``decode_device`` was given but the fast
            path does not apply (the message says why), they disagree, or
            ``jpeg_decoder`` is unknown or given without ``decode_device``.
        ImportError: the ``jpeg_decoder`` asked for is not installed.
    """

    def __init__(
        self,
        *args: Any,
        device: Any = None,
        decode_device: Any = None,
        jpeg_decoder: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._tiacc_why_not = _why_not_fast(self)
        self._tiacc_iter: Optional[_ThreadedIter] = None
        self._tiacc_device: Optional[torch.device] = None
        self._tiacc_decoder: Any = None
        for name, value in (("device", device), ("decode_device", decode_device)):
            if value is not None and self._tiacc_why_not is not None:
                raise ValueError(
                    f"{name}={value!r} needs the fast path, which does not apply: "
                    f"{self._tiacc_why_not}"
                )
        if jpeg_decoder is not None and decode_device is None:
            raise ValueError(
                f"jpeg_decoder={jpeg_decoder!r} picks the decoder of decode_device=, "
                "which was not given"
            )
        if decode_device is not None:
            if device is not None and torch.device(device) != torch.device(decode_device):
                raise ValueError(
                    f"decode_device={decode_device!r} yields batches there; device={device!r} "
                    "differs"
                )
            self._tiacc_decoder = DeviceDecoder(
                self.dataset, torch.device(decode_device), jpeg_decoder or "torchvision"
            )
        elif device is not None:
            self._tiacc_device = torch.device(device)
            if not self.dataset._plan.to_float:
                raise ValueError(
                    f"device={device!r} converts on the device, but the transform yields "
                    "uint8 images: move them with .to() instead"
                )

    def check_worker_number_rationality(self) -> None:
        """Warns, as torch does, of more worker processes than cores.

        The fast path's workers are threads that release the GIL: no warning.
        """
        if _why_not_fast(self) is not None:
            super().check_worker_number_rationality()

    @property
    def uses_fast_path(self) -> bool:
        """Whether batches come from the engine's threads."""
        return self._tiacc_why_not is None

    def __iter__(self) -> Any:
        if self._tiacc_why_not is not None:
            return super().__iter__()
        if self.persistent_workers and self.num_workers > 0:
            if self._tiacc_iter is None or self._tiacc_iter.closed:
                self._tiacc_iter = _ThreadedIter(self)
            else:
                self._tiacc_iter.reset()
            return self._tiacc_iter
        return _ThreadedIter(self)


def _why_not_fast(loader: DataLoader) -> Optional[str]:
    """Why the fast path does not apply to ``loader``, or ``None``."""
    dataset = loader.dataset
    if not isinstance(dataset, IndexedDataset):  # IndexTFRDataset is this class
        return f"the dataset is a {type(dataset).__name__}, not an IndexTFRDataset"
    if not dataset.uses_fused_path:
        return "the dataset's transform does not run on the fused path"
    if loader.batch_sampler is None:
        return "batch_size=None (no batching)"
    if loader.collate_fn is not default_collate:
        return "a collate_fn other than the default"
    return None


class _Failure:
    """An exception raised while loading a batch, carried to the caller."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _ThreadedIter:
    """The fast path's iterator.

    The batch sampler feeds the worker threads in turn, as torch feeds its
    worker processes, and batches come back in order.
    """

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self.workers = loader.num_workers
        self.prefetch = (loader.prefetch_factor or 2) * max(self.workers, 1)
        self.timeout = loader.timeout
        self.pin = loader.pin_memory and torch.cuda.is_available()
        if loader.pin_memory and not self.pin:
            warnings.warn(
                "DataLoader: pin_memory=True, but no CUDA device is available: batches stay in "
                "pageable memory",
                stacklevel=3,
            )
        self.device = loader._tiacc_device
        self.closed = False
        _LIVE.add(self)
        self.epoch = 0
        self.results: queue.SimpleQueue[tuple[int, int, Any]] = queue.SimpleQueue()
        self.inputs: list[queue.SimpleQueue[Optional[tuple[int, int, list[int]]]]] = []
        self.threads: list[threading.Thread] = []
        # Drawn as torch's iterator draws it, whether or not it is used.
        base_seed = int(
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()
        )
        self.generators = [
            torch.Generator().manual_seed(base_seed + w) for w in range(self.workers)
        ]
        for w in range(self.workers):
            inbox: queue.SimpleQueue[Optional[tuple[int, int, list[int]]]] = queue.SimpleQueue()
            thread = threading.Thread(
                target=_work,
                args=(weakref.proxy(self), w, inbox),
                name=f"tiacc-loader-{w}",
                daemon=True,
            )
            self.inputs.append(inbox)
            self.threads.append(thread)
            thread.start()
        self.reset()

    def reset(self) -> None:
        """Starts an epoch: a fresh pass over the batch sampler.

        Batches still in flight from an epoch left early are loaded (their
        draws are consumed, as torch's workers consume them) and dropped.
        """
        self.epoch += 1
        self.sampler = iter(self.loader._index_sampler)
        self.sent = 0
        self.received = 0
        self.pending: dict[int, Any] = {}
        self.exhausted = False
        if self.workers:
            for _ in range(self.prefetch):
                self._send()

    def _send(self) -> None:
        if self.exhausted:
            return
        try:
            indices = list(next(self.sampler))
        except StopIteration:
            self.exhausted = True
            return
        self.inputs[self.sent % self.workers].put((self.epoch, self.sent, indices))
        self.sent += 1

    def __iter__(self) -> _ThreadedIter:
        return self

    def __len__(self) -> int:
        return len(self.loader._index_sampler)

    def __next__(self) -> Any:
        if self.closed:
            raise StopIteration
        if self.workers == 0:
            try:
                indices = list(next(self.sampler))
            except StopIteration:
                raise StopIteration from None
            return self._finish(self.load(indices, None))
        if self.received == self.sent:
            self.close_unless_persistent()
            raise StopIteration
        while self.received not in self.pending:
            try:
                epoch, k, batch = self.results.get(timeout=self.timeout or None)
            except queue.Empty:
                self.close()
                raise RuntimeError(f"DataLoader timed out after {self.timeout} seconds") from None
            if epoch == self.epoch:
                self.pending[k] = batch
        batch = self.pending.pop(self.received)
        self.received += 1
        self._send()
        if isinstance(batch, _Failure):
            self.close()
            raise batch.exc
        return self._finish(batch)

    def load(self, indices: list[int], generator: Optional[torch.Generator]) -> Any:
        """One batch: ``[images, targets]`` as the default collate gives it."""
        decoder = self.loader._tiacc_decoder
        if decoder is not None:
            images, targets = decoder.batch(indices, generator)
            return [images, default_collate(targets)]
        images, targets = self.dataset._fused_batch(
            indices,
            threads=1 if self.workers else 0,
            generator=generator,
            pin_memory=self.pin,
            uint8=self.device is not None,
        )
        return [images, default_collate(targets)]

    def _finish(self, batch: Any) -> Any:
        images = batch[0]
        if images.device.type == "cuda":
            # Made on a worker thread's stream: the caching allocator must
            # not reuse it before the consumer's stream is done with it.
            images.record_stream(torch.cuda.current_stream(images.device))
        if self.device is None:
            return batch
        images, targets = batch
        out = images.to(self.device, non_blocking=True).float()
        return [normalize_(out, self.dataset._plan), targets]

    def close_unless_persistent(self) -> None:
        """Ends an epoch: the threads stop unless the workers persist."""
        if not self.loader.persistent_workers:
            self.close()

    def close(self) -> None:
        """Stops the threads (each finishes the batch it is on)."""
        if self.closed:
            return
        self.closed = True
        for inbox in self.inputs:
            inbox.put(None)
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join(timeout=60)

    def __del__(self) -> None:
        self.close()


_LIVE: weakref.WeakSet[_ThreadedIter] = weakref.WeakSet()
"""Iterators whose threads may still run: stopped before the interpreter exits."""


@atexit.register
def _stop_all() -> None:
    """Stops every loader's threads at exit, before torch and CUDA are torn down.

    A loader left mid-epoch (a ``break`` kept alive, persistent workers)
    would otherwise have its threads, and the CUDA streams of GPU decoding,
    outlive the interpreter's own shutdown.
    """
    for it in list(_LIVE):
        it.close()


def _work(it: Any, worker: int, inbox: queue.SimpleQueue) -> None:
    """A worker thread: its share of the batches, in order, with its generator."""
    try:
        init = it.loader.worker_init_fn
        generator = it.generators[worker]
        results = it.results
        if init is not None:
            init(worker)
    except ReferenceError:
        return
    except BaseException as exc:  # worker_init_fn failed: every batch reports it
        failure: Any = _Failure(exc)
        while (job := inbox.get()) is not None:
            results.put((job[0], job[1], failure))
        return
    stream = None
    decoder = it.loader._tiacc_decoder
    if decoder is not None and decoder.device.type == "cuda":
        stream = torch.cuda.Stream(decoder.device)
    while (job := inbox.get()) is not None:
        epoch, k, indices = job
        try:
            if stream is not None:
                with torch.cuda.stream(stream):
                    batch: Any = it.load(indices, generator)
            else:
                batch = it.load(indices, generator)
        except ReferenceError:
            return
        except BaseException as exc:
            batch = _Failure(exc)
        results.put((epoch, k, batch))

"""``DataLoader``: a drop-in for ``torch.utils.data.DataLoader``.

Same arguments, same behaviour, same ``len()``; where it can, it loads
faster. For an :class:`~tiacc_training.torch.tiacc_torch_warp.IndexTFRDataset`
whose transform the fused path runs, with the default collate, every batch
is read, decoded, cropped, resized, flipped and normalised by the engine in
one call, straight into the batch tensor (pinned with ``pin_memory``), by
``num_workers`` threads instead of worker processes: no pickling, no
per-sample collate, no copies between processes. Anything else is handed
to torch's ``DataLoader`` unchanged.

What stays the same as torch's loader:

* the indices, in the same order, for any sampler, ``batch_sampler``,
  ``shuffle``, ``generator``, ``drop_last`` and ``DistributedSampler`` (with
  ``set_epoch``): the batch sampler is torch's own;
* the random crops and flips: with ``num_workers=0`` they come from torch's
  global generator in the main thread, as in torch; with ``num_workers=W``
  worker ``w`` draws from a generator seeded ``base_seed + w`` and takes
  batches ``w, w + W, ...``, where ``base_seed`` is drawn as torch draws it
  (from ``generator``, else the global generator). So a seeded run gives the
  same batches as torch's loader over the same dataset;
* ``prefetch_factor`` (batches in flight per worker), ``persistent_workers``
  (threads and their generators kept across epochs), ``worker_init_fn``
  (called with the worker id in each thread), ``timeout`` (a
  ``RuntimeError`` when a batch takes longer), ``pin_memory``.

Differences, all documented: workers are threads (``get_worker_info()`` is
``None`` in ``worker_init_fn``), and an error raised while loading reaches
the caller as itself (a ``CorruptRecordError`` naming the shard and offset),
not wrapped. Breaking out of the loop, an exception or Ctrl-C stops the
threads; forking afterwards is safe.

Additions:

* ``device="cuda"``: the engine produces uint8 batches, they go to the GPU
  (a quarter of the bytes of float32) and are converted and normalised
  there, as DALI and FFCV do. The result equals the float32 batches up to
  float rounding.
* ``decode_device="cuda"``: JPEGs are decoded on the GPU (nvJPEG, through
  torchvision, or with ``jpeg_decoder="nvimagecodec"`` NVIDIA's
  nvImageCodec, which can use the GPU's hardware JPEG engines) and
  cropped, resized, flipped and normalised there in whole batches; the CPU
  threads only read records. Non-JPEG records, and JPEGs the GPU decoder
  refuses, take the CPU path in the same batch. Crops and
  flips are the same draws as on the CPU; pixels differ from the CPU path
  by a few levels of 255 (IDCT rounding, the resampling filter). See
  ``_device_decode``.

The package's modules, one job each: ``_loader`` (``DataLoader``, its
threaded iterator and worker threads), ``_dataset`` (``IndexedDataset``,
which :mod:`tiacc_training.torch.tiacc_torch_warp` exports as
``IndexTFRDataset``), ``_fused`` (recognising the transform chains the
engine runs in one pass, v1 and v2), ``_random_params`` (where their random
parameters are drawn: the engine's reproduction of torch's generator,
checked once, or torch's own calls), ``_device_decode`` (decoding and
augmenting batches on a GPU) and ``_gpu_jpeg`` (its batched JPEG decoders).
Each imports only the ones after it in that order.
"""

from __future__ import annotations

from ._loader import DataLoader

__all__ = ["DataLoader"]

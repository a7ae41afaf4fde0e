"""PyTorch-facing classes under the names the TI-ACC documents use.

``IndexTFRDataset`` reads a dataset packed by ``img2tfrecord`` (or any
TFRecord shards with an index from ``build_index``) with random access;
``MixedPrecision_TrainingPolicy`` (defined in ``_amp``) decides when to train
in mixed precision.

Importing this module needs neither torchvision nor PIL: the dataset imports
them when it first needs them, and the mixed-precision policy never does.
"""

from __future__ import annotations

from tiacc_training.torch._amp import MixedPrecision_TrainingPolicy
from tiacc_training.torch.data._dataset import IndexedDataset

IndexTFRDataset = IndexedDataset
"""The TI-ACC name of :class:`~tiacc_training.torch.data._dataset.IndexedDataset`."""

IndexTfrDataset = IndexedDataset
"""PEP 8 spelling of :class:`IndexTFRDataset`."""

__all__ = ["IndexTFRDataset", "IndexTfrDataset", "IndexedDataset", "MixedPrecision_TrainingPolicy"]

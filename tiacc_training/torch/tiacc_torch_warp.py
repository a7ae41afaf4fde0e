"""PyTorch-facing classes under the names the TI-ACC documents use.

``IndexTFRDataset`` reads a dataset packed by ``img2tfrecord`` (or any
TFRecord shards with an index from ``build_index``) with random access.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.utils.data
from PIL import Image

from tiacc_training import _engine


def _resolve_index(root: str, index_file: str) -> str:
    """The index path: as given if it exists or is absolute, else under ``root``."""
    if os.path.isabs(index_file) or os.path.exists(index_file):
        return index_file
    candidate = os.path.join(root, index_file)
    return candidate if os.path.exists(candidate) else index_file


class IndexTFRDataset(torch.utils.data.Dataset):
    """A map-style dataset over TFRecord shards and their index.

    Each item is ``(image, label)``. The image is decoded from the record's
    ``image/encoded`` feature with libjpeg-turbo (pixel-identical to PIL's own
    decode), converted to RGB like ``PIL.Image.convert("RGB")``, and passed as
    a PIL image through ``transform``, exactly as torchvision datasets do; the
    label comes from the index (``target_transform`` is applied to it).

    ``__getitems__`` (which ``torch.utils.data.DataLoader`` calls for a whole
    batch) reads and decodes the batch in parallel in Rust with the GIL
    released; in a DataLoader worker process it uses one thread, since the
    workers already run in parallel.

    Args:
        tfrecored_dir: Folder of the shards (the TI-ACC spelling; the
            keyword ``tfrecord_dir`` is accepted too).
        tfrecord_file: The index written by ``img2tfrecord`` (``NAME.index``);
            a relative path that does not exist is looked up under
            ``tfrecored_dir``.
        transform: Callable applied to the PIL image.
        target_transform: Callable applied to the label.
        decode_threads: Threads for ``__getitems__`` (default: all cores in
            the main process, 1 in DataLoader workers).
        tfrecord_dir: Alias of ``tfrecored_dir``.

    Raises:
        DataError: The index is malformed or names a shard that cannot be
            opened (the message names the index line and the shard path).

    Example:
        >>> ds = IndexTFRDataset("train_tfr", "train_tfr/train.index", transform)
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=2)
    """

    def __init__(
        self,
        tfrecored_dir: Optional[str] = None,
        tfrecord_file: Optional[str] = None,
        transform: Optional[Callable[[Image.Image], Any]] = None,
        target_transform: Optional[Callable[[int], Any]] = None,
        *,
        decode_threads: Optional[int] = None,
        tfrecord_dir: Optional[str] = None,
    ) -> None:
        if tfrecored_dir is not None and tfrecord_dir is not None:
            raise TypeError("pass the shard folder once: tfrecored_dir or tfrecord_dir")
        root = tfrecored_dir if tfrecored_dir is not None else tfrecord_dir
        if root is None:
            raise TypeError("IndexTFRDataset needs the shard folder (tfrecored_dir)")
        if tfrecord_file is None:
            raise TypeError("IndexTFRDataset needs the index file (tfrecord_file)")
        if decode_threads is not None and decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1, got {decode_threads}")
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"tfrecored_dir {self.root!r} is not a directory")
        self.index_file = _resolve_index(self.root, os.fspath(tfrecord_file))
        if not os.path.isfile(self.index_file):
            raise FileNotFoundError(f"index file {self.index_file!r} does not exist")
        self.transform = transform
        self.target_transform = target_transform
        self.decode_threads = decode_threads
        self._data = _engine.PackedDataset(self.root, self.index_file)
        labels = self._data.labels()
        self.targets: list[int] = labels.tolist()
        self.class_num: int = int(labels.max()) + 1 if len(labels) and labels.max() >= 0 else 0
        self.classes: list[int] = list(range(self.class_num))

    def __len__(self) -> int:
        return len(self._data)

    def _index(self, index: Any) -> int:
        i = operator.index(index)
        n = len(self._data)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of range for a dataset of {n} records")
        return i + n if i < 0 else i

    def _item(self, pixels: Any, index: int) -> tuple[Any, Any]:
        image = Image.fromarray(pixels, mode="RGB") if pixels.ndim == 3 else pixels
        if self.transform is not None:
            image = self.transform(image)
        target: Any = self.targets[index]
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        """Returns ``(transform(image), target_transform(label))`` of record ``index``.

        Raises:
            DecodeError: The record's image cannot be decoded (the message
                and the ``path``, ``offset`` and ``index`` attributes locate it).
            CorruptRecordError: The record fails its CRC check.
        """
        i = self._index(index)
        return self._item(self._data.decode(i), i)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """Returns the items of ``indices``, read and decoded in parallel."""
        idx = [self._index(i) for i in indices]
        pixels = self._data.decode_batch(idx, self._threads())
        return [self._item(p, i) for p, i in zip(pixels, idx)]

    def _threads(self) -> int:
        if self.decode_threads is not None:
            return self.decode_threads
        return 1 if torch.utils.data.get_worker_info() is not None else 0

    def location(self, index: int) -> tuple[str, int]:
        """``(shard_path, offset)`` of record ``index``."""
        path, offset = self._data.location(self._index(index))
        return os.fspath(path), offset

    def __getstate__(self) -> dict[str, Any]:
        # The engine object holds open files: pickling (DataLoader workers
        # under the spawn start method) reopens the dataset instead.
        state = self.__dict__.copy()
        del state["_data"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._data = _engine.PackedDataset(self.root, self.index_file)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self)} records, {self.class_num} classes, "
            f"index={self.index_file!r}, transform={self.transform!r})"
        )


IndexTfrDataset = IndexTFRDataset
"""PEP 8 spelling of :class:`IndexTFRDataset`."""

__all__ = ["IndexTFRDataset", "IndexTfrDataset"]

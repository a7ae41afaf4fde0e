"""``IndexedDataset``: random access to a packed dataset, decoded in Rust.

The one dataset class of the package. The TI-ACC documents call it
``IndexTFRDataset``; :mod:`tiacc_training.torch.tiacc_torch_warp` exports it
under that name and as ``IndexTfrDataset``. The Rust engine's type behind it
(``tiacc_training._engine.IndexedDataset``) has the same name.

torchvision and PIL are imported when first needed: PIL when an item takes
the PIL path, torchvision when a transform is planned for the fused path
(without torchvision no transform can be a torchvision ``Compose``, so
nothing fuses).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.utils.data

from tiacc_training import _engine
from tiacc_training.errors import missing_file

from ._fused import FusedPlan
from ._random_params import TorchDraws, reproducible

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage


def _resolve_index(root: str, index_file: str) -> str:
    """The index path: as given if it exists or is absolute, else under ``root``."""
    if os.path.isabs(index_file) or os.path.exists(index_file):
        return index_file
    candidate = os.path.join(root, index_file)
    return candidate if os.path.exists(candidate) else index_file


class IndexedDataset(torch.utils.data.Dataset):
    """A map-style dataset over TFRecord shards and their index.

    Public as ``IndexTFRDataset`` (the TI-ACC name) and ``IndexTfrDataset``
    (PEP 8), both in :mod:`tiacc_training.torch.tiacc_torch_warp`.

    Each item is ``(image, label)``. The image is decoded from the record's
    ``image/encoded`` feature with libjpeg-turbo (pixel-identical to PIL's own
    decode), converted to RGB like ``PIL.Image.convert("RGB")``, and passed as
    a PIL image through ``transform``, exactly as torchvision datasets do; the
    label comes from the index (``target_transform`` is applied to it).

    ``__getitems__`` (which ``torch.utils.data.DataLoader`` calls for a whole
    batch) reads and decodes the batch in parallel in Rust with the GIL
    released; in a DataLoader worker process it uses one thread, since the
    workers already run in parallel.

    Fused path: when ``transform`` is a ``Compose`` (``torchvision.transforms``
    or ``transforms.v2``) of ``RandomResizedCrop`` / ``Resize`` [+
    ``CenterCrop``] / ``CenterCrop``, optionally ``RandomHorizontalFlip``,
    then ``ToTensor``, ``PILToTensor`` or ``ToImage`` [+
    ``ConvertImageDtype(float32)`` or ``ToDtype(float32, scale=True)``] and
    optionally ``Normalize``, the whole chain runs in Rust in one pass per
    image: the random parameters are drawn
    from PyTorch's generator with the same torch calls as torchvision's
    ``get_params`` (same seed, same crops and flips), the resize is Pillow's
    bilinear filter computed identically, and JPEGs are decoded at 1/2, 1/4
    or 1/8 scale when the crop is shrunk at least that much. Each record is
    read once. Any other transform runs the PIL path, and a warning (once)
    names the step that prevented fusing. For whole batches without worker
    processes, use :class:`tiacc_training.torch.data.DataLoader`.

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
        output: ``"uint8"`` makes the fused path return uint8 CHW tensors
            (what ``PILToTensor`` gives) instead of converting and
            normalising, for users who normalise on the GPU: a quarter of
            the bytes through worker IPC. Needs a transform the fused path
            supports.
        fused: Use the fused path when the transform allows (default True).
        decode_downscale: Let the fused path decode JPEGs at reduced scale
            (default True); False decodes at full size, the closest to PIL.
        tfrecord_dir: Alias of ``tfrecored_dir``.

    Raises:
        DataFileNotFoundError: The folder, the index or a shard the index
            names does not exist (also a ``FileNotFoundError``; for a shard
            the message names the index line and the shard path).
        DataError: The index is malformed or names a shard that cannot be
            opened.

    Example:
        >>> ds = IndexTFRDataset("train_tfr", "train_tfr/train.index", transform)
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=2)
    """

    def __init__(
        self,
        tfrecored_dir: Optional[str] = None,
        tfrecord_file: Optional[str] = None,
        transform: Optional[Callable[[PILImage], Any]] = None,
        target_transform: Optional[Callable[[int], Any]] = None,
        *,
        decode_threads: Optional[int] = None,
        output: Optional[str] = None,
        fused: bool = True,
        decode_downscale: bool = True,
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
        if output not in (None, "uint8"):
            raise ValueError(f"output must be None or 'uint8', got {output!r}")
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise missing_file(f"tfrecored_dir {self.root!r} is not a directory", self.root)
        self.index_file = _resolve_index(self.root, os.fspath(tfrecord_file))
        if not os.path.isfile(self.index_file):
            raise missing_file(f"index file {self.index_file!r} does not exist", self.index_file)
        self.output = output
        self.fused = fused
        self.decode_downscale = decode_downscale
        self.transform = transform
        self.target_transform = target_transform
        self.decode_threads = decode_threads
        self._data = _engine.IndexedDataset(self.root, self.index_file)
        labels = self._data.labels()
        self.targets: list[int] = labels.tolist()
        self.class_num: int = int(labels.max()) + 1 if len(labels) and labels.max() >= 0 else 0
        self.classes: list[int] = list(range(self.class_num))

    @property
    def transform(self) -> Optional[Callable[[PILImage], Any]]:
        """The image transform; setting it re-plans the fused path."""
        return self._transform

    @transform.setter
    def transform(self, transform: Optional[Callable[[PILImage], Any]]) -> None:
        plan = FusedPlan.from_transform(transform, warn=self.output is None) if self.fused else None
        if self.output == "uint8":
            if plan is None:
                raise ValueError(
                    "output='uint8' needs a transform the fused path supports "
                    f"(see IndexTFRDataset's docstring), got {transform!r}"
                )
            plan.to_float, plan.mean, plan.std = False, None, None
        self._transform = transform
        self._plan = plan

    @property
    def uses_fused_path(self) -> bool:
        """Whether items are produced by the fused Rust path."""
        return self._plan is not None

    def __len__(self) -> int:
        return len(self._data)

    def _index(self, index: Any) -> int:
        i = operator.index(index)
        n = len(self._data)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of range for a dataset of {n} records")
        return i + n if i < 0 else i

    def _item(self, pixels: Any, index: int) -> tuple[Any, Any]:
        from PIL import Image  # optional dependency: only the PIL path needs PIL

        image = Image.fromarray(pixels)  # (H, W, 3) uint8: mode RGB
        if self.transform is not None:
            image = self.transform(image)
        target: Any = self.targets[index]
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        """Returns ``(transform(image), target_transform(label))`` of record ``index``.

        Raises:
            RecordDecodeError: The record's image cannot be decoded (a
                ``DecodeError`` and a ``DataError``; the message and the
                ``path``, ``offset`` and ``index`` attributes locate it).
            CorruptRecordError: The record fails its CRC check, or its
                offset or length field does not fit in the shard.
            DataError: The shard changed (was rewritten, truncated, deleted
                or replaced) after the dataset was opened, or the record is
                not a ``tf.train.Example`` with an image; ``path`` and
                ``offset`` locate it. Shards are read with ``pread``, never
                mapped, so a shard cut short under a reader is an error,
                not a ``SIGBUS``.
        """
        i = self._index(index)
        if self._plan is not None:
            return self._fused([i], threads=1)[0]
        return self._item(self._data.decode(i), i)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """Returns the items of ``indices``, read and decoded in parallel."""
        idx = [self._index(i) for i in indices]
        if not idx:
            return []
        if self._plan is not None:
            return self._fused(idx, self._threads())
        pixels = self._data.decode_batch(idx, self._threads())
        return [self._item(p, i) for p, i in zip(pixels, idx)]

    def _fused(self, idx: list[int], threads: int) -> list[tuple[Any, Any]]:
        images, targets = self._fused_batch(idx, threads)
        return list(zip(images, targets))

    def _fused_batch(
        self,
        idx: list[int],
        threads: int,
        generator: Optional[torch.Generator] = None,
        pin_memory: bool = False,
        uint8: bool = False,
    ) -> tuple[torch.Tensor, list[Any]]:
        """A batch on the fused path: ``(N, 3, H, W)`` images and the targets.

        Args:
            idx: Record numbers (already checked).
            threads: Engine threads (0: all cores, 1: this thread).
            generator: Where the random crops and flips are drawn from
                (default: torch's global generator).
            pin_memory: Allocate the batch in pinned memory.
            uint8: Produce uint8 images even if the transform converts and
                normalises (for conversion on the GPU).
        """
        plan = self._plan
        assert plan is not None
        height, width = plan.output_size
        as_float = plan.to_float and not uint8
        out = torch.empty(
            (len(idx), 3, height, width),
            dtype=torch.float32 if as_float else torch.uint8,
            pin_memory=pin_memory,
        )
        mean, std = (plan.mean, plan.std) if as_float else (None, None)
        flag = reproducible(plan.sampler) if generator is not None else None
        if generator is not None and flag is not None:
            # A generator of the caller's own (a loader thread's): read, draw
            # and render in one call with the GIL released.
            state = generator.get_state()
            self._data.load_batch(
                idx, plan.sampler, state.numpy(), generator, TorchDraws(generator), flag,
                out.numpy(), mean, std, self.decode_downscale, threads,
            )  # fmt: skip
            generator.set_state(state)
        else:
            # One read per record: the sizes, to draw the parameters, come
            # with the bytes that are then rendered.
            images = self._data.read_images(idx, threads)
            geometries = plan.sample(images.sizes, generator)
            self._data.render_images(
                images, geometries, out.numpy(), mean, std, self.decode_downscale, threads
            )
        targets: list[Any] = [self.targets[i] for i in idx]
        if self.target_transform is not None:
            targets = [self.target_transform(t) for t in targets]
        return out, targets

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
        self._data = _engine.IndexedDataset(self.root, self.index_file)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self)} records, {self.class_num} classes, "
            f"index={self.index_file!r}, transform={self.transform!r})"
        )


__all__ = ["IndexedDataset"]

"""TFRecord files and ``tf.train.Example`` records.

The framing is TensorFlow's: each record is a little-endian u64 length, the
masked CRC32C of those 8 bytes, the payload, and the masked CRC32C of the
payload. Files written here are read by TensorFlow and other TFRecord
readers, and theirs are read here. Every read verifies both CRCs unless told
not to, and a length field is checked against the file size before anything
is allocated.

Example:
    >>> from tiacc_training import tfrecord
    >>> with tfrecord.TFRecordWriter("data.tfrecord") as w:
    ...     offset = w.write_example({"label": 3, "image": b"..."})
    >>> tfrecord.read_example("data.tfrecord", offset)["label"]
    [3]

Feature values are bytes/str (``BytesList``), ints (``Int64List``) or floats
(``FloatList``), alone, in a list or tuple, or as a numpy array. Decoded
Examples are dicts ``{name: list[bytes] | list[int] | list[float]}``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional, Union

from tiacc_training import _engine

PathLike = Union[str, "os.PathLike[str]"]
Features = Mapping[str, Any]

crc32c = _engine.crc32c
masked_crc32c = _engine.masked_crc32c
frame_record = _engine.frame_record


def encode_example(features: Features) -> bytes:
    """Serializes ``features`` as a ``tf.train.Example``.

    Args:
        features: Mapping from feature name to value(s).

    Returns:
        The serialized Example (feature names sorted, so equal inputs give
        equal bytes).

    Raises:
        TypeError: A value has an unsupported type or a list mixes kinds.
        ValueError: A list is empty (its kind is unknown) or an int does not
            fit in int64.
    """
    return _engine.encode_example(dict(features))


def decode_example(payload: bytes) -> dict[str, list[Any]]:
    """Parses a serialized ``tf.train.Example``.

    Args:
        payload: The record payload.

    Returns:
        ``{name: list}`` with bytes, int or float elements.

    Raises:
        DataError: The payload is not a valid Example.
    """
    return _engine.decode_example(payload)


class TFRecordReader:
    """Random-access and sequential reader of one TFRecord file.

    Args:
        path: The TFRecord file.
        verify: Check both CRCs of every record read (default True).

    Raises:
        DataError: The file cannot be opened.
    """

    def __init__(self, path: PathLike, verify: bool = True) -> None:
        self._reader = _engine.RecordReader(os.fspath(path), verify)

    @property
    def path(self) -> str:
        """The file path."""
        return os.fspath(self._reader.path)

    @property
    def size(self) -> int:
        """The file size in bytes."""
        return self._reader.size

    def read(self, offset: int) -> bytes:
        """Returns the payload of the record whose header starts at ``offset``.

        Raises:
            CorruptRecordError: No valid record starts at ``offset`` (with the
                path and offset as attributes).
        """
        return self._reader.read(_offset(offset))

    def read_example(self, offset: int) -> dict[str, list[Any]]:
        """Returns the record at ``offset`` decoded as an Example dict."""
        return self._reader.read_example(_offset(offset))

    def scan(self, start: int = 0) -> Iterator[tuple[int, bytes]]:
        """Yields ``(offset, payload)`` for every record from ``start`` on."""
        return self._reader.scan(_offset(start))

    def __iter__(self) -> Iterator[bytes]:
        for _, payload in self.scan():
            yield payload


class TFRecordWriter:
    """Writes one TFRecord file, atomically.

    Records go to a hidden temporary file beside ``path``; :meth:`close`
    fsyncs it and renames it into place. Leaving a ``with`` block by an
    exception discards the file instead, so a partial file never appears at
    ``path``.

    Args:
        path: The file to create (replaced if it exists).
    """

    def __init__(self, path: PathLike) -> None:
        self._writer = _engine.RecordWriter(os.fspath(path))

    def write(self, payload: bytes) -> int:
        """Appends a raw record payload; returns its offset."""
        return self._writer.write(payload)

    def write_example(self, features: Features) -> int:
        """Appends ``features`` as a ``tf.train.Example``; returns its offset."""
        return self._writer.write_example(dict(features))

    def close(self) -> list[tuple[int, int]]:
        """Publishes the file; returns ``(offset, framed_size)`` per record."""
        return self._writer.close()

    def abort(self) -> None:
        """Discards everything written; nothing appears at ``path``."""
        self._writer.abort()

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class ShardedWriter:
    """Writes a dataset of fixed-size shards plus its indexes.

    Produces ``NAME-00000.tfrecord``, ... with a DALI ``.idx`` beside each,
    and ``NAME.index`` (``shard_file  shard_idx  offset  label`` per line) in
    ``out_dir``. Everything is written to a hidden staging directory and
    published by :meth:`finish`, the index last: a dataset without its index
    is incomplete.

    Args:
        out_dir: Output directory (created if needed).
        name: Dataset name, used in the file names.
        records_per_shard: Records in each shard but the last.
    """

    def __init__(self, out_dir: PathLike, name: str, records_per_shard: int = 1024) -> None:
        if records_per_shard < 1:
            raise ValueError(f"records_per_shard must be >= 1, got {records_per_shard}")
        self._writer = _engine.ShardedWriter(os.fspath(out_dir), name, records_per_shard)

    def write(self, payload: bytes, label: int = -1) -> tuple[int, int]:
        """Appends a payload; returns ``(shard_idx, offset)``."""
        return self._writer.write(payload, label)

    def write_example(self, features: Features, label: int = -1) -> tuple[int, int]:
        """Appends ``features`` as an Example; returns ``(shard_idx, offset)``."""
        return self._writer.write(encode_example(features), label)

    def finish(self) -> dict[str, Any]:
        """Publishes the dataset and returns a summary dict."""
        return self._writer.finish()

    def abort(self) -> None:
        """Discards everything written."""
        self._writer.abort()

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()


def read_record(path: PathLike, offset: int, verify: bool = True) -> bytes:
    """Returns the payload of the record at ``offset`` in ``path``."""
    return TFRecordReader(path, verify).read(offset)


def read_example(path: PathLike, offset: int, verify: bool = True) -> dict[str, list[Any]]:
    """Returns the Example at ``offset`` in ``path`` as a dict."""
    return TFRecordReader(path, verify).read_example(offset)


def iter_records(path: PathLike, verify: bool = True) -> Iterator[bytes]:
    """Yields every record payload of ``path`` in order."""
    return iter(TFRecordReader(path, verify))


def iter_examples(path: PathLike, verify: bool = True) -> Iterator[dict[str, list[Any]]]:
    """Yields every record of ``path`` decoded as an Example dict."""
    for payload in iter_records(path, verify):
        yield decode_example(payload)


def read_index(path: PathLike) -> list[tuple[str, int, int, int]]:
    """Reads a dataset index: ``(shard_file, shard_idx, offset, label)`` per line.

    Raises:
        DataError: A line is malformed (the message names the line).
    """
    return _engine.read_index(os.fspath(path))


def verify_shard(path: PathLike, check_examples: bool = True) -> tuple[int, int]:
    """Checks every record of a shard; returns ``(records, bytes)``.

    Raises:
        CorruptRecordError: The first bad record, with path and offset.
        DataError: A payload is not an Example (with ``check_examples``).
    """
    return _engine.verify_shard(os.fspath(path), check_examples)


def verify_index(
    path: PathLike,
    check_examples: bool = True,
    progress: Optional[Callable[[int], Any]] = None,
) -> dict[str, int]:
    """Checks an index against its shards and every record they hold.

    Args:
        path: The dataset index.
        check_examples: Also parse every payload as a ``tf.train.Example``.
        progress: Called with each shard's size in bytes once it is verified
            (shards are verified in parallel, in no particular order); an
            exception it raises is raised when the verification ends.

    Returns:
        ``{"entries", "shards", "records", "bytes"}``.

    Raises:
        DataError: A malformed line, a missing shard, or an offset that is not
            a record boundary (the message names the index line).
        CorruptRecordError: A bad record in a shard.
    """
    return _engine.verify_index(os.fspath(path), check_examples, progress)


def _offset(offset: int) -> int:
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    return offset


__all__ = [
    "ShardedWriter",
    "TFRecordReader",
    "TFRecordWriter",
    "crc32c",
    "decode_example",
    "encode_example",
    "frame_record",
    "iter_examples",
    "iter_records",
    "masked_crc32c",
    "read_example",
    "read_index",
    "read_record",
    "verify_index",
    "verify_shard",
]

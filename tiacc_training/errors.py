"""Exceptions raised by tiacc-training.

Every error from the engine derives from :class:`TiaccError`, itself a
``RuntimeError``; a missing or forbidden file is also the built-in
``OSError`` subclass Python code expects, so ``except FileNotFoundError``
and ``except PermissionError`` catch it::

    TiaccError (RuntimeError)
    ├── ConfigError            bad argument or environment variable value
    ├── CommError              a collective failed
    │   └── CommTimeoutError   a peer did not answer in time
    ├── DataError              a shard, index or list is unreadable or invalid,
    │   │                      or a shard changed after it was opened (.path, .offset)
    │   ├── CorruptRecordError     bad TFRecord framing or CRC (.path, .offset)
    │   ├── DataFileNotFoundError  also a FileNotFoundError (.path, .filename)
    │   ├── DataPermissionError    also a PermissionError (.path, .filename)
    │   └── RecordDecodeError      a record's image is not decodable (.path,
    │                              .offset, .index); also a DecodeError
    └── DecodeError            a file is not a readable image (.path)
        └── RecordDecodeError

Mistakes in arguments raise ``ValueError`` or ``TypeError`` before any work.
"""

from __future__ import annotations

import errno
import os

from tiacc_training._engine import (
    CommError,
    CommTimeoutError,
    ConfigError,
    CorruptRecordError,
    DataError,
    DataFileNotFoundError,
    DataPermissionError,
    DecodeError,
    RecordDecodeError,
    TiaccError,
)


def missing_file(message: str, path: str | os.PathLike[str]) -> DataFileNotFoundError:
    """A :class:`DataFileNotFoundError` for ``path``, as the engine builds them.

    Args:
        message: The whole message (it should name ``path``).
        path: The file or folder that does not exist.

    Returns:
        The exception, with ``path``, ``filename``, ``errno`` and ``strerror`` set.
    """
    exc = DataFileNotFoundError(message)
    exc.path = exc.filename = os.fspath(path)
    exc.errno, exc.strerror = errno.ENOENT, os.strerror(errno.ENOENT)
    return exc


__all__ = [
    "CommError",
    "CommTimeoutError",
    "ConfigError",
    "CorruptRecordError",
    "DataError",
    "DataFileNotFoundError",
    "DataPermissionError",
    "DecodeError",
    "RecordDecodeError",
    "TiaccError",
]

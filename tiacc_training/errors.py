"""Exceptions raised by tiacc-training.

Every error from the engine derives from :class:`TiaccError`, itself a
``RuntimeError``::

    TiaccError
    ├── ConfigError          bad argument or environment variable value
    ├── CommError            a collective failed
    │   └── CommTimeoutError a peer did not answer in time
    ├── DataError            a shard, index or list is unreadable or invalid
    │   └── CorruptRecordError  bad TFRecord framing or CRC (has .path, .offset)
    └── DecodeError          a file is not a readable image (has .path)

Mistakes in arguments raise ``ValueError`` or ``TypeError`` before any work.
"""

from tiacc_training._engine import (
    CommError,
    CommTimeoutError,
    ConfigError,
    CorruptRecordError,
    DataError,
    DecodeError,
    TiaccError,
)

__all__ = [
    "CommError",
    "CommTimeoutError",
    "ConfigError",
    "CorruptRecordError",
    "DataError",
    "DecodeError",
    "TiaccError",
]

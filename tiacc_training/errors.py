"""Exceptions raised by tiacc-training.

Every error from the engine derives from :class:`TiaccError`, itself a
``RuntimeError``::

    TiaccError
    ├── ConfigError          bad argument or environment variable value
    ├── CommError            a collective failed
    │   └── CommTimeoutError a peer did not answer in time
    ├── DataError            a shard, index or list is unreadable or invalid,
    │   │                    or a shard changed after it was opened (.path, .offset)
    │   ├── CorruptRecordError  bad TFRecord framing or CRC (has .path, .offset)
    │   └── RecordDecodeError   a record's image is not decodable (.path, .offset,
    │                           .index); also a DecodeError
    └── DecodeError          a file is not a readable image (has .path)
        └── RecordDecodeError

Mistakes in arguments raise ``ValueError`` or ``TypeError`` before any work.
"""

from tiacc_training._engine import (
    CommError,
    CommTimeoutError,
    ConfigError,
    CorruptRecordError,
    DataError,
    DecodeError,
    RecordDecodeError,
    TiaccError,
)

__all__ = [
    "CommError",
    "CommTimeoutError",
    "ConfigError",
    "CorruptRecordError",
    "DataError",
    "DecodeError",
    "RecordDecodeError",
    "TiaccError",
]

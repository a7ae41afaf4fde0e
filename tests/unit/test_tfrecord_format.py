"""Record framing, CRCs and tf.train.Example encoding against known values."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from tiacc_training import tfrecord
from tiacc_training.errors import DataError, TiaccError


def py_crc32c(data: bytes) -> int:
    """Bitwise reference CRC32C (Castagnoli, reflected 0x82F63B78)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def py_mask(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def test_crc32c_check_value_is_castagnoli_not_zlib():
    assert tfrecord.crc32c(b"123456789") == 0xE3069283
    assert tfrecord.crc32c(b"123456789") != 0xCBF43926  # zlib's CRC-32


@pytest.mark.parametrize("data", [b"", b"a", b"hello world" * 37, bytes(range(256))])
def test_crc_matches_reference(data):
    assert tfrecord.crc32c(data) == py_crc32c(data)
    assert tfrecord.masked_crc32c(data) == py_mask(py_crc32c(data))


def test_frame_layout():
    payload = b"payload bytes"
    framed = tfrecord.frame_record(payload)
    length = struct.pack("<Q", len(payload))
    expected = (
        length
        + struct.pack("<I", py_mask(py_crc32c(length)))
        + payload
        + struct.pack("<I", py_mask(py_crc32c(payload)))
    )
    assert framed == expected


def test_example_roundtrip_types():
    features = {
        "bytes": [b"a", b"bc"],
        "str": "text",
        "int": 7,
        "ints": (1, -2, 2**62),
        "bool": True,
        "float": 0.5,
        "mixed_numbers": [1, 2.5],
        "np_int": np.array([[1, 2], [3, 4]], dtype=np.int32),
        "np_float": np.array([0.25, 1.5], dtype=np.float64),
        "np_empty_int": np.array([], dtype=np.int64),
        "np_empty_bytes": np.array([], dtype=object),
        "np_scalar": np.int16(9),
    }
    decoded = tfrecord.decode_example(tfrecord.encode_example(features))
    assert decoded == {
        "bytes": [b"a", b"bc"],
        "str": [b"text"],
        "int": [7],
        "ints": [1, -2, 2**62],
        "bool": [1],
        "float": [0.5],
        "mixed_numbers": [1.0, 2.5],
        "np_int": [1, 2, 3, 4],
        "np_float": [0.25, 1.5],
        "np_empty_int": [],
        "np_empty_bytes": [],
        "np_scalar": [9],
    }


def test_encoding_is_deterministic():
    a = tfrecord.encode_example({"b": 1, "a": [b"x"]})
    b = tfrecord.encode_example({"a": [b"x"], "b": 1})
    assert a == b


def test_unpacked_repeated_fields_are_accepted():
    # Example{features{feature{"x": Feature{int64_list{value: 1 value: 2}}}}} with the
    # Int64List written unpacked (two varint fields) instead of packed.
    int64_list = bytes([0x08, 0x01, 0x08, 0x02])
    feature = bytes([0x1A, len(int64_list)]) + int64_list
    entry = bytes([0x0A, 0x01]) + b"x" + bytes([0x12, len(feature)]) + feature
    features = bytes([0x0A, len(entry)]) + entry
    example = bytes([0x0A, len(features)]) + features
    assert tfrecord.decode_example(example) == {"x": [1, 2]}


@pytest.mark.parametrize(
    ("features", "exc", "match"),
    [
        ({"e": []}, ValueError, '"e".*empty list'),
        ({"m": [b"a", 1]}, TypeError, "mixes"),
        ({"o": object()}, TypeError, '"o".*unsupported'),
        ({"big": 2**70}, ValueError, "int64"),
        ({1: b"x"}, TypeError, "not a str"),
    ],
)
def test_bad_feature_values(features, exc, match):
    with pytest.raises(exc, match=match):
        tfrecord.encode_example(features)


@pytest.mark.parametrize(
    "payload",
    [
        b"\x0a\x05\x01",  # length runs past the end
        b"\x0a\x02\x0a\x10",  # nested length overflow
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # varint too long
        b"\x0b",  # start-group wire type with no end
    ],
)
def test_malformed_example_raises_data_error(payload):
    with pytest.raises(DataError, match="malformed tf.train.Example"):
        tfrecord.decode_example(payload)


def test_exception_hierarchy():
    from tiacc_training import errors

    assert issubclass(errors.TiaccError, RuntimeError)
    assert issubclass(errors.DataError, TiaccError)
    assert issubclass(errors.CorruptRecordError, errors.DataError)
    assert issubclass(errors.DecodeError, TiaccError)
    assert issubclass(errors.ConfigError, TiaccError)
    assert issubclass(errors.CommTimeoutError, errors.CommError)
    assert errors.CorruptRecordError.__module__ == "tiacc_training.errors"
    # A record whose image does not decode is both (catchable as either).
    assert issubclass(errors.RecordDecodeError, errors.DecodeError)
    assert issubclass(errors.RecordDecodeError, errors.DataError)
    assert errors.RecordDecodeError.__module__ == "tiacc_training.errors"

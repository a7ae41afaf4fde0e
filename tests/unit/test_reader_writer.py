"""Reading and writing TFRecord files, and every way a shard can be bad."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from tiacc_training import tfrecord
from tiacc_training.errors import CorruptRecordError, DataError


def write_shard(path: Path, payloads: list[bytes]) -> list[int]:
    with tfrecord.TFRecordWriter(path) as w:
        return [w.write(p) for p in payloads]


def test_roundtrip_random_access_and_scan(tmp_path):
    path = tmp_path / "a.tfrecord"
    payloads = [b"first", b"", b"x" * 100_000, b"last"]
    offsets = write_shard(path, payloads)
    assert offsets == [0, 21, 37, 100_053]
    reader = tfrecord.TFRecordReader(path)
    assert reader.size == os.path.getsize(path)
    for offset, payload in zip(offsets, payloads):
        assert reader.read(offset) == payload
    assert list(reader.scan()) == list(zip(offsets, payloads))
    assert list(reader.scan(start=offsets[2])) == list(zip(offsets[2:], payloads[2:]))
    assert list(tfrecord.iter_records(path)) == payloads


def test_writer_publishes_only_on_close(tmp_path):
    path = tmp_path / "w.tfrecord"
    w = tfrecord.TFRecordWriter(path)
    w.write_example({"k": 1})
    assert not path.exists()
    assert w.close() == [(0, os.path.getsize(path))]
    assert list(tfrecord.iter_examples(path)) == [{"k": [1]}]
    with pytest.raises(ValueError, match="already closed"):
        w.write(b"more")


def test_writer_context_discards_on_exception(tmp_path):
    path = tmp_path / "w.tfrecord"
    with pytest.raises(RuntimeError, match="boom"):
        with tfrecord.TFRecordWriter(path) as w:
            w.write(b"data")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def corrupt(path: Path, offset: int, xor: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= xor
    path.write_bytes(bytes(data))


@pytest.fixture
def shard(tmp_path) -> tuple[Path, list[int]]:
    path = tmp_path / "s.tfrecord"
    return path, write_shard(path, [b"alpha", b"bravo" * 10, b"charlie"])


def test_length_crc_mismatch(shard):
    path, offsets = shard
    corrupt(path, offsets[1] + 2)  # inside the length field
    with pytest.raises(CorruptRecordError, match="length CRC mismatch") as info:
        tfrecord.read_record(path, offsets[1])
    assert info.value.path == str(path)
    assert info.value.offset == offsets[1]
    assert f"offset {offsets[1]}" in str(info.value) and str(path) in str(info.value)


def test_length_crc_field_itself_corrupt(shard):
    path, offsets = shard
    corrupt(path, offsets[0] + 9)  # inside the stored CRC of the length
    with pytest.raises(CorruptRecordError, match="length CRC mismatch"):
        tfrecord.read_record(path, 0)


def test_payload_crc_mismatch(shard):
    path, offsets = shard
    corrupt(path, offsets[2] + 12 + 3)
    with pytest.raises(CorruptRecordError, match="payload CRC mismatch") as info:
        tfrecord.read_record(path, offsets[2])
    assert info.value.offset == offsets[2]
    # Scanning stops at the same record, after yielding the good ones.
    it = tfrecord.TFRecordReader(path).scan()
    assert next(it)[0] == 0 and next(it)[0] == offsets[1]
    with pytest.raises(CorruptRecordError):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_no_verify_reads_corrupt_payload(shard):
    path, offsets = shard
    corrupt(path, offsets[0] + 12)
    assert tfrecord.read_record(path, 0, verify=False) == bytes([ord("a") ^ 1]) + b"lpha"


def test_truncated_mid_record(shard):
    path, offsets = shard
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    with pytest.raises(CorruptRecordError, match="truncated or corrupt") as info:
        list(tfrecord.iter_records(path))
    assert info.value.offset == offsets[2]


def test_truncated_header(shard):
    path, offsets = shard
    path.write_bytes(path.read_bytes()[: offsets[2] + 7])
    with pytest.raises(CorruptRecordError, match="truncated header") as info:
        tfrecord.verify_shard(path, check_examples=False)
    assert info.value.offset == offsets[2]


def test_length_larger_than_file_is_rejected_before_allocation(tmp_path):
    path = tmp_path / "huge.tfrecord"
    length = struct.pack("<Q", 1 << 50)  # a petabyte: allocating it would fail loudly
    crc = struct.pack("<I", tfrecord.masked_crc32c(length))
    path.write_bytes(length + crc + b"tiny")
    with pytest.raises(CorruptRecordError, match="1125899906842624 payload bytes"):
        tfrecord.read_record(path, 0)


def test_offset_past_end_and_bad_offsets(shard):
    path, _ = shard
    size = os.path.getsize(path)
    with pytest.raises(CorruptRecordError, match="past the end"):
        tfrecord.read_record(path, size + 10)
    with pytest.raises(ValueError, match=">= 0"):
        tfrecord.read_record(path, -1)
    with pytest.raises(TypeError, match="int"):
        tfrecord.read_record(path, 1.5)


def test_missing_file_names_path(tmp_path):
    missing = tmp_path / "nope.tfrecord"
    with pytest.raises(DataError, match="nope.tfrecord"):
        tfrecord.TFRecordReader(missing)


def test_malformed_example_in_file_names_location(tmp_path):
    path = tmp_path / "m.tfrecord"
    write_shard(path, [tfrecord.encode_example({"a": 1}), b"\x0a\x05\x01"])
    with pytest.raises(DataError, match=r"m\.tfrecord at offset \d+"):
        tfrecord.TFRecordReader(path).read_example(os.path.getsize(path) - 19)
    with pytest.raises(DataError, match="malformed"):
        tfrecord.verify_shard(path)
    assert tfrecord.verify_shard(path, check_examples=False)[0] == 2


def test_sharded_writer(tmp_path):
    out = tmp_path / "out"
    with tfrecord.ShardedWriter(out, "ds", records_per_shard=2) as w:
        locations = [w.write_example({"i": i}, label=i % 3) for i in range(5)]
    assert [shard for shard, _ in locations] == [0, 0, 1, 1, 2]
    index = tfrecord.read_index(out / "ds.index")
    assert [(e[0], e[1], e[3]) for e in index] == [
        ("ds-00000.tfrecord", 0, 0),
        ("ds-00000.tfrecord", 0, 1),
        ("ds-00001.tfrecord", 1, 2),
        ("ds-00001.tfrecord", 1, 0),
        ("ds-00002.tfrecord", 2, 1),
    ]
    for i, (shard_file, _, offset, _) in enumerate(index):
        assert tfrecord.read_example(out / shard_file, offset) == {"i": [i]}
    assert tfrecord.verify_index(out / "ds.index")["records"] == 5
    with pytest.raises(ValueError, match="records_per_shard"):
        tfrecord.ShardedWriter(out, "x", records_per_shard=0)
    with pytest.raises(ValueError, match="dataset name"):
        tfrecord.ShardedWriter(out, "a/b")


def test_sharded_writer_abort_leaves_nothing(tmp_path):
    with pytest.raises(KeyError):
        with tfrecord.ShardedWriter(tmp_path, "ds", 1) as w:
            w.write(b"x")
            raise KeyError("stop")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("ds-00000.tfrecord\t0\t0", "4 tab-separated columns"),
        ("ds-00000.tfrecord\t0\tzero\t1", "offset is not an integer"),
        ("ds-00000.tfrecord\t0\t-4\t1", "offset out of range"),
        ("ds-00000.tfrecord\tx\t0\t1", "shard_idx is not an integer"),
    ],
)
def test_malformed_index_line_names_line(tmp_path, line, match):
    index = tmp_path / "bad.index"
    index.write_text(f"ds-00000.tfrecord\t0\t0\t1\n{line}\n")
    with pytest.raises(DataError, match=match) as info:
        tfrecord.read_index(index)
    assert "bad.index:2:" in str(info.value)
    assert info.value.line == 2

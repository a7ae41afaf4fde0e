"""tfrecord_verify: exit status and the first problem with its file and offset."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_tool
from tiacc_training import tfrecord


@pytest.fixture
def dataset(tmp_path) -> Path:
    out = tmp_path / "ds"
    with tfrecord.ShardedWriter(out, "ds", records_per_shard=4) as w:
        for i in range(10):
            w.write_example({"image/encoded": bytes([i]) * (100 + i), "label": i}, label=i)
    return out


def verify(path: Path, *extra: str):
    return run_tool("tfrecord_verify", str(path), *extra)


def assert_rejected(path: Path, *problems: str) -> None:
    """``tfrecord_verify path`` exits 1 and its standard error names each of ``problems``."""
    result = verify(path)
    assert result.returncode == 1, result.stderr
    for problem in problems:
        assert problem in result.stderr, result.stderr


def test_good_dataset_directory_index_and_shard(dataset):
    for target in [dataset, dataset / "ds.index", dataset / "ds-00001.tfrecord"]:
        result = verify(target)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("OK: ")
    assert "10 records in 3 shards" in verify(dataset).stdout


def test_payload_corruption_reports_shard_and_offset(dataset):
    shard = dataset / "ds-00001.tfrecord"
    offsets = [o for f, _, o, _ in tfrecord.read_index(dataset / "ds.index") if f == shard.name]
    data = bytearray(shard.read_bytes())
    data[offsets[2] + 20] ^= 0xFF
    shard.write_bytes(bytes(data))
    for target in [dataset, dataset / "ds.index", shard]:
        assert_rejected(
            target, f"{shard}: corrupt record at offset {offsets[2]}: payload CRC mismatch"
        )


def test_truncated_shard(dataset):
    shard = dataset / "ds-00002.tfrecord"
    shard.write_bytes(shard.read_bytes()[:-3])
    assert_rejected(dataset, "ds-00002.tfrecord: corrupt record at offset")


def test_index_line_not_at_record_boundary(dataset):
    index = dataset / "ds.index"
    lines = index.read_text().splitlines()
    name, shard, offset, label = lines[5].split("\t")
    lines[5] = "\t".join([name, shard, str(int(offset) + 3), label])
    index.write_text("\n".join(lines) + "\n")
    assert_rejected(index, "ds.index:6:", "not a record boundary")


def test_index_line_past_end_of_shard(dataset):
    index = dataset / "ds.index"
    index.write_text(index.read_text() + "ds-00000.tfrecord\t0\t999999\t0\n")
    assert_rejected(index, "ds.index:11:", "past the end")


def test_malformed_index_line(dataset):
    index = dataset / "ds.index"
    index.write_text(index.read_text() + "garbage line\n")
    assert_rejected(dataset, "ds.index:11:")


def test_bad_dali_idx(dataset):
    (dataset / "ds-00000.tfrecord.idx").write_text("0 5\n")
    assert_rejected(dataset / "ds-00000.tfrecord", "ds-00000.tfrecord.idx:1:")


def test_malformed_example_and_opt_out(tmp_path):
    path = tmp_path / "raw.tfrecord"
    with tfrecord.TFRecordWriter(path) as w:
        w.write(b"\x0a\x05\x01")
    assert_rejected(path, "malformed tf.train.Example")
    assert verify(path, "--no-check-examples").returncode == 0


def test_missing_path_is_a_usage_error(tmp_path):
    result = verify(tmp_path / "nope")
    assert result.returncode == 2 and "does not exist" in result.stderr
    (tmp_path / "empty").mkdir()
    result = verify(tmp_path / "empty")
    assert result.returncode == 2 and "holds no .index or .tfrecord files" in result.stderr


class RecordingBar:
    def __init__(self, total, desc, unit="img", unit_scale=False):
        self.total, self.unit, self.done, self.closed = total, unit, 0, False
        BARS.append(self)

    def update(self, n=1):
        self.done += n

    def close(self):
        self.closed = True


BARS: list[RecordingBar] = []


def test_progress_bar_counts_every_byte_for_large_datasets(dataset, tmp_path, monkeypatch):
    from tiacc_training.tools import tfrecord_verify as tool

    # one standalone shard next to the index, so both ways of counting are used
    with tfrecord.TFRecordWriter(dataset / "extra.tfrecord") as w:
        w.write_example({"x": 1})
    monkeypatch.setattr(tool, "progress", RecordingBar)
    BARS.clear()
    monkeypatch.setattr(tool, "PROGRESS_BYTES", 1 << 40)
    tool.verify(str(dataset), show_progress=True)
    assert BARS == []  # small: no bar
    monkeypatch.setattr(tool, "PROGRESS_BYTES", 1)
    totals = tool.verify(str(dataset), show_progress=True)
    [bar] = BARS
    expected = sum(p.stat().st_size for p in dataset.glob("*.tfrecord"))
    assert bar.unit == "B" and bar.total == bar.done == totals["bytes"] == expected
    assert bar.closed
    BARS.clear()
    tool.verify(str(dataset), show_progress=False)
    assert BARS == []


def test_a_progress_callback_that_raises_fails_the_verification(dataset):
    def boom(_: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tfrecord.verify_index(dataset / "ds.index", progress=boom)
    seen: list[int] = []
    report = tfrecord.verify_index(dataset / "ds.index", progress=seen.append)
    assert len(seen) == report["shards"] == 3 and sum(seen) == report["bytes"]

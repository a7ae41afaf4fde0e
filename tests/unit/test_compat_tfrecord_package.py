"""Cross-check with an independent TFRecord implementation (the `tfrecord` package)."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

from tiacc_training import tfrecord as ours


def _their_round_trip() -> None:
    """Writes and reads one record with the package alone: some installs
    import but cannot run (tfrecord 1.14 on protobuf 7's pure-Python
    implementation raises TypeError inside its writer)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.tfrecord")
        writer = theirs_writer.TFRecordWriter(path)
        writer.write({"label": (1, "int")})
        writer.close()
        (record,) = list(theirs_reader.tfrecord_loader(path, None))
        assert list(record["label"]) == [1], record


# A broken install fails with other errors than ImportError (tfrecord 1.14 with
# protobuf 7 raises TypeError), which `pytest.importorskip` would let through.
try:
    import tfrecord.reader as theirs_reader
    import tfrecord.tools.tfrecord2idx as theirs_idx
    import tfrecord.writer as theirs_writer

    _their_round_trip()
except Exception as exc:  # the package cannot run here: nothing to cross-check with
    pytest.skip(
        f"the tfrecord package does not work here: {type(exc).__name__}: {exc}",
        allow_module_level=True,
    )


def as_lists(example: dict) -> dict:
    """The `tfrecord` package's decoded values as our plain lists."""
    out = {}
    for key, value in example.items():
        if isinstance(value, bytes):
            out[key] = [value]
        elif value.dtype.kind in "SO":
            out[key] = [bytes(v) for v in value]
        else:
            out[key] = value.tolist()
    return out


def test_shards_we_write_are_read_by_them(image_folder, tmp_path):
    from tiacc_training.tools import general_image_list, img2tfrecord

    img_list = tmp_path / "list.txt"
    general_image_list.main(["--img_dir", str(image_folder), "--img_list", str(img_list)])
    items = img2tfrecord.read_image_list(str(image_folder), str(img_list))
    img2tfrecord.pack(items, str(tmp_path / "out"), "ds", records_per_shard=7, show_progress=False)
    index = ours.read_index(tmp_path / "out" / "ds.index")
    theirs = []
    for shard in sorted((tmp_path / "out").glob("ds-*.tfrecord")):
        theirs.extend(as_lists(ex) for ex in theirs_reader.tfrecord_loader(str(shard), None))
        # Their index tool computes the same `offset size` lines as our .idx files.
        idx = tmp_path / "theirs.idx"
        theirs_idx.create_index(str(shard), str(idx))
        assert idx.read_text() == shard.with_name(shard.name + ".idx").read_text()
    mine = [ours.read_example(tmp_path / "out" / f, o) for f, _, o, _ in index]
    assert len(theirs) == len(mine) == 18
    assert theirs == mine


def test_shards_they_write_are_read_by_us_with_crcs_verified(tmp_path):
    path = tmp_path / "theirs.tfrecord"
    writer = theirs_writer.TFRecordWriter(str(path))
    rng = np.random.default_rng(1)
    expected = []
    for i in range(25):
        blob = rng.integers(0, 256, int(rng.integers(0, 5000)), dtype=np.uint8).tobytes()
        floats = rng.standard_normal(int(rng.integers(1, 6))).astype(np.float32)
        writer.write(
            {
                "blob": (blob, "byte"),
                "label": (i, "int"),
                "ints": ([i, -i, 2**40], "int"),
                "floats": (floats.tolist(), "float"),
            }
        )
        expected.append(
            {"blob": [blob], "label": [i], "ints": [i, -i, 2**40], "floats": floats.tolist()}
        )
    writer.close()
    records, size = ours.verify_shard(path)
    assert (records, size) == (25, path.stat().st_size)
    assert list(ours.iter_examples(path, verify=True)) == expected

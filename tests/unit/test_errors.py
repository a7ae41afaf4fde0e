"""The exception hierarchy: data errors are also the OS errors Python code expects."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
from conftest import REPO, pack_folder, write_image

from tiacc_training import errors, tfrecord
from tiacc_training.errors import DataError, DataFileNotFoundError, DataPermissionError
from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset


@pytest.fixture
def packed(tmp_path):
    for i in range(6):
        write_image(tmp_path / "imgs" / f"c{i % 2}" / f"{i}.jpg", 12, 10, i)
    return pack_folder(tmp_path, records_per_shard=2)  # 3 shards


def test_the_hierarchy():
    assert issubclass(DataFileNotFoundError, DataError)
    assert issubclass(DataFileNotFoundError, FileNotFoundError)
    assert issubclass(DataPermissionError, DataError)
    assert issubclass(DataPermissionError, PermissionError)
    assert issubclass(DataError, errors.TiaccError) and issubclass(DataError, RuntimeError)
    assert not issubclass(DataError, OSError)
    assert DataFileNotFoundError.__module__ == "tiacc_training.errors"


def test_a_missing_shard_is_a_file_not_found_error(tmp_path):
    path = tmp_path / "nope.tfrecord"
    with pytest.raises(FileNotFoundError) as info:
        tfrecord.TFRecordReader(str(path))
    exc = info.value
    assert isinstance(exc, DataError) and type(exc) is DataFileNotFoundError
    assert exc.path == exc.filename == str(path) and exc.errno == errno.ENOENT
    # the engine's message, not OSError's "[Errno 2] ..." rendering
    assert str(exc).startswith(str(path)) and "[Errno" not in str(exc)


def test_a_missing_index_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        tfrecord.verify_index(str(tmp_path / "ds.index"))
    assert isinstance(info.value, DataError)
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        IndexTFRDataset(str(tmp_path), "ds.index")
    assert isinstance(info.value, DataError) and info.value.filename.endswith("ds.index")
    with pytest.raises(DataFileNotFoundError, match="not a directory"):
        IndexTFRDataset(str(tmp_path / "absent"), "ds.index")


def test_an_index_naming_a_missing_shard(packed):
    shard = packed.parent / "ds-00001.tfrecord"
    shard.unlink()
    with pytest.raises(FileNotFoundError) as info:
        IndexTFRDataset(str(packed.parent), str(packed))
    exc = info.value
    assert isinstance(exc, DataError)
    # .path and .line locate the index line, .shard and .filename name the missing file
    assert exc.path == str(packed) and exc.line == 3
    assert exc.shard == exc.filename == str(shard)
    assert f"{packed}:3:" in str(exc)
    with pytest.raises(DataFileNotFoundError, match="does not exist"):
        tfrecord.verify_index(str(packed))


def test_other_data_errors_stay_plain_data_errors(packed):
    packed.write_text("not an index line\n")
    with pytest.raises(DataError) as info:
        IndexTFRDataset(str(packed.parent), str(packed))
    assert not isinstance(info.value, OSError)


UNREADABLE_CHECKS = """
import errno, sys
from tiacc_training import tfrecord
from tiacc_training.errors import DataPermissionError
from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset

shard, index = sys.argv[1], sys.argv[2]
try:
    tfrecord.TFRecordReader(shard)
except PermissionError as e:
    assert type(e) is DataPermissionError and e.errno == errno.EACCES, repr(e)
    assert shard in str(e), str(e)
else:
    raise AssertionError("reading a shard of mode 000 did not raise")
try:
    IndexTFRDataset(str(__import__("pathlib").Path(index).parent), index)
except PermissionError:
    pass
else:
    raise AssertionError("a dataset over a shard of mode 000 did not raise")
print("ok")
"""


def test_an_unreadable_shard_is_a_permission_error(packed):
    """Checked in a child; as root, one in a user namespace of its own.

    Root reads files of any mode through its capabilities; a process in a
    new user namespace has none over the files of the machine's root, so
    the mode decides for it as for any user (its own uid still owns the
    interpreter and the repository).
    """
    shard = packed.parent / "ds-00000.tfrecord"
    prefix = []
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        probe = subprocess.run(["unshare", "--user", "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"running as root and unshare --user fails: {probe.stderr!r}")
        prefix = ["unshare", "--user"]
    shard.chmod(0)
    try:
        result = subprocess.run(
            [*prefix, sys.executable, "-c", UNREADABLE_CHECKS, str(shard), str(packed)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    finally:
        shard.chmod(0o644)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr

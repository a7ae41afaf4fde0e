"""Data faults: broken shards, indexes and payloads, and shards changed under a reader.

Every fault must end in a ``DataError`` (``CorruptRecordError`` and
``RecordDecodeError`` are ones) that names the shard and the byte offset,
through the dataset and through both kinds of ``DataLoader`` workers: the
fast path's threads and torch's worker processes (``num_workers=2``). None
may crash, hang or hand out wrong pixels: every item or batch returned
before the error is compared with the source images.

The faults run in one child process (this file run as a script) under a
time limit, so that a crash (``SIGSEGV``, ``SIGBUS``) or a hang fails the
tests instead of killing or stalling pytest. The child prints one JSON line
per case; each test checks one line.
"""

from __future__ import annotations

import gc
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 420
BATCH = 4
SHARD1 = "ds-00001.tfrecord"  # records 5..9

# (fault, expected error class names (one must be in the error's MRO)).
FAULTS: dict[str, tuple[str, ...]] = {
    "truncated_shard": ("CorruptRecordError",),
    "index_past_end": ("CorruptRecordError",),
    "index_inside_record": ("CorruptRecordError",),
    "huge_length": ("CorruptRecordError",),
    "payload_text_not_image": ("RecordDecodeError",),
    "payload_random_jpeg_header": ("RecordDecodeError",),
    "payload_random_png_header": ("RecordDecodeError",),
    "payload_not_an_example": ("DataError",),
    "truncated_mid_epoch": ("DataError",),
    "rewritten_same_size_between_epochs": ("DataError",),
    "deleted_between_epochs": ("DataError",),
    "replaced_by_rename_mid_epoch": ("DataError",),
}
MODES = ("dataset", "loader_threads", "loader_processes")


# --------------------------------------------------------------------------
# The child: applies each fault to a fresh copy of the packed dataset.
# --------------------------------------------------------------------------


def _masked_crc(data: bytes) -> int:
    from tiacc_training import tfrecord

    return tfrecord.masked_crc32c(data)


def _index_lines(index: Path) -> list[list[str]]:
    return [line.split("\t") for line in index.read_text().splitlines() if line]


def _write_index(index: Path, rows: list[list[str]]) -> None:
    index.write_text("".join("\t".join(r) + "\n" for r in rows))


def _append_record(tfr: Path, payload: bytes, label: int) -> int:
    """Appends a framed record to the last shard and indexes it; returns its offset."""
    from tiacc_training import tfrecord

    shard = tfr / "ds-00003.tfrecord"
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(tfrecord.frame_record(payload))
    with open(tfr / "ds.index", "a") as f:
        f.write(f"ds-00003.tfrecord\t3\t{offset}\t{label}\n")
    return offset


def _image_payload(data: bytes) -> bytes:
    from tiacc_training import tfrecord

    return tfrecord.encode_example({"image/encoded": data, "image/class/label": 1})


class Fault:
    """One fault: ``before_open`` edits the files; ``after_items`` runs once
    ``after`` items or whole epochs (``between_epochs``) have been read."""

    def __init__(self, tfr: Path) -> None:
        self.tfr = tfr
        self.index = tfr / "ds.index"
        self.rows = _index_lines(self.index)
        self.shard = str(tfr / SHARD1)
        # Where the first error must point, when it is known exactly.
        self.path: Optional[str] = None
        self.offset: Optional[int] = None
        # Offsets an error may name when prefetching makes the exact one vary.
        self.offsets: set[int] = set()
        self.after: Optional[int] = None
        self.between_epochs = False
        self.extra_records = 0

    def offsets_of(self, shard: str) -> set[int]:
        return {int(r[2]) for r in self.rows if r[0] == shard}

    def before_open(self, name: str) -> None:
        rows, tfr = self.rows, self.tfr
        if name == "truncated_shard":
            # Cut record 7 short: records 5 and 6 stay readable.
            offset = int(rows[7][2])
            os.truncate(self.shard, offset + 100)
            self.path, self.offset = self.shard, offset
        elif name == "index_past_end":
            offset = os.path.getsize(self.shard) + 1000
            rows[6][2] = str(offset)
            _write_index(self.index, rows)
            self.path, self.offset = self.shard, offset
        elif name == "index_inside_record":
            offset = int(rows[6][2]) + 37
            rows[6][2] = str(offset)
            _write_index(self.index, rows)
            self.path, self.offset = self.shard, offset
        elif name == "huge_length":
            # A length field of 2^62 with a valid length CRC: only the bound
            # against the file size stops it.
            offset = int(rows[8][2])
            length = struct.pack("<Q", 1 << 62)
            with open(self.shard, "r+b") as f:
                f.seek(offset)
                f.write(length + struct.pack("<I", _masked_crc(length)))
            self.path, self.offset = self.shard, offset
        elif name.startswith("payload_"):
            rng = random.Random(name)
            junk = bytes(rng.randrange(256) for _ in range(3000))
            payload = {
                "payload_text_not_image": _image_payload(b"plain text where the JPEG should be\n"),
                "payload_random_jpeg_header": _image_payload(b"\xff\xd8\xff\xe0" + junk),
                "payload_random_png_header": _image_payload(b"\x89PNG\r\n\x1a\n" + junk),
                "payload_not_an_example": junk,
            }[name]
            offset = _append_record(tfr, payload, 1)
            self.extra_records = 1
            self.path, self.offset = str(tfr / "ds-00003.tfrecord"), offset
        else:
            self.path = self.shard
            self.offsets = self.offsets_of(SHARD1)
            if name.endswith("between_epochs"):
                self.between_epochs = True
            else:
                self.after = BATCH  # after the first batch

    def apply_late(self, name: str) -> None:
        shard = Path(self.shard)
        if name == "truncated_mid_epoch":
            os.truncate(shard, shard.stat().st_size // 2)
        elif name == "rewritten_same_size_between_epochs":
            # Same size, same record offsets, valid CRCs, other pixels: only
            # the file's modification time tells the reader it changed.
            from tiacc_training import tfrecord

            data = bytearray(shard.read_bytes())
            offset = int(self.rows[6][2])
            length = struct.unpack_from("<Q", data, offset)[0]
            start = offset + 12
            payload = bytearray(data[start : start + length])
            jpeg = tfrecord.decode_example(bytes(payload))["image/encoded"][0]
            at = payload.find(jpeg) + len(jpeg) - 30  # in the entropy-coded data
            while 0xFF in (payload[at - 1], payload[at], payload[at] ^ 1):
                at -= 1
            payload[at] ^= 1
            changed = tfrecord.decode_example(bytes(payload))["image/encoded"][0]
            assert _pixels(changed).tolist() != _pixels(jpeg).tolist(), "same pixels"
            data[start : start + length] = payload
            struct.pack_into("<I", data, start + length, tfrecord.masked_crc32c(bytes(payload)))
            time.sleep(0.05)  # past the file system's timestamp tick
            with open(shard, "r+b") as f:
                f.write(data)
        elif name == "deleted_between_epochs":
            shard.unlink()
        elif name == "replaced_by_rename_mid_epoch":
            other = shard.with_name("incoming.tmp")
            shutil.copyfile(self.tfr / "ds-00002.tfrecord", other)
            os.replace(other, shard)
        else:
            raise AssertionError(name)


def _pixels(encoded: bytes) -> Any:
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(encoded)).convert("RGB"))


def _reference(base: Path, n_extra: int) -> list[Any]:
    """The source images, in index order (ImageFolder's order), as uint8 arrays."""
    import numpy as np
    from torchvision.datasets import ImageFolder

    ref = ImageFolder(str(base / "imgs"))
    return [np.asarray(ref[i][0].convert("RGB")) for i in range(len(ref))] + [None] * n_extra


# Module level so that spawned workers could pickle it.
def _resize_to_tensor(image: Any) -> Any:
    import torchvision.transforms as T

    return T.Compose([T.Resize((16, 16)), T.ToTensor()])(image)


def _run_case(base: Path, work: Path, name: str, mode: str) -> dict[str, Any]:
    import numpy as np
    import torch
    import torchvision.transforms as T
    from PIL import Image

    from tiacc_training.torch.data import DataLoader
    from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset

    tfr = work / "tfr"
    shutil.copytree(base / "tfr", tfr)
    fault = Fault(tfr)
    fault.before_open(name)
    ref = _reference(base, fault.extra_records)
    n = len(ref)
    result: dict[str, Any] = {"case": name, "mode": mode, "checked": 0, "wrong": 0}

    if mode == "dataset":
        ds = IndexTFRDataset(str(tfr), str(fault.index), fused=False)

        def passes() -> Any:
            for i in range(n):
                image, _ = ds[i]
                yield [i], [np.asarray(image)]

    else:
        fused = mode == "loader_threads"
        if fused:
            transform: Callable[[Any], Any] = T.Compose([T.Resize((16, 16)), T.ToTensor()])
        else:
            transform = _resize_to_tensor
        ds = IndexTFRDataset(
            str(tfr), str(fault.index), transform, fused=fused, decode_downscale=False
        )
        loader = DataLoader(ds, batch_size=BATCH, num_workers=2, timeout=120)
        assert loader.uses_fast_path == fused, loader._tiacc_why_not
        expected = [None if r is None else _resize_to_tensor(Image.fromarray(r)) for r in ref]
        ref = expected

        def passes() -> Any:
            k = 0
            for images, _ in loader:
                idx = list(range(k, min(k + BATCH, n)))
                k += BATCH
                yield idx, list(images)

    started = time.monotonic()
    applied = fault.after is None and not fault.between_epochs
    try:
        for epoch in range(3):
            if epoch == 1 and fault.between_epochs:
                fault.apply_late(name)
                applied, started = True, time.monotonic()
            for idx, items in passes():
                for i, item in zip(idx, items):
                    good = ref[i]
                    same = good is not None and (
                        np.array_equal(item, good)
                        if isinstance(good, np.ndarray)
                        else torch.equal(item, good)
                    )
                    result["checked"] += 1
                    result["wrong"] += 0 if same else 1
                if not applied and fault.after is not None and idx[-1] + 1 >= fault.after:
                    fault.apply_late(name)
                    applied, started = True, time.monotonic()
        result["status"] = "no error"
    except Exception as exc:  # the error under test, whatever its class
        result.update(
            status="error",
            seconds_to_error=round(time.monotonic() - started, 3),
            mro=[c.__name__ for c in type(exc).__mro__],
            message=str(exc),
            path=getattr(exc, "path", None),
            offset=getattr(exc, "offset", None),
        )
    result.update(expect_path=fault.path, expect_offset=fault.offset, allowed=sorted(fault.offsets))
    return result


def child_main(base: Path, work: Path) -> None:
    """Runs every (fault, mode), one JSON line each (a ``start`` line first,
    so that a crash names the case it happened in)."""
    import torch.utils.data._utils as torch_data_utils

    # Torch joins each worker of a loader that raised for up to this interval
    # (5 s stock), which made this file 10 s a case slower; the faults do
    # not depend on it.
    torch_data_utils.MP_STATUS_CHECK_INTERVAL = 0.5
    for name in FAULTS:
        for mode in MODES:
            print(json.dumps({"start": [name, mode]}), flush=True)
            result = _run_case(base, work / f"{name}-{mode}", name, mode)
            print(json.dumps(result), flush=True)
            # A loader left in a reference cycle by the error would otherwise
            # shut its workers down whenever the collector runs: during a
            # later case (its time to error) or in a worker forked later.
            gc.collect()


# --------------------------------------------------------------------------
# The tests.
# --------------------------------------------------------------------------


def make_base(base: Path) -> None:
    """Writes the source images (the layout of conftest's ``image_folder``
    fixture: 3 classes of 6, JPEG and PNG) to ``base/imgs`` and packs them
    into ``base/tfr`` with conftest's ``pack_folder``, 5 records a shard."""
    from tests.conftest import pack_folder, write_image

    seed = 0
    for cls in ["ant", "bee", "cat"]:
        for i in range(6):
            fmt, ext = ("PNG", "png") if i % 3 == 2 else ("JPEG", "JPEG")
            path = base / "imgs" / cls / f"{cls}_{i:03d}.{ext}"
            write_image(path, 20 + i, 16 + seed % 5, seed, fmt)
            seed += 1
    pack_folder(base, records_per_shard=5)


def run_faults(base: Path) -> dict[tuple[str, str], Any]:
    """Runs every case in a child process under a time limit; returns the
    results by ``(fault, mode)``. A case the child did not finish maps to a
    string that says why (crash, signal or time limit)."""
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": pythonpath}
    cmd = [sys.executable, __file__, str(base), str(base / "work")]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env, cwd=REPO
        )
        out, why = proc.stdout, f"the child exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        why = f"the child hung: killed after {CHILD_TIMEOUT_S} s"
    results: dict[tuple[str, str], Any] = {}
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if "start" in row:
            results[tuple(row["start"])] = f"did not finish: {why}"
        else:
            results[(row["case"], row["mode"])] = row
    return results


def check(fault: str, mode: str, row: Any) -> None:
    """Asserts that the result ``row`` of ``(fault, mode)`` is what it must be."""
    assert isinstance(row, dict), row
    assert row["status"] == "error", f"no error: {row}"
    assert any(name in row["mro"] for name in FAULTS[fault]), row
    assert "DataError" in row["mro"], row
    assert row["wrong"] == 0, f"{row['wrong']} items with wrong pixels: {row}"
    message = row["message"]
    path = row["expect_path"]
    assert path in message, row
    if row["expect_offset"] is not None:
        offset = row["expect_offset"]
        assert re.search(rf"offset {offset}\b", message), row
    else:
        named = [o for o in row["allowed"] if re.search(rf"offset {o}\b", message)]
        assert named, f"the message names none of the shard's record offsets: {row}"
        offset = named[0]
    # Torch's worker processes re-raise the class with the message only; the
    # dataset and the fast path keep the attributes.
    if mode != "loader_processes":
        assert (row["path"], row["offset"]) == (path, offset), row
    if fault.endswith(("mid_epoch", "between_epochs")):
        assert row["checked"] >= BATCH, f"the fault came before any item was read: {row}"


@pytest.fixture(scope="module")
def fault_results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    """Every case's result, from one child process."""
    base = tmp_path_factory.mktemp("datafaults")
    make_base(base)
    return run_faults(base)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_data_fault(fault_results: dict[tuple[str, str], Any], fault: str, mode: str) -> None:
    check(fault, mode, fault_results.get((fault, mode), "never started: the child stopped"))


def test_good_records_still_read_after_a_fault(tmp_path: Path, image_folder: Path) -> None:
    """A bad record fails alone: its neighbours, in the same shard, still
    give the source pixels."""
    import numpy as np
    from torchvision.datasets import ImageFolder

    from tests.conftest import pack_folder
    from tiacc_training.errors import CorruptRecordError
    from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset

    index = pack_folder(tmp_path, records_per_shard=5)
    rows = _index_lines(index)
    shard, offset = index.parent / rows[8][0], int(rows[8][2])
    length = struct.pack("<Q", 1 << 62)
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(length + struct.pack("<I", _masked_crc(length)))
    ds = IndexTFRDataset(str(index.parent), str(index))
    ref = ImageFolder(str(image_folder))
    with pytest.raises(CorruptRecordError) as info:
        ds[8]
    assert (info.value.path, info.value.offset) == (str(shard), offset)
    for i in (5, 6, 7, 9):
        assert np.array_equal(np.asarray(ds[i][0]), np.asarray(ref[i][0].convert("RGB")))


if __name__ == "__main__":
    child_main(Path(sys.argv[1]), Path(sys.argv[2]))

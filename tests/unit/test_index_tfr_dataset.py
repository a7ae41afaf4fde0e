"""IndexTFRDataset: the same items as torchvision's ImageFolder, DataLoader modes, bad input."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.datasets import ImageFolder

from tests.conftest import write_image
from tiacc_training import tfrecord
from tiacc_training.errors import CorruptRecordError, DataError, DecodeError
from tiacc_training.tools import general_image_list, img2tfrecord
from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset, IndexTfrDataset

TRAIN_TRANSFORM = T.Compose(
    [
        T.RandomResizedCrop(16),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ]
)


def pack_folder(folder: Path, out: Path, per_shard: int = 5) -> Path:
    img_list = out.parent / f"{out.name}.list"
    general_image_list.main(["--img_dir", str(folder), "--img_list", str(img_list)])
    items = img2tfrecord.read_image_list(str(folder), str(img_list))
    img2tfrecord.pack(items, str(out), "ds", records_per_shard=per_shard, show_progress=False)
    return out / "ds.index"


@pytest.fixture
def packed(image_folder, tmp_path) -> tuple[Path, Path]:
    return image_folder, pack_folder(image_folder, tmp_path / "tfr")


def test_items_equal_imagefolder_pixels_and_labels(packed):
    folder, index = packed
    ds = IndexTFRDataset(str(index.parent), str(index))
    ref = ImageFolder(str(folder))
    assert len(ds) == len(ref) == 18
    assert ds.targets == ref.targets
    assert ds.class_num == 3 and ds.classes == [0, 1, 2]
    for i in range(len(ds)):
        image, label = ds[i]
        ref_image, ref_label = ref[i]
        assert isinstance(image, Image.Image) and image.mode == "RGB"
        assert label == ref_label
        assert np.array_equal(np.asarray(image), np.asarray(ref_image))


def test_transform_and_seeding_match_imagefolder(packed):
    folder, index = packed
    ds = IndexTFRDataset(str(index.parent), str(index), TRAIN_TRANSFORM)
    ref = ImageFolder(str(folder), TRAIN_TRANSFORM)
    torch.manual_seed(7)
    mine = [ds[i] for i in range(len(ds))]
    torch.manual_seed(7)
    theirs = [ref[i] for i in range(len(ref))]
    for (a, la), (b, lb) in zip(mine, theirs):
        assert la == lb and torch.equal(a, b)
    torch.manual_seed(7)
    batch = ds.__getitems__(list(range(len(ds))))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(batch, mine))


def test_constructor_spellings_and_errors(packed, tmp_path):
    _, index = packed
    a = IndexTFRDataset(tfrecord_dir=str(index.parent), tfrecord_file="ds.index")
    b = IndexTfrDataset(str(index.parent), str(index), target_transform=lambda y: y * 10)
    assert len(a) == len(b) and b[4][1] == a[4][1] * 10
    assert a[-1][1] == a[len(a) - 1][1]
    with pytest.raises(IndexError, match="out of range"):
        a[len(a)]
    with pytest.raises(TypeError):
        IndexTFRDataset(str(index.parent), str(index), tfrecord_dir=str(index.parent))
    with pytest.raises(FileNotFoundError, match="nope.index"):
        IndexTFRDataset(str(index.parent), "nope.index")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        IndexTFRDataset(str(tmp_path / "missing"), str(index))
    with pytest.raises(ValueError, match="decode_threads"):
        IndexTFRDataset(str(index.parent), str(index), decode_threads=0)


def loader_labels(ds, **kwargs) -> list[int]:
    return [int(y) for _, ys in DataLoader(ds, batch_size=4, **kwargs) for y in ys]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_workers": 0},
        {"num_workers": 2, "multiprocessing_context": "fork"},
        {"num_workers": 2, "multiprocessing_context": "spawn", "persistent_workers": True},
        {"num_workers": 1, "pin_memory": True},
    ],
)
def test_dataloader_modes(packed, kwargs):
    _, index = packed
    ds = IndexTFRDataset(str(index.parent), str(index), TRAIN_TRANSFORM)
    assert loader_labels(ds, **kwargs) == ds.targets
    batch = next(iter(DataLoader(ds, batch_size=4, **kwargs)))
    assert batch[0].shape == (4, 3, 16, 16) and batch[0].dtype == torch.float32


def test_reproducible_with_manual_seed(packed):
    _, index = packed
    ds = IndexTFRDataset(str(index.parent), str(index), TRAIN_TRANSFORM)

    def run() -> list[torch.Tensor]:
        torch.manual_seed(3)
        return [x for x, _ in DataLoader(ds, batch_size=6, shuffle=True, num_workers=2)]

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_distributed_sampler_partitions(packed):
    _, index = packed
    ds = IndexTFRDataset(str(index.parent), str(index), T.Compose([T.Resize((8, 8)), T.ToTensor()]))
    seen = []
    for rank in range(3):
        sampler = DistributedSampler(ds, num_replicas=3, rank=rank, shuffle=True, seed=1)
        seen += loader_labels(ds, sampler=sampler, num_workers=1)
    assert sorted(seen) == sorted(ds.targets)


def test_workers_fork_after_parent_used_its_thread_pool(packed):
    _, index = packed
    # Two decode threads everywhere: the parent starts its pool, then forked
    # workers must start their own instead of waiting on the parent's threads.
    to_tensor = T.Compose([T.Resize((8, 8)), T.ToTensor()])
    ds = IndexTFRDataset(str(index.parent), str(index), to_tensor, decode_threads=2)
    assert len(ds.__getitems__(list(range(8)))) == 8
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork", timeout=60)
    assert sum(len(y) for _, y in loader) == len(ds)


def corrupt_image_in_record(index: Path, which: int) -> tuple[str, int]:
    shard, _, offset, _ = tfrecord.read_index(index)[which]
    path = index.parent / shard
    example = tfrecord.read_example(path, offset)
    # Rewrite the shard with this record's image bytes damaged (CRCs valid).
    records = [(o, p) for o, p in tfrecord.TFRecordReader(path).scan()]
    with tfrecord.TFRecordWriter(path) as w:
        for o, payload in records:
            if o == offset:
                jpeg = bytearray(example["image/encoded"][0])
                jpeg[2:] = b"\x00" * (len(jpeg) - 2)
                example["image/encoded"] = [bytes(jpeg)]
                payload = tfrecord.encode_example(example)
            w.write(payload)
    os.remove(f"{path}.idx")
    return str(path), offset


def test_corrupt_image_names_shard_offset_and_index(packed):
    _, index = packed
    shard, offset = corrupt_image_in_record(index, 7)
    ds = IndexTFRDataset(str(index.parent), str(index))
    with pytest.raises(DecodeError) as info:
        ds[7]
    assert info.value.path == shard and info.value.offset == offset and info.value.index == 7
    assert f"offset {offset} (dataset index 7)" in str(info.value)
    with pytest.raises(DecodeError, match="dataset index 7"):
        ds.__getitems__([6, 7, 8])
    ds[6]  # the neighbours are fine


def test_crc_mismatch_raises_corrupt_record(packed):
    _, index = packed
    shard, _, offset, _ = tfrecord.read_index(index)[3]
    path = index.parent / shard
    data = bytearray(path.read_bytes())
    data[offset + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    ds = IndexTFRDataset(str(index.parent), str(index))
    with pytest.raises(CorruptRecordError) as info:
        ds[3]
    assert info.value.offset == offset and info.value.path == str(path)


def test_missing_shard_fails_at_construction(packed):
    _, index = packed
    (index.parent / "ds-00002.tfrecord").unlink()
    with pytest.raises(DataError, match=r"ds\.index:11:.*ds-00002\.tfrecord"):
        IndexTFRDataset(str(index.parent), str(index))


def test_grayscale_and_cmyk_jpegs_come_out_like_pil_convert_rgb(tmp_path):
    folder = tmp_path / "imgs"
    rng = np.random.default_rng(0)
    (folder / "a").mkdir(parents=True)
    Image.fromarray(rng.integers(0, 256, (20, 30), dtype=np.uint8), "L").save(
        folder / "a" / "gray.jpg", quality=90
    )
    cmyk = Image.fromarray(rng.integers(0, 256, (20, 30, 4), dtype=np.uint8), "CMYK")
    cmyk.save(folder / "a" / "cmyk.jpg", quality=90)
    write_image(folder / "a" / "rgb.jpg", 30, 20, 1)
    Image.fromarray(rng.integers(0, 256, (20, 30, 4), dtype=np.uint8), "RGBA").save(
        folder / "a" / "rgba.png"
    )
    index = pack_folder(folder, tmp_path / "tfr")
    ds = IndexTFRDataset(str(index.parent), str(index))
    entries = [line.rsplit(" ", 1)[0] for line in (tmp_path / "tfr.list").read_text().splitlines()]
    assert sorted(entries) == ["a/cmyk.jpg", "a/gray.jpg", "a/rgb.jpg", "a/rgba.png"]
    for i, rel in enumerate(entries):
        with Image.open(folder / rel) as im:
            expected = np.asarray(im.convert("RGB"))
        assert np.array_equal(np.asarray(ds[i][0]), expected), rel


def test_tensorflow_style_shards_with_built_index(tmp_path, image_folder):
    # Shards as TensorFlow's ImageNet scripts write them: other file names, the
    # keys image/encoded and image/class/label, no index of ours.
    files = sorted(image_folder.rglob("*.JPEG"))
    out = tmp_path / "tf"
    out.mkdir()
    for shard in range(2):
        with tfrecord.TFRecordWriter(out / f"train-0000{shard}-of-00002") as w:
            for j, f in enumerate(files[shard::2]):
                w.write_example(
                    {
                        "image/encoded": f.read_bytes(),
                        "image/class/label": 1 + j % 3,  # TF's ImageNet labels start at 1
                        "image/class/text": b"x",
                    }
                )
    from tiacc_training.tools import build_index

    index = out / "train.index"
    assert build_index.main([str(out), "--output", str(index), "--quiet"]) == 0
    ds = IndexTFRDataset(str(out), str(index))
    assert len(ds) == len(files)
    assert set(ds.targets) == {1, 2, 3}
    image, _ = ds[0]
    with Image.open(files[0]) as im:
        assert np.array_equal(np.asarray(image), np.asarray(im.convert("RGB")))
    assert tfrecord.verify_index(index)["records"] == len(files)

"""The fused Rust path against torchvision's PIL path: same seeds, same crops, same pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import DataLoader

from tests.conftest import pack_folder, write_image
from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def photo_like(path: Path, width: int, height: int, seed: int) -> None:
    """A smooth JPEG (noise-only images exaggerate resampling differences)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, height // 16), max(2, width // 16), 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((width, height), Image.BICUBIC)
    noise = rng.normal(0, 6, (height, width, 3))
    pixels = np.clip(np.asarray(img, dtype=np.float64) + noise, 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, quality=90)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fused")
    folder = root / "imgs"
    sizes = [(500, 375), (375, 500), (333, 500), (1000, 800), (640, 480), (90, 70)]
    for i in range(12):
        w, h = sizes[i % len(sizes)]
        photo_like(folder / f"c{i % 3}" / f"{i:03d}.jpg", w, h, i)
    write_image(folder / "c0" / "png_000.png", 300, 200, 99, fmt="PNG")
    return pack_folder(root, records_per_shard=4)


def pair(index: Path, transform, **kwargs):
    fused = IndexTFRDataset(str(index.parent), str(index), transform, **kwargs)
    plain = IndexTFRDataset(str(index.parent), str(index), transform, fused=False)
    assert fused.uses_fused_path and not plain.uses_fused_path
    return fused, plain


def same_seed_items(fused, plain, i, seed):
    torch.manual_seed(seed)
    a, la = fused[i]
    torch.manual_seed(seed)
    b, lb = plain[i]
    assert la == lb
    return a, b


def train_transform(size=224):
    return T.Compose(
        [T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]
    )


def mean_abs_01(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean absolute difference on the [0, 1] scale (undoing Normalize)."""
    std = torch.tensor(STD).view(3, 1, 1)
    return float(((a - b) * std).abs().mean())


def test_random_resized_crop_matches_pil_without_downscaling(packed):
    fused, plain = pair(packed, train_transform(), decode_downscale=False)
    worst = 0.0
    for i in range(len(fused)):
        for seed in range(4):
            a, b = same_seed_items(fused, plain, i, seed)
            assert a.shape == b.shape == (3, 224, 224) and a.dtype == torch.float32
            worst = max(worst, mean_abs_01(a, b))
    assert worst <= 1 / 255, worst


def test_random_resized_crop_with_downscaling(packed):
    transform = T.Compose([T.RandomResizedCrop(96, scale=(0.6, 1.0)), T.ToTensor(),
                           T.Normalize(MEAN, STD)])  # fmt: skip
    fused, plain = pair(packed, transform)
    exact, _ = pair(packed, transform, decode_downscale=False)
    big = [i for i in range(len(fused)) if fused._data.image_sizes([i])[0][0] >= 640]
    assert big
    differs = False
    for i in big:
        for seed in range(3):
            a, b = same_seed_items(fused, plain, i, seed)
            assert mean_abs_01(a, b) <= 2 / 255
            torch.manual_seed(seed)
            c, _ = exact[i]
            differs |= not torch.equal(a, c)
    assert differs, "downscaled decoding never kicked in for large crops"


@pytest.mark.parametrize(
    "transform",
    [
        T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)]),
        T.Compose([T.Resize(64), T.CenterCrop((80, 60)), T.PILToTensor()]),  # pads
        T.Compose([T.CenterCrop(400), T.ToTensor()]),  # pads small images
        T.Compose(
            [
                T.Resize((50, 70)),
                T.RandomHorizontalFlip(0.5),
                T.PILToTensor(),
                T.ConvertImageDtype(torch.float32),
            ]
        ),  # fmt: skip
        T.Compose([T.Resize(100, max_size=120), T.CenterCrop(100), T.PILToTensor()]),
    ],
)
def test_deterministic_chains_are_bit_exact(packed, transform):
    fused, plain = pair(packed, transform, decode_downscale=False)
    for i in range(len(fused)):
        a, b = same_seed_items(fused, plain, i, i)
        assert a.dtype == b.dtype and torch.equal(a, b), i


def test_uint8_output_equals_pil_to_tensor(packed):
    transform = T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize(MEAN, STD)])  # fmt: skip
    as_uint8 = IndexTFRDataset(str(packed.parent), str(packed), transform, output="uint8",
                               decode_downscale=False)  # fmt: skip
    reference = IndexTFRDataset(
        str(packed.parent), str(packed),
        T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(), T.PILToTensor()]),
        fused=False,
    )  # fmt: skip
    for i in range(len(as_uint8)):
        a, b = same_seed_items(as_uint8, reference, i, i)
        assert a.dtype == torch.uint8 and (a.int() - b.int()).abs().float().mean() <= 1.0


def test_unsupported_transforms_use_the_pil_path(packed):
    for transform in [
        T.Compose(
            [T.RandomResizedCrop(32, interpolation=T.InterpolationMode.BICUBIC), T.ToTensor()]
        ),  # fmt: skip
        T.Compose([T.RandomResizedCrop(32), T.ColorJitter(0.2), T.ToTensor()]),
        T.Compose([T.Resize(32), T.ToTensor()]),  # variable output size
        T.Compose([T.RandomResizedCrop(32)]),  # ends with a PIL image
        T.ToTensor(),
        None,
    ]:
        ds = IndexTFRDataset(str(packed.parent), str(packed), transform)
        assert not ds.uses_fused_path
        ds[0]
    with pytest.raises(ValueError, match="output='uint8' needs a transform"):
        IndexTFRDataset(str(packed.parent), str(packed), T.ToTensor(), output="uint8")


def test_fused_batches_through_dataloader_are_reproducible(packed):
    ds = IndexTFRDataset(str(packed.parent), str(packed), train_transform(32))
    plain = IndexTFRDataset(str(packed.parent), str(packed), train_transform(32), fused=False)

    def run(dataset, workers):
        torch.manual_seed(5)
        loader = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=workers)
        return [(x, y) for x, y in loader]

    first, second = run(ds, 2), run(ds, 2)
    assert all(torch.equal(a, b) and torch.equal(la, lb)
               for (a, la), (b, lb) in zip(first, second))  # fmt: skip
    # Same seed, same sampler order and crops as the PIL path.
    for (a, la), (b, lb) in zip(run(ds, 0), run(plain, 0)):
        assert torch.equal(la, lb)
        assert float((a - b).abs().mean()) < 0.05


def test_images_read_once_render_as_render_batch(packed):
    ds = IndexTFRDataset(str(packed.parent), str(packed), train_transform(32))
    data, idx = ds._data, [4, 0, 6]
    images = data.read_images(idx, 2)
    assert len(images) == 3 and images.indices == idx
    assert images.sizes == data.image_sizes(idx)
    geometries = [((0, 0, 60, 50), (32, 32), (0, 0, 32, 32), k == 1) for k in range(3)]
    a = np.zeros((3, 3, 32, 32), np.float32)
    b = np.ones((3, 3, 32, 32), np.float32)
    data.render_batch(idx, geometries, a, MEAN, STD)
    data.render_images(images, geometries, b, MEAN, STD, threads=1)
    assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="3 images but 2 geometries"):
        data.render_images(images, geometries[:2], b)
    other = IndexTFRDataset(str(packed.parent), str(packed), train_transform(32))
    with pytest.raises(ValueError, match="another dataset"):
        other._data.render_images(images, geometries, b)

"""The input pipeline on a GPU: device output, GPU decode, pinned batches.

Needs a CUDA device (``@pytest.mark.gpu``; skipped without one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.test_data_loader import STD, _is_png, batches, dataset
from tests.unit.test_data_loader import index as index  # noqa: F401  (the fixture)
from tiacc_training.torch.data import DataLoader

pytestmark = pytest.mark.gpu


def test_gpu_decode_equals_cpu_decode_within_idct_tolerance(index: Path) -> None:  # noqa: F811
    """nvJPEG against the engine's libjpeg-turbo decode, image by image."""
    from torchvision.io import ImageReadMode, decode_jpeg

    ds = dataset(index)
    for i in range(len(ds)):
        data = ds._data.image_bytes(i)
        if _is_png(ds, i):
            continue
        ours = torch.from_numpy(ds._data.decode(i)).permute(2, 0, 1)
        gpu = decode_jpeg(
            torch.frombuffer(bytearray(data), dtype=torch.uint8),
            mode=ImageReadMode.RGB,
            device="cuda",
        ).cpu()
        assert gpu.shape == ours.shape, i
        diff = (gpu.int() - ours.int()).abs()
        # Different IDCTs and chroma upsampling: on these noise images (the
        # worst case for upsampling) nvJPEG of CUDA 13 on an H100 was 2.4 to
        # 3.4 levels off on average, by image; a wrong decode of noise (a
        # shifted block, swapped channels) is tens of levels off.
        assert diff.float().mean() <= 8.0, (i, diff.float().mean())


@pytest.mark.parametrize("workers", [0, 2])
def test_gpu_decode_batches(index: Path, workers: int) -> None:  # noqa: F811
    ds = dataset(index)
    png = next(i for i in range(len(ds)) if _is_png(ds, i))
    cpu = batches(DataLoader(ds, batch_size=6, num_workers=workers))
    gpu = batches(DataLoader(ds, batch_size=6, num_workers=workers, decode_device="cuda"))
    std = torch.tensor(STD).view(1, 3, 1, 1)
    for k, ((a, la), (b, lb)) in enumerate(zip(cpu, gpu)):
        assert b.device.type == "cuda" and b.dtype == torch.float32
        b = b.cpu()
        assert torch.equal(la, lb)
        assert float(((a - b) * std).abs().mean()) <= 3 / 255, k
        if 6 * k <= png < 6 * k + 6:
            # The PNG took the CPU path inside the GPU batch.
            j = png - 6 * k
            torch.testing.assert_close(b[j], a[j], rtol=0, atol=1e-6)


def test_device_output_and_pinned_batches(index: Path) -> None:  # noqa: F811
    ds = dataset(index)
    host = batches(DataLoader(ds, batch_size=5, num_workers=2, pin_memory=True))
    shipped = batches(DataLoader(ds, batch_size=5, num_workers=2, device="cuda"))
    for (a, la), (b, lb) in zip(host, shipped):
        assert b.device.type == "cuda"
        assert torch.equal(la, lb)
        torch.testing.assert_close(b.cpu(), a, rtol=0, atol=1e-5)
    images, _ = next(iter(DataLoader(ds, batch_size=5, num_workers=2, pin_memory=True)))
    assert images.is_pinned()


@pytest.mark.parametrize("workers", [0, 2])
def test_nvimagecodec_decode_batches(index: Path, workers: int) -> None:  # noqa: F811
    """nvImageCodec's decoder (hardware engines first) against torchvision's."""
    pytest.importorskip(
        "nvidia.nvimgcodec",
        reason="needs nvImageCodec (pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg)",
    )
    ds = dataset(index)
    png = next(i for i in range(len(ds)) if _is_png(ds, i))
    torchvision = batches(DataLoader(ds, batch_size=6, num_workers=workers, decode_device="cuda"))
    loader = DataLoader(
        ds, batch_size=6, num_workers=workers, decode_device="cuda", jpeg_decoder="nvimagecodec"
    )
    std = torch.tensor(STD).view(1, 3, 1, 1)
    for k, ((a, la), (b, lb)) in enumerate(zip(torchvision, batches(loader))):
        assert b.device.type == "cuda" and b.dtype == torch.float32
        assert torch.equal(la, lb)
        # Two GPU decoders (and, on hardware engines, another IDCT).
        assert float(((a.cpu() - b.cpu()) * std).abs().mean()) <= 3 / 255, k
        if 6 * k <= png < 6 * k + 6:
            j = png - 6 * k
            torch.testing.assert_close(b[j].cpu(), a[j].cpu(), rtol=0, atol=1e-6)

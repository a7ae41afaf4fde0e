"""``tiacc_training.torch.data.DataLoader`` against torch's ``DataLoader``.

The drop-in loader must yield what torch's loader yields over the same
dataset: the same indices in the same order for every sampler, the same
random crops (num_workers=0: torch's global generator; num_workers=W: one
generator per worker seeded like torch's workers), and so the same pixels.
"""

from __future__ import annotations

import gc
import io
import multiprocessing
import signal
import sys
import threading
import time
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

from tests.conftest import pack_folder, write_image
from tests.unit.test_fused_path import photo_like
from tiacc_training.errors import CorruptRecordError
from tiacc_training.torch.data import DataLoader
from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
TRAIN = T.Compose(
    [T.RandomResizedCrop(48), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]
)


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("loader")
    folder = root / "imgs"
    sizes = [(120, 90), (90, 120), (100, 100), (160, 120), (64, 80)]
    for i in range(23):
        w, h = sizes[i % len(sizes)]
        photo_like(folder / f"c{i % 4}" / f"{i:03d}.jpg", w, h, i)
    write_image(folder / "c1" / "png_000.png", 70, 50, 99, fmt="PNG")
    return pack_folder(root, records_per_shard=8)


def dataset(index: Path, transform=TRAIN, **kwargs) -> IndexTFRDataset:
    return IndexTFRDataset(str(index.parent), str(index), transform, **kwargs)


def batches(loader, epochs: int = 1, seed: int = 7) -> list[list[torch.Tensor]]:
    torch.manual_seed(seed)
    out = []
    for epoch in range(epochs):
        sampler = loader.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        out += [[images.clone(), labels.clone()] for images, labels in loader]
    return out


def assert_same(ours, theirs) -> None:
    assert len(ours) == len(theirs)
    for k, ((a, la), (b, lb)) in enumerate(zip(ours, theirs)):
        assert torch.equal(la, lb), f"batch {k}: labels {la} vs {lb}"
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a, b), f"batch {k}: pixels differ"


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    "options",
    [
        {"batch_size": 5, "shuffle": True},
        {"batch_size": 4, "shuffle": False, "drop_last": True},
        {"batch_size": 6, "shuffle": True, "generator": "seeded"},
    ],
    ids=["shuffle", "sequential-drop-last", "generator"],
)
def test_the_same_batches_as_torch(index: Path, workers: int, options: dict) -> None:
    ds = dataset(index)

    def make(cls):
        kw = dict(options)
        if kw.get("generator") == "seeded":
            kw["generator"] = torch.Generator().manual_seed(3)
        return cls(ds, num_workers=workers, **kw)

    ours = make(DataLoader)
    assert ours.uses_fast_path
    assert len(ours) == len(make(torch.utils.data.DataLoader))
    assert_same(batches(ours), batches(make(torch.utils.data.DataLoader)))


@pytest.mark.parametrize("workers", [0, 2])
def test_distributed_sampler_with_set_epoch(index: Path, workers: int) -> None:
    ds = dataset(index)
    for rank in range(2):

        def make(cls, rank=rank):
            sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=5)
            return cls(ds, batch_size=3, sampler=sampler, num_workers=workers)

        assert_same(
            batches(make(DataLoader), epochs=2),
            batches(make(torch.utils.data.DataLoader), epochs=2),
        )


def test_a_batch_sampler(index: Path) -> None:
    ds = dataset(index)

    def make(cls):
        sampler = BatchSampler(RandomSampler(ds), batch_size=4, drop_last=False)
        return cls(ds, batch_sampler=sampler, num_workers=2, prefetch_factor=3)

    assert_same(batches(make(DataLoader)), batches(make(torch.utils.data.DataLoader)))


def test_persistent_workers_over_two_epochs(index: Path) -> None:
    ds = dataset(index)

    def make(cls):
        return cls(ds, batch_size=5, shuffle=True, num_workers=2, persistent_workers=True)

    ours = make(DataLoader)
    assert_same(batches(ours, epochs=2), batches(make(torch.utils.data.DataLoader), epochs=2))
    # An epoch left early: the next one draws the same order as stock
    # PyTorch's after the same early exit (same labels batch by batch, every
    # item once, whole images). The augmentations' random draws are not
    # compared: stock's persistent workers carry their generators on from the
    # batches they prefetched for the abandoned epoch.
    stock = make(torch.utils.data.DataLoader)
    for loader in (ours, stock):
        torch.manual_seed(1)
        next(iter(loader))
    after_ours, after_stock = batches(ours, seed=2), batches(stock, seed=2)
    assert len(after_ours) == len(after_stock) == len(ours)
    for k, ((a, la), (b, lb)) in enumerate(zip(after_ours, after_stock)):
        assert torch.equal(la, lb), f"batch {k}: labels {la} vs {lb}"
        assert a.shape == b.shape and a.dtype == b.dtype and torch.isfinite(a).all(), k
    assert sum(len(la) for _, la in after_ours) == len(ds)


@pytest.mark.parametrize("downscale", [False, True])
def test_pixels_within_tolerance_of_the_per_item_pil_path(index: Path, downscale: bool) -> None:
    fused = dataset(index, decode_downscale=downscale)
    plain = dataset(index, fused=False)
    assert not plain.uses_fused_path
    ours = batches(DataLoader(fused, batch_size=4, num_workers=2))
    stock = batches(torch.utils.data.DataLoader(plain, batch_size=4, num_workers=2))
    std = torch.tensor(STD).view(1, 3, 1, 1)
    for (a, la), (b, lb) in zip(ours, stock):
        assert torch.equal(la, lb)
        # In [0, 1] units: full-size decoding matches Pillow to 1/255 per mean
        # pixel; reduced-scale decoding (the default) to 2/255.
        mean_abs = float(((a - b) * std).abs().mean())
        assert mean_abs <= (2 if downscale else 1) / 255, mean_abs


def test_other_datasets_and_collates_fall_back_to_torch(index: Path) -> None:
    ds = dataset(index)
    plain = DataLoader(dataset(index, fused=False), batch_size=4)
    custom = DataLoader(ds, batch_size=4, collate_fn=lambda items: items)
    unbatched = DataLoader(ds, batch_size=None)
    for loader in (plain, custom, unbatched):
        assert not loader.uses_fast_path
        assert isinstance(iter(loader), torch.utils.data.dataloader._BaseDataLoaderIter)
    listed = DataLoader(list(range(10)), batch_size=4)
    assert [b.tolist() for b in listed] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match="fast path"):
        DataLoader(dataset(index, fused=False), batch_size=4, device="cpu")


def test_device_output_converts_on_the_device(index: Path) -> None:
    ds = dataset(index)
    host = batches(DataLoader(ds, batch_size=5, num_workers=2))
    shipped = batches(DataLoader(ds, batch_size=5, num_workers=2, device="cpu"))
    for (a, la), (b, lb) in zip(host, shipped):
        assert torch.equal(la, lb) and b.dtype == torch.float32
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_a_corrupt_record_is_named_by_shard_and_offset(index: Path, tmp_path: Path) -> None:
    copy = tmp_path / "tfr"
    copy.mkdir()
    for f in index.parent.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    shard, offset = dataset(copy / index.name).location(9)
    data = bytearray(Path(shard).read_bytes())
    data[offset + 40] ^= 0xFF  # inside the record's payload: its CRC fails
    Path(shard).write_bytes(bytes(data))
    # Opened after the damage: a shard changed under an open dataset is
    # refused as changed (see tests/faults/test_data_faults.py).
    loader = DataLoader(dataset(copy / index.name), batch_size=4, num_workers=2)
    with pytest.raises(CorruptRecordError) as info:
        list(loader)
    assert info.value.path == shard and info.value.offset == offset
    assert_no_loader_threads()


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tiacc-loader-")]


def assert_no_loader_threads() -> None:
    gc.collect()
    deadline = time.monotonic() + 10
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not loader_threads(), loader_threads()


def test_threads_stop_after_an_early_break_and_an_exception(index: Path) -> None:
    loader = DataLoader(dataset(index), batch_size=2, num_workers=3)
    for k, _ in enumerate(loader):
        assert len(loader_threads()) == 3
        if k == 1:
            break
    assert_no_loader_threads()

    def fail(worker: int) -> None:
        raise OSError(f"worker {worker} cannot start")

    with pytest.raises(OSError, match="cannot start"):
        list(DataLoader(dataset(index), batch_size=2, num_workers=2, worker_init_fn=fail))
    assert_no_loader_threads()


def test_ctrl_c_stops_the_threads(index: Path) -> None:
    # Python's own Ctrl-C handler, also where the suite was started with SIGINT
    # ignored (a shell's background job: Python then keeps it ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    loader = DataLoader(dataset(index), batch_size=2, num_workers=2)
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in loader:
                signal.raise_signal(signal.SIGINT)  # what Ctrl-C does
    finally:
        signal.signal(signal.SIGINT, previous)
    assert_no_loader_threads()


def test_worker_init_fn_and_timeout(index: Path) -> None:
    seen: list[int] = []
    loader = DataLoader(dataset(index), batch_size=8, num_workers=2, worker_init_fn=seen.append)
    assert len(list(loader)) == len(loader)
    assert sorted(seen) == [0, 1]

    def slow(worker: int) -> None:
        time.sleep(3)

    loader = DataLoader(
        dataset(index), batch_size=8, num_workers=1, worker_init_fn=slow, timeout=0.5
    )
    with pytest.raises(RuntimeError, match="timed out after 0.5 seconds"):
        next(iter(loader))
    assert_no_loader_threads()


def _child(index: str, conn) -> None:
    ds = IndexTFRDataset(str(Path(index).parent), index, TRAIN)
    n = sum(len(labels) for _, labels in DataLoader(ds, batch_size=4, num_workers=2))
    conn.send(n)


def test_forking_after_use_is_safe(index: Path) -> None:
    ds = dataset(index)
    assert sum(len(lb) for _, lb in DataLoader(ds, batch_size=4, num_workers=2)) == len(ds)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(str(index), child))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0 and parent.recv() == len(ds)


def test_pin_memory(index: Path) -> None:
    loader = DataLoader(dataset(index), batch_size=4, num_workers=2, pin_memory=True)
    if torch.cuda.is_available():
        images, _ = next(iter(loader))
        assert images.is_pinned()
        return
    # Without an accelerator torch's loader warns and does not pin; so do we.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        images, _ = next(iter(loader))
    assert any("pin_memory" in str(w.message) for w in caught)
    assert not images.is_pinned()


@pytest.mark.parametrize("workers", [0, 2])
def test_the_device_decode_path_on_the_cpu(index: Path, workers: int) -> None:
    """decode_device runs the GPU path's code; on the CPU, torchvision decodes.

    Same crops and flips as the CPU path (its draws), pixels within a few
    levels (another IDCT, another resampling filter), and records that are
    not JPEG take the CPU path in the same batch: those are exact.
    """
    ds = dataset(index)
    png = next(i for i in range(len(ds)) if ds.location(i)[0] and _is_png(ds, i))
    cpu = batches(DataLoader(ds, batch_size=6, num_workers=workers))
    device = batches(DataLoader(ds, batch_size=6, num_workers=workers, decode_device="cpu"))
    std = torch.tensor(STD).view(1, 3, 1, 1)
    order = list(range(len(ds)))  # no shuffle: batch k holds records 6k..6k+5
    for k, ((a, la), (b, lb)) in enumerate(zip(cpu, device)):
        assert torch.equal(la, lb) and a.shape == b.shape and b.dtype == torch.float32
        mean_abs = float(((a - b) * std).abs().mean())
        assert mean_abs <= 3 / 255, (k, mean_abs)
        for j, i in enumerate(order[6 * k : 6 * k + 6]):
            if i == png:
                assert torch.equal(a[j], b[j]), "the PNG took the CPU path"


def _is_png(ds: IndexTFRDataset, i: int) -> bool:
    return ds._data.image_bytes(i)[:4] == b"\x89PNG"


def test_device_and_decode_device_arguments(index: Path) -> None:
    ds = dataset(index)
    with pytest.raises(ValueError, match="differs"):
        DataLoader(ds, batch_size=4, device="cpu", decode_device="meta")
    uint8 = dataset(index, transform=T.Compose([T.CenterCrop(32), T.PILToTensor()]))
    with pytest.raises(ValueError, match="uint8"):
        DataLoader(uint8, batch_size=4, device="cpu")
    # uint8 plans decode on the device too, and stay uint8.
    images, _ = next(iter(DataLoader(uint8, batch_size=4, decode_device="cpu")))
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 32, 32)


class _StandInNvImageCodec(types.ModuleType):
    """``nvidia.nvimgcodec`` as far as ``_gpu_jpeg`` uses it, decoding with PIL.

    Its images are HWC uint8 numpy arrays (which speak DLPack, as
    nvImageCodec's do); a stream PIL cannot open decodes to ``None``, as
    nvImageCodec reports a failed image. Records what it was asked for.
    """

    def __init__(self) -> None:
        super().__init__("nvidia.nvimgcodec")
        self.BackendKind = types.SimpleNamespace(
            CPU_ONLY="cpu", GPU_ONLY="gpu", HW_GPU_ONLY="hw", HYBRID_CPU_GPU="hybrid"
        )
        self.ColorSpec = types.SimpleNamespace(SRGB="srgb")
        self.SampleFormat = types.SimpleNamespace(I_RGB="i_rgb")
        self.decoders: list[dict] = []
        self.batches: list[int] = []
        module = self

        class Decoder:
            def __init__(self, device_id: int = -1, backends: Any = None) -> None:
                module.decoders.append({"device_id": device_id, "backends": backends})

            def decode(self, streams: list, params: Any = None, cuda_stream: int = 0) -> list:
                assert params == ("srgb", "i_rgb", False), params
                module.batches.append(len(streams))
                out = []
                for data in streams:
                    try:
                        out.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
                    except OSError:
                        out.append(None)
                return out

        self.Decoder = Decoder
        self.Backend = lambda kind: kind
        self.CodeStream = lambda array: bytes(array)
        self.DecodeParams = lambda apply_exif_orientation, color_spec, sample_format: (
            color_spec,
            sample_format,
            apply_exif_orientation,
        )


@pytest.fixture
def stand_in_nvimgcodec(monkeypatch: pytest.MonkeyPatch) -> _StandInNvImageCodec:
    fake = _StandInNvImageCodec()
    parent = sys.modules.get("nvidia") or types.ModuleType("nvidia")
    monkeypatch.setitem(sys.modules, "nvidia", parent)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", fake)
    monkeypatch.setattr(parent, "nvimgcodec", fake, raising=False)
    return fake


def test_the_nvimagecodec_decoder_feeds_the_same_batches(
    index: Path, stand_in_nvimgcodec: _StandInNvImageCodec
) -> None:
    """``jpeg_decoder="nvimagecodec"`` runs its adapter on the CPU (a stand-in
    decoding with PIL, the same libjpeg-turbo as torchvision's CPU decoder):
    the batches equal torchvision's, and a record it fails takes the CPU path."""
    ds = dataset(index)
    torchvision = batches(DataLoader(ds, batch_size=6, decode_device="cpu"))
    loader = DataLoader(ds, batch_size=6, decode_device="cpu", jpeg_decoder="nvimagecodec")
    ours = batches(loader)
    assert stand_in_nvimgcodec.decoders == [{"device_id": -1, "backends": ["cpu"]}]
    assert sum(stand_in_nvimgcodec.batches) == sum(not _is_png(ds, i) for i in range(len(ds))), (
        "every JPEG, and only the JPEGs, went to the decoder"
    )
    assert len(ours) == len(torchvision)
    for (a, la), (b, lb) in zip(torchvision, ours):
        assert torch.equal(la, lb)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_an_image_nvimagecodec_fails_takes_the_cpu_path(
    index: Path, stand_in_nvimgcodec: _StandInNvImageCodec, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = dataset(index)
    cpu = batches(DataLoader(ds, batch_size=6))
    loader = DataLoader(ds, batch_size=6, decode_device="cpu", jpeg_decoder="nvimagecodec")
    decoder = loader._tiacc_decoder._jpeg._decoder
    real = decoder.decode
    monkeypatch.setattr(decoder, "decode", lambda s, **kw: [None] * len(real(s, **kw)))
    # Every JPEG refused: the whole batch is the CPU path's, exactly.
    for (a, la), (b, lb) in zip(cpu, batches(loader)):
        assert torch.equal(la, lb)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_jpeg_decoder_argument_errors(index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = dataset(index)
    with pytest.raises(ValueError, match="jpeg_decoder='nvimagecodec' picks the decoder"):
        DataLoader(ds, batch_size=4, jpeg_decoder="nvimagecodec")
    with pytest.raises(ValueError, match="jpeg_decoder='nvjpeg': expected one of torchvision"):
        DataLoader(ds, batch_size=4, decode_device="cpu", jpeg_decoder="nvjpeg")
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # not installed
    with pytest.raises(ImportError, match="pip install nvidia-nvimgcodec-cu13"):
        DataLoader(ds, batch_size=4, decode_device="cpu", jpeg_decoder="nvimagecodec")

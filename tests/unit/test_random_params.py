"""The fused path's random draws against torchvision's: same stream, same parameters.

Both sources of the engine's sampler are checked: its reproduction of
torch's CPU generator, and torch's own calls (the fallback).
"""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms as T

from tiacc_training import _engine
from tiacc_training.torch.data import _random_params
from tiacc_training.torch.data._random_params import TorchDraws, crop_sampler, reproduction, sample

SIZES = [(500, 375), (375, 500), (90, 70), (1, 1), (3000, 20), (20, 3000), (224, 224)]
CASES = [
    ((0.08, 1.0), (3 / 4, 4 / 3)),
    ((0.9, 1.0), (0.2, 5.0)),  # often no fit in 10 tries: the fallback
    ((1.0, 1.0), (1.0, 1.0)),
]


def test_the_engine_reproduces_this_torch():
    # Where this fails, every batch draws from torch: correct, but slower.
    assert reproduction() is not None


def _torchvision(seed: int, scale, ratio, flip_p: float) -> tuple[list, torch.Tensor]:
    """torchvision's crops and flips of SIZES from seed, and the state after."""
    torch.manual_seed(seed)
    want = []
    for width, height in SIZES:
        stand_in = torch.empty(1, 1, 1).expand(3, height, width)
        top, left, h, w = T.RandomResizedCrop.get_params(stand_in, scale, ratio)
        flip = bool(torch.rand(1) < flip_p)
        want.append(((left, top, w, h), (32, 24), (0, 0, 32, 24), flip))
    return want, torch.get_rng_state()


@pytest.mark.parametrize("scale, ratio", CASES)
@pytest.mark.parametrize("source", ["engine", "torch"])
def test_crop_and_flip_equal_torchvision(scale, ratio, source):
    sampler = crop_sampler(scale, ratio, (24, 32), flip_p=0.3)
    for seed in range(60):
        want, after = _torchvision(seed, scale, ratio, 0.3)
        torch.manual_seed(seed)
        if source == "engine":
            got = sample(sampler, SIZES, None)
        else:
            got = sampler.sample_with(SIZES, TorchDraws())
        assert got == want, seed
        assert torch.equal(torch.get_rng_state(), after), "random stream consumed differently"


def test_images_the_engine_is_unsure_of_are_drawn_by_torch():
    # About one 500 x 375 crop in five thousand depends on the last bits of
    # torch's exp: those go to torch, and the whole batch still equals
    # torch's draws.
    class Counting(TorchDraws):
        images = 0

        def flip(self, p: float) -> bool:
            Counting.images += 1
            return super().flip(p)

    sampler = crop_sampler((0.08, 1.0), (3 / 4, 4 / 3), (224, 224), flip_p=0.5)
    sizes = [(500, 375), (640, 480)] * 15000
    ours, theirs = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    got = sampler.sample(sizes, ours, Counting(ours), reproduction())
    assert got == sampler.sample_with(sizes, TorchDraws(theirs))
    assert torch.equal(ours.get_state(), theirs.get_state())
    assert 0 < Counting.images < 60


def test_a_generator_of_its_own_is_drawn_from_and_advanced():
    sampler = crop_sampler((0.08, 1.0), (3 / 4, 4 / 3), (8, 8), flip_p=0.5)
    ours, theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    torch.manual_seed(0)
    global_before = torch.get_rng_state()
    for _ in range(3):
        assert sample(sampler, SIZES, ours) == sampler.sample_with(SIZES, TorchDraws(theirs))
        assert torch.equal(ours.get_state(), theirs.get_state())
    assert torch.equal(torch.get_rng_state(), global_before)


def test_reversed_ratio_bounds_fail_as_in_torchvision():
    with pytest.raises(RuntimeError) as want:
        T.RandomResizedCrop.get_params(torch.empty(3, 10, 10), (0.3, 0.3), (2.0, 0.5))
    sampler = crop_sampler((0.3, 0.3), (2.0, 0.5), (8, 8))
    assert not sampler.ranges_ordered  # drawn from torch, which raises
    with pytest.raises(RuntimeError) as got:
        sample(sampler, [(10, 10)], None)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("p", [0.5, 0.3, 0.0, 1.0, 0.7000001, 1])
def test_flip_draw_equals_random_horizontal_flip(p):
    sampler = _engine.Sampler("center", center=(4, 4), flip_p=p)
    for seed in range(200):
        torch.manual_seed(seed)
        want = [bool(torch.rand(1) < p) for _ in range(3)]
        after_want = torch.rand(1)
        torch.manual_seed(seed)
        assert [g[3] for g in sample(sampler, [(9, 9)] * 3, None)] == want, seed
        assert torch.equal(torch.rand(1), after_want)


def test_float64_default_dtype_draws_from_torch_like_torchvision():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        sampler = crop_sampler((0.08, 1.0), (3 / 4, 4 / 3), (8, 8), flip_p=0.3)
        assert _random_params.reproducible(sampler) is None
        for seed in range(50):
            torch.manual_seed(seed)
            top, left, h, w = T.RandomResizedCrop.get_params(
                torch.empty(3, 375, 500), (0.08, 1.0), (3 / 4, 4 / 3)
            )
            want_flip = bool(torch.rand(1) < 0.3)
            torch.manual_seed(seed)
            assert sample(sampler, [(500, 375)], None) == [
                ((left, top, w, h), (8, 8), (0, 0, 8, 8), want_flip)
            ]
    finally:
        torch.set_default_dtype(old)


def test_a_malformed_generator_state_is_refused_with_its_size():
    sampler = crop_sampler((0.08, 1.0), (3 / 4, 4 / 3), (8, 8))

    class Short:
        def get_state(self) -> torch.Tensor:
            return torch.zeros(10, dtype=torch.uint8)

    with pytest.raises(ValueError, match="10 bytes, expected 5056"):
        sampler.sample([(5, 5)], Short(), TorchDraws(), False)


def test_resize_and_center_crop_windows_as_torchvision():
    from PIL import Image

    for size, max_size, center in [(256, None, (224, 224)), ([300], 400, (100, 120)),
                                   ([64, 48], None, (64, 48))]:  # fmt: skip
        engine_size = [size] if isinstance(size, int) else size
        sampler = _engine.Sampler("resize", size=engine_size, max_size=max_size, center=center)
        for width, height in [(500, 375), (375, 500), (50, 40), (1000, 10)]:
            resized = T.Resize(size, max_size=max_size)(Image.new("RGB", (width, height)))
            [(crop, (rw, rh), (left, top, cw, ch), flip)] = sample(sampler, [(width, height)], None)
            assert crop == (0, 0, width, height) and not flip
            assert (rw, rh) == resized.size, (size, width, height)
            # CenterCrop of the resized image, padding included: the window
            # covers exactly the pixels CenterCrop keeps.
            kept = T.CenterCrop(center)(Image.new("L", resized.size, 255))
            inside = torch.tensor(list(kept.getdata())).reshape(ch, cw) > 0
            want = torch.zeros(ch, cw, dtype=torch.bool)
            want[max(0, -top) : min(ch, rh - top), max(0, -left) : min(cw, rw - left)] = True
            assert torch.equal(inside, want), (size, width, height)


def test_a_whole_batch_in_the_engine_equals_torchs_draws(tmp_path):
    # load_batch (read, draw, render with the GIL released) against the
    # same batch drawn by torch's calls: equal pixels, equal generator
    # state, and the images the engine was unsure of went to torch.
    from PIL import Image

    from tests.conftest import pack_folder
    from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset

    (tmp_path / "imgs" / "a").mkdir(parents=True)
    for k, size in enumerate([(500, 375), (640, 480)]):  # flat: quick to decode
        Image.new("RGB", size, (120, 80 + k, 40)).save(tmp_path / "imgs" / "a" / f"{k}.JPEG")
    index = pack_folder(tmp_path, 10)
    transform = T.Compose([T.RandomResizedCrop(8), T.RandomHorizontalFlip(), T.ToTensor()])
    ds = IndexTFRDataset(str(index.parent), str(index), transform)
    plan = ds._plan
    indices = [0, 1] * 6000

    class Counting(TorchDraws):
        images = 0

        def flip(self, p: float) -> bool:
            Counting.images += 1
            return super().flip(p)

    ours = torch.Generator().manual_seed(3)
    state = ours.get_state()
    got = torch.empty((len(indices), 3, 8, 8))
    ds._data.load_batch(indices, plan.sampler, state.numpy(), ours, Counting(ours),
                        reproduction(), got.numpy(), None, None, True, 1)  # fmt: skip
    theirs = torch.Generator().manual_seed(3)
    images = ds._data.read_images(indices, 1)
    geometries = plan.sampler.sample_with(images.sizes, TorchDraws(theirs))
    want = torch.empty_like(got)
    ds._data.render_images(images, geometries, want.numpy(), None, None, True, 1)
    assert torch.equal(got, want)
    assert torch.equal(state, theirs.get_state())
    assert Counting.images > 0


def test_a_sampler_pickles_for_spawned_workers():
    import pickle

    for sampler in [
        crop_sampler((0.08, 1.0), (3 / 4, 4 / 3), (24, 32), flip_p=0.3),
        _engine.Sampler("resize", size=[256], max_size=300, center=(224, 224), flip_p=None),
        _engine.Sampler("center", center=(5, 7), flip_p=0.5),
    ]:
        again = pickle.loads(pickle.dumps(sampler))
        assert again.output_size == sampler.output_size
        torch.manual_seed(0)
        want = sample(sampler, SIZES, None)
        torch.manual_seed(0)
        assert sample(again, SIZES, None) == want

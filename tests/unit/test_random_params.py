"""The fused path's random draws against torchvision's: same stream, same parameters."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms as T

from tiacc_training.torch._random_params import ResizedCropParams, flip_draw

SIZES = [(500, 375), (375, 500), (90, 70), (1, 1), (3000, 20), (20, 3000), (224, 224)]


@pytest.mark.parametrize(
    "scale, ratio",
    [
        ((0.08, 1.0), (3 / 4, 4 / 3)),
        ((0.9, 1.0), (0.2, 5.0)),  # often no fit in 10 tries: the fallback
        ((1.0, 1.0), (1.0, 1.0)),
    ],
)
def test_crop_params_equal_get_params(scale, ratio):
    params = ResizedCropParams(scale, ratio)
    for seed in range(60):
        for width, height in SIZES:
            torch.manual_seed(seed)
            stand_in = torch.empty(1, 1, 1).expand(3, height, width)
            want = T.RandomResizedCrop.get_params(stand_in, scale, ratio)
            after_want = torch.rand(1)
            torch.manual_seed(seed)
            got = params(width, height)
            assert got == want, (seed, width, height)
            assert torch.equal(torch.rand(1), after_want), "random stream consumed differently"


def test_reversed_ratio_bounds_fail_as_in_torchvision():
    with pytest.raises(RuntimeError) as want:
        T.RandomResizedCrop.get_params(torch.empty(3, 10, 10), (0.3, 0.3), (2.0, 0.5))
    with pytest.raises(RuntimeError) as got:
        ResizedCropParams((0.3, 0.3), (2.0, 0.5))(10, 10)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("p", [0.5, 0.3, 0.0, 1.0, 0.7000001, 1])
def test_flip_draw_equals_random_horizontal_flip(p):
    for seed in range(500):
        torch.manual_seed(seed)
        want = bool(torch.rand(1) < p)
        after_want = torch.rand(1)
        torch.manual_seed(seed)
        assert flip_draw(p) == want, seed
        assert torch.equal(torch.rand(1), after_want)


def test_float64_default_dtype_draws_like_torchvision():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        params = ResizedCropParams((0.08, 1.0), (3 / 4, 4 / 3))
        for seed in range(50):
            torch.manual_seed(seed)
            want = T.RandomResizedCrop.get_params(torch.empty(3, 375, 500), (0.08, 1.0),
                                                  (3 / 4, 4 / 3))  # fmt: skip
            want_flip = bool(torch.rand(1) < 0.3)
            torch.manual_seed(seed)
            assert params(500, 375) == want
            assert flip_draw(0.3) == want_flip
    finally:
        torch.set_default_dtype(old)

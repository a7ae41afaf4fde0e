"""The fused path with ``torchvision.transforms.v2``: same seeds, same crops, same pixels.

Also: which pipelines do not fuse, and the one warning that says why.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from torchvision.transforms import v2

from tests.conftest import pack_folder
from tests.unit.test_fused_path import MEAN, STD, mean_abs_01, pair, photo_like, same_seed_items
from tiacc_training import _engine
from tiacc_training.torch.data import _fused
from tiacc_training.torch.data._fused import FusedPlan
from tiacc_training.torch.data._random_params import sample
from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset

# transforms.v2 left beta, with tv_tensors, in torchvision 0.16 (torch 2.1).
tv_tensors = pytest.importorskip(
    "torchvision.tv_tensors", reason="torchvision < 0.16: transforms.v2 is a beta, no tv_tensors"
)

OURS = "IndexTFRDataset: the fused path"
SIZES = [(500, 375), (375, 500), (90, 70), (1, 1), (3000, 20), (20, 3000), (224, 224)]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fused_v2")
    folder = root / "imgs"
    sizes = [(500, 375), (375, 500), (333, 500), (1000, 800), (640, 480), (90, 70)]
    for i in range(8):
        w, h = sizes[i % len(sizes)]
        photo_like(folder / f"c{i % 2}" / f"{i:03d}.jpg", w, h, 100 + i)
    return pack_folder(root, records_per_shard=3)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forgets the reasons already warned about, so each test sees its first warning."""
    monkeypatch.setattr(_fused, "_WARNED", set())


def ours(records) -> list[warnings.WarningMessage]:
    return [w for w in records if str(w.message).startswith(OURS)]


def to_float():
    return v2.ToDtype(torch.float32, scale=True)


def v2_train(size=224):
    return v2.Compose(
        [
            v2.RandomResizedCrop(size),
            v2.RandomHorizontalFlip(),
            v2.ToImage(),
            to_float(),
            v2.Normalize(MEAN, STD),
        ]
    )


def v2_eval():
    return v2.Compose(
        [v2.Resize(256), v2.CenterCrop(224), v2.ToImage(), to_float(), v2.Normalize(MEAN, STD)]
    )


def quiet_items(fused, plain, i, seed):
    """``same_seed_items`` without torchvision's per-call warnings (antialias=False on PIL)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return same_seed_items(fused, plain, i, seed)


def v2_to_tensor():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in v2
        return v2.ToTensor()


# -- random draws -----------------------------------------------------------


@pytest.mark.parametrize(
    "scale, ratio",
    [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (0.2, 5.0)), ((1.0, 1.0), (1.0, 1.0))],
)
def test_crop_draws_equal_v2_make_params(scale, ratio):
    step = v2.RandomResizedCrop(32, scale=scale, ratio=ratio)
    plan = FusedPlan.from_transform(v2.Compose([step, v2.ToImage()]))
    assert plan is not None and plan.kind == "rrc"
    for seed in range(40):
        for width, height in SIZES:
            stand_in = Image.new("RGB", (width, height))
            torch.manual_seed(seed)
            p = step.make_params([stand_in])
            want = (p["top"], p["left"], p["height"], p["width"])
            after_want = torch.rand(1)
            torch.manual_seed(seed)
            [((left, top, w, h), *_)] = plan.sample([(width, height)])
            assert (top, left, h, w) == want, (seed, width, height)
            assert torch.equal(torch.rand(1), after_want), "random stream consumed differently"


@pytest.mark.parametrize("p", [0.5, 0.3, 0.0, 1.0])
def test_flip_draws_equal_v2_random_horizontal_flip(p):
    image = Image.frombytes("RGB", (3, 1), bytes(range(9)))  # not mirror-symmetric
    step = v2.RandomHorizontalFlip(p)
    sampler = _engine.Sampler("center", center=(1, 3), flip_p=p)
    for seed in range(100):
        torch.manual_seed(seed)
        flipped = step(image).tobytes() != image.tobytes()
        after_want = torch.rand(1)
        torch.manual_seed(seed)
        [(*_, flip)] = sample(sampler, [(3, 1)], None)
        assert flip == flipped, seed
        assert torch.equal(torch.rand(1), after_want), "random stream consumed differently"


# -- fused items against the PIL path running the real v2 transform --------


def test_v2_train_pipeline_matches_pil_path(packed):
    fused, plain = pair(packed, v2_train(), decode_downscale=False)
    v1_fused, _ = pair(packed, T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
                                          T.ToTensor(), T.Normalize(MEAN, STD)]),
                       decode_downscale=False)  # fmt: skip
    worst = 0.0
    for i in range(len(fused)):
        for seed in range(4):
            a, b = same_seed_items(fused, plain, i, seed)
            assert isinstance(b, tv_tensors.Image)  # the real v2 transform ran
            assert a.shape == b.shape == (3, 224, 224) and a.dtype == b.dtype == torch.float32
            worst = max(worst, mean_abs_01(a, b.as_subclass(torch.Tensor)))
            torch.manual_seed(seed)
            c, _ = v1_fused[i]
            assert torch.equal(a, c), "v1 and v2 plans drew or rendered differently"
    assert worst <= 1 / 255, worst


def test_v2_train_pipeline_through_getitems_and_downscaling(packed):
    fused, plain = pair(packed, v2_train(96))
    idx = list(range(len(fused)))
    torch.manual_seed(3)
    batch = fused.__getitems__(idx)
    torch.manual_seed(3)
    for i, (a, label) in zip(idx, batch):
        b, lb = plain[i]
        assert label == lb and mean_abs_01(a, b.as_subclass(torch.Tensor)) <= 2 / 255


def test_v2_eval_pipeline_matches_to_float_rounding(packed):
    fused, plain = pair(packed, v2_eval(), decode_downscale=False)
    for i in range(len(fused)):
        a, b = same_seed_items(fused, plain, i, i)
        assert a.shape == b.shape == (3, 224, 224) and a.dtype == b.dtype == torch.float32
        # ToDtype multiplies by 1/255 where the engine divides by 255: one
        # float32 rounding, divided by std.
        assert (a - b).abs().max().item() <= 1e-6, i


@pytest.mark.parametrize(
    "transform",
    [
        v2.Compose([v2.Resize(256), v2.CenterCrop(224), v2.ToImage()]),
        v2.Compose([v2.Resize(64), v2.CenterCrop((80, 60)), v2.ToImage()]),  # pads
        v2.Compose([v2.CenterCrop(400), v2.PILToTensor()]),  # pads small images
        v2.Compose([v2.Resize((50, 70)), v2.RandomHorizontalFlip(0.5), v2.ToImage()]),
        v2.Compose([v2.Resize(100, max_size=120), v2.CenterCrop(100), v2.ToImage()]),
        v2.Compose([v2.Resize(None, max_size=100), v2.CenterCrop(64), v2.ToImage()]),
        v2.Compose(
            [
                v2.Resize(72, interpolation=T.InterpolationMode.BILINEAR),
                v2.CenterCrop(64),
                v2.ToImage(),
            ]
        ),  # fmt: skip
        v2.Compose(
            [
                v2.Resize(72, interpolation=Image.BILINEAR, antialias=False),
                v2.CenterCrop(64),
                v2.ToImage(),
            ]
        ),  # fmt: skip
        v2.Compose([v2.Resize(256), v2.CenterCrop(224), v2_to_tensor(), v2.Normalize(MEAN, STD)]),
        # Mixed v1 and v2 steps, and a nested Compose.
        T.Compose(
            [
                v2.Resize(64),
                T.CenterCrop(56),
                v2.PILToTensor(),
                T.ConvertImageDtype(torch.float32),
                v2.Normalize(MEAN, STD),
            ]
        ),  # fmt: skip
        v2.Compose([T.Resize(64), v2.CenterCrop(56), v2.Compose([T.ToTensor()])]),
    ],
)
def test_deterministic_v2_chains_are_bit_exact(packed, transform):
    fused, plain = pair(packed, transform, decode_downscale=False)
    for i in range(len(fused)):
        a, b = quiet_items(fused, plain, i, i)
        assert a.dtype == b.dtype and torch.equal(a, b.as_subclass(torch.Tensor)), i


def test_to_image_alone_gives_uint8(packed):
    transform = v2.Compose(
        [v2.RandomResizedCrop(64), v2.RandomHorizontalFlip(), v2.ToImage()]
    )  # fmt: skip
    fused, plain = pair(packed, transform, decode_downscale=False)
    assert fused._plan is not None and not fused._plan.to_float
    for i in range(len(fused)):
        a, b = same_seed_items(fused, plain, i, i)
        assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape == (3, 64, 64)
        assert (a.int() - b.int()).abs().float().mean() <= 1.0


@pytest.mark.parametrize(
    "transform",
    [
        v2.Compose(
            [
                v2.RandomResizedCrop(64),
                T.RandomHorizontalFlip(),
                v2.PILToTensor(),
                to_float(),
                T.Normalize(MEAN, STD),
            ]
        ),  # fmt: skip
        T.Compose(
            [
                T.RandomResizedCrop(64),
                v2.RandomHorizontalFlip(),
                v2.ToImage(),
                T.ConvertImageDtype(torch.float32),
                v2.Normalize(MEAN, STD),
            ]
        ),  # fmt: skip
        v2.Compose(
            [
                v2.RandomResizedCrop(
                    64, interpolation=v2.InterpolationMode.BILINEAR, antialias=False
                ),
                v2.RandomHorizontalFlip(),
                v2.Compose([v2.ToImage(), to_float()]),
                v2.Normalize(MEAN, STD),
            ]
        ),  # fmt: skip
    ],
    ids=["v2-flip-v1", "v1-crop-v2-convert", "nested-antialias-false"],
)
def test_mixed_and_nested_random_chains_match_pil_path(packed, transform):
    fused, plain = pair(packed, transform, decode_downscale=False)
    for i in range(len(fused)):
        for seed in range(3):
            a, b = quiet_items(fused, plain, i, seed)
            assert a.shape == b.shape == (3, 64, 64)
            assert mean_abs_01(a, b.as_subclass(torch.Tensor)) <= 1 / 255


def test_uint8_output_with_a_v2_pipeline(packed):
    ds = IndexTFRDataset(str(packed.parent), str(packed), v2_train(64), output="uint8")
    image, _ = ds[0]
    assert image.dtype == torch.uint8 and image.shape == (3, 64, 64)


# -- what does not fuse, and the warning ------------------------------------


def shown(step) -> str:
    """How the warning shows a step: its repr on one line (reprs differ between torchvision
    releases: 0.26 prints `interpolation=InterpolationMode.BILINEAR`, earlier ones
    `interpolation=bilinear`)."""
    return " ".join(repr(step).split())


UNFUSABLE = [
    (v2.Compose([v2.Resize(256), v2.CenterCrop(224), v2.ToImage(), v2.ToDtype(torch.float32)]),
     "ToDtype(dtype=torch.float32, scale=False) (step 4 of Compose)"),
    (v2.Compose([v2.Resize(256), v2.CenterCrop(224), v2.ToImage(),
                 v2.ToDtype(torch.float64, scale=True)]),
     "ToDtype(dtype=torch.float64, scale=True) (step 4 of Compose)"),
    (v2.Compose([v2.RandomResizedCrop(32), v2.ToImage(),
                 v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True)]),
     "ToDtype(dtype={"),
    (v2.Compose([v2.RandomResizedCrop(32), v2.RandomHorizontalFlip(), v2.GaussianBlur(3),
                 v2.ToImage(), to_float()]),
     shown(v2.GaussianBlur(3)) + " (step 3 of Compose)"),
    (v2.Compose([v2.ToImage(), v2.RandomResizedCrop(32), to_float()]),
     "(step 2 of Compose): it comes after the tensor conversion"),
    (T.Compose([T.RandomResizedCrop(32), T.ColorJitter(0.2), T.ToTensor()]),
     shown(T.ColorJitter(0.2)) + " (step 2 of Compose)"),
    (v2.Compose([v2.RandomResizedCrop(32, interpolation=v2.InterpolationMode.BICUBIC),
                 v2.ToImage()]),
     "only bilinear interpolation"),
    (v2.Compose([v2.Resize(32), v2.ToImage()]), "its output size differs per image"),
    (v2.Compose([v2.RandomResizedCrop(32)]), "with a PIL image"),
    (v2.Compose([v2.RandomResizedCrop(32), v2.ToImage(), v2.Normalize(MEAN, STD)]),
     "Normalize(mean=[0.485, 0.456, 0.406]"),
    (v2.RandomResizedCrop(32),
     shown(v2.RandomResizedCrop(32)) + ": it is not a torchvision Compose"),
    (v2.Compose([v2.Resize(64), v2.CenterCrop(48), v2.Compose([v2.ToImage(), to_float()]),
                 v2.Grayscale(3)]),
     "Grayscale(num_output_channels=3) (step 4 of Compose)"),
    (v2.Compose([v2.Resize(64), v2.CenterCrop(48),
                 v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32)])]),
     "(step 3.2 of Compose)"),
]  # fmt: skip


class MyCrop(v2.RandomResizedCrop):
    pass


UNFUSABLE.append((v2.Compose([MyCrop(32), v2.ToImage()]), "a subclass of"))


@pytest.mark.parametrize("transform, needle", UNFUSABLE)
def test_unfusable_pipelines_explain_and_warn_once(fresh_warnings, transform, needle):
    plan, reason = FusedPlan.explain(transform)
    assert plan is None and reason is not None and needle in reason, reason
    with pytest.warns(UserWarning, match=re.escape(needle)) as record:
        assert FusedPlan.from_transform(transform, warn=True) is None
    [warning] = ours(record)
    assert str(warning.message) == f"{OURS} cannot run {reason}; items take the PIL path"
    assert warning.filename == __file__, "the warning should point at the caller"
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert FusedPlan.from_transform(transform, warn=True) is None
        assert FusedPlan.from_transform(transform) is None
    assert not ours(again), "warned twice for the same reason"


def test_fusable_and_absent_transforms_do_not_warn(fresh_warnings):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert FusedPlan.explain(None) == (None, None)
        assert FusedPlan.from_transform(None, warn=True) is None
        assert FusedPlan.from_transform(v2_train(), warn=True) is not None
        assert FusedPlan.from_transform(v2_eval(), warn=True) is not None
    assert not ours(record)


def test_dataset_never_warns_per_item_nor_for_none_or_fused_false(fresh_warnings, packed):
    blur = v2.Compose([v2.RandomResizedCrop(32), v2.GaussianBlur(3), v2.ToImage(), to_float()])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for kwargs in ({"transform": None}, {"transform": blur, "fused": False}):
            ds = IndexTFRDataset(str(packed.parent), str(packed), **kwargs)
            assert not ds.uses_fused_path
            ds[0], ds.__getitems__([1, 2])
        ds = IndexTFRDataset(str(packed.parent), str(packed), blur)
        first = len(ours(record))
        for i in range(len(ds)):
            ds[i]
        ds.__getitems__(list(range(len(ds))))
    assert first <= 1 and len(ours(record)) == first


def test_dataset_warns_once_naming_the_step(fresh_warnings, packed):
    blur = v2.Compose([v2.RandomResizedCrop(32), v2.RandomHorizontalFlip(), v2.GaussianBlur(3),
                       v2.ToImage(), to_float()])  # fmt: skip
    with pytest.warns(UserWarning, match=re.escape("GaussianBlur(kernel_size=(3, 3)")) as record:
        ds = IndexTFRDataset(str(packed.parent), str(packed), blur)
    [warning] = ours(record)
    assert "(step 3 of Compose); items take the PIL path" in str(warning.message)
    assert warning.filename == __file__
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        IndexTFRDataset(str(packed.parent), str(packed), blur)
        ds.transform = blur
        [ds[i] for i in range(len(ds))]
        IndexTFRDataset(str(packed.parent), str(packed), blur, fused=False)
    assert not ours(again)

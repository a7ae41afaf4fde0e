"""Decoding and augmenting whole batches on a device (``decode_device``).

JPEGs are decoded on the device by the decoder asked for (``_gpu_jpeg``:
torchvision's, nvJPEG on CUDA, or nvImageCodec's), then cropped, resized,
flipped and normalised there, batched: the decoded images are stacked into
one padded tensor and every crop is resampled by one ``roi_align`` call,
which averages ``ceil(scale)`` bilinear samples per output pixel when it
shrinks (so downscaling is antialiased, like Pillow's filter, though not
with Pillow's exact weights).
The random crops and flips are the fused path's own draws, so a seeded run
crops exactly what the CPU path crops; the pixels differ from the CPU path
by the decoders' IDCT rounding and the resampling filter, a few levels of
255.

Records that are not JPEG, and JPEGs the device decoder refuses (CMYK,
arithmetic coding, ...), go through the CPU fused path in the same batch and
are copied into it. On the CPU (``decode_device="cpu"``) the same code runs
with the decoder's CPU form, which is how the tests check it without a GPU.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ._gpu_jpeg import jpeg_decoder

# Padded float32 staging beyond this is resampled in smaller groups.
_STAGING_BYTES = 512 << 20


class DeviceDecoder:
    """Turns records into a batch on ``device``, as the fused plan says.

    Args:
        dataset: An ``IndexTFRDataset`` on the fused path.
        device: Where to decode and augment (``"cuda"``, or ``"cpu"``).
        decoder: The JPEG decoder, one of ``_gpu_jpeg.DECODERS``.
    """

    def __init__(self, dataset: Any, device: torch.device, decoder: str = "torchvision") -> None:
        # Optional dependency, imported when used; here to fail early without it.
        from torchvision.ops import roi_align  # noqa: F401

        self.dataset = dataset
        self.device = torch.device(device)
        self._jpeg = jpeg_decoder(decoder, self.device)

    def batch(
        self, idx: list[int], generator: Optional[torch.Generator]
    ) -> tuple[torch.Tensor, list[Any]]:
        """``(images, targets)`` of records ``idx``; images on the device."""
        ds = self.dataset
        plan = ds._plan
        images = ds._data.read_images(idx, 1)
        geometries = plan.sample(images.sizes, generator)
        # One copy of every image's bytes (in the engine, the GIL released);
        # the decoder takes slices of it.
        packed, offsets, is_jpeg = images.packed()
        flat = torch.from_numpy(packed)
        height, width = plan.output_size
        to_float = plan.to_float
        out = torch.empty(
            (len(idx), 3, height, width),
            dtype=torch.float32 if to_float else torch.uint8,
            device=self.device,
        )
        jpegs = [k for k in range(len(idx)) if is_jpeg[k]]
        decoded = self._jpeg.decode([flat[offsets[k] : offsets[k + 1]] for k in jpegs])
        ok = [k for k, img in zip(jpegs, decoded) if img is not None]
        if ok:
            pixels = _resample(
                [img for img in decoded if img is not None],
                [geometries[k] for k in ok],
                (height, width),
            )
            out[ok] = _finish(pixels, plan, to_float)
        cpu = sorted(set(range(len(idx))) - set(ok))
        if cpu:
            # The CPU fused path, for the records the device did not decode.
            subset = images.select(cpu)
            host = torch.empty((len(cpu), 3, height, width), dtype=out.dtype)
            mean, std = (plan.mean, plan.std) if to_float else (None, None)
            ds._data.render_images(
                subset, [geometries[k] for k in cpu], host.numpy(), mean, std,
                ds.decode_downscale, 1,
            )  # fmt: skip
            out[cpu] = host.to(self.device)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        targets: list[Any] = [ds.targets[i] for i in idx]
        if ds.target_transform is not None:
            targets = [ds.target_transform(t) for t in targets]
        return out, targets


def _boxes(geometries: list[Any], offset: int = 0) -> torch.Tensor:
    """``roi_align`` boxes: each output window mapped back to the source."""
    rows = []
    for k, ((cl, ct, cw, ch), (rw, rh), (wl, wt, ww, wh), _flip) in enumerate(geometries):
        sx, sy = cw / rw, ch / rh
        rows.append(
            [offset + k, cl + wl * sx, ct + wt * sy, cl + (wl + ww) * sx, ct + (wt + wh) * sy]
        )
    return torch.tensor(rows, dtype=torch.float32)


def _resample(
    images: list[torch.Tensor], geometries: list[Any], size: tuple[int, int]
) -> torch.Tensor:
    """Every image's crop resized to ``size`` and flipped: float 0..255, NCHW."""
    from torchvision.ops import roi_align  # optional dependency, imported when used

    device = images[0].device
    height, width = size
    out = torch.empty((len(images), 3, height, width), dtype=torch.float32, device=device)
    for group in _groups(images):
        hmax = max(images[k].shape[1] for k in group)
        wmax = max(images[k].shape[2] for k in group)
        staging = torch.empty((len(group), 3, hmax, wmax), dtype=torch.float32, device=device)
        for j, k in enumerate(group):
            img = images[k]
            h, w = img.shape[1], img.shape[2]
            staging[j, :, :h, :w] = img
            # Edge pixels repeated into the padding: bilinear samples at the
            # border then see the image, not the padding (as Pillow clamps).
            staging[j, :, :h, w:] = staging[j, :, :h, w - 1 : w]
            staging[j, :, h:, :] = staging[j, :, h - 1 : h, :]
        boxes = _boxes([geometries[k] for k in group]).to(device)
        resized = roi_align(staging, boxes, (height, width), 1.0, -1, True)
        out[group] = resized
    # Windows reaching past the resized image (CenterCrop larger than it)
    # are padded with zeros, as torchvision pads.
    masks = [_window_mask(g, height, width) for g in geometries]
    if any(m is not None for m in masks):
        full = torch.ones((height, width), dtype=torch.float32)
        stacked = torch.stack([full if m is None else m for m in masks]).to(device)
        out.mul_(stacked.unsqueeze(1))
    flips = torch.tensor([g[3] for g in geometries], device=device).view(-1, 1, 1, 1)
    return torch.where(flips, out.flip(-1), out)


def _groups(images: list[torch.Tensor]) -> list[list[int]]:
    """Positions in groups whose padded float32 staging fits the budget.

    Images are sorted by size, so similar sizes share a group.
    """
    order = sorted(range(len(images)), key=lambda k: images[k].shape[1] * images[k].shape[2])
    groups: list[list[int]] = []
    current: list[int] = []
    hmax = wmax = 0
    for k in order:
        h, w = images[k].shape[1], images[k].shape[2]
        nh, nw = max(hmax, h), max(wmax, w)
        if current and (len(current) + 1) * 3 * nh * nw * 4 > _STAGING_BYTES:
            groups.append(current)
            current, nh, nw = [], h, w
        current.append(k)
        hmax, wmax = nh, nw
    if current:
        groups.append(current)
    return groups


def _window_mask(geometry: Any, height: int, width: int) -> Optional[torch.Tensor]:
    """Where the output window lies inside the resized image (None: all of it)."""
    _crop, (rw, rh), (wl, wt, ww, wh), _flip = geometry
    if wl >= 0 and wt >= 0 and wl + ww <= rw and wt + wh <= rh:
        return None
    xs = torch.arange(width) + wl
    ys = torch.arange(height) + wt
    inside_x = (xs >= 0) & (xs < rw)
    inside_y = (ys >= 0) & (ys < rh)
    return (inside_y.view(-1, 1) & inside_x.view(1, -1)).to(torch.float32)


def _finish(pixels: torch.Tensor, plan: Any, to_float: bool) -> torch.Tensor:
    """Float 0..255 pixels as the plan's output: normalised float, or uint8."""
    if not to_float:
        return pixels.round_().clamp_(0, 255).to(torch.uint8)
    return normalize_(pixels, plan)


def normalize_(pixels: torch.Tensor, plan: Any) -> torch.Tensor:
    """Float 0..255 pixels to the plan's float output, in place.

    ``(v / 255 - mean) / std``: what ``ToTensor`` then ``Normalize`` give.
    """
    pixels.div_(255.0)
    if plan.mean is not None:
        mean = torch.tensor(plan.mean, device=pixels.device).view(1, 3, 1, 1)
        std = torch.tensor(plan.std, device=pixels.device).view(1, 3, 1, 1)
        pixels.sub_(mean).div_(std)
    return pixels

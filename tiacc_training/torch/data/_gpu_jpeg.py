"""Batched JPEG decoders for ``decode_device``: torchvision's or nvImageCodec.

Each decoder takes every JPEG's bytes (a 1-D uint8 CPU tensor) and returns
CHW uint8 RGB tensors on its device, ``None`` where an image did not decode
(the caller sends those through the CPU path). Neither applies EXIF
orientation, as the CPU path does not.

* ``"torchvision"`` (the default): ``torchvision.io.decode_jpeg`` on the
  device, nvJPEG on CUDA, in one call per batch.
* ``"nvimagecodec"``: NVIDIA's nvImageCodec (``pip install
  nvidia-nvimgcodec-cu13 nvidia-nvjpeg``, or the ``-cu12`` build matching
  torch's CUDA), which can use the GPU's hardware JPEG engines (A100,
  H100): its backends are tried in the order hardware, GPU, hybrid, per
  image. Optional; chosen by the caller, never installed by this package.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

DECODERS = ("torchvision", "nvimagecodec")


def jpeg_decoder(name: str, device: torch.device) -> Any:
    """The decoder called ``name`` (one of :data:`DECODERS`) on ``device``.

    Raises:
        ValueError: ``name`` is not one of :data:`DECODERS`.
        ImportError: the decoder's package is not installed.
    """
    if name == "torchvision":
        return TorchvisionJpeg(device)
    if name == "nvimagecodec":
        return NvImageCodecJpeg(device)
    raise ValueError(f"jpeg_decoder={name!r}: expected one of {', '.join(DECODERS)}")


class TorchvisionJpeg:
    """``torchvision.io.decode_jpeg`` on ``device`` (nvJPEG on CUDA)."""

    # torchvision's CUDA decoder keeps one nvJPEG state per device: one batch
    # at a time.
    _lock = threading.Lock()

    def __init__(self, device: torch.device) -> None:
        # Optional dependency, imported when used; here to fail early without it.
        import torchvision.io  # noqa: F401

        self.device = device

    def decode(self, inputs: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        """CHW uint8 RGB images on the device (``None`` where one failed)."""
        from torchvision.io import ImageReadMode, decode_jpeg  # optional dependency

        if not inputs:
            return []
        with self._lock:
            try:
                return list(decode_jpeg(inputs, mode=ImageReadMode.RGB, device=self.device))
            except RuntimeError:
                pass  # one of them: find which, decode the others
            out: list[Optional[torch.Tensor]] = []
            for one in inputs:
                try:
                    out.append(decode_jpeg(one, mode=ImageReadMode.RGB, device=self.device))
                except RuntimeError:
                    out.append(None)
        return out


class NvImageCodecJpeg:
    """nvImageCodec's batched decoder on ``device``.

    On CUDA its backends are the hardware JPEG engines, then the GPU, then
    hybrid CPU/GPU decoding; on the CPU its CPU backend.

    Raises:
        ImportError: nvImageCodec is not installed.
    """

    def __init__(self, device: torch.device) -> None:
        try:
            from nvidia import nvimgcodec  # optional dependency, installed by the user
        except ImportError as exc:
            raise ImportError(
                "jpeg_decoder='nvimagecodec' needs NVIDIA's nvImageCodec: pip install "
                "nvidia-nvimgcodec-cu13 nvidia-nvjpeg (or nvidia-nvimgcodec-cu12 for a "
                "CUDA 12 torch)"
            ) from exc
        self._nv = nvimgcodec
        self.device = device
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            kinds = ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU")
        else:
            index, kinds = -1, ("CPU_ONLY",)
        backends = [nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, k)) for k in kinds]
        try:
            self._decoder = nvimgcodec.Decoder(device_id=index, backends=backends)
        except RuntimeError as exc:
            raise RuntimeError(
                f"jpeg_decoder='nvimagecodec': nvImageCodec could not start a decoder on "
                f"{device}: {exc}"
            ) from exc
        self._params = nvimgcodec.DecodeParams(
            apply_exif_orientation=False,
            color_spec=nvimgcodec.ColorSpec.SRGB,
            sample_format=nvimgcodec.SampleFormat.I_RGB,
        )
        # One batch at a time per decoder (its scratch state is shared).
        self._lock = threading.Lock()

    def decode(self, inputs: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        """CHW uint8 RGB images on the device (``None`` where one failed)."""
        if not inputs:
            return []
        streams = [self._nv.CodeStream(one.numpy()) for one in inputs]
        stream = 0
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device).cuda_stream
        with self._lock:
            images = self._decoder.decode(streams, params=self._params, cuda_stream=stream)
        out: list[Optional[torch.Tensor]] = []
        for image in images:
            if image is None:
                out.append(None)
                continue
            # HWC, interleaved RGB; torch takes the buffer over DLPack (on
            # CUDA ordered after the decode on the current stream).
            hwc = torch.from_dlpack(image)
            out.append(hwc.to(self.device).permute(2, 0, 1))
        return out

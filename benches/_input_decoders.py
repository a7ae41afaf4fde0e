"""Which backend each GPU JPEG decoder of the input benchmark decodes on.

Neither torchvision nor nvImageCodec reports it: nvJPEG is asked the
questions torchvision's batched decode asks, and nvImageCodec is tried
one backend at a time. ``decoder_backends`` is what the training part
records.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torchvision
from torchvision.io import decode_jpeg

# JPEGs of the dataset the decoders' backends are probed with.
PROBE_IMAGES = 64
# nvJPEG's C API (nvjpeg.h): NVJPEG_BACKEND_HARDWARE, NVJPEG_STATUS_ARCH_MISMATCH.
NVJPEG_BACKEND_HARDWARE = 3
NVJPEG_STATUS_ARCH_MISMATCH = 7


def _loaded_library(prefix: str) -> str | None:
    """The path of a shared library this process has mapped whose name starts with ``prefix``."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                path = line.split()[-1]
                if path.startswith("/") and Path(path).name.startswith(prefix):
                    return path
    except OSError:
        pass
    return None


def nvjpeg_backend(jpegs: list[bytes], device: torch.device) -> dict[str, Any]:
    """The nvJPEG backend torchvision's batched CUDA decode takes for ``jpegs``.

    torchvision (``decode_jpeg`` on a list, 0.19 and later) creates its
    nvJPEG handle with the hardware backend, falling back to the default
    (CUDA) one where ``nvjpegCreateEx`` answers ARCH_MISMATCH (no hardware
    JPEG engine), and decodes on the hardware engine the images
    ``nvjpegDecodeBatchedSupported`` accepts, the others on CUDA. It does not
    report which; the same calls on the libnvjpeg it loaded say it.
    """
    basis = (
        f"torchvision {torchvision.__version__} does not report it; nvjpegCreateEx("
        "NVJPEG_BACKEND_HARDWARE) and nvjpegDecodeBatchedSupported, the calls by which its "
        "batched CUDA decode chooses, asked on its libnvjpeg"
    )
    # One decode loads torchvision's libnvjpeg (and proves it decodes here).
    decode_jpeg([torch.frombuffer(bytearray(jpegs[0]), dtype=torch.uint8)], device=device)
    path = _loaded_library("libnvjpeg")
    if path is None:
        return {"backend": "unknown", "backend_basis": "no libnvjpeg is loaded after a decode"}
    lib = ctypes.CDLL(path)
    lib.nvjpegCreateEx.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint,
                                   ctypes.POINTER(ctypes.c_void_p)]  # fmt: skip
    lib.nvjpegJpegStreamCreate.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.nvjpegJpegStreamParseHeader.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                                ctypes.c_void_p]  # fmt: skip
    lib.nvjpegDecodeBatchedSupported.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                                 ctypes.POINTER(ctypes.c_int)]  # fmt: skip
    lib.nvjpegJpegStreamDestroy.argtypes = [ctypes.c_void_p]
    lib.nvjpegDestroy.argtypes = [ctypes.c_void_p]
    handle = ctypes.c_void_p()
    status = lib.nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, None, None, 0, ctypes.byref(handle))
    if status == NVJPEG_STATUS_ARCH_MISMATCH:
        return {"backend": "CUDA", "backend_basis": basis + f" ({path}): no hardware JPEG "
                "engine on this GPU (ARCH_MISMATCH)"}  # fmt: skip
    if status != 0:
        return {"backend": "unknown", "backend_basis": basis + f" ({path}): nvjpegCreateEx "
                f"failed with status {status}"}  # fmt: skip
    stream = ctypes.c_void_p()
    hardware = 0
    try:
        if lib.nvjpegJpegStreamCreate(handle, ctypes.byref(stream)) != 0:
            return {"backend": "unknown", "backend_basis": basis + ": no nvJPEG stream"}
        for data in jpegs:
            supported = ctypes.c_int(-1)
            if (
                lib.nvjpegJpegStreamParseHeader(handle, data, len(data), stream) == 0
                and lib.nvjpegDecodeBatchedSupported(handle, stream, ctypes.byref(supported)) == 0
                and supported.value == 0  # 0: the hardware backend decodes it
            ):
                hardware += 1
    finally:
        if stream.value:
            lib.nvjpegJpegStreamDestroy(stream)
        lib.nvjpegDestroy(handle)
    return {
        "backend": _backend_name(hardware, len(jpegs), "CUDA"),
        "backend_basis": basis + f" ({path}), for {len(jpegs)} of the dataset's JPEGs",
        "hardware_images": hardware,
        "probe_images": len(jpegs),
    }


def _backend_name(hardware: int, total: int, other: str | None) -> str:
    """``hardware``, ``other``, or both with the count each decoded."""
    if hardware == total:
        return "hardware"
    if other is None:
        return f"hardware for {hardware} of {total} images, no other backend" if hardware else (
            "unknown")  # fmt: skip
    if hardware == 0:
        return other
    return f"hardware for {hardware} of {total} images, {other} for the rest"


def nvimagecodec_backend(jpegs: list[bytes], device: torch.device, repeats: int = 3) -> dict:
    """The nvImageCodec backend that decodes ``jpegs`` on ``device``, and each one's rate.

    nvImageCodec does not report which backend decoded an image. The loader's
    decoder (``_gpu_jpeg``) lists the hardware JPEG engine, then CUDA, then
    hybrid CPU/GPU decoding, and each image goes to the first that takes it;
    here a decoder limited to each backend in turn decodes the images (timed
    over ``repeats`` passes after one), and the backend named is the first
    in that order that decoded them: inferred, not reported.
    """
    from nvidia import nvimgcodec

    index = device.index if device.index is not None else torch.cuda.current_device()
    params = nvimgcodec.DecodeParams(
        apply_exif_orientation=False,
        color_spec=nvimgcodec.ColorSpec.SRGB,
        sample_format=nvimgcodec.SampleFormat.I_RGB,
    )
    arrays = [torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy() for data in jpegs]
    backends: dict[str, dict[str, Any]] = {}
    for name, kind in (("hardware", "HW_GPU_ONLY"), ("CUDA", "GPU_ONLY"),
                       ("hybrid", "HYBRID_CPU_GPU")):  # fmt: skip
        found: dict[str, Any] = {"decoded": 0, "of": len(jpegs)}
        try:
            backend = nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, kind))
            decoder = nvimgcodec.Decoder(device_id=index, backends=[backend])
            streams = [nvimgcodec.CodeStream(array) for array in arrays]
            images = decoder.decode(streams, params=params)
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(repeats):
                decoder.decode(streams, params=params)
            torch.cuda.synchronize(device)
            found["decoded"] = sum(image is not None for image in images)
            if found["decoded"]:
                found["images_per_s"] = repeats * found["decoded"] / (time.perf_counter() - start)
        except Exception as exc:  # a backend this GPU or this build lacks
            found["error"] = f"{type(exc).__name__}: {exc}"[:300]
        backends[name] = found
    whole = [n for n in ("CUDA", "hybrid") if backends[n]["decoded"] == len(jpegs)]
    return {
        "backend": _backend_name(
            backends["hardware"]["decoded"], len(jpegs), whole[0] if whole else None
        ),
        "backend_basis": "inferred: nvImageCodec does not report it; of decoders limited to one "
        f"backend each, the first in the loader's order (hardware, CUDA, hybrid) that decoded "
        f"{len(jpegs)} of the dataset's JPEGs",
        "backends": backends,
    }


def decoder_backends(img_dir: Path, device: torch.device, nvimagecodec: bool) -> dict:
    """Per GPU decoder, the backend that decodes the dataset's JPEGs on ``device``.

    Keyed by decoder (``torchvision``, ``nvimagecodec``), each with how the
    backend was found (``backend_basis``). The first :data:`PROBE_IMAGES`
    JPEGs of ``img_dir`` are asked about; a probe that fails records
    ``"unknown"`` and why, and the rows still run.
    """
    if device.type != "cuda":
        return {"torchvision": {"decoder": "torchvision", "backend": "CPU (libjpeg)",
                                "backend_basis": "decode_jpeg on the CPU"}}  # fmt: skip
    jpegs = [f.read_bytes() for f in sorted(img_dir.rglob("*.JPEG"))[:PROBE_IMAGES]]
    probes: dict[str, Callable[[list[bytes], torch.device], dict[str, Any]]] = {
        "torchvision": nvjpeg_backend
    }
    if nvimagecodec:
        probes["nvimagecodec"] = nvimagecodec_backend
    found: dict[str, dict[str, Any]] = {}
    for decoder, probe in probes.items():
        try:
            found[decoder] = {"decoder": decoder, **probe(jpegs, device)}
        except Exception as exc:  # the rows run all the same
            why = f"the probe failed: {type(exc).__name__}: {exc}"
            found[decoder] = {"decoder": decoder, "backend": "unknown", "backend_basis": why}
        print(f"  {decoder} decodes on {found[decoder]['backend']}", flush=True)
    return found

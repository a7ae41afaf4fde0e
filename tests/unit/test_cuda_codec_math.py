"""The arithmetic the CUDA paths run on the channel stream, checked on CPU.

The same torch ops run on CUDA tensors in the hook; here they run on CPU
tensors to check they mirror the engine's host codec (multiply by
scale / world, cast, sum, cast back, divide by scale) and DDP's averaging.
"""

from __future__ import annotations

import torch

import tiacc_training.torch.distributed as tdist


def _config(compression: str) -> tdist._Config:
    return tdist._effective_config(None, None, None, None, compression)


def test_uncompressed_buckets_are_averaged_in_place_like_ddp() -> None:
    buf = torch.arange(8, dtype=torch.float32)
    expected = buf * (1.0 / 4)
    sent = tdist._encode_on_stream(buf, None, world=4, scale=1.0, average=True)
    assert sent is buf and torch.equal(buf, expected)
    tdist._decode_on_stream(buf, sent, 1.0)
    assert torch.equal(buf, expected)


def test_half_compression_scales_casts_and_unscales() -> None:
    buf = torch.linspace(-3, 3, 101, dtype=torch.float32)
    original = buf.clone()
    sent = tdist._encode_on_stream(buf, torch.float16, world=2, scale=8.0, average=True)
    assert sent.dtype == torch.float16
    assert torch.equal(sent, (original * 4.0).to(torch.float16))
    # A world of two summing identical buckets: the wire sum doubles `sent`.
    reduced = sent * 2
    tdist._decode_on_stream(buf, reduced, 8.0)
    torch.testing.assert_close(buf, original, rtol=1e-3, atol=1e-3)


def test_wire_dtype_only_for_full_precision_buckets_across_ranks() -> None:
    fp16 = _config("fp16")
    assert tdist._wire_dtype(fp16, 2, torch.float32) == torch.float16
    assert tdist._wire_dtype(fp16, 2, torch.float64) == torch.float16
    assert tdist._wire_dtype(fp16, 1, torch.float32) is None
    assert tdist._wire_dtype(fp16, 2, torch.bfloat16) is None
    assert tdist._wire_dtype(_config("bf16"), 4, torch.float32) == torch.bfloat16
    assert tdist._wire_dtype(_config("none"), 4, torch.float32) is None

"""The element-wise steps of the engine's algorithms, as torch operations.

The device engine (``_engine.DeviceEngine``) runs the same algorithms as
the CPU engine; where those need arithmetic on a bucket (averaging, the
half-precision casts, the NaN check, Top-K packing and summing) it calls
these methods. Tensors arrive as flat ``uint8`` tensors plus a byte offset
and length, and are viewed here with the element type the engine names.
The caller runs them inside the channel stream's context, so on CUDA they
are ordered with the NCCL collectives around them; on CPU (the tests) they
run at once.

The arithmetic matches the CPU engine's Rust kernels: casts round to
nearest even, Top-K picks the largest magnitudes of ``data + residual`` and
feeds back what it did not send, and sums add each rank's pairs in rank
order (so every rank gets the same bits). The momentum correction's kernels
round every product and sum to float32 on its own (separate torch
operations, never a fused multiply-add), as the Rust kernels do.
"""

from __future__ import annotations

import torch

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _view(t: torch.Tensor, offset: int, nbytes: int, dtype: str | torch.dtype) -> torch.Tensor:
    kind = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    return t[offset : offset + nbytes].view(kind)


def _packed(t: torch.Tensor, offset: int, k: int, fp16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The Top-K block at byte ``offset``: ``k`` int32 indices, then ``k`` values.

    The values are float16 with ``fp16``, float32 otherwise.
    """
    kind, size = (torch.float16, 2) if fp16 else (torch.float32, 4)
    return _view(t, offset, 4 * k, torch.int32), _view(t, offset + 4 * k, size * k, kind)


class TorchKernels:
    """Kernels on one device, called by the device engine.

    Args:
        device: where the tensors live (a CUDA device, or the CPU).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def empty(self, nbytes: int) -> torch.Tensor:
        """Scratch memory: ``nbytes`` zero bytes on the device."""
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def copy(
        self, src: torch.Tensor, src_off: int, dst: torch.Tensor, dst_off: int, n: int
    ) -> None:
        """Copies ``n`` bytes."""
        dst[dst_off : dst_off + n].copy_(src[src_off : src_off + n])

    def current_stream(self) -> int:
        """The stream kernels run on now, as NCCL takes it (0 on the CPU)."""
        if self.device.type != "cuda":
            return 0
        return torch.cuda.current_stream(self.device).cuda_stream

    def synchronize(self) -> None:
        """Waits until the device has finished all the work queued on it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def load(self, t: torch.Tensor, off: int, data: bytes) -> None:
        """Copies host bytes ``data`` into ``t`` at byte ``off``."""
        host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        t[off : off + len(data)].copy_(host)

    def fetch(self, t: torch.Tensor, off: int, n: int) -> bytes:
        """``n`` bytes of ``t`` from byte ``off``, once the work before is done."""
        return t[off : off + n].cpu().numpy().tobytes()

    def div(self, t: torch.Tensor, off: int, nbytes: int, dtype: str, divisor: float) -> None:
        """Divides the elements in place (DDP's averaging)."""
        _view(t, off, nbytes, dtype).div_(divisor)

    def cast(
        self,
        src: torch.Tensor,
        src_off: int,
        src_bytes: int,
        src_dtype: str,
        factor: float,
        dst: torch.Tensor,
        dst_off: int,
        dst_bytes: int,
        dst_dtype: str,
    ) -> None:
        """``dst = dst_dtype(src * factor)``: the compression casts both ways.

        The product is taken in the wider of float32 and the source type, so
        a half-precision source is widened before it is scaled.
        """
        s = _view(src, src_off, src_bytes, src_dtype)
        d = _view(dst, dst_off, dst_bytes, dst_dtype)
        if factor == 1.0:
            d.copy_(s)
            return
        wide = torch.float64 if torch.float64 in (s.dtype, d.dtype) else torch.float32
        d.copy_(s.to(wide) * factor)

    def first_non_finite(
        self, t: torch.Tensor, off: int, nbytes: int, dtype: str
    ) -> tuple[int, float] | None:
        """The first NaN or infinity: ``(index, value)``, or ``None``.

        Reading the answer waits for the device (the NaN check's one sync).
        """
        v = _view(t, off, nbytes, dtype)
        bad = ~torch.isfinite(v)
        if not bool(bad.any()):
            return None
        index = int(bad.nonzero()[0, 0])
        return index, float(v[index])

    def topk_pack(
        self,
        data: torch.Tensor,
        data_off: int,
        residual: torch.Tensor,
        residual_off: int,
        out: torch.Tensor,
        out_off: int,
        n: int,
        k: int,
        fp16: bool,
    ) -> None:
        """Top-K with error feedback on ``n`` float32 values.

        ``residual += data``; the ``k`` entries of largest magnitude go to
        ``out`` (``k`` int32 indices, ascending, then ``k`` values); what was
        sent is subtracted from ``residual``.
        """
        d = _view(data, data_off, 4 * n, torch.float32)
        r = _view(residual, residual_off, 4 * n, torch.float32)
        r.add_(d)
        index = torch.topk(r.abs(), k, sorted=False).indices.sort().values
        values = r[index]
        sent = values.to(torch.float16) if fp16 else values
        sent_index, sent_values = _packed(out, out_off, k, fp16)
        sent_index.copy_(index)
        sent_values.copy_(sent)
        r.index_put_((index,), values - sent.to(torch.float32))

    def topk_sum(
        self,
        gathered: torch.Tensor,
        gathered_off: int,
        parts: int,
        block: int,
        out: torch.Tensor,
        out_off: int,
        n: int,
        k: int,
        fp16: bool,
    ) -> None:
        """``out = 0``, then every block's pairs added in, block by block.

        Indices within a block are distinct, so each addition is exact and
        the order of additions is rank order on every rank.
        """
        o = _view(out, out_off, 4 * n, torch.float32)
        o.zero_()
        for rank in range(parts):
            index, values = _packed(gathered, gathered_off + rank * block, k, fp16)
            o.index_put_((index.to(torch.int64),), values.to(torch.float32), accumulate=True)

    def clip_norm(self, t: torch.Tensor, off: int, n: int, max_norm: float) -> None:
        """Scales ``n`` float32 values so that their L2 norm is at most ``max_norm``.

        The sum of squares is taken in float64 and the norm rounded to
        float32; when it exceeds ``max_norm`` (as float32) every value is
        multiplied by ``max_norm / norm`` in float32. Nothing waits on the
        device: the factor stays a tensor.
        """
        v = _view(t, off, 4 * n, torch.float32)
        wide = v.to(torch.float64)
        norm = torch.dot(wide, wide).sqrt().to(torch.float32)
        limit = torch.full((), max_norm, dtype=torch.float32, device=v.device)
        one = torch.ones((), dtype=torch.float32, device=v.device)
        v.mul_(torch.where(norm > limit, limit / norm, one))

    def momentum_step(
        self,
        velocity: torch.Tensor,
        velocity_off: int,
        data: torch.Tensor,
        data_off: int,
        n: int,
        momentum: float,
    ) -> None:
        """``velocity = momentum * velocity + data`` on ``n`` float32 values."""
        u = _view(velocity, velocity_off, 4 * n, torch.float32)
        u.mul_(momentum).add_(_view(data, data_off, 4 * n, torch.float32))

    def topk_mask(
        self, block: torch.Tensor, block_off: int, k: int, t: torch.Tensor, off: int, n: int
    ) -> None:
        """Zeroes the ``n`` float32 values of ``t`` at the block's ``k`` indices."""
        index = _view(block, block_off, 4 * k, torch.int32).to(torch.int64)
        _view(t, off, 4 * n, torch.float32).index_fill_(0, index, 0.0)

    def momentum_correct(
        self,
        data: torch.Tensor,
        data_off: int,
        previous: torch.Tensor,
        previous_off: int,
        n: int,
        momentum: float,
    ) -> None:
        """``(data, previous) = (data - momentum * previous, data)``, float32.

        ``data`` holds this step's averaged sparse sum ``S_t``, ``previous``
        the last one; an optimiser with momentum ``momentum`` that is handed
        the result makes the step of DGC's momentum correction.
        """
        d = _view(data, data_off, 4 * n, torch.float32)
        p = _view(previous, previous_off, 4 * n, torch.float32)
        product = p * momentum
        p.copy_(d)
        d.sub_(product)

"""The torch kernels of Top-K's momentum correction, without a process group.

The device engine runs these on CUDA buckets (and, in
``tests/distributed/test_device_engine.py``, on CPU tensors next to the
Rust kernels, bit for bit). Here: what each computes, and the reason the
correction exists, checked against ``torch.optim.SGD`` itself.
"""

from __future__ import annotations

import torch

from tiacc_training.torch.distributed._kernels import TorchKernels

KERNELS = TorchKernels(torch.device("cpu"))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_clip_norm_scales_down_to_the_threshold_only_when_above() -> None:
    t = torch.tensor([0.0, 3.0, -4.0])
    KERNELS.clip_norm(as_bytes(t), 4, 2, 1.0)
    assert torch.equal(t, torch.tensor([0.0, 0.6, -0.8]))
    small = torch.tensor([0.3, 0.4])
    KERNELS.clip_norm(as_bytes(small), 0, 2, 1.0)
    assert torch.equal(small, torch.tensor([0.3, 0.4]))


def test_velocity_and_masking() -> None:
    u = torch.tensor([1.0, 2.0, -4.0])
    KERNELS.momentum_step(as_bytes(u), 0, as_bytes(torch.tensor([0.5, 0.0, 1.0])), 0, 3, 0.5)
    assert torch.equal(u, torch.tensor([1.0, 1.0, -1.0]))
    block = torch.tensor([2, 0], dtype=torch.int32)
    KERNELS.topk_mask(as_bytes(block), 0, 2, as_bytes(u), 0, 3)
    assert torch.equal(u, torch.tensor([0.0, 1.0, 0.0]))


def test_sgd_with_momentum_handed_the_corrected_sums_steps_by_the_sums() -> None:
    """DGC updates ``w -= lr * S_t`` with the sparse sums ``S_t`` (the
    momentum is inside them). DDP hands the user's ``SGD(momentum=m)``
    ``G_t = S_t - m * S_{t-1}`` instead; its buffer ``m * M_{t-1} + G_t``
    is then ``S_t`` at every step, so its update is DGC's."""
    m, lr, n = 0.9, 0.1, 256
    gen = torch.Generator().manual_seed(5)
    w = torch.nn.Parameter(torch.randn(n, generator=gen))
    reference = w.detach().clone()
    opt = torch.optim.SGD([w], lr=lr, momentum=m)
    previous = torch.zeros(n)
    for _ in range(100):
        # Sparse sums: about 5% of the entries, of varying size.
        sums = torch.randn(n, generator=gen) * (torch.rand(n, generator=gen) < 0.05)
        grad = sums.clone()
        KERNELS.momentum_correct(as_bytes(grad), 0, as_bytes(previous), 0, n, m)
        assert torch.equal(previous, sums)
        w.grad = grad
        opt.step()
        reference -= lr * sums
        buffer = opt.state[w]["momentum_buffer"]
        torch.testing.assert_close(buffer, sums, rtol=0, atol=1e-5)
    torch.testing.assert_close(w.detach(), reference, rtol=0, atol=1e-4)

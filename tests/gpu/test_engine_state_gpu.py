"""The device engine's state in a checkpoint, over NCCL on a GPU (a world of one).

Top-K with the momentum correction and a warm-up on two channels (two CUDA
streams): the state saved after 3 steps (``DeviceEngine.state()``, fetched
after the device finished) and loaded into fresh NCCL channels
(``NcclChannels.load_engine_state``: each channel's buffers allocated on
its own stream) continues bit for bit as the uninterrupted engine does; a
fresh engine does not. The same logic runs on CPU tensors in
``tests/unit/test_engine_state.py``. Needs a CUDA device
(``@pytest.mark.gpu``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tiacc_training import _engine
from tiacc_training.torch.distributed import nccl_search_dirs
from tiacc_training.torch.distributed._cuda import NcclChannels
from tiacc_training.torch.distributed._kernels import TorchKernels

pytestmark = pytest.mark.gpu

TOPK = {
    "LIGHT_TOPK_ALLREDUCE": "1",
    "LIGHT_TOPK_RATIO": "0.05",
    "LIGHT_TOPK_THRESHOLD": "0",
    "TIACC_TRAINING_TOPK_MOMENTUM": "0.9",
    "TIACC_TRAINING_TOPK_WARMUP_STEPS": "4",
    "TIACC_TRAINING_NUM_NCCL_STREAMS": "2",
}
LENS = (4096, 1000, 2500)


def channels(config: Any) -> NcclChannels:
    device = torch.device("cuda", 0)
    engine = _engine.DeviceEngine(config, 0, 1, TorchKernels(device), "nccl")
    with torch.cuda.device(device):
        engine.connect_store(dist.HashStore(), "t", 60.0, search_dirs=nccl_search_dirs())
    return NcclChannels(engine, device)


def steps(path: NcclChannels, first: int, last: int) -> list[torch.Tensor]:
    out = []
    for step in range(first, last):
        for bucket, n in enumerate(LENS):
            g = torch.Generator().manual_seed(100 * step + bucket)
            buf = (torch.randn(n, generator=g) * (1 + step % 3)).to(path.device)
            # A CUDA-aware future: waiting orders this stream after the channel's.
            out.append(path.allreduce(buf, bucket).wait().cpu())
    return out


def test_nccl_channels_continue_bit_for_bit_from_a_saved_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in TOPK.items():
        monkeypatch.setenv(name, value)
    config = _engine.CommConfig.from_env()
    whole = channels(config)
    want = steps(whole, 0, 6)
    whole_state = whole.engine.state()
    whole.close()

    first = channels(config)
    steps(first, 0, 3)
    saved = first.engine.state()
    first.close()
    assert sorted(saved["buckets"]) == [0, 1, 2]
    assert len(saved["buckets"][1]["velocity"]) == 4 * LENS[1]

    resumed = channels(config)
    resumed.load_engine_state(saved)
    got = steps(resumed, 3, 6)
    assert resumed.engine.state() == whole_state
    resumed.close()
    fresh = channels(config)
    other = steps(fresh, 3, 6)
    fresh.close()
    rest = want[3 * len(LENS) :]
    for i, (g, w) in enumerate(zip(got, rest)):
        assert torch.equal(g, w), f"allreduce {i} after resuming differs"
    assert not all(torch.equal(o, w) for o, w in zip(other, rest))

"""The environment of GPU test ranks, and the skip where NCCL cannot run them.

Several ranks share GPU 0 here (NCCL >= 2.30 with
``NCCL_MULTI_RANK_GPU_ENABLE=1``), and a suite runs several such launches
at once, each rank with a few communicators (torch's, and one per engine
channel, plus the 2D groups'). NCCL gives every channel of a communicator
buffers per peer, so the ranks cap NCCL's channels and buffers: a suite of
concurrent launches then fits one GPU's memory (unbounded, 16 workers ran
it out of memory on an 80 GB H100). Results do not depend on the caps: the
native and the engine's runs get the same ones.
"""

from __future__ import annotations

import os

import pytest
import torch

# NCCL's channels (CTAs) per communicator and its buffer per channel and peer.
NCCL_CAPS = {"NCCL_MAX_CTAS": "4", "NCCL_BUFFSIZE": str(1 << 20)}


def ranks_env(ranks: int, share: bool = False) -> dict[str, str]:
    """The variables of ``ranks`` ranks over NCCL, or a skip saying why none.

    One GPU per rank where there are enough (and ``share`` is not asked);
    else every rank on GPU 0, which needs an NCCL that allows it (the core's
    rule: 2.30 or later).
    """
    if not share and torch.cuda.device_count() >= ranks:
        return dict(NCCL_CAPS)
    from tiacc_training.torch.distributed._nccl import shared_gpu_unavailable

    why = shared_gpu_unavailable(ranks)
    if why is not None:
        pytest.skip(f"{why} ({torch.cuda.device_count()} GPU here)")
    env = {**NCCL_CAPS, "NCCL_MULTI_RANK_GPU_ENABLE": "1", "CUDA_VISIBLE_DEVICES": "0"}
    library = os.environ.get("TIACC_TRAINING_NCCL_LIBRARY")
    return {**env, "TIACC_TRAINING_NCCL_LIBRARY": library} if library else env

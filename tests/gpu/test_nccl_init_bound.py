"""NCCL initialisation that never completes is bounded (a peer never arrives).

The communicator is built in NCCL's non-blocking mode and polled until a
deadline, then aborted: the caller gets ``CommTimeoutError`` within the
timeout plus 5 s, never a hang. Needs a CUDA device (``@pytest.mark.gpu``);
the deadline logic itself is tested without one in the engine's Rust tests
(``a_non_blocking_init_is_polled_until_ready_and_aborted_at_its_deadline``).
It drives ``_engine.NcclCommunicator``, built only with the cargo feature
``nccl-communicator`` (``maturin develop --release --features
nccl-communicator``): skipped without it.
"""

from __future__ import annotations

import time

import pytest
import torch

from tiacc_training import _engine
from tiacc_training.errors import CommTimeoutError
from tiacc_training.torch.distributed import nccl_search_dirs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not hasattr(_engine, "NcclCommunicator"),
        reason="_engine.NcclCommunicator is built only with the cargo feature nccl-communicator",
    ),
]

TIMEOUT = 4.0


def test_a_communicator_whose_peer_never_arrives_times_out_and_is_aborted() -> None:
    dirs = nccl_search_dirs()
    unique_id = _engine.nccl_unique_id(dirs, None)
    torch.cuda.set_device(0)
    start = time.monotonic()
    # Rank 0 of 2; rank 1 never joins.
    with pytest.raises(CommTimeoutError) as caught:
        _engine.NcclCommunicator(unique_id, 0, 2, dirs, None, "world", TIMEOUT)
    waited = time.monotonic() - start
    message = str(caught.value)
    print(f"TIME_TO_ERROR nccl_init_peer_never_arrives {waited:.2f}s: {message}")
    assert "world communicator, rank 0 of 2: ncclCommInitRankConfig" in message
    assert "did not complete within 4.0s" in message
    assert TIMEOUT <= waited < TIMEOUT + 5.0, waited
    # The process is still usable: a one-rank communicator initialises.
    alone = _engine.NcclCommunicator(_engine.nccl_unique_id(dirs, None), 0, 1, dirs, None)
    assert alone.size == 1
    alone.destroy()

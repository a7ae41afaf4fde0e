"""One GPU per rank for NCCL: ranks sharing a GPU are found before NCCL's init.

The exchange runs through a real c10d store; the GPU identities are given,
so the decision is tested without a GPU (the end-to-end case is in
``tests/gpu``).
"""

from __future__ import annotations

import datetime
import logging

import pytest
import torch.distributed as dist

import tiacc_training.torch.distributed as tdist
from tiacc_training.errors import CommError, TiaccError


def test_ranks_sharing_groups_equal_identities_in_rank_order() -> None:
    assert tdist._ranks_sharing(["h/GPU a", "h/GPU b", "g/GPU a"]) == []
    assert tdist._ranks_sharing(["h/GPU a", "h/GPU b", "h/GPU a", "h/GPU b", "h/GPU c"]) == [
        [0, 2],
        [1, 3],
    ]
    assert tdist._ranks_sharing(["h/GPU a"] * 3) == [[0, 1, 2]]
    assert tdist._ranks_sharing([]) == []


def test_exchange_returns_every_rank_value_in_rank_order() -> None:
    store = dist.HashStore()
    store.set("p/0", "zero")
    store.set("p/2", "two")
    assert tdist._exchange(store, "p", 1, 3, "one", timeout=5) == ["zero", "one", "two"]


def test_exchange_times_out_when_a_rank_never_publishes() -> None:
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    with pytest.raises(Exception, match="(?i)timeout|timed out|wait"):
        tdist._exchange(store, "q", 0, 2, "zero", timeout=0.5)


@pytest.fixture
def placement(monkeypatch: pytest.MonkeyPatch):
    """Rank 0 of two, whose peer already published ``peer``; returns a runner."""

    def run(transport: str, mine: str, peer: str) -> str:
        store = dist.HashStore()
        round_ = tdist._state.placement_round + 1
        store.set(f"tiacc_training/gpu{round_}/1", peer)
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(tdist, "_gpu_identity", lambda device: mine)
        monkeypatch.setattr(tdist._state, "cuda_transport", "nccl")
        config = tdist._effective_config(None, None, 5, True, transport=transport)
        tdist._check_one_gpu_per_rank(config, None)  # type: ignore[arg-type]
        return tdist._state.cuda_transport

    return run


def test_distinct_gpus_keep_nccl(placement) -> None:
    assert placement("auto", "node1/GPU a", "node1/GPU b") == "nccl"
    assert placement("nccl", "node1/GPU a", "node2/GPU a") == "nccl"


def test_auto_falls_back_to_tcp_staging_naming_the_ranks(placement, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger=tdist.logger.name):
        assert placement("auto", "node1/GPU a", "node1/GPU a") == "tcp"
    assert "ranks 0, 1 share node1/GPU a" in caplog.text
    assert "host staging" in caplog.text


def test_explicit_nccl_with_a_shared_gpu_is_a_comm_error(placement) -> None:
    with pytest.raises(CommError, match="one GPU per rank, but ranks 0, 1 share node1/GPU a") as e:
        placement("nccl", "node1/GPU a", "node1/GPU a")
    assert isinstance(e.value, TiaccError)
    assert tdist._state.cuda_transport == "nccl"

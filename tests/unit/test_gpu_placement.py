"""Where CUDA buckets go when ranks share GPUs, decided before NCCL's init.

The exchange runs through a real c10d store; GPU identities and NCCL's
version are given, so the decisions are tested without a GPU (the
end-to-end cases are in ``tests/gpu``).
"""

from __future__ import annotations

import datetime
import logging

import pytest
import torch
import torch.distributed as dist

from tiacc_training.errors import CommError, CommTimeoutError, TiaccError
from tiacc_training.torch.distributed import _config, _launch, _nccl, _rendezvous
from tiacc_training.torch.distributed._state import logger


def test_ranks_sharing_groups_equal_identities_in_rank_order() -> None:
    assert _nccl.ranks_sharing(["h/GPU a", "h/GPU b", "g/GPU a"]) == []
    assert _nccl.ranks_sharing(["h/GPU a", "h/GPU b", "h/GPU a", "h/GPU b", "h/GPU c"]) == [
        [0, 2],
        [1, 3],
    ]
    assert _nccl.ranks_sharing(["h/GPU a"] * 3) == [[0, 1, 2]]
    assert _nccl.ranks_sharing([]) == []


def test_exchange_returns_every_rank_value_in_rank_order() -> None:
    store = dist.HashStore()
    store.set("p/0", "zero")
    store.set("p/2", "two")
    assert _rendezvous.exchange(store, "p", 1, 3, "one", timeout=5) == ["zero", "one", "two"]


def test_exchange_times_out_when_a_rank_never_publishes() -> None:
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    # The error names the rank whose key never came, and the exchange.
    with pytest.raises(
        CommTimeoutError, match="rank 0: rank 1 did not reach the start-up exchange 'q'"
    ):
        _rendezvous.exchange(store, "q", 0, 2, "zero", timeout=0.5)


def test_the_failure_board_keeps_the_first_failure() -> None:
    board = _rendezvous.FailureBoard(dist.HashStore(), "job")
    assert board.peek() is None
    assert board.publish("rank 1: bucket 3 holds a non-finite gradient") == (
        "rank 1: bucket 3 holds a non-finite gradient"
    )
    assert board.publish("rank 0: rank 1 closed the connection").startswith("rank 1: bucket 3")
    assert board.peek().startswith("rank 1: bucket 3")
    # Progress records: absent until written, read without waiting.
    assert board.records(2) == [None, None]
    board.record(1, "v1 3 2 1 0")
    assert board.records(2) == [None, "v1 3 2 1 0"]


@pytest.fixture
def placement(monkeypatch: pytest.MonkeyPatch):
    """Rank 0 of two, whose peer already published ``peer``; returns a runner.

    The runner answers the transport CUDA buckets then take, as
    ``_runtime.cuda_path`` adopts it: ``"tcp"`` when the check returns the
    ranks sharing a GPU (kept in ``reasons``), else ``"nccl"``.
    """

    def run(
        transport: str,
        mine: str,
        peer: str,
        version: tuple[int, int, int] = (2, 28, 9),
        multi_rank: bool = False,
    ) -> str:
        store = dist.HashStore()
        prefix = "tiacc_training/gpu1"
        store.set(f"{prefix}/1", peer)
        if multi_rank:
            monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
        else:
            monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
        monkeypatch.setattr(_nccl, "default_store", lambda: store)
        monkeypatch.setattr(_nccl, "gpu_identity", lambda device: mine)
        monkeypatch.setattr(_nccl, "nccl_version", lambda library=None: version)
        config = _config.effective_config(timeout=5, transport=transport)
        reason = _nccl.check_gpu_placement(config, None, 0, 2, prefix)  # type: ignore[arg-type]
        reasons.append(reason)
        return "nccl" if reason is None else "tcp"

    reasons: list[str | None] = []
    run.reasons = reasons  # type: ignore[attr-defined]
    return run


def test_distinct_gpus_keep_nccl(placement) -> None:
    assert placement("auto", "node1/GPU a", "node1/GPU b") == "nccl"
    assert placement("nccl", "node1/GPU a", "node2/GPU a") == "nccl"


def test_auto_falls_back_to_tcp_staging_naming_the_ranks(placement, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger=logger.name):
        assert placement("auto", "node1/GPU a", "node1/GPU a") == "tcp"
    assert "ranks 0, 1 share node1/GPU a" in caplog.text
    assert "host staging" in caplog.text and "NCCL 2.28.9" in caplog.text
    assert placement.reasons == ["ranks 0, 1 share node1/GPU a"]


def test_explicit_nccl_with_a_shared_gpu_is_a_comm_error(placement) -> None:
    with pytest.raises(CommError, match="one GPU per rank .*ranks 0, 1 share node1/GPU a") as e:
        placement("nccl", "node1/GPU a", "node1/GPU a")
    assert isinstance(e.value, TiaccError)
    assert placement.reasons == []  # raised: nothing for the runtime to adopt


def test_nccl_2_30_with_its_switch_lets_ranks_share_a_gpu(placement) -> None:
    shared = ("node1/GPU a", "node1/GPU a")
    assert placement("nccl", *shared, version=(2, 30, 7), multi_rank=True) == "nccl"
    assert placement("auto", *shared, version=(2, 30, 7), multi_rank=True) == "nccl"
    # The switch alone, or the version alone, is not enough.
    assert placement("auto", *shared, version=(2, 28, 9), multi_rank=True) == "tcp"
    assert placement("auto", *shared, version=(2, 30, 7), multi_rank=False) == "tcp"


@pytest.mark.parametrize(
    ("gpus", "version", "multi_rank", "expected"),
    [
        (0, None, False, "gloo"),
        (2, (2, 28, 9), False, "cpu:gloo,cuda:nccl"),
        (1, (2, 28, 9), False, "cpu:gloo,cuda:gloo"),
        (1, (2, 30, 7), True, "cpu:gloo,cuda:nccl"),
        (1, (2, 30, 7), False, "cpu:gloo,cuda:gloo"),
    ],
)
def test_the_default_group_gets_a_backend_for_cpu_and_cuda_tensors(
    monkeypatch: pytest.MonkeyPatch, gpus: int, version, multi_rank: bool, expected: str
) -> None:
    """Two ranks on the node: DDP of a CPU model needs gloo even with CUDA
    present, and ranks sharing a GPU need gloo for CUDA tensors unless NCCL
    can share it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(_launch, "nccl_version", lambda library=None: version)
    if multi_rank:
        monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    config = _config.effective_config()
    assert _launch.default_backend(config, {"local_size": 2}) == expected


def test_auto_stages_over_tcp_at_init_when_the_node_has_fewer_gpus_than_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(_nccl, "nccl_version", lambda library=None: (2, 28, 9))
    config = _config.effective_config()
    transport, reason = _nccl.resolve_cuda_transport(config, {"local_size": 2})
    assert transport == "tcp"
    assert "2 ranks on this node share 1 GPU(s)" in reason and "NCCL 2.28.9" in reason
    with pytest.raises(CommError, match="2 ranks on this node share 1 GPU"):
        _nccl.resolve_cuda_transport(_config.effective_config(transport="nccl"), {"local_size": 2})
    assert _nccl.resolve_cuda_transport(config, {"local_size": 1}) == ("nccl", None)


def test_why_ranks_cannot_share_a_gpu_follows_the_cores_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tiacc_training import _engine

    assert _engine.NCCL_MULTI_RANK_GPU_SINCE == (2, 30, 0)
    assert _engine.nccl_allows_shared_gpu((2, 30, 0)) is True
    assert _engine.nccl_allows_shared_gpu((2, 30, 7), enabled=False) is False
    monkeypatch.setattr(_nccl, "nccl_version", lambda: (2, 28, 9))
    why = _nccl.shared_gpu_unavailable(4)
    assert why is not None and why.startswith("4 ranks on one GPU need NCCL >= 2.30 (found 2.28.9)")
    monkeypatch.setattr(_nccl, "nccl_version", lambda: (2, 30, 7))
    assert _nccl.shared_gpu_unavailable(2) is None

    def missing() -> tuple[int, int, int]:
        raise CommError("no libnccl.so.2 in /nowhere")

    monkeypatch.setattr(_nccl, "nccl_version", missing)
    assert _nccl.shared_gpu_unavailable(2) == (
        "2 ranks on one GPU need NCCL >= 2.30; none loads: no libnccl.so.2 in /nowhere"
    )

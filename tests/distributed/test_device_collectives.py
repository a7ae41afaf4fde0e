"""The CUDA side of the "tiacc" backend: its code on CPU tensors, and the opt-in.

``DeviceCollectives`` serves a group's CUDA collectives through the device
engine. Here its code runs on CPU tensors over the device engine's TCP rings
(gloo underneath in NCCL's place): the same checks, dispatch, counts and
engine calls as on a GPU, without the CUDA streams. The run through
``init_process_group("cpu:tiacc,cuda:tiacc")`` on a GPU is
``tests/gpu/test_cuda_collectives.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _launch import results_of, run_ranks

WORKER = Path(__file__).resolve().parent / "device_collectives_worker.py"

FORWARDED = [
    ["allreduce", "a reduction the engine does not run", 1],
    ["barrier", "an op the engine does not run", 1],
    ["broadcast", "an op the engine does not run", 1],
]


def test_two_ranks_run_the_cuda_sides_collectives_exactly() -> None:
    """Sums and averages of three element types, both tensor and list
    forms, equal the references bit for bit; what the engine does not run
    (a max, broadcast, barrier) went underneath, counted with its reason."""
    for result in results_of(run_ranks(2, [], worker=WORKER, timeout=180.0)):
        assert result["checked"] == 25, result
        assert result["served"] == {"allreduce": 6, "reduce_scatter": 10, "allgather": 6}, result
        assert result["forwarded"] == FORWARDED, result
        assert result["transport"] == "tcp", result
        ring = result["paths"]["collective/none"]
        assert ring["buckets"] == 22 and ring["wire"]["world"] > 0, result


def test_two_nodes_of_two_ranks_scatter_and_gather_over_the_2d_groups() -> None:
    """With 2D forced on 2 x 2, the reduce-scatters and all-gathers (16)
    crossed nodes over the inter-node group, the all-reduces (6) stayed
    on the world ring; results are still exact."""
    ranks = run_ranks(
        4,
        [],
        env={"TIACC_TRAINING_ALGORITHM": "2d"},
        local_size=2,
        worker=WORKER,
        timeout=240.0,
    )
    for result in results_of(ranks):
        assert result["checked"] == 25, result
        two_d = result["paths"]["collective-2d/none"]
        assert two_d["buckets"] == 16, result
        assert two_d["wire"]["inter"] > 0 and two_d["wire"]["world"] == 0, result
        assert result["paths"]["collective/none"]["buckets"] == 6, result


def test_cuda_collectives_go_to_tiacc_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TIACC_TRAINING_CUDA_COLLECTIVES=tiacc`` puts "tiacc" where NCCL
    would serve CUDA tensors, and nowhere else; the default keeps NCCL."""
    from tiacc_training import _engine
    from tiacc_training.torch.distributed import _backend

    if not _backend.register() or not _backend.takes_device_strings():
        pytest.skip(f"this torch cannot take the tiacc backend per device: {_backend._reason}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in [k for k in os.environ if k.startswith("TIACC_TRAINING_")]:
        monkeypatch.delenv(name)
    default = _engine.CommConfig.from_env()
    assert default.cuda_collectives == "nccl"
    assert _backend.cpu_backend(None, default) == "cpu:tiacc,cuda:nccl"
    assert _backend.cpu_backend("nccl", default) == "nccl"
    monkeypatch.setenv("TIACC_TRAINING_CUDA_COLLECTIVES", "tiacc")
    asked = _engine.CommConfig.from_env()
    assert _backend.cpu_backend(None, asked) == "cpu:tiacc,cuda:tiacc"
    assert _backend.cpu_backend("nccl", asked) == "cuda:tiacc"
    assert _backend.cpu_backend("cpu:gloo,cuda:nccl", asked) == "cpu:tiacc,cuda:tiacc"
    # What the script asked for besides NCCL stays.
    assert _backend.cpu_backend("gloo", asked) == "cpu:tiacc,cuda:gloo"
    assert _backend.cpu_backend("cpu:tiacc", asked) == "cpu:tiacc"
    monkeypatch.setenv("TIACC_TRAINING_COLLECTIVES", "gloo")
    cpu_gloo = _engine.CommConfig.from_env()
    assert _backend.cpu_backend(None, cpu_gloo) == "cpu:gloo,cuda:tiacc"
    monkeypatch.setenv("TIACC_TRAINING_CUDA_COLLECTIVES", "mpi")
    with pytest.raises(Exception, match="TIACC_TRAINING_CUDA_COLLECTIVES"):
        _engine.CommConfig.from_env()

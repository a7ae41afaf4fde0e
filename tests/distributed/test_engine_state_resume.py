"""The engine's state in a checkpoint: a Top-K run resumed from one goes on bit for bit.

Two CPU ranks train with Top-K, DGC's momentum correction and a warm-up on
two channels. The uninterrupted run saves a checkpoint after step 3 (the
model, the optimizer and ``tdist.state_dict()``, through ``torch.save``)
and trains on to step 8; fresh processes resume from the checkpoint. With
the engine state loaded (before the DDP model exists, or after) their final
parameters are the uninterrupted run's, bit for bit; without it they differ,
which shows the comparison can fail.
"""

from __future__ import annotations

from pathlib import Path

import torch
from _launch import describe, run_ranks

WORKER = Path(__file__).resolve().parent / "engine_state_worker.py"

ENV = {
    "LIGHT_TOPK_ALLREDUCE": "1",
    "LIGHT_TOPK_RATIO": "0.05",
    "LIGHT_TOPK_THRESHOLD": "0",
    "TIACC_TRAINING_TOPK_MOMENTUM": "0.9",
    "TIACC_TRAINING_TOPK_WARMUP_STEPS": "6",
    "TIACC_TRAINING_NUM_NCCL_STREAMS": "2",
    # Buckets of at most 8 KiB: the model's 22 KiB of gradients in two,
    # one on each channel.
    "TIACC_TRAINING_FUSION_THRESHOLD": "8192",
}


def finals(out: Path, name: str) -> list[list[torch.Tensor]]:
    return [torch.load(out / f"final_{name}_rank{rank}.pt") for rank in range(2)]


def run(out: Path, *args: str) -> list:
    ranks = run_ranks(2, ["--out", str(out), *args], env=ENV, timeout=120, worker=WORKER)
    assert all(r.returncode == 0 for r in ranks), describe(ranks)
    return ranks


def test_a_resumed_top_k_run_continues_bit_for_bit(tmp_path: Path) -> None:
    full = run(tmp_path, "--mode", "full")
    assert "BUCKETS 2 STEPS [3, 3]" in full[0].stdout, describe(full)
    resumed = run(tmp_path, "--mode", "resume")
    for load, carried in (("before", 10), ("after", 20), ("none", 30)):
        assert all(f"CARRIED {load} {carried}" in r.stdout for r in resumed), describe(resumed)

    want = finals(tmp_path, "full")
    assert all(torch.equal(a, b) for a, b in zip(want[0], want[1])), "ranks differ"
    for load in ("before", "after"):
        got = finals(tmp_path, load)
        for rank in range(2):
            for i, (g, w) in enumerate(zip(got[rank], want[rank])):
                assert torch.equal(g, w), (
                    f"engine state loaded {load} DDP: rank {rank} parameter {i} is off by "
                    f"{(g - w).abs().max().item()}"
                )
    # Without the engine state the same steps end elsewhere.
    fresh = finals(tmp_path, "none")
    for rank in range(2):
        assert not all(torch.equal(g, w) for g, w in zip(fresh[rank], want[rank])), rank

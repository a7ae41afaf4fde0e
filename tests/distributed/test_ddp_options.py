"""DDP's options with the engine: same parameters as native DDP, every bucket carried.

``gradient_as_bucket_view``, ``find_unused_parameters`` and ``static_graph``
each train a model of several buckets with 2 ranks, native and through the
engine, over shared memory and over the loopback TCP ring
(``TIACC_TRAINING_SHM=0``). The engine must carry every bucket of every step
(``_hook.totals.engine_buckets``), so a hook that silently stepped aside would
fail here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import describe, json_lines, run_ranks

WORKER = Path(__file__).resolve().parent / "ddp_options_worker.py"


@pytest.mark.parametrize(("shm", "medium"), [("1", "shared memory"), ("0", "tcp")])
def test_ddp_options_match_native_with_every_bucket_through_the_engine(
    shm: str, medium: str
) -> None:
    ranks = run_ranks(2, [], env={"TIACC_TRAINING_SHM": shm}, worker=WORKER, timeout=300)
    assert all(r.returncode == 0 for r in ranks), describe(ranks)
    for r in ranks:
        results = json_lines(r.stdout)
        assert [x["option"] for x in results] == [
            "default",
            "gradient_as_bucket_view",
            "find_unused_parameters",
            "static_graph",
        ], describe(ranks)
        for x in results:
            # The same sums in another order: float32 rounding apart.
            assert x["max_diff"] < 1e-5, x
            assert x["native_carried"] == 0, x
            assert x["buckets"] >= 2 and x["carried"] == x["expected"], x
            assert x["transports"] == {"world": medium}, x

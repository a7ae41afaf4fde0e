"""torch.distributed's CPU collectives through the "tiacc" backend.

Real jobs of 2 and 4 processes on loopback (``collectives_worker.py``):
every collective, reduction and element type is checked on every rank
against values the worker computes itself, asynchronous work included;
ops the engine does not run (``gather``, ``send``/``recv``, ``reduce``,
uneven all-to-all) go to gloo underneath. Training with a synchronised
batch norm and ``ZeroRedundancyOptimizer`` gives the gloo run's results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _launch import describe, results_of, run_ranks, tiacc_class

from tiacc_training.torch.distributed import _backend

WORKER = Path(__file__).resolve().parent / "collectives_worker.py"
# What dist.get_backend() says for a group whose CPU tensors are on "tiacc"
# (torch 2.0.0 takes one backend name for every device).
CPU_TIACC = "cpu:tiacc" if _backend.takes_device_strings() else "tiacc"


def run(world: int, args: list[str], env: dict[str, str] | None = None) -> list[dict]:
    """Runs the worker on ``world`` ranks; every rank's ``RESULT``."""
    return results_of(run_ranks(world, args, env=env, worker=WORKER, timeout=240.0))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict]]]:
    """The same 2-rank job with "gloo" requested: served by tiacc, and by gloo."""
    jobs = {}
    for name, env in (("tiacc", {}), ("gloo", {"TIACC_TRAINING_COLLECTIVES": "gloo"})):
        out = tmp_path_factory.mktemp(name)
        jobs[name] = (out, run(2, ["--train", "--out", str(out)], env=env))
    return jobs


def test_gloo_requested_is_served_by_tiacc(trained: dict) -> None:
    _, results = trained["tiacc"]
    for result in results:
        assert result["cpu_backend"] == tiacc_class(), result
        assert result["backend"] == CPU_TIACC, result
        assert result["line"].startswith("CPU collectives: tiacc"), result
        # The engine ran every native collective; gloo only what it forwards.
        for name in ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall"):
            assert result["served"].get(name, 0) > 0, result
        assert result["forwarded"].get("gather") == 1 and result["forwarded"].get("reduce") == 1
        assert result["forwarded"].get("alltoall") == 2, result  # the two with split sizes
        assert result["transport"] in ("shared memory", "tcp"), result


def test_the_variable_keeps_gloo(trained: dict) -> None:
    _, results = trained["gloo"]
    for result in results:
        assert result["cpu_backend"] == "ProcessGroupGloo", result
        assert result["backend"] == "gloo", result
        assert result["line"] == "CPU collectives: gloo (TIACC_TRAINING_COLLECTIVES=gloo)"


def test_sync_batch_norm_and_zero_train_as_on_gloo(trained: dict) -> None:
    (ours, _), (theirs, _) = trained["tiacc"], trained["gloo"]
    if (theirs / "gloo_lacks_all_gather_into_tensor").exists():
        pytest.skip(f"gloo of torch {torch.__version__} has no all_gather_into_tensor to compare")
    for rank in range(2):
        mine = torch.load(ours / f"train_rank{rank}.pt")
        gloo = torch.load(theirs / f"train_rank{rank}.pt")
        assert mine.keys() == gloo.keys()
        for name, value in mine.items():
            # Exact collectives on both: the same bits.
            assert torch.equal(value, gloo[name]), f"rank {rank} {name}: {value} vs {gloo[name]}"
        assert mine["losses"][-1] < mine["losses"][0], mine["losses"]


def test_four_ranks_with_tiacc_asked_for_explicitly() -> None:
    results = run(4, ["--init", "explicit"])
    for result in results:
        assert result["backend"] == CPU_TIACC, result
        assert result["served"]["allreduce"] >= 100, result


def test_four_ranks_on_two_nodes_scatter_and_gather_over_the_2d_groups() -> None:
    """Two nodes of two ranks (the launcher's local ranks), 2D forced.

    Every check of the worker holds (its values make every order of
    additions exact), and the reduce-scatters and all-gathers went over
    the 2D groups: the inter-node group carried bytes, the world none.
    """
    results = results_of(
        run_ranks(
            4,
            ["--init", "explicit"],
            env={"TIACC_TRAINING_ALGORITHM": "2d"},
            local_size=2,
            worker=WORKER,
            timeout=240.0,
        )
    )
    for result in results:
        two_d = result["paths"].get("collective-2d/none")
        assert two_d and two_d["buckets"] >= 4, result["paths"]
        assert two_d["wire"]["inter"] > 0 and two_d["wire"]["world"] == 0, result["paths"]
        # Other ops, and the reductions other than a sum, stay on the ring.
        assert result["paths"]["collective/none"]["wire"]["world"] > 0, result["paths"]


def test_a_peer_that_exits_makes_the_next_collectives_raise() -> None:
    """The engine's error reaches every way of waiting on a collective.

    A work made by torch from the engine's future returned from ``wait()``
    as if it had succeeded, leaving the output unfilled.
    """
    ranks = run_ranks(
        2, ["--peer-exits"], env={"TIACC_TRAINING_TIMEOUT": "20"}, worker=WORKER, timeout=120.0
    )
    assert all(r.returncode == 0 for r in ranks), describe(ranks)
    lines = [
        line for line in ranks[0].stdout.splitlines() if line.startswith(("RAISED", "RETURNED"))
    ]
    assert lines == [
        "RAISED async wait CommError",
        "RAISED future value CommError",
        "RAISED sync all_reduce CommError",
        "RAISED sync barrier CommError",
    ], describe(ranks)

"""Horovod's operations back to back in one 2-rank job, failures included.

``horovod_sequence_worker.py`` runs, in one process per rank, a long
sequence of working operations and of operations that must fail (the
cases Horovod's own suite checks: mismatched shapes, dtypes, ops, roots
and names, bad splits, refused reductions, operations after ``join()``),
plus the optimizer helpers and process sets. Every expected failure must
raise the class Horovod raises, on every rank, and the job must stay in
step: each case is followed by an allreduce every rank issues.
"""

from __future__ import annotations

from pathlib import Path

from _launch import describe, json_lines, run_ranks

WORKER = Path(__file__).resolve().parent / "horovod_sequence_worker.py"


def test_every_case_in_one_job() -> None:
    # A desynchronised job fails its next collective within the timeout
    # instead of hanging the test.
    ranks = run_ranks(2, [], worker=WORKER, timeout=240.0, env={"TIACC_TRAINING_TIMEOUT": "30"})
    outcomes = []
    for rank in ranks:
        lines = json_lines(rank.stdout)
        assert lines, describe(ranks)
        outcomes.append(lines[-1]["cases"])
    assert [r.returncode for r in ranks] == [0, 0], describe(ranks)
    assert len(outcomes[0]) >= 50, outcomes[0]
    assert outcomes[0].keys() == outcomes[1].keys(), outcomes
    failed = {
        f"rank {r}: {name}": outcome
        for r, cases in enumerate(outcomes)
        for name, outcome in cases.items()
        if outcome != "pass" and not outcome.startswith("skip: ")
    }
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items()) + "\n" + describe(ranks)

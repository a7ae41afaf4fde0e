"""``tests/_launch.case_report``: a failed case's own line first."""

from __future__ import annotations

from tests._launch import Rank, case_report


def _rank(rank: int, stdout: str) -> Rank:
    return Rank(rank, 3, stdout, "", 1.0)


def test_the_first_line_names_the_case_and_its_failure() -> None:
    ranks = [
        _rank(0, "CASE a DONE\nCASE b FAILED CommError: rank 1 timed out\nCASE c DONE\n"),
        _rank(1, "CASE a DONE\nCASE b FAILED AcceleratorError: out of memory\nCASE c DONE\n"),
    ]
    report = case_report(ranks, "b").splitlines()
    assert report[0] == "case b: rank 0: FAILED CommError: rank 1 timed out (+1 more)"
    # It ends with the case's own lines, every rank's.
    assert report[-2:] == [
        "rank 0: FAILED CommError: rank 1 timed out",
        "rank 1: FAILED AcceleratorError: out of memory",
    ]
    # Another case's failure is not this case's.
    assert case_report(ranks, "c").splitlines()[0] == "case c: no DONE line from ranks []"


def test_a_case_that_never_ran_names_the_silent_ranks() -> None:
    ranks = [_rank(0, "CASE a DONE\n"), _rank(1, "CASE a LOSS first 1 last 0.5\n")]
    assert case_report(ranks, "a").splitlines()[0] == "case a: no DONE line from ranks [1]"

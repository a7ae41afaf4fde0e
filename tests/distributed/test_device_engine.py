"""The CUDA path's algorithm code, run on CPU tensors in CPU CI.

CUDA buckets go through ``_engine.DeviceEngine``: the shared algorithms
with torch kernels and, on a GPU, NCCL. Here the same engine runs on CPU
tensors over the TCP rings, next to the host engine (Rust kernels) on the
same buckets, and both must agree bit for bit, for every algorithm and
codec. As both run the same algorithm code, each rank also runs a probe
bucket of known inputs through the device engine and checks it against a
reference the worker computes from every rank's input with torch's own
roundings (``probe_reference``). Only the NCCL calls themselves are left to
``tests/gpu``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _cases import FLAT, TOP_K, TOP_K_DGC
from _launch import case_lines, case_report, describe, run_ranks

WORKER = Path(__file__).resolve().parent / "device_engine_worker.py"

# The flat variants force flat (FLAT): on 2 x 2 ranks each engine's auto
# would time flat against 2D on its own and could pick either (see the auto
# test).
ALGORITHMS = {
    "flat": FLAT,
    "fp16": {**FLAT, "TIACC_TRAINING_COMPRESSION": "fp16", "TIACC_TRAINING_COMPRESSION_SCALE": "4"},
    "bf16": {**FLAT, "TIACC_TRAINING_COMPRESSION": "bf16"},
    "2d": {"LIGHT_2D_ALLREDUCE": "1", "LIGHT_HIERARCHICAL_THRESHOLD": "100000"},
    "2d-fp16-between-nodes": {
        "LIGHT_2D_ALLREDUCE": "1",
        "TIACC_TRAINING_COMPRESSION": "fp16",
        "TIACC_TRAINING_COMPRESSION_SCOPE": "inter",
    },
    "2d-fp16": {"LIGHT_2D_ALLREDUCE": "1", "PERSEUS_ALLREDUCE_DTYPE": "0"},
    "topk": TOP_K,
    "topk-2d-fp16-values": {
        "LIGHT_TOPK_ALLREDUCE": "1",
        "LIGHT_TOPK_THRESHOLD": "4000",
        "LIGHT_TOPK_FP16": "1",
        "LIGHT_2D_ALLREDUCE": "1",
    },
    # Momentum correction with the warm-up (densities 25%, 11%, 5%) and
    # clipping (the large buckets are clipped, the small ones not).
    "topk-dgc": TOP_K_DGC,
    "topk-dgc-masking-2d-fp16-values": {
        "LIGHT_TOPK_ALLREDUCE": "1",
        "LIGHT_TOPK_THRESHOLD": "4000",
        "LIGHT_TOPK_FP16": "1",
        "LIGHT_2D_ALLREDUCE": "1",
        "TIACC_TRAINING_TOPK_MOMENTUM": "0.9",
        "TIACC_TRAINING_TOPK_MOMENTUM_MASKING": "1",
    },
}


def _run(tmp_path: Path, world: int, env: dict[str, str], extra: list[str] | None = None):
    return run_ranks(
        world,
        ["--out", str(tmp_path), *(extra or [])],
        env={"TIACC_TRAINING_TIMEOUT": "60", **env},
        local_size=2,
        worker=WORKER,
        timeout=240,
    )


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """Every (algorithm, channels) case on 4 ranks, in one launch of the ranks."""
    out = tmp_path_factory.mktemp("matrix")
    cases = [
        {
            "id": f"{name}-{channels}",
            "env": {**ALGORITHMS[name], "TIACC_TRAINING_NUM_NCCL_STREAMS": str(channels)},
            "exact": False,
        }
        for name in sorted(ALGORITHMS)
        for channels in (1, 3)
    ]
    (out / "cases.json").write_text(json.dumps(cases))
    ranks = run_ranks(
        4,
        ["--out", str(out), "--cases", str(out / "cases.json")],
        env={"TIACC_TRAINING_TIMEOUT": "60"},
        local_size=2,
        worker=WORKER,
        timeout=540,
    )
    return out, ranks


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_the_device_engine_equals_the_host_engine_bit_for_bit(
    matrix: tuple[Path, list], algorithm: str, channels: int
) -> None:
    """Each case runs in the matrix's one launch of 4 ranks (``--cases``):
    the engines are built anew for it, after the cases before it."""
    world = 4
    out, ranks = matrix
    case = f"{algorithm}-{channels}"
    lines = [case_lines(r.stdout, case) for r in ranks]
    assert all("DONE" in mine for mine in lines), case_report(ranks, case)
    assert all("EQUAL 21" in mine for mine in lines), describe(ranks)
    # Both engines' own counters hold the 21 buckets under the same paths
    # and codecs; the probe's, under the one its settings call for.
    assert all("COUNTED 21" in mine for mine in lines), describe(ranks)
    assert all("COUNTED probe" in mine for mine in lines), describe(ranks)
    # torch.distributed's collectives on device buffers, exact.
    assert all("COLLECTIVES 15" in mine for mine in lines), describe(ranks)
    # The probe against the worker's own reference: bit for bit where the
    # algorithm's roundings are order-free (compression, Top-K), else the
    # float64 average.
    how = "close" if algorithm in ("flat", "2d") else "exact"
    assert all(f"PROBE {how}" in mine for mine in lines), describe(ranks)
    if "2d" in algorithm:
        assert "ENGINE_2D=([0, 1], [0, 2])" in lines[0], describe(ranks)
    first = torch.load(out / case / "device_rank0.pt")
    for rank in range(1, world):
        other = torch.load(out / case / f"device_rank{rank}.pt")
        for key, value in first.items():
            assert torch.equal(value.view(torch.uint8), other[key].view(torch.uint8)), key


def test_a_wrong_result_on_one_rank_fails_its_case_only(tmp_path: Path) -> None:
    """The rank whose result is wrong goes on with the case's collectives, so
    its peers finish the case, and the next case runs on every rank."""
    cases = [
        {"id": "wrong", "env": {**FLAT, "DEVICE_CHECK_WRONG_RANK": "1"}, "exact": False},
        {"id": "after", "env": FLAT, "exact": False},
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    ranks = _run(tmp_path, 2, {}, ["--cases", str(tmp_path / "cases.json")])
    assert [r.returncode for r in ranks] == [3, 3], describe(ranks)
    wrong = [case_lines(r.stdout, "wrong") for r in ranks]
    assert "DONE" in wrong[0] and "EQUAL 21" in wrong[0], describe(ranks)
    assert "DONE" not in wrong[1] and "EQUAL 20" in wrong[1], describe(ranks)
    failed = [x for x in wrong[1] if x.startswith("FAILED AssertionError: step 0 bucket 0 ")]
    assert failed and "differs from the host engine" in failed[0], describe(ranks)
    # Its collectives after the wrong bucket ran with its peer's.
    assert all("COLLECTIVES 15" in mine for mine in wrong), describe(ranks)
    assert all("FAILED_ON ranks [1]" in mine for mine in wrong), describe(ranks)
    after = [case_lines(r.stdout, "after") for r in ranks]
    assert all("DONE" in mine and "EQUAL 21" in mine for mine in after), describe(ranks)
    assert all("cases failed: wrong" in r.stdout for r in ranks), describe(ranks)


def test_after_an_engine_failure_the_next_case_runs_on_fresh_engines(tmp_path: Path) -> None:
    """A NaN fails its case on every rank (the engine's error, published on
    its failure board, its groups broken); the next case builds new engines
    whose board is clean, and passes."""
    nan = {"LIGHT_2D_ALLREDUCE": "1", "TIACC_TRAINING_NAN_CHECK": "1"}
    cases = [
        {"id": "nan", "env": {**nan, "DEVICE_CHECK_NAN_RANK": "1"}, "exact": False},
        {"id": "after", "env": {"LIGHT_2D_ALLREDUCE": "1"}, "exact": False},
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    ranks = _run(tmp_path, 4, {}, ["--cases", str(tmp_path / "cases.json")])
    assert all(r.returncode == 3 for r in ranks), describe(ranks)
    named = "rank 1: bucket 2 holds a non-finite gradient"
    for r in ranks:
        failed = [x for x in case_lines(r.stdout, "nan") if x.startswith("FAILED ")]
        assert failed and named in failed[0], case_report(ranks, "nan")
    assert all("FAILED_ON ranks [0, 1, 2, 3]" in r.stdout for r in ranks), describe(ranks)
    after = [case_lines(r.stdout, "after") for r in ranks]
    assert all("DONE" in mine and "EQUAL 21" in mine for mine in after), case_report(ranks, "after")


def test_two_ranks_of_one_node(tmp_path: Path) -> None:
    ranks = _run(tmp_path, 2, {"LIGHT_2D_ALLREDUCE": "1", "TIACC_TRAINING_COMPRESSION": "bf16"})
    assert all(r.returncode == 0 and "EQUAL 21" in r.stdout for r in ranks), describe(ranks)
    # One node: flat, the whole bucket in bfloat16 (counted as ring/bf16).
    assert all("PROBE exact" in r.stdout for r in ranks), describe(ranks)
    assert all("COUNTED probe" in r.stdout for r in ranks), describe(ranks)


def test_the_nan_check_names_the_rank_and_no_peer_receives_it(tmp_path: Path) -> None:
    env = {"TIACC_TRAINING_NAN_CHECK": "1", "LIGHT_2D_ALLREDUCE": "1"}
    ranks = _run(tmp_path, 4, env, ["--nan-rank", "1"])
    for r in ranks:
        assert r.returncode == 3, describe(ranks)
        assert "rank 1: bucket 2 holds a non-finite gradient (NaN at element 1 of 3)" in (
            r.stdout
        ), describe(ranks)
        assert "RECEIVED_ONLY_FINITE=True" in r.stdout or r.rank == 1, describe(ranks)


@pytest.mark.parametrize("world", [2, 4])
def test_auto_measures_on_the_device_engine_and_every_rank_agrees(
    tmp_path: Path, world: int
) -> None:
    """``auto`` times flat against 2D through the device backend (the NCCL
    path's code, here over TCP on CPU tensors) when the job spans nodes of
    several ranks, and every rank takes the same choice from the same
    numbers. One node of two: nothing to measure, flat."""
    ranks = _run(tmp_path, world, {"TIACC_TRAINING_ALGORITHM": "auto"})
    assert all(r.returncode == 0 and "EQUAL 21" in r.stdout for r in ranks), describe(ranks)
    assert all("COUNTED probe" in r.stdout for r in ranks), describe(ranks)
    choices = [
        next(x for x in r.stdout.splitlines() if x.startswith("AUTO_CHOICE=")) for r in ranks
    ]
    two_d = [next(x for x in r.stdout.splitlines() if x.startswith("TWO_D ")) for r in ranks]
    if world == 2:
        assert choices == ["AUTO_CHOICE=None"] * world, describe(ranks)
        assert all("device=False" in x for x in two_d), two_d
        return
    # The timings are averaged over the ranks: every rank prints one line.
    assert len(set(choices)) == 1, choices
    line = choices[0].removeprefix("AUTO_CHOICE=")
    probe = "(5 rounds of a 4.0 MiB probe: median flat "
    assert line.startswith((f"auto: chose 2d {probe}", f"auto: chose flat {probe}")), line
    assert "intra-node" in line and "inter-node" in line and "fp16 would take" in line, line
    chose_2d = line.startswith("auto: chose 2d")
    assert all(f"device={chose_2d}" in x for x in two_d), (line, two_d)

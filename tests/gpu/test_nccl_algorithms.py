"""Every algorithm on CUDA buckets over NCCL, with 2 and 4 ranks on one GPU.

Several ranks share GPU 0 (NCCL 2.30 and later with
``NCCL_MULTI_RANK_GPU_ENABLE=1``, which these tests set themselves); with an
older NCCL the tests skip and say so. Point ``TIACC_TRAINING_NCCL_LIBRARY``
(and ``LD_PRELOAD``, so that torch uses the same copy) at a newer one.

* DDP training, every algorithm x {1, 4} channels x {2, 4} ranks: ranks end
  bitwise in sync; the flat allreduce equals native NCCL DDP bit for bit;
  2D, fp16 and bf16 stay within tolerance of it; Top-K learns. Native
  DDP and the 9 cases of a world size and channel count run in one launch
  of its ranks (``--cases``), so the ranks, CUDA and the default group
  start once per launch; each case is still its own test, and a case that
  fails costs only itself (``tests/_cases``). Under pytest-xdist,
  ``--dist loadgroup`` keeps a launch's cases on one worker while the
  other launches run on others (``make gpu-check`` passes it).
* The CUDA path against the host engine on the same buckets: Top-K's
  results are bitwise equal to the CPU reference, the dense algorithms
  equal within rounding (NCCL sums in its own order). These cases, too,
  run in one launch per world size and channel count; a rank whose result
  is wrong finishes the case's collectives with its peers before failing it.
* The NaN check: the rank holding the NaN raises naming the bucket, its
  peers raise naming it too, and nobody hangs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _cases import FLAT, TOP_K, TOP_K_DGC
from _gpu_env import ranks_env
from _launch import case_lines, case_report, describe, run_ranks

pytestmark = pytest.mark.gpu

TESTS = Path(__file__).resolve().parents[1]
DDP_WORKER = Path(__file__).resolve().parent / "_nccl_worker.py"
DEVICE_WORKER = TESTS / "distributed" / "device_engine_worker.py"

# Flat variants force flat (FLAT): on 2 x 2 ranks auto times flat against 2D
# at start-up (the host engine and NCCL each on their own) and may take
# either; the "auto" variant checks that path.
ALGORITHMS = {
    "auto": {"TIACC_TRAINING_ALGORITHM": "auto"},
    "flat": FLAT,
    "fp16": {**FLAT, "TIACC_TRAINING_COMPRESSION": "fp16"},
    "bf16": {**FLAT, "TIACC_TRAINING_COMPRESSION": "bf16"},
    "2d": {"LIGHT_2D_ALLREDUCE": "1"},
    "2d-fp16": {
        "LIGHT_2D_ALLREDUCE": "1",
        "TIACC_TRAINING_COMPRESSION": "fp16",
        "TIACC_TRAINING_COMPRESSION_SCOPE": "inter",
    },
    "topk": TOP_K,
    "topk-2d-fp16-values": {
        "LIGHT_TOPK_ALLREDUCE": "1",
        "LIGHT_TOPK_THRESHOLD": "0",
        "LIGHT_TOPK_FP16": "1",
        "LIGHT_2D_ALLREDUCE": "1",
    },
    "topk-dgc": TOP_K_DGC,
}


def matrix(group: str) -> list:
    """(algorithm, channels, world) for every case of a matrix, each launch its own
    pytest-xdist group: the cases of one world size and channel count run in one
    launch of its ranks, on one worker, while the other launches run on others."""
    return [
        pytest.param(
            algorithm,
            channels,
            world,
            id=f"{algorithm}-{channels}-{world}",
            marks=pytest.mark.xdist_group(f"{group}-{world}x{channels}"),
        )
        for world in (2, 4)
        for channels in (1, 4)
        for algorithm in sorted(ALGORITHMS)
    ]


@pytest.fixture(scope="module")
def shared_gpu_env() -> dict[str, str]:
    """The environment of ranks sharing GPU 0; skips below NCCL 2.30."""
    return {
        **ranks_env(4, share=True),
        # Bitwise comparisons need deterministic cuBLAS workspaces.
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "TIACC_TRAINING_TIMEOUT": "120",
    }


def _ranks(world: int, worker: Path, args: list[str], env: dict[str, str], timeout: float = 300):
    return run_ranks(world, args, env=env, timeout=timeout, local_size=2, worker=worker)


def _params(out: Path, mode: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{mode}_rank{rank}.pt")


@pytest.fixture(scope="module")
def ddp_matrix(tmp_path_factory: pytest.TempPathFactory, shared_gpu_env: dict[str, str]):
    """Native NCCL DDP, then every algorithm's case of one world size and
    channel count, trained in one launch (``<out>/native/`` holds native's)."""
    cache: dict[tuple[int, int], tuple[Path, list]] = {}

    def get(world: int, channels: int) -> tuple[Path, list]:
        if (world, channels) not in cache:
            out = tmp_path_factory.mktemp(f"matrix{world}x{channels}")
            cases = [{"id": "native", "env": {}, "channels": 1, "mode": "native"}]
            cases += [
                {"id": f"{name}-{channels}", "env": ALGORITHMS[name], "channels": channels}
                for name in sorted(ALGORITHMS)
            ]
            (out / "cases.json").write_text(json.dumps(cases))
            args = ["--out", str(out), "--mode", "tiacc", "--transport", "nccl", "--steps", "12"]
            args += ["--backend", "nccl"]
            args += ["--cases", str(out / "cases.json")]
            ranks = _ranks(world, DDP_WORKER, args, shared_gpu_env, timeout=540)
            cache[world, channels] = (out, ranks)
        return cache[world, channels]

    return get


@pytest.mark.parametrize(("algorithm", "channels", "world"), matrix("ddp"))
def test_ddp_over_nccl_on_one_gpu(ddp_matrix, algorithm: str, channels: int, world: int) -> None:
    out, ranks = ddp_matrix(world, channels)
    case = f"{algorithm}-{channels}"
    done = f"CASE {case} DONE tiacc nccl"
    assert all(done in r.stdout for r in ranks), case_report(ranks, case)
    ours = [_params(out / case, "tiacc", r) for r in range(world)]
    for r in range(1, world):
        for key, value in ours[0].items():
            assert torch.equal(value, ours[r][key]), f"rank {r} differs from rank 0 in {key}"
    reference = _params(out / "native", "native", 0)
    if algorithm == "flat":
        for key, value in reference.items():
            assert torch.equal(ours[0][key], value), key
    elif not algorithm.startswith("topk"):
        for key, value in reference.items():
            torch.testing.assert_close(ours[0][key], value, rtol=2e-2, atol=2e-3, msg=key)
    else:
        # Top-K sends 5% of the gradient per step: it learns, more slowly.
        prefix = f"CASE {case} LOSS "
        line = next(x for x in ranks[0].stdout.splitlines() if x.startswith(prefix))
        first, last = float(line.split()[4]), float(line.split()[6])
        assert last < first, line


@pytest.fixture(scope="module")
def engine_matrix(tmp_path_factory: pytest.TempPathFactory, shared_gpu_env: dict[str, str]):
    """Every algorithm's case of the engines' check for one world size and
    channel count, in one launch of its ranks (``device_engine_worker.py --cases``)."""
    cache: dict[tuple[int, int], list] = {}

    def get(world: int, channels: int) -> list:
        if (world, channels) not in cache:
            out = tmp_path_factory.mktemp(f"engines{world}x{channels}")
            # Top-K adds the gathered pairs rank by rank on every rank, as
            # the CPU reference does; its dense step inside a node of two
            # adds a + b. So its results are bitwise equal. Dense sums of
            # two ranks are too.
            cases = [
                {
                    "id": f"{name}-{channels}",
                    "env": {**ALGORITHMS[name], "TIACC_TRAINING_NUM_NCCL_STREAMS": str(channels)},
                    "exact": name.startswith("topk") or world == 2,
                }
                for name in sorted(ALGORITHMS)
            ]
            (out / "cases.json").write_text(json.dumps(cases))
            args = ["--out", str(out), "--device", "cuda", "--cases", str(out / "cases.json")]
            ranks = _ranks(world, DEVICE_WORKER, args, shared_gpu_env, timeout=540)
            cache[world, channels] = ranks
        return cache[world, channels]

    return get


@pytest.mark.parametrize(("algorithm", "channels", "world"), matrix("engines"))
def test_the_cuda_path_matches_the_host_engine(
    engine_matrix, algorithm: str, channels: int, world: int
) -> None:
    ranks = engine_matrix(world, channels)
    case = f"{algorithm}-{channels}"
    lines = [case_lines(r.stdout, case) for r in ranks]
    assert all("DONE" in mine and "EQUAL 21" in mine for mine in lines), case_report(ranks, case)
    # torch.distributed's collectives on CUDA buffers through the device
    # engine (NCCL, 2D where it goes 2D): integer-valued, so exact.
    assert all("COLLECTIVES 15" in mine for mine in lines), describe(ranks)
    if algorithm == "auto":
        # 2 x 2 ranks: NCCL's flat and 2D timed on the GPU, one choice on
        # every rank; one node of two: nothing to measure.
        choices = {next(x for x in mine if x.startswith("AUTO_CHOICE=")) for mine in lines}
        assert len(choices) == 1, choices
        want = "AUTO_CHOICE=auto: chose " if world == 4 else "AUTO_CHOICE=None"
        assert choices.pop().startswith(want), describe(ranks)


@pytest.mark.parametrize("algorithm", ["flat", "2d"])
def test_a_nan_is_raised_on_its_rank_and_named_on_the_peers(
    tmp_path: Path, shared_gpu_env, algorithm: str
) -> None:
    # The engine's timeout is short, the engine traces its NCCL waits, and a
    # rank still running after 40 s prints its threads' stacks: a hang shows
    # where it waits (the outcome file keeps those lines).
    env = {**shared_gpu_env, **ALGORITHMS[algorithm], "TIACC_TRAINING_NAN_CHECK": "1"}
    env.update({"TIACC_TRAINING_TIMEOUT": "30", "TIACC_TEST_STACKS_AFTER": "40"})
    env["TIACC_TRAINING_NCCL_TRACE"] = "1"
    args = ["--out", str(tmp_path), "--mode", "tiacc", "--transport", "nccl", "--steps", "12"]
    args += ["--nan-rank", "1", "--nan-step", "3", "--channels", "4"]
    ranks = _ranks(4, DDP_WORKER, args, env, timeout=120)
    for r in ranks:
        assert r.returncode == 3, describe(ranks)
        error = next(x for x in r.stdout.splitlines() if x.startswith("WORKER_ERROR"))
        assert "rank 1: bucket" in error and "non-finite gradient" in error, describe(ranks)
        # Raised by the NaN check or the failure board, not by the timeout.
        timed_out = "CommTimeout" in error or "did not complete within" in error
        assert not timed_out, describe(ranks)

"""DDP on CUDA through the engine: NCCL channels and TCP host staging.

Every test here needs a CUDA device (``@pytest.mark.gpu``; the conftest
skips them without one). Ranks are separate processes with torchrun-style
variables, like the multi-process CPU tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _gpu_env import ranks_env
from _launch import describe, run_ranks

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).resolve().parent / "_nccl_worker.py"
# Bitwise comparisons need deterministic cuBLAS workspaces.
CUDA_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _two_nccl_ranks() -> dict[str, str]:
    """The environment for two ranks over NCCL (a GPU each, or both on GPU 0),
    or a skip saying why none: a test that needs two ranks never runs with one."""
    return ranks_env(2)


def _launch(
    world: int,
    args: list[str],
    timeout: float = 600.0,
    one_gpu: bool = False,
    expect_failure: bool = False,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Runs `world` worker ranks; returns their stdout, failing on any error.

    ``one_gpu`` makes every rank see only GPU 0, so ranks share it even on
    a machine with several, and keeps NCCL's multi-rank switch off: these
    tests check what happens where NCCL cannot share a GPU
    (``test_nccl_algorithms.py`` covers NCCL on a shared GPU). With
    ``expect_failure`` every rank must fail, and their stdout + stderr are
    returned. ``env`` adds variables (``_two_nccl_ranks``'s).
    """
    shared = {"CUDA_VISIBLE_DEVICES": "0", "NCCL_MULTI_RANK_GPU_ENABLE": "0"}
    env = {**CUDA_ENV, **(shared if one_gpu else {}), **(env or {})}
    ranks = run_ranks(world, args, env=env, timeout=timeout, worker=WORKER)
    if expect_failure:
        assert all(r.returncode != 0 for r in ranks), describe(ranks)
        return [r.stdout + r.stderr for r in ranks]
    assert all(r.returncode == 0 for r in ranks), describe(ranks)
    return [r.stdout for r in ranks]


def _params(out: Path, mode: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{mode}_rank{rank}.pt")


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("channels", [1, 4])
def test_world_of_one_over_nccl_equals_native_ddp(tmp_path: Path, channels: int) -> None:
    """One rank by design: the NCCL path's set-up with no peer, and the
    hook's buckets handed back as they are (the average over one rank)."""
    common = ["--out", str(tmp_path), "--steps", "50", "--backend", "nccl"]
    _launch(1, [*common, "--mode", "native"])
    tiacc_args = [*common, "--mode", "tiacc", "--transport", "nccl", "--channels", str(channels)]
    out = _launch(1, tiacc_args)
    assert "DONE tiacc nccl" in out[0]
    _assert_equal(_params(tmp_path, "tiacc", 0), _params(tmp_path, "native", 0), exact=True)


@pytest.mark.parametrize("channels", [1, 4])
def test_two_ranks_over_nccl_equal_native_ddp(tmp_path: Path, channels: int) -> None:
    """Two ranks (or a skip saying why there cannot be): a sum of two and
    the halving are exact, so the engine's NCCL path equals native NCCL DDP
    bit for bit."""
    env = _two_nccl_ranks()
    common = ["--out", str(tmp_path), "--steps", "50", "--backend", "nccl"]
    _launch(2, [*common, "--mode", "native"], env=env)
    tiacc_args = [*common, "--mode", "tiacc", "--transport", "nccl", "--channels", str(channels)]
    out = _launch(2, tiacc_args, env=env)
    assert all("DONE tiacc nccl" in o for o in out)
    ours = [_params(tmp_path, "tiacc", r) for r in range(2)]
    _assert_equal(ours[1], ours[0], exact=True)
    _assert_equal(ours[0], _params(tmp_path, "native", 0), exact=True)


def test_several_nccl_communicators_stay_deadlock_free(tmp_path: Path) -> None:
    # Two ranks, or a skip saying why there cannot be: one rank has no
    # peer to deadlock with.
    env = _two_nccl_ranks()
    args = ["--out", str(tmp_path), "--mode", "tiacc", "--transport", "nccl"]
    # Small buckets: many collectives per step, spread over four channels.
    args += ["--channels", "4", "--steps", "1000", "--bucket-cap-mb", "0.02", "--width", "128"]
    out = _launch(2, args, timeout=900, env=env)
    assert all("DONE tiacc nccl" in o for o in out)
    _assert_equal(_params(tmp_path, "tiacc", 0), _params(tmp_path, "tiacc", 1), exact=True)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_sharing_a_gpu_over_tcp_staging_match_native_ddp(tmp_path: Path, world: int) -> None:
    # Native DDP cannot use NCCL with ranks sharing a GPU; gloo handles CUDA
    # tensors through the host, which is the fair stock comparison here.
    common = ["--out", str(tmp_path), "--steps", "20", "--backend", "gloo"]
    _launch(world, [*common, "--mode", "native"], one_gpu=True)
    tiacc_args = [*common, "--mode", "tiacc", "--transport", "tcp", "--channels", "2"]
    out = _launch(world, tiacc_args, one_gpu=True)
    assert all("DONE tiacc tcp" in o for o in out)
    tiacc = [_params(tmp_path, "tiacc", r) for r in range(world)]
    for r in range(1, world):
        _assert_equal(tiacc[r], tiacc[0], exact=True)
    # Two ranks: a + b is exact in any order, and halving is exact, so the
    # results are bitwise equal; with four the summation order differs.
    _assert_equal(tiacc[0], _params(tmp_path, "native", 0), exact=world == 2)


def test_auto_stages_over_tcp_when_ranks_share_a_gpu(tmp_path: Path) -> None:
    # NCCL cannot run two ranks on one GPU: auto must notice before NCCL's
    # init and stage through the host instead.
    common = ["--out", str(tmp_path), "--steps", "20", "--backend", "gloo"]
    _launch(2, [*common, "--mode", "native"], one_gpu=True)
    args = [*common, "--mode", "tiacc", "--transport", "auto", "--expect-transport", "tcp"]
    out = _launch(2, args, one_gpu=True)
    assert all("DONE tiacc tcp" in o for o in out)
    _assert_equal(_params(tmp_path, "tiacc", 0), _params(tmp_path, "native", 0), exact=True)


def test_explicit_nccl_with_ranks_sharing_a_gpu_names_them(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path), "--steps", "2", "--mode", "tiacc", "--transport", "nccl"]
    out = _launch(2, [*args, "--backend", "gloo"], timeout=300, one_gpu=True, expect_failure=True)
    for text in out:
        # Refused at init (more ranks than GPUs on the node) or when the
        # model is wrapped (ranks found on one GPU), never inside NCCL.
        assert "2 ranks on this node share 1 GPU(s)" in text or (
            "needs one GPU per rank" in text and "ranks 0, 1 share" in text
        ), text[-3000:]


@pytest.mark.parametrize("horovod", [False, True], ids=["torch", "horovod"])
def test_cuda_collectives_through_the_tiacc_backend(horovod: bool) -> None:
    """``init_process_group("cpu:tiacc,cuda:tiacc")``: the CUDA collectives
    torch and Horovod call run on the device engine over NCCL, exact, with
    the ops it does not run forwarded to NCCL underneath (the same checks
    as ``tests/distributed/test_device_collectives.py`` runs on CPU)."""
    worker = Path(__file__).resolve().parent.parent / "distributed" / "device_collectives_worker.py"
    args = ["--device", "cuda"] + (["--horovod"] if horovod else [])
    ranks = run_ranks(2, args, env={**CUDA_ENV, **_two_nccl_ranks()}, timeout=300.0, worker=worker)
    assert all(r.returncode == 0 for r in ranks), describe(ranks)
    from _launch import json_lines

    for rank in ranks:
        result = json_lines(rank.stdout)[-1]
        assert result["checked"] == 25 + (3 if horovod else 0), result
        assert result["transport"] == "nccl", result
        assert result["served"]["reduce_scatter"] >= 10, result
        assert result["paths"]["collective/none"]["buckets"] >= 22, result

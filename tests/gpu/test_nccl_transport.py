"""DDP on CUDA through the engine: NCCL channels and TCP host staging.

Every test here needs a CUDA device (``@pytest.mark.gpu``; the conftest
skips them without one). Ranks are separate processes with torchrun-style
variables, like the multi-process CPU tests. Where tests compare the engine
with native DDP, the native run and the engine's runs are cases of one
launch (``_nccl_worker.py --cases``, each case with its own mode and
transport), so the ranks, CUDA and the default group start once for them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def _run_cases(
    folder: Path, world: int, cases: list[dict], common: list[str], **launch: Any
) -> list[str]:
    """Every case in one launch of ``world`` ranks (``_nccl_worker --cases``): a
    native run and the engine's runs in the same processes, started once."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cases.json").write_text(json.dumps(cases))
    args = ["--out", str(folder), "--mode", "tiacc", *common, "--cases", str(folder / "cases.json")]
    return _launch(world, args, **launch)


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory):
    """Each launch of cases once per module (a pytest-xdist group each)."""
    done: dict[str, tuple[Path, list[str]]] = {}

    def get(name: str, world: int, cases: list[dict], common: list[str], **launch: Any):
        if name not in done:
            folder = tmp_path_factory.mktemp(name)
            done[name] = (folder, _run_cases(folder, world, cases, common, **launch))
        return done[name]

    return get


def _native_and(cases: list[dict]) -> list[dict]:
    return [{"id": "native", "env": {}, "channels": 1, "mode": "native"}, *cases]


NCCL_CASES = _native_and(
    [{"id": f"tiacc-{n}", "env": {}, "channels": n, "transport": "nccl"} for n in (1, 4)]
)


@pytest.mark.xdist_group("nccl-world-of-one")
@pytest.mark.parametrize("channels", [1, 4])
def test_world_of_one_over_nccl_equals_native_ddp(launches, channels: int) -> None:
    """One rank by design: the NCCL path's set-up with no peer, and the
    hook's buckets handed back as they are (the average over one rank)."""
    common = ["--steps", "50", "--backend", "nccl"]
    out, stdout = launches("nccl-one", 1, NCCL_CASES, common)
    assert f"CASE tiacc-{channels} DONE tiacc nccl" in stdout[0]
    ours = _params(out / f"tiacc-{channels}", "tiacc", 0)
    _assert_equal(ours, _params(out / "native", "native", 0), exact=True)


@pytest.mark.xdist_group("nccl-two-ranks")
@pytest.mark.parametrize("channels", [1, 4])
def test_two_ranks_over_nccl_equal_native_ddp(launches, channels: int) -> None:
    """Two ranks (or a skip saying why there cannot be): a sum of two and
    the halving are exact, so the engine's NCCL path equals native NCCL DDP
    bit for bit."""
    env = _two_nccl_ranks()
    common = ["--steps", "50", "--backend", "nccl"]
    out, stdout = launches("nccl-two", 2, NCCL_CASES, common, env=env)
    assert all(f"CASE tiacc-{channels} DONE tiacc nccl" in o for o in stdout)
    ours = [_params(out / f"tiacc-{channels}", "tiacc", r) for r in range(2)]
    _assert_equal(ours[1], ours[0], exact=True)
    _assert_equal(ours[0], _params(out / "native", "native", 0), exact=True)


def test_several_nccl_communicators_stay_deadlock_free(tmp_path: Path) -> None:
    # Two ranks, or a skip saying why there cannot be: one rank has no
    # peer to deadlock with.
    env = _two_nccl_ranks()
    args = ["--out", str(tmp_path), "--mode", "tiacc", "--transport", "nccl"]
    # Small buckets (a 20 KB cap): several collectives per step, spread over
    # four channels, for 400 steps (1000 took 109 s of the GPU suite's 180 s
    # window on an H100, its longest single test).
    args += ["--channels", "4", "--steps", "400", "--bucket-cap-mb", "0.02", "--width", "128"]
    out = _launch(2, args, timeout=900, env=env)
    assert all("DONE tiacc nccl" in o for o in out)
    _assert_equal(_params(tmp_path, "tiacc", 0), _params(tmp_path, "tiacc", 1), exact=True)


def _staging(launches, world: int) -> tuple[Path, list[str]]:
    """Ranks sharing GPU 0 without NCCL's multi-rank switch: native DDP over
    gloo, the engine staging through the host (TCP), and with two ranks the
    engine left to choose (``auto``), in one launch per world size."""
    cases = [{"id": "tcp", "env": {}, "channels": 2, "transport": "tcp"}]
    if world == 2:
        cases.append(
            {"id": "auto", "env": {}, "channels": 1, "transport": "auto", "expect_transport": "tcp"}
        )
    common = ["--steps", "20", "--backend", "gloo"]
    return launches(f"staging-{world}", world, _native_and(cases), common, one_gpu=True)


@pytest.mark.parametrize(
    "world",
    [pytest.param(w, marks=pytest.mark.xdist_group(f"tcp-staging-{w}")) for w in (2, 4)],
)
def test_ranks_sharing_a_gpu_over_tcp_staging_match_native_ddp(launches, world: int) -> None:
    # Native DDP cannot use NCCL with ranks sharing a GPU; gloo handles CUDA
    # tensors through the host, which is the fair stock comparison here.
    out, stdout = _staging(launches, world)
    assert all("CASE tcp DONE tiacc tcp" in o for o in stdout)
    tiacc = [_params(out / "tcp", "tiacc", r) for r in range(world)]
    for r in range(1, world):
        _assert_equal(tiacc[r], tiacc[0], exact=True)
    # Two ranks: a + b is exact in any order, and halving is exact, so the
    # results are bitwise equal; with four the summation order differs.
    _assert_equal(tiacc[0], _params(out / "native", "native", 0), exact=world == 2)


@pytest.mark.xdist_group("tcp-staging-2")
def test_auto_stages_over_tcp_when_ranks_share_a_gpu(launches) -> None:
    # NCCL cannot run two ranks on one GPU: auto must notice before NCCL's
    # init and stage through the host instead.
    out, stdout = _staging(launches, 2)
    assert all("CASE auto DONE tiacc tcp" in o for o in stdout)
    ours = _params(out / "auto", "tiacc", 0)
    _assert_equal(ours, _params(out / "native", "native", 0), exact=True)


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

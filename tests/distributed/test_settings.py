"""Settings hygiene in real jobs: unknown names and ignored aliases warned
about once by rank 0 (an error on every rank under
``TIACC_TRAINING_STRICT=1``), AIACC's and Horovod's names taking effect,
local gradient accumulation against native DDP's ``no_sync()``, and
``no_sync()`` itself through the engine."""

from __future__ import annotations

from pathlib import Path

import torch
from _launch import REPO, describe, run_ranks

WORKER = REPO / "tests" / "distributed" / "settings_worker.py"


def results(out: Path, rank: int) -> dict:
    return torch.load(out / f"rank{rank}.pt")


def assert_same_training(ours: dict, native: dict) -> None:
    """The same gradients at the end of every window, and the same final
    parameters (the engine and gloo may round a mean differently)."""
    assert len(ours["grads"]) == len(native["grads"]) > 0
    for window, (mine, theirs) in enumerate(zip(ours["grads"], native["grads"])):
        for name, value in theirs.items():
            torch.testing.assert_close(
                mine[name], value, rtol=1e-5, atol=1e-7, msg=f"window {window}: {name}"
            )
    for name, value in native["params"].items():
        torch.testing.assert_close(ours["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def line(out: str, prefix: str) -> str:
    return next(x for x in out.splitlines() if x.startswith(prefix))


def test_accumulate_n_steps_equals_native_no_sync(tmp_path: Path) -> None:
    """``PERSEUS_ACCUMULATE_N_STEPS=3``: the engine communicates in every
    third backward pass only, and the gradients then are exactly what
    native DDP gives after two passes under ``no_sync()`` and a synced one,
    with and without ``gradient_as_bucket_view``; ``PERSEUS_ALLREDUCE_FUSION=4``
    makes each bucket a quarter of the model's gradient bytes."""
    modes = "tiacc-accumulate,tiacc-accumulate-view,native-nosync"
    ranks = run_ranks(
        2,
        ["--out", str(tmp_path), "--modes", modes],
        env={"PERSEUS_ACCUMULATE_N_STEPS": "3", "PERSEUS_ALLREDUCE_FUSION": "4"},
        worker=WORKER,
        timeout=180,
    )
    assert all(r.returncode == 0 for r in ranks), describe(ranks)
    out = ranks[0].stdout
    _, _, cap, gradient_bytes = line(out, "BUCKET_CAP tiacc-accumulate ").split()
    assert int(cap) == -(-int(gradient_bytes) // 4), out
    for mode in ("tiacc-accumulate", "tiacc-accumulate-view"):
        sent = [int(n) for n in line(out, f"ENGINE_BUCKETS_PER_PASS {mode} ").split()[2:]]
        # Nothing leaves in the first two passes of a window; every bucket
        # (several: a quarter of the model at most, whole layers each) in
        # the third.
        assert sent[0::3] == sent[1::3] == [0, 0], sent
        assert sent[2] == sent[5] > 1, sent
    assert "accumulate_n_steps=3 (one communication every 3 backward passes)" in ranks[0].stderr
    native = results(tmp_path, 0)["native-nosync"]
    for rank in range(2):
        for mode in ("tiacc-accumulate", "tiacc-accumulate-view"):
            assert_same_training(results(tmp_path, rank)[mode], native)


def test_no_sync_through_the_engine_and_the_start_up_warnings(tmp_path: Path) -> None:
    """One job with several settings: DDP's ``no_sync()`` through the engine
    trains as natively; rank 0 warns once about the typo, the ignored
    Horovod name and the alias that disagrees with our name, rank 1 says
    nothing; the aliases set the channels, the bucket size and the
    interface."""
    env = {
        "LIGHT_TOPK_RATO": "0.01",
        "HOROVOD_CYCLE_TIME": "5",
        "PERSEUS_ALLREDUCE_STREAMS": "3",
        "HOROVOD_FUSION_THRESHOLD": "65536",
        "PERSEUS_ALLREDUCE_NANCHECK": "1",
        "TIACC_TRAINING_NAN_CHECK": "0",
        "PERSEUS_GLOO_NETWORK_INTERFACE": "lo",
    }
    ranks = run_ranks(
        2,
        ["--out", str(tmp_path), "--modes", "native-nosync,tiacc-nosync"],
        env=env,
        worker=WORKER,
        timeout=180,
    )
    assert all(r.returncode == 0 for r in ranks), describe(ranks)
    native = results(tmp_path, 0)["native-nosync"]
    for rank in range(2):
        assert_same_training(results(tmp_path, rank)["tiacc-nosync"], native)
    out, err = ranks[0].stdout, ranks[0].stderr
    sent = [int(n) for n in line(out, "ENGINE_BUCKETS_PER_PASS tiacc-nosync ").split()[2:]]
    assert sent[0::3] == sent[1::3] == [0, 0] and all(n > 0 for n in sent[2::3]), sent

    assert "ENGINE_CHANNELS=3" in out
    assert "BUCKET_CAP tiacc-nosync 65536 " in out
    assert "ENGINE_ADDR=127.0.0.1" in out and "SOCKET_ADDR=127.0.0.1" in out
    expected = [
        "LIGHT_TOPK_RATO is not a variable tiacc_training knows and has no effect: "
        "did you mean LIGHT_TOPK_RATIO?",
        "HOROVOD_CYCLE_TIME is ignored: Horovod's background cycle",
        'PERSEUS_ALLREDUCE_NANCHECK is set to "1" and TIACC_TRAINING_NAN_CHECK to "0", '
        "which disagree: TIACC_TRAINING_NAN_CHECK wins",
    ]
    for text in expected:
        # Once per job: logged by rank 0 only, once, though the job set up
        # the engine twice (native, then through the engine).
        assert err.count(text) == 1, err
        assert text not in ranks[1].stderr, ranks[1].stderr
    assert "PERSEUS_ALLREDUCE_STREAMS" not in err and "HOROVOD_FUSION" not in err, err


def test_strict_mode_makes_an_unknown_name_an_error_on_every_rank(tmp_path: Path) -> None:
    ranks = run_ranks(
        2,
        ["--out", str(tmp_path)],
        env={"TIACC_TRAINING_STRICT": "1", "LIGHT_TOPK_RATO": "0.01"},
        worker=WORKER,
        timeout=120,
    )
    for r in ranks:
        assert r.returncode == 3, describe(ranks)
        error = line(r.stdout, "WORKER_ERROR")
        assert error.startswith('WORKER_ERROR ConfigError: LIGHT_TOPK_RATO="0.01"'), error
        assert "did you mean LIGHT_TOPK_RATIO?" in error, error

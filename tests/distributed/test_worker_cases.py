"""The GPU suite's DDP worker running a matrix of cases in one launch, on the CPU.

``tests/gpu/_nccl_worker.py --cases`` trains case after case in the same
rank processes (the GPU suite starts its ranks once per world size so). Its
loop runs here on the CPU (gloo, the engine over TCP): each case's settings
replace the previous case's, the flat cases equal native DDP bit for bit
whatever came before them, a compressed case differs, and a case that fails
is named while the cases after it still run.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _cases import FLAT
from _launch import describe, run_ranks

WORKER = Path(__file__).resolve().parents[1] / "gpu" / "_nccl_worker.py"
CPU = ["--device", "cpu", "--backend", "gloo", "--transport", "tcp", "--steps", "8"]


def _params(folder: Path, mode: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(folder / f"{mode}_rank{rank}.pt")


def test_cases_run_one_after_the_other_with_their_own_settings(tmp_path: Path) -> None:
    native = run_ranks(2, ["--out", str(tmp_path / "native"), "--mode", "native", *CPU],
                       worker=WORKER, timeout=180)  # fmt: skip
    assert all(r.returncode == 0 for r in native), describe(native)
    cases = [
        {"id": "flat-1", "env": FLAT, "channels": 1},
        {"id": "fp16-4", "env": {**FLAT, "TIACC_TRAINING_COMPRESSION": "fp16"}, "channels": 4},
        {"id": "flat-4", "env": FLAT, "channels": 4},
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    args = ["--out", str(tmp_path), "--mode", "tiacc", "--cases", str(tmp_path / "cases.json")]
    ranks = run_ranks(2, [*args, *CPU], worker=WORKER, timeout=240)
    assert all(r.returncode == 0 for r in ranks), describe(ranks)
    for case in cases:
        assert all(f"CASE {case['id']} DONE tiacc tcp" in r.stdout for r in ranks), describe(ranks)
    reference = _params(tmp_path / "native", "native", 0)
    for case in ("flat-1", "fp16-4", "flat-4"):
        ours = [_params(tmp_path / case, "tiacc", r) for r in range(2)]
        assert all(torch.equal(ours[0][k], ours[1][k]) for k in ours[0]), case
        exact = all(torch.equal(ours[0][k], reference[k]) for k in reference)
        # fp16 on the wire rounds the gradients; the flat cases after it
        # start from clean settings and match native exactly.
        assert exact == (case != "fp16-4"), case


def test_native_and_tiacc_cases_in_one_launch(tmp_path: Path) -> None:
    """A case may set its own mode: native DDP first, then the engine, then
    native again, in the same processes, each as a launch of its own gives."""
    alone = run_ranks(2, ["--out", str(tmp_path / "alone"), "--mode", "native", *CPU],
                      worker=WORKER, timeout=180)  # fmt: skip
    assert all(r.returncode == 0 for r in alone), describe(alone)
    cases = [
        {"id": "native", "env": {}, "channels": 1, "mode": "native"},
        {"id": "flat-2", "env": FLAT, "channels": 2},
        {"id": "native-again", "env": {}, "channels": 1, "mode": "native"},
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    args = ["--out", str(tmp_path), "--mode", "tiacc", "--cases", str(tmp_path / "cases.json")]
    ranks = run_ranks(2, [*args, *CPU], worker=WORKER, timeout=240)
    assert all(r.returncode == 0 for r in ranks), describe(ranks)
    for r in ranks:
        assert "CASE native DONE native gloo" in r.stdout, describe(ranks)
        assert "CASE flat-2 DONE tiacc tcp" in r.stdout, describe(ranks)
        assert "CASE native-again DONE native gloo" in r.stdout, describe(ranks)
    reference = _params(tmp_path / "alone", "native", 0)
    for case, mode in (("native", "native"), ("flat-2", "tiacc"), ("native-again", "native")):
        ours = _params(tmp_path / case, mode, 0)
        assert all(torch.equal(ours[k], reference[k]) for k in reference), case


def test_a_failing_case_is_named_and_the_cases_after_it_still_run(tmp_path: Path) -> None:
    cases = [
        {"id": "flat-1", "env": FLAT, "channels": 1},
        {"id": "bad", "env": {"TIACC_TRAINING_COMPRESSION": "fp8"}, "channels": 1},
        {"id": "after", "env": FLAT, "channels": 1},
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    args = ["--out", str(tmp_path), "--mode", "tiacc", "--cases", str(tmp_path / "cases.json")]
    ranks = run_ranks(2, [*args, *CPU], worker=WORKER, timeout=240)
    for r in ranks:
        assert r.returncode == 3, describe(ranks)
        assert "CASE flat-1 DONE tiacc tcp" in r.stdout, describe(ranks)
        failed = [x for x in r.stdout.splitlines() if x.startswith("CASE bad FAILED ")]
        assert failed and "TIACC_TRAINING_COMPRESSION" in failed[0], describe(ranks)
        assert "CASE bad FAILED_ON ranks [0, 1]" in r.stdout, describe(ranks)
        assert "CASE after DONE tiacc tcp" in r.stdout, describe(ranks)
        assert "WORKER_ERROR RuntimeError: cases failed: bad" in r.stdout, describe(ranks)
    # The failed case left nothing behind: the flat case after it trains
    # exactly as the one before it.
    before = _params(tmp_path / "flat-1", "tiacc", 0)
    after = _params(tmp_path / "after", "tiacc", 0)
    assert all(torch.equal(before[k], after[k]) for k in before)

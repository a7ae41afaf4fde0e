"""How the benches' results travel: a worker's RESULT line, the results file,
and the smoke test's package path (relative to the checkout)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benches"))
sys.path.insert(0, str(REPO / "tools"))

import _machine  # noqa: E402
import torch_smoke  # noqa: E402


def test_the_results_file_is_indented_json_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "results" / "bench_x.json"
    result = {"benchmark": "bench_x", "rows": [1, 2.5, None], "out": tmp_path}
    _machine.write_results(path, result)
    assert path.read_text() == json.dumps({**result, "out": str(tmp_path)}, indent=2) + "\n"
    assert capsys.readouterr().out == f"wrote {path}\n"
    assert not path.with_name(path.name + ".partial").exists()


def test_a_worker_result_line_is_read_back(capsys: pytest.CaptureFixture[str]) -> None:
    _machine.print_result({"step_s": [0.5], "rank": 0})
    printed = capsys.readouterr().out
    assert printed.startswith("RESULT ")
    output = "a log line\n" + printed.replace("0.5", "0.25") + printed + "after\n"
    assert _machine.last_result(output) == {"step_s": [0.5], "rank": 0}
    assert _machine.last_result("no result here\n") is None


def test_load_average_has_three_rounded_values() -> None:
    load = _machine.load_average()
    assert len(load) == 3 and all(round(x, 2) == x for x in load)


def test_the_smoke_test_records_its_package_relative_to_the_checkout() -> None:
    inside = str(REPO / ".compat" / "smoke-head" / "tiacc_training")
    assert torch_smoke.repo_relative(inside) == ".compat/smoke-head/tiacc_training"
    assert torch_smoke.repo_relative("/elsewhere/tiacc_training") == "/elsewhere/tiacc_training"
    legs = json.loads((REPO / "benches" / "results" / "torch_smoke.json").read_text())
    assert all(not str(leg.get("package", "")).startswith("/") for leg in legs)

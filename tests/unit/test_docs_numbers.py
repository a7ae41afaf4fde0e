"""tools/docs_numbers.py: markers rendered from results files, and the check."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "docs_numbers.py"

_spec = importlib.util.spec_from_file_location("docs_numbers", TOOL)
assert _spec and _spec.loader
docs_numbers = importlib.util.module_from_spec(_spec)
sys.modules["docs_numbers"] = docs_numbers
_spec.loader.exec_module(docs_numbers)

RESULTS = {
    "machine": {"git_commit": "abc1234"},
    "rows": [
        {"pipeline": "native DDP (gloo)", "median_ms": 1121.1},
        {"pipeline": "tiacc 2D + fp16", "median_ms": 403.66, "speedup": 2.777},
    ],
    "results": {"d_dropin": {"images_s": 2148.1, "ratio": 2.5}, "e.f": {"v": 0.125}},
}

PAGE = "\n".join(
    [
        "# Performance",
        "",
        "Intro: 2 x 2 ranks, 25 MiB buckets, `--steps 10`.",
        "",
        "<!-- nums benches/results/r.json -->",
        "| pipeline | step | speed-up |",
        "| --- | --- | --- |",
        "| 2D + fp16 | <!-- num 'rows[pipeline=tiacc 2D + fp16].median_ms' '{:.0f} ms' -->"
        "404 ms<!-- /num --> | <!-- num 'rows[pipeline=tiacc 2D + fp16].speedup' {:.2f}x -->"
        "2.78x<!-- /num --> |",
        "<!-- /nums -->",
        "",
        "The loader: <!-- num benches/results/r.json results.d_dropin.images_s .0f -->"
        "2148<!-- /num --> images/s,",
        "a ratio of <!-- num benches/results/r.json 'rows[0].median_ms / rows[1].median_ms'"
        " {:.2f}x -->2.78x<!-- /num -->,",
        "goal <!-- exempt: the goal, not a measurement -->1.25x<!-- /exempt -->.",
        "```",
        "output: 99 ms",
        "```",
        "",
    ]
)


def make_repo(tmp_path: Path, page: str = PAGE, results: dict | None = None) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "benches" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "performance.md").write_text(page, encoding="utf-8")
    (tmp_path / "README.md").write_text(
        "# x\n\n## Headline numbers\n\n- fast: "
        "<!-- num benches/results/r.json results.d_dropin.ratio {:.2f}x -->2.50x<!-- /num -->\n"
        "\n## Other\n\n3x faster, not scanned here.\n",
        encoding="utf-8",
    )
    data = RESULTS if results is None else results
    (tmp_path / "benches" / "results" / "r.json").write_text(json.dumps(data), encoding="utf-8")
    return tmp_path


def test_paths_and_expressions() -> None:
    ev = docs_numbers.evaluate
    assert ev(RESULTS, "rows[1].median_ms") == 403.66
    assert ev(RESULTS, "rows[pipeline=tiacc 2D + fp16].speedup") == 2.777
    assert ev(RESULTS, 'results["e.f"].v') == 0.125
    assert ev(RESULTS, "rows[pipeline=tiacc 2D + fp16&median_ms=403.66].speedup") == 2.777
    assert ev(RESULTS, "rows[-1].median_ms * 1000") == pytest.approx(403660)
    assert ev(RESULTS, "max(rows[*].median_ms)") == 1121.1
    assert ev(RESULTS, "len(rows)") == 2
    assert ev(RESULTS, "min(rows[?pipeline=tiacc 2D + fp16].median_ms)") == 403.66
    assert ev(RESULTS, "len(rows[?median_ms=1121.1])") == 1
    assert ev(RESULTS, "machine.git_commit") == "abc1234"
    assert docs_numbers.render(0.125, ".1%") == "12.5%"
    assert docs_numbers.render(2.777, "{:.2f}x") == "2.78x"
    for bad in ("rows[5].median_ms", "rows[pipeline=nope].median_ms", "machine.nope"):
        with pytest.raises(docs_numbers.DocsNumbersError):
            ev(RESULTS, bad)
    with pytest.raises(docs_numbers.DocsNumbersError):
        docs_numbers.render("abc", ".2f")


def test_check_passes_on_matching_page(tmp_path: Path) -> None:
    report = docs_numbers.run(make_repo(tmp_path), write=False)
    assert [str(p) for p in report.problems] == []
    assert report.markers == 5
    assert report.files == {"benches/results/r.json"}


def test_changed_json_fails_check_then_write_fixes_it(tmp_path: Path) -> None:
    changed = json.loads(json.dumps(RESULTS))
    changed["rows"][1]["speedup"] = 2.5
    root = make_repo(tmp_path, results=changed)
    report = docs_numbers.run(root, write=False)
    messages = [str(p) for p in report.problems]
    assert len(messages) == 1
    assert messages[0].startswith("docs/performance.md:8: shows '2.78x'")
    assert "'2.50x'" in messages[0]

    cli = subprocess.run(
        [sys.executable, str(TOOL), "--check", "--root", str(root)],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 1
    assert "docs/performance.md:8:" in cli.stderr

    report = docs_numbers.run(root, write=True)
    assert report.problems == []
    assert report.changed == ["docs/performance.md"]
    text = (root / "docs" / "performance.md").read_text(encoding="utf-8")
    assert "{:.2f}x -->2.50x<!-- /num -->" in text
    assert docs_numbers.run(root, write=False).problems == []
    ok = subprocess.run(
        [sys.executable, str(TOOL), "--check", "--root", str(root)],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert "measured at abc1234" in ok.stdout


def test_unmarked_figures_are_flagged(tmp_path: Path) -> None:
    page = PAGE + "\nA new claim: 1.5-2x faster, 24-37 ms, 5.7 GB/s and 12% less.\n"
    root = make_repo(tmp_path, page=page)
    messages = [str(p) for p in docs_numbers.run(root, write=False).problems]
    figures = [m.split("'")[1] for m in messages]
    assert figures == ["1.5-2x", "24-37 ms", "5.7 GB/s", "12%"]
    assert all(m.startswith("docs/performance.md:18:") for m in messages)


def test_readme_scanned_only_in_its_section(tmp_path: Path) -> None:
    root = make_repo(tmp_path)
    readme = root / "README.md"
    readme.write_text(
        readme.read_text(encoding="utf-8").replace("- fast:", "- 1.31x gloo, fast:"),
        encoding="utf-8",
    )
    messages = [str(p) for p in docs_numbers.run(root, write=False).problems]
    assert messages == ["README.md:5: figure '1.31x' is neither marked nor exempted"]


def test_bad_markers_are_reported(tmp_path: Path) -> None:
    page = (
        "<!-- num benches/results/missing.json a .2f -->1<!-- /num -->\n"
        "<!-- num rows[0].median_ms .1f -->1121.1<!-- /num -->\n"
        "<!-- num benches/results/r.json rows[0].pipeline .2f -->x<!-- /num -->\n"
        "<!-- exempt: -->3x<!-- /exempt -->\n"
    )
    messages = [str(p) for p in docs_numbers.run(make_repo(tmp_path, page=page), False).problems]
    assert "no results file benches/results/missing.json" in messages[0]
    assert "in no nums block" in messages[1]
    assert "does not fit" in messages[2]
    assert messages[3] == "docs/performance.md:4: exemption without a reason"


def test_max_age(tmp_path: Path) -> None:
    root = make_repo(tmp_path)
    status = docs_numbers.main(["--check", "--root", str(root), "--max-age", "3"])
    assert status == 0  # no git history here: the age is unknown, not failed


def test_repository_docs_pass() -> None:
    report = docs_numbers.run(REPO, write=False)
    assert [str(p) for p in report.problems] == []
    assert report.markers > 0

"""Renders the torch smoke test's results as a table in docs/limits.md.

Reads the JSON list ``tools/torch_smoke.sh`` writes (one record per torch
release, ``tools/torch_smoke.py``'s line plus the install's facts) and
replaces what lies between the markers ``<!-- torch-smoke:begin -->`` and
``<!-- torch-smoke:end -->`` in the page with a Markdown table: each
release, the path its CPU collectives took, the ``all_reduce`` and DDP
checks, and a note (why a check failed, why the newer form or the backend
is unavailable, the run that forces the older form, numpy pinned below 2)::

    python tools/torch_table.py                # writes docs/limits.md
    python tools/torch_table.py --print        # prints the table only
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BEGIN = "<!-- torch-smoke:begin -->"
END = "<!-- torch-smoke:end -->"
# The most characters of a note in a cell.
NOTE_CHARS = 320
# What each path means, in the table's words.
PATHS = {
    "backend": "backend",
    "process-group": "process group",
    "gloo": "gloo (tiacc unavailable)",
    "unknown": "unknown",
}


def _version_key(record: dict[str, Any]) -> tuple[int, ...]:
    """A release's sort key: its numbers (``"2.10.0"`` after ``"2.9.1"``)."""
    parts = str(record.get("release", "")).split("+")[0].split(".")
    return tuple(int(p) if p.isdigit() else -1 for p in parts)


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, pipes escaped."""
    text = " ".join(str(text).split())
    if len(text) > NOTE_CHARS:
        text = text[: NOTE_CHARS - 3].rstrip() + "..."
    return text.replace("|", "\\|")


def _result(record: dict[str, Any], name: str) -> str:
    """A check's cell: ``pass``, ``**fail**`` or ``not run``."""
    result = record.get("checks", {}).get(name, {}).get("result", "skip")
    return {"pass": "pass", "fail": "**fail**"}.get(result, "not run")


def _error(text: Any) -> str:
    """An error text without the smoke test's own frames of a hung rank's stack."""
    return re.sub(r" < \w+ \(torch_smoke\.py:\d+\)", "", str(text))


def _why_not(text: str) -> str:
    """The end of a "cannot construct" reason: what torch said, in parentheses."""
    found = re.search(r"\(([^()]*(?:\([^()]*\))?[^()]*)\)$", text)
    return found.group(1) if found else text


def note(record: dict[str, Any]) -> str:
    """The note of one release: failures first, then why, then the install's pins."""
    parts = []
    for name, check in record.get("checks", {}).items():
        if check.get("result") == "fail":
            parts.append(f"{name}: {_error(check.get('error'))}")
    if record.get("reason") and record.get("path") != "backend":
        parts.append(f"reason: {record['reason']}")
    elif record.get("path") == "process-group" and (record.get("forms") or {}).get("backend"):
        parts.append(f"no Python Backend ({_why_not(record['forms']['backend'])})")
    forced = record.get("forced_process_group")
    if forced:
        failed = [
            f"{name}: {_error(check.get('error'))}"
            for name, check in (forced.get("checks") or {}).items()
            if check.get("result") == "fail"
        ]
        if failed:
            parts.append("forced process-group: **fail** (" + "; ".join(failed) + ")")
        elif record.get("path") != "process-group":
            parts.append("forced process-group: pass")
    if record.get("numpy_pinned"):
        parts.append(f"numpy {record.get('numpy')} (torch built against numpy 1)")
    return _cell("; ".join(parts))


def table(records: list[dict[str, Any]]) -> str:
    """The Markdown table of ``records``, oldest release first, with its caption."""
    rows = [
        "| torch release | path | all_reduce | DDP step | note |",
        "| --- | --- | --- | --- | --- |",
    ]
    for record in sorted(records, key=_version_key):
        path = str(record.get("path") or "unknown")
        rows.append(
            f"| {_cell(record.get('release', '?'))} | {_cell(PATHS.get(path, path))} "
            f"| {_result(record, 'all_reduce')} | {_result(record, 'ddp')} | {note(record)} |"
        )
    passed = sum(1 for r in records if r.get("ok"))
    install = sum(int(r.get("install_seconds") or 0) for r in records)
    smoke = sum(float(r.get("seconds") or 0) for r in records)
    facts = [f"{passed} of {len(records)} releases passed every check"]
    pythons = sorted({str(r["python"]) for r in records if r.get("python")})
    if pythons:
        facts.append(f"Python {', '.join(pythons)}")
    commits = sorted({str(r["commit"]) for r in records if r.get("commit")})
    if commits:
        facts.append(f"tiacc-training at {', '.join(commits)}")
    dates = sorted({str(r["date"])[:10] for r in records if r.get("date")})
    if dates:
        facts.append(f"run {' to '.join(dict.fromkeys([dates[0], dates[-1]]))}")
    facts.append(f"{install} s installing, {smoke:.0f} s testing")
    return "\n".join(rows) + "\n\n" + "; ".join(facts) + "."


def render(page: str, block: str) -> str:
    """``page`` with what lies between the markers replaced by ``block``.

    Raises:
        ValueError: the page lacks a marker, or they are out of order.
    """
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(f"the page needs {BEGIN} and then {END}")
    return page[: start + len(BEGIN)] + "\n" + block + "\n" + page[end:]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results",
        type=Path,
        default=REPO / "benches" / "results" / "torch_smoke.json",
        help="the smoke test's JSON list (default benches/results/torch_smoke.json)",
    )
    parser.add_argument(
        "--doc", type=Path, default=REPO / "docs" / "limits.md", help="the page to write"
    )
    parser.add_argument("--print", action="store_true", help="print the table, write nothing")
    args = parser.parse_args(argv)
    records = json.loads(args.results.read_text(encoding="utf-8"))
    block = table(records)
    if args.print:
        print(block)
        return 0
    page = args.doc.read_text(encoding="utf-8")
    try:
        updated = render(page, block)
    except ValueError as error:
        print(f"{args.doc}: {error}", file=sys.stderr)
        return 1
    if updated != page:
        args.doc.write_text(updated, encoding="utf-8")
    print(f"{args.doc}: {len(records)} releases")
    return 0


if __name__ == "__main__":
    sys.exit(main())

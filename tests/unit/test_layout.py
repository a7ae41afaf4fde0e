"""docs/development.md's Layout tables name every source file, and only real ones.

The Layout section holds one table per folder: a heading ``### `folder/` ``
then a table whose first column is a file's path relative to that folder,
in backticks (a header row starting ``| file |`` and the ``|---|`` row are
skipped). The rule:

* every tracked file (``git ls-files``) under a covered folder whose name
  ends in a covered suffix must have a row;
* every row must name a file that exists in the working tree, under a
  covered folder, once;
* a row before any folder heading, or whose first cell is not one path in
  backticks, is an error.

Covered folders: ``rust/tiacc-core/src``, ``rust/tiacc-core/examples``,
``rust/tiacc-py/src``, ``tiacc_training``, ``benches``, ``tools``,
``demo``, ``examples``, ``fuzz`` and ``tests``. Covered kinds: ``.py``,
``.pyi``, ``.rs``, ``.sh``, ``.sbatch``. Exempt: every other kind (data
and configuration: ``.json``, ``.md``, ``.toml``, ``.lock``, ``py.typed``,
``.gitignore``, the built extension) and, whatever their names, the
results in ``benches/results/`` and the fuzz corpus in ``fuzz/corpus/``.
Files that are not tracked yet need no row (they may have one). Outside a
git checkout the test is skipped; the checker itself is tested on a
synthetic section first, so that it cannot pass by finding nothing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "development.md"

ROOTS = (
    "rust/tiacc-core/src",
    "rust/tiacc-core/examples",
    "rust/tiacc-py/src",
    "tiacc_training",
    "benches",
    "tools",
    "demo",
    "examples",
    "fuzz",
    "tests",
)
KINDS = (".py", ".pyi", ".rs", ".sh", ".sbatch")
EXEMPT = ("benches/results/", "fuzz/corpus/")

_HEADING = re.compile(r"^#{3,4} `([^`]+)/`\s*$")
_SECTION = re.compile(r"^## ")
_FIRST_CELL = re.compile(r"^`([^`\s]+)`$")


def layout_section(text: str) -> list[tuple[int, str]]:
    """The lines of the ``## Layout`` section, with their line numbers."""
    lines = text.splitlines()
    out: list[tuple[int, str]] = []
    inside = False
    for number, line in enumerate(lines, 1):
        if _SECTION.match(line):
            inside = line.strip() == "## Layout"
            continue
        if inside:
            out.append((number, line))
    return out


def rows(text: str) -> tuple[dict[str, int], list[str]]:
    """The files the tables name (path: line number), and the malformed rows."""
    found: dict[str, int] = {}
    problems: list[str] = []
    folder: str | None = None
    for number, line in layout_section(text):
        heading = _HEADING.match(line)
        if heading:
            folder = heading.group(1).strip("/")
            continue
        if line.startswith("#"):
            folder = None  # a heading that is not a folder ends the folder's table
            continue
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        first = cells[0]
        if first == "file" or set(first) <= set("-: "):
            continue  # header or separator row
        if folder is None:
            problems.append(f"line {number}: a table row outside a folder's table: {line}")
            continue
        name = _FIRST_CELL.match(first)
        if not name:
            problems.append(f"line {number}: the first cell is not one path in backticks: {line}")
            continue
        path = f"{folder}/{name.group(1)}"
        if path in found:
            problems.append(f"line {number}: {path} listed twice (first on line {found[path]})")
            continue
        found[path] = number
    return found, problems


def covered(path: str) -> bool:
    """Whether a tracked file must have a row."""
    if path.startswith(EXEMPT):
        return False
    return path.endswith(KINDS) and any(path.startswith(root + "/") for root in ROOTS)


def check(text: str, tracked: list[str], exists) -> list[str]:
    """Everything wrong between the Layout tables and the tree, one line each."""
    listed, problems = rows(text)
    for path, number in sorted(listed.items(), key=lambda item: item[1]):
        if not any(path.startswith(root + "/") for root in ROOTS) or path.startswith(EXEMPT):
            problems.append(f"line {number}: {path} is not under a covered folder")
        elif not exists(path):
            problems.append(f"line {number}: {path} is named but not in the tree")
    for path in sorted(tracked):
        if covered(path) and path not in listed and exists(path):
            problems.append(f"{path} is tracked but has no row in the Layout tables")
    return problems


SYNTHETIC = """\
# Title

## Layout

Some prose with a `| pipe`.

### `tools/`

| file | its one job | imports |
|---|---|---|
| `a.py` | does a | — |
| `gone.py` | was moved away | — |

### `fuzz/`

| file | its one job |
|---|---|
| `run.sh` | runs |
| `run.sh` | twice |
| not a path | broken |

## Next section

| `tools/b.py` | outside Layout: ignored |
"""


def test_checker_on_a_synthetic_section() -> None:
    tree = {"tools/a.py", "tools/b.py", "fuzz/run.sh", "fuzz/corpus/x/seed.rs", "tools/data.json"}
    listed, _ = rows(SYNTHETIC)
    assert set(listed) == {"tools/a.py", "tools/gone.py", "fuzz/run.sh"}
    problems = check(SYNTHETIC, sorted(tree), tree.__contains__)
    text = "\n".join(problems)
    assert "tools/gone.py is named but not in the tree" in text
    assert "tools/b.py is tracked but has no row" in text
    assert "fuzz/run.sh listed twice" in text
    assert "not one path in backticks" in text
    assert "corpus" not in text and "data.json" not in text  # exempt
    assert len(problems) == 4, problems
    # A file moved into a new folder: its old row is stale, the new path is missing.
    moved = {"tools/a.py", "tools/b.py", "fuzz/run.sh", "tools/sub/gone.py"}
    after = "\n".join(check(SYNTHETIC, sorted(moved), moved.__contains__))
    assert "tools/gone.py is named but not in the tree" in after
    assert "tools/sub/gone.py is tracked but has no row" in after


def _tracked() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", *ROOTS],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing to hold the tables against")
    return [p for p in out.decode().split("\0") if p]


def test_layout_tables_match_the_tree() -> None:
    tracked = _tracked()
    text = DOC.read_text(encoding="utf-8")
    listed, _ = rows(text)
    # Not vacuous: the section parses into rows, in every covered folder.
    assert len(listed) > 200, f"only {len(listed)} rows found in the Layout tables"
    for root in ROOTS:
        assert any(p.startswith(root + "/") for p in listed), f"no row under {root}/"
    problems = check(text, tracked, lambda p: (REPO / p).is_file())
    assert not problems, "docs/development.md, Layout:\n" + "\n".join(problems)

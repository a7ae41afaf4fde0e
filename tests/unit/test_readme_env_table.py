"""The environment-variable table (docs/communication.md) matches the config module.

`rust/tiacc-core/src/config/` is the only code that reads the environment
(the names are in its `variables.rs`); every variable it names must be in
the table, and the table must not list variables the engine does not read.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PREFIXES = r"(?:TIACC_TRAINING|LIGHT|PERSEUS|NCCL)_[A-Z0-9_]+"


def config_variables() -> set[str]:
    names: set[str] = set()
    for path in sorted((REPO / "rust/tiacc-core/src/config").glob("*.rs")):
        # Only the constants' string literals, not the tests' uses of them.
        body = path.read_text().split("#[cfg(test)]", 1)[0]
        names.update(re.findall(rf'"({PREFIXES})"', body))
    return names


TABLE_PAGE = REPO / "docs" / "communication.md"


def readme_table_variables() -> set[str]:
    page = TABLE_PAGE.read_text()
    section = page.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(rf"`({PREFIXES})`", row.split(" | ")[0])}


def test_every_variable_the_engine_reads_is_documented() -> None:
    names = config_variables()
    assert len(names) >= 20, names  # the parse found the constants
    assert names - readme_table_variables() == set()


def test_the_table_lists_no_variable_the_engine_does_not_read() -> None:
    assert readme_table_variables() - config_variables() == set()

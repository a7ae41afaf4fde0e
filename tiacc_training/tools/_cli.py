"""Shared plumbing of the command-line tools: errors, warnings, progress."""

from __future__ import annotations

import sys
from typing import Any, NoReturn


class UsageError(Exception):
    """Bad input named by the user (a path, a list line); exit status 2."""


def warn(message: str) -> None:
    """Prints a warning line to stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def die(prog: str, message: str, status: int = 2) -> NoReturn:
    """Prints ``prog: error: message`` to stderr and exits."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def progress(total: int, desc: str, unit: str = "img", unit_scale: bool = False) -> Any:
    """A tqdm bar on an interactive stderr, a silent stand-in otherwise.

    Args:
        total: The count at which the work is done.
        desc: The bar's label.
        unit: What is counted.
        unit_scale: Show counts with SI prefixes (for bytes).
    """
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: no bar without it
        return _NoBar()
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit_scale,
        disable=None,  # None: off unless stderr is a terminal
        dynamic_ncols=True,
    )


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

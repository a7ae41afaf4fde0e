"""Renders and checks the published figures of the docs against their results.

A figure in a Markdown page names the results file and the value it comes
from in an HTML comment around it, so the rendered page shows only the
figure::

    <!-- num benches/results/bench_pack.json goals.speedup_workers2 {:.2f}x -->2.02x<!-- /num -->

The opening comment holds, split like a shell line (quote what has spaces):
``num [FILE] EXPR FORMAT``.

- ``FILE``: a JSON file, relative to the repository root. It may be left out
  inside a block ``<!-- nums FILE -->`` ... ``<!-- /nums -->``, which names
  the file for every marker in it (a table, a paragraph).
- ``EXPR``: a path into the JSON: keys joined by dots, ``[3]`` for a list
  item, ``[key=value]`` for the first item of a list whose ``key`` equals
  ``value`` (``rows[pipeline=tiacc 2D]``, ``rows[world=4&bytes=4096]``:
  every pair must hold), ``["a.b"]`` for a key holding a
  dot, ``[*]`` for every item of a list or value of an object and
  ``[?key=value]`` for every item that matches (each makes the rest of the
  path apply to every item, and the value a list). Paths may be joined by `` + ``,
  `` - ``, `` * ``, `` / `` (left to right, spaces around the operator) and
  numbers may stand in for paths; ``min(...)``, ``max(...)`` and ``len(...)``
  take a path that holds a list.
- ``FORMAT``: a format spec (``.2f``, ``,.0f``, ``.1%``, ``s``) or a template
  with ``{}`` fields (``{:.2f}x``).

``--write`` replaces the text between every marker pair with the value
rendered from its file; ``--check`` renders without writing and exits
non-zero naming ``file:line`` for every marker whose text differs, whose file
or value is missing, and for every figure that looks like a measurement
(``1.5x``, ``24 ms``, ``1491 images/s``, ``5.7 GB/s``, ``12%``) outside a
marker in the pages and sections that publish measurements (``SCANNED``).
A figure there that is not a measurement (a setting, a goal, a unit of the
setup) is exempted by a comment that gives the reason::

    <!-- exempt: the goal, not a measurement -->1.25x<!-- /exempt -->

Inline code, fenced blocks and settings written like figures (``Top-K 1%``)
are not scanned. The check also lists each
results file with the commit it was measured at and how many commits ago
that was (``--max-age N`` fails when one is older than N commits)::

    python tools/docs_numbers.py --check
    python tools/docs_numbers.py --write
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# Pages whose markers are rendered and checked.
PAGES = ("README.md", "docs/*.md")

# (page, section heading or None for the whole page): where every figure that
# looks like a measurement must be marked or exempted.
SCANNED: tuple[tuple[str, str | None], ...] = (
    ("docs/performance.md", None),
    ("README.md", "Headline numbers"),
)

MARKER = re.compile(r"<!--\s*num\s+(?P<args>.*?)\s*-->(?P<text>.*?)<!--\s*/num\s*-->", re.S)
BLOCK_OPEN = re.compile(r"<!--\s*nums\s+(?P<file>\S+)\s*-->")
BLOCK_CLOSE = re.compile(r"<!--\s*/nums\s*-->")
EXEMPT = re.compile(r"<!--\s*exempt:(?P<reason>.*?)-->(?P<text>.*?)<!--\s*/exempt\s*-->", re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
# Settings written like figures: the density of Top-K ("Top-K 1%").
SETTINGS = re.compile(r"\bTop-K \d+(?:\.\d+)?%")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.S)

_NUM = r"\d[\d,]*(?:\.\d+)?"
# What a measurement looks like: a ratio, a time, a rate, a share.
FIGURE = re.compile(
    rf"(?<![\w.])(?:"
    rf"{_NUM}(?:\s*(?:-|–|to)\s*{_NUM})?x\b"  # 1.06x, 1.5-2x
    rf"|{_NUM}(?:\s*(?:-|–|to)\s*{_NUM})?\s*(?:ms|µs|us)\b"  # 24-37 ms
    rf"|{_NUM}(?:\s*(?:-|–|to)\s*{_NUM})?\s*(?:images/s|img/s|[KMG]B/s)"  # 1491 images/s
    rf"|{_NUM}(?:\s*(?:-|–|to)\s*{_NUM})?\s*%"  # 12%
    rf")"
)


class DocsNumbersError(Exception):
    """A marker that cannot be rendered: a bad marker, file, path or format."""


@dataclass
class Problem:
    """One finding of the check, at a page's line."""

    page: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.message}"


@dataclass
class Report:
    """What a check or a write found: problems, and the results files cited."""

    problems: list[Problem] = field(default_factory=list)
    files: set[str] = field(default_factory=set)
    markers: int = 0
    changed: list[str] = field(default_factory=list)


_PATH_TOKEN = re.compile(r'\.?([^.\[\]]+)|\[("(?:[^"\\]|\\.)*"|[^\]]*)\]')


def _step(node: Any, token: str, bracket: bool) -> Any:
    """One step of a path: a key, an index or a selector."""
    if not bracket:
        if not isinstance(node, dict) or token not in node:
            raise DocsNumbersError(f"no key {token!r}")
        return node[token]
    if token.startswith('"'):
        return _step(node, json.loads(token), False)
    if "=" in token:
        wanted = [part.split("=", 1) for part in token.split("&")]
        if not isinstance(node, list) or any(len(pair) != 2 for pair in wanted):
            raise DocsNumbersError(f"[{token}] on something that is not a list")
        for item in node:
            if isinstance(item, dict) and all(str(item.get(k)) == v for k, v in wanted):
                return item
        raise DocsNumbersError(f"no item with {token}")
    try:
        index = int(token)
    except ValueError:
        return _step(node, token, False)
    if not isinstance(node, list) or not -len(node) <= index < len(node):
        raise DocsNumbersError(f"no item [{index}]")
    return node[index]


def resolve_path(data: Any, path: str) -> Any:
    """The value at ``path`` in ``data`` (see the module docstring).

    After ``[*]`` (every item of a list, every value of an object) each
    further step applies to every item, and the result is a list.

    Raises:
        DocsNumbersError: the path does not lead to a value.
    """
    nodes = [data]
    spread = False
    pos = 0
    while pos < len(path):
        match = _PATH_TOKEN.match(path, pos)
        if not match or match.end() == pos:
            raise DocsNumbersError(f"cannot parse path {path!r} at {path[pos:]!r}")
        pos = match.end()
        if match.group(2) is not None and match.group(2).startswith("?"):
            wanted = [part.split("=", 1) for part in match.group(2)[1:].split("&")]
            if any(len(pair) != 2 for pair in wanted):
                raise DocsNumbersError(f"cannot parse filter [{match.group(2)}]")
            kept: list[Any] = []
            for node in nodes:
                if not isinstance(node, list):
                    raise DocsNumbersError(f"[{match.group(2)}] on something that is not a list")
                kept.extend(
                    item
                    for item in node
                    if isinstance(item, dict) and all(str(item.get(k)) == v for k, v in wanted)
                )
            if not kept:
                raise DocsNumbersError(f"no item matches [{match.group(2)}]")
            nodes = kept
            spread = True
            continue
        if match.group(2) == "*":
            items: list[Any] = []
            for node in nodes:
                if isinstance(node, list):
                    items.extend(node)
                elif isinstance(node, dict):
                    items.extend(node.values())
                else:
                    raise DocsNumbersError("[*] on something that is neither a list nor an object")
            nodes = items
            spread = True
            continue
        bracket = match.group(1) is None
        token = match.group(2) if bracket else match.group(1)
        nodes = [_step(node, token, bracket) for node in nodes]
    return nodes if spread else nodes[0]


_FUNCTIONS = {"min": min, "max": max, "len": len}
_OPERATORS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
}


def _operand(data: Any, text: str) -> Any:
    text = text.strip()
    call = re.fullmatch(r"(min|max|len)\((.*)\)", text)
    if call:
        values = resolve_path(data, call.group(2).strip())
        if not isinstance(values, list) or not values:
            raise DocsNumbersError(f"{call.group(1)}() of something that is not a non-empty list")
        return _FUNCTIONS[call.group(1)](values)
    try:
        return float(text)
    except ValueError:
        return resolve_path(data, text)


def _split_operators(expr: str) -> list[str]:
    """``expr`` cut at `` + - * / `` outside brackets: operand, op, operand..."""
    parts: list[str] = []
    depth = 0
    start = 0
    i = 0
    while i < len(expr):
        char = expr[i]
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        elif (
            depth == 0 and char in "+-*/" and expr[i - 1 : i] == " " and expr[i + 1 : i + 2] == " "
        ):
            parts += [expr[start : i - 1], char]
            start = i + 2
            i += 2
            continue
        i += 1
    parts.append(expr[start:])
    return parts


def evaluate(data: Any, expr: str) -> Any:
    """The value of ``expr``: paths and numbers joined by ``+ - * /``.

    Raises:
        DocsNumbersError: a path is missing, or an operand is not a number.
    """
    parts = _split_operators(expr.strip())
    value = _operand(data, parts[0])
    for op, text in zip(parts[1::2], parts[2::2]):
        other = _operand(data, text)
        if not all(isinstance(v, (int, float)) for v in (value, other)):
            raise DocsNumbersError(f"{op} on something that is not a number in {expr!r}")
        try:
            value = _OPERATORS[op](value, other)
        except ZeroDivisionError as exc:
            raise DocsNumbersError(f"division by zero in {expr!r}") from exc
    return value


def render(value: Any, spec: str) -> str:
    """``value`` formatted by ``spec``: a format spec or a ``{}`` template.

    Raises:
        DocsNumbersError: the spec does not fit the value.
    """
    try:
        return spec.format(value) if "{" in spec else format(value, spec)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise DocsNumbersError(f"format {spec!r} does not fit {value!r}: {exc}") from exc


class _Results:
    """The results files, each read once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[str, Any] = {}

    def load(self, name: str) -> Any:
        if name not in self._cache:
            path = self.root / name
            try:
                self._cache[name] = json.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError as exc:
                raise DocsNumbersError(f"no results file {name}") from exc
            except json.JSONDecodeError as exc:
                raise DocsNumbersError(f"{name} is not JSON: {exc}") from exc
        return self._cache[name]


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _blocks(text: str) -> Iterator[tuple[int, int, str]]:
    """(start, end, file) of every ``nums`` block."""
    pos = 0
    while True:
        opened = BLOCK_OPEN.search(text, pos)
        if not opened:
            return
        closed = BLOCK_CLOSE.search(text, opened.end())
        end = closed.start() if closed else len(text)
        yield opened.start(), end, opened.group("file")
        pos = closed.end() if closed else len(text)


def _process(page: str, text: str, results: _Results, report: Report) -> str:
    """``text`` with every marker rendered; problems go into ``report``."""
    blocks = list(_blocks(text))
    for start, _end, _file in blocks:
        if not BLOCK_CLOSE.search(text, start):
            report.problems.append(Problem(page, _line_of(text, start), "nums block never closed"))

    def block_file(offset: int) -> str | None:
        for start, end, name in blocks:
            if start <= offset < end:
                return name
        return None

    out: list[str] = []
    pos = 0
    for match in MARKER.finditer(text):
        out.append(text[pos : match.start("text")])
        pos = match.start("text")
        line = _line_of(text, match.start())
        report.markers += 1
        try:
            args = shlex.split(match.group("args"))
        except ValueError as exc:
            report.problems.append(Problem(page, line, f"bad marker: {exc}"))
            continue
        if len(args) == 2:
            name = block_file(match.start())
            if name is None:
                report.problems.append(
                    Problem(page, line, "marker names no file and is in no nums block")
                )
                continue
            expr, spec = args
        elif len(args) == 3:
            name, expr, spec = args
        else:
            report.problems.append(
                Problem(page, line, f"marker needs [FILE] EXPR FORMAT, got {args!r}")
            )
            continue
        report.files.add(name)
        try:
            rendered = render(evaluate(results.load(name), expr), spec)
        except DocsNumbersError as exc:
            report.problems.append(Problem(page, line, f"{name} {expr}: {exc}"))
            continue
        shown = match.group("text")
        if shown != rendered:
            report.problems.append(
                Problem(page, line, f"shows {shown!r}, {name} {expr} gives {rendered!r}")
            )
        out.append(rendered)
        pos = match.end("text")
    out.append(text[pos:])
    return "".join(out)


def _blank(match: re.Match[str]) -> str:
    """The match with everything but newlines turned into spaces."""
    return re.sub(r"[^\n]", " ", match.group(0))


def _section(text: str, heading: str | None) -> tuple[int, int]:
    """(start, end) of the section under ``## heading`` (the page if None)."""
    if heading is None:
        return 0, len(text)
    found = re.search(rf"^(#+)\s+{re.escape(heading)}\s*$", text, re.M)
    if not found:
        return 0, 0
    level = len(found.group(1))
    nxt = re.compile(rf"^#{{1,{level}}}\s", re.M).search(text, found.end())
    return found.end(), nxt.start() if nxt else len(text)


def unmarked_figures(text: str, heading: str | None = None) -> list[tuple[int, str]]:
    """(line, figure) of every measurement-like figure outside markers.

    Markers, exemptions, other HTML comments,
    inline code and fenced blocks are left out; with ``heading``, only that
    section is scanned.
    """
    found: list[tuple[int, str]] = []
    scrubbed = FENCE.sub(_blank, text)
    scrubbed = MARKER.sub(_blank, scrubbed)
    scrubbed = EXEMPT.sub(_blank, scrubbed)
    scrubbed = COMMENT.sub(_blank, scrubbed)
    scrubbed = CODE_SPAN.sub(_blank, scrubbed)
    scrubbed = SETTINGS.sub(_blank, scrubbed)
    start, end = _section(scrubbed, heading)
    for match in FIGURE.finditer(scrubbed, start, end):
        found.append((_line_of(scrubbed, match.start()), match.group(0)))
    return found


def _pages(root: Path, patterns: Sequence[str]) -> list[str]:
    pages: list[str] = []
    for pattern in patterns:
        for path in sorted(root.glob(pattern)):
            name = path.relative_to(root).as_posix()
            if path.is_file() and name not in pages:
                pages.append(name)
    return pages


def run(
    root: Path,
    write: bool,
    pages: Sequence[str] = PAGES,
    scanned: Sequence[tuple[str, str | None]] = SCANNED,
) -> Report:
    """Renders (and with ``write`` rewrites) every page; returns the findings."""
    report = Report()
    results = _Results(root)
    for page in _pages(root, pages):
        path = root / page
        text = path.read_text(encoding="utf-8")
        new = _process(page, text, results, report)
        if write and new != text:
            path.write_text(new, encoding="utf-8")
            report.changed.append(page)
    if write:
        report.problems = [p for p in report.problems if not p.message.startswith("shows ")]
    for page, heading in scanned:
        path = root / page
        if not path.is_file():
            report.problems.append(Problem(page, 0, "page to scan is missing"))
            continue
        text = path.read_text(encoding="utf-8")
        if heading is not None and _section(text, heading) == (0, 0):
            report.problems.append(Problem(page, 0, f"no section {heading!r} to scan"))
        for exempt in EXEMPT.finditer(text):
            if not exempt.group("reason").strip():
                line = _line_of(text, exempt.start())
                report.problems.append(Problem(page, line, "exemption without a reason"))
        for line, figure in unmarked_figures(text, heading):
            report.problems.append(
                Problem(page, line, f"figure {figure!r} is neither marked nor exempted")
            )
    return report


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def ages(root: Path, files: Sequence[str]) -> dict[str, tuple[str | None, int | None]]:
    """(commit measured at, commits since) of each results file, where known."""
    out: dict[str, tuple[str | None, int | None]] = {}
    results = _Results(root)
    for name in sorted(files):
        try:
            commit = results.load(name).get("machine", {}).get("git_commit")
        except (DocsNumbersError, AttributeError):
            commit = None
        count = _git(root, "rev-list", "--count", f"{commit}..HEAD") if commit else None
        out[name] = (commit, int(count) if count and count.isdigit() else None)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``--check`` or ``--write``; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="fail on any figure off its file")
    mode.add_argument("--write", action="store_true", help="re-render the figures from the files")
    parser.add_argument("--root", type=Path, default=REPO, help="repository root")
    parser.add_argument(
        "--max-age",
        type=int,
        default=None,
        help="fail when a cited results file was measured more than this many commits ago",
    )
    args = parser.parse_args(argv)
    report = run(args.root, write=args.write)
    for page in report.changed:
        print(f"rewrote {page}")
    for problem in report.problems:
        print(problem, file=sys.stderr)
    status = 1 if report.problems else 0
    print(f"{report.markers} marked figures from {len(report.files)} results files")
    for name, (commit, count) in ages(args.root, sorted(report.files)).items():
        since = "?" if count is None else str(count)
        print(f"  {name}: measured at {commit or '?'}, {since} commits ago")
        if args.max_age is not None and count is not None and count > args.max_age:
            print(
                f"{name}: measured {count} commits ago (--max-age {args.max_age})", file=sys.stderr
            )
            status = 1
    if report.problems:
        print(f"{len(report.problems)} problems", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())

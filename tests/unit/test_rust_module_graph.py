"""The Rust crates' source files import each other without circles.

Read from the ``.rs`` sources as text (regexes, nothing is built). Each
source file under a crate's ``src/`` is a node; the module tree is found
from ``lib.rs`` through its ``mod name;`` declarations (``name.rs`` or
``name/mod.rs``) and the inline ``mod name { ... }`` blocks (which belong
to the file that holds them).

The rule, an edge ``X -> Y``:

* a path in file ``X`` (in a ``use`` or in code) that starts with
  ``crate::``, ``super::``, ``self::``, a child module's name or a module
  brought in by a ``use``, resolved against the module tree, names an
  item (or glob-imports a module) that ``Y`` defines. The path is walked
  down the modules as far as they go; its next segment is the item. An
  item that the module only re-exports (``pub use``, or a ``use`` a child
  reaches) is followed to the file that defines it, so importing
  ``crate::comm::Engine`` depends on the file that defines ``Engine``,
  not on ``comm/mod.rs``. A name that cannot be found is charged to the
  module's own file. A ``use`` of a module itself (``use crate::config;``)
  is an edge to that module's file, and so is a glob (``use super::*``).
* A ``mod child;`` declaration is not an edge, and a re-export
  (``pub use child::Item``) is not an edge of the file that re-exports it
  unless that file's own code uses the name.
* No arrow back up: a module's file (``dir/mod.rs``, ``lib.rs``, or
  ``x.rs`` for the children in ``x/``) may use its own descendants, and
  those edges are dropped: a parent is where its children are put
  together. A child using an item its parent's file defines is then an
  edge up that closes no circle by itself; it does when the parent file
  reaches the child through some other module (``mod.rs -> other.rs ->
  child.rs -> mod.rs``), and that fails.
* A file's edges to itself are dropped (``mod tests { use super::*; }``).

The graph must have no cycle (a strongly connected component of more
than one file). The same holds at every level of the tree: in each
directory, the modules directly in it (a file ``x.rs``, a directory
``x/``, or both, count as one module ``x``) with an edge wherever a file
of one uses a file of another must form no cycle either. At ``src/`` that
is the top-level areas (``config``, ``comm``, ``image``, ``error``, ...);
in ``comm/`` it keeps ``shm/`` and ``tcp/`` from using each other even
when no two files do. A failure names the modules of each circle and the
paths behind each edge. The checker is first run on a synthetic tree with
a two-file circle, so the test cannot pass by finding no edges.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from _graph_cycles import cycles

REPO = Path(__file__).resolve().parents[2]
CRATES = [REPO / "rust" / "tiacc-core" / "src", REPO / "rust" / "tiacc-py" / "src"]

_CHAR = re.compile(r"'(?:\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^\\'\n])'")
_RAW = re.compile(r'b?r(#*)"')
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_MOD = re.compile(rf"(?<![\w$])(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+({_IDENT})\s*([;{{])")
_USE = re.compile(r"(?<![\w$])(pub(?:\s*\([^)]*\))?\s+)?use\s+([^;]+);")
_ITEM = re.compile(
    rf"(?<![\w$])(?:fn|struct|enum|trait|type|const|static|union)\s+({_IDENT})"
    rf"|macro_rules!\s*({_IDENT})"
)
_PATH = re.compile(rf"(?<![\w$:.])({_IDENT}(?:\s*::\s*{_IDENT})+)")


def strip(text: str) -> str:
    """The source with comments, strings and char literals blanked out."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
            out.append(" ")
        elif (m := _RAW.match(text, i)) and (i == 0 or not text[i - 1].isalnum()):
            end = text.find('"' + m.group(1), m.end())
            i = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and (m := _CHAR.match(text, i)):
            i = m.end()
            out.append("' '")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def use_paths(tree: str) -> list[tuple[list[str], str | None]]:
    """A use tree's leaves: (path segments, the name it binds; None for ``*``)."""
    tree = re.sub(r"\s*([:{},*])\s*", r"\1", re.sub(r"\s+", " ", tree.strip()))
    tree = tree.removeprefix("::")
    found: list[tuple[list[str], str | None]] = []

    def walk(prefix: list[str], text: str) -> None:
        if "{" in text:
            head, _, rest = text.partition("{")
            inner = rest[: rest.rfind("}")]
            base = prefix + [s for s in head.split("::") if s]
            depth, start = 0, 0
            for k, ch in enumerate(inner + ","):
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                elif ch == "," and depth == 0:
                    if inner[start:k]:
                        walk(base, inner[start:k])
                    start = k + 1
            return
        text, _, alias = text.partition(" as ")
        segs = prefix + [s for s in text.split("::") if s]
        if segs and segs[-1] == "*":
            found.append((segs[:-1], None))
        elif len(segs) > 1 and segs[-1] == "self":
            found.append((segs[:-1], alias or segs[-2]))
        elif segs:
            found.append((segs, alias or segs[-1]))

    walk([], tree)
    return found


@dataclass
class Module:
    path: tuple[str, ...]
    file: Path
    children: dict[str, tuple[str, ...]] = field(default_factory=dict)
    items: set[str] = field(default_factory=set)
    # (segments, bound name or None for a glob, is a re-export, file offset)
    uses: list[tuple[list[str], str | None, bool, int]] = field(default_factory=list)
    code_paths: list[list[str]] = field(default_factory=list)


class Crate:
    """The module tree of one crate and its file-level import graph."""

    def __init__(self, src: Path) -> None:
        self.src = src
        self.modules: dict[tuple[str, ...], Module] = {}
        self.texts: dict[Path, str] = {}
        self._load(src / "lib.rs", ())

    def _load(self, file: Path, path: tuple[str, ...]) -> None:
        text = strip(file.read_text())
        self.texts[file] = text
        # The inline module every offset sits in.
        stack: list[tuple[tuple[str, ...], int]] = [(path, -1)]
        spans: list[tuple[int, tuple[str, ...]]] = [(0, path)]
        self.modules[path] = Module(path, file)
        depth = 0
        pending: dict[int, str] = {m.end() - 1: m.group(1) for m in _MOD.finditer(text)}
        for k, ch in enumerate(text):
            if ch == "{":
                depth += 1
                if k in pending:
                    parent = stack[-1][0]
                    child = parent + (pending[k],)
                    self.modules[parent].children[pending[k]] = child
                    self.modules[child] = Module(child, file)
                    stack.append((child, depth))
                    spans.append((k, child))
            elif ch == "}":
                if stack[-1][1] == depth:
                    stack.pop()
                    spans.append((k, stack[-1][0]))
                depth -= 1
            elif ch == ";" and k in pending:
                parent = stack[-1][0]
                name = pending[k]
                child = parent + (name,)
                self.modules[parent].children[name] = child
                base = file.parent if file.name in ("lib.rs", "mod.rs") else file.with_suffix("")
                # Inline modules nest their files' directories too.
                base = base.joinpath(*parent[len(path) :])
                target = base / f"{name}.rs"
                if not target.exists():
                    target = base / name / "mod.rs"
                self._load(target, child)

        def scope(offset: int) -> tuple[str, ...]:
            current = path
            for start, mod in spans:
                if start > offset:
                    break
                current = mod
            return current

        in_use: list[tuple[int, int]] = []
        for m in _USE.finditer(text):
            in_use.append((m.start(), m.end()))
            module = self.modules[scope(m.start())]
            for segs, name in use_paths(m.group(2)):
                module.uses.append((segs, name, bool(m.group(1)), m.start()))
        for m in _ITEM.finditer(text):
            self.modules[scope(m.start())].items.add(m.group(1) or m.group(2))
        for m in _PATH.finditer(text):
            if any(a <= m.start() < b for a, b in in_use):
                continue
            segs = re.sub(r"\s+", "", m.group(1)).split("::")
            self.modules[scope(m.start())].code_paths.append(segs)

    # -- resolution ---------------------------------------------------------

    def _start(
        self, scope: tuple[str, ...], segs: list[str]
    ) -> tuple[tuple[str, ...], list[str]] | None:
        """Where a path starts in the tree, and its segments after that."""
        head, rest = segs[0], segs[1:]
        if head == "crate":
            return (), rest
        if head == "self":
            return scope, rest
        if head == "super":
            here = scope
            while segs and segs[0] == "super":
                here, segs = here[:-1], segs[1:]
            return here, segs
        if head in self.modules[scope].children:
            return self.modules[scope].children[head], rest
        for use_segs, name, _, _ in self.modules[scope].uses:
            if name == head and use_segs[:1] != [head]:
                start = self._start(scope, use_segs)
                if start is not None:
                    return start[0], start[1] + rest
        return None

    def resolve(
        self, scope: tuple[str, ...], segs: list[str], seen: frozenset = frozenset()
    ) -> set[Path]:
        """The files that define what a path names (empty: outside the crate)."""
        if not segs:
            return set()
        start = self._start(scope, segs)
        if start is None:
            return set()
        module, rest = start
        while rest and rest[0] in self.modules[module].children:
            module, rest = self.modules[module].children[rest[0]], rest[1:]
        here = self.modules[module]
        if not rest:
            return {here.file}
        item = rest[0]
        if item in here.items or (module, item) in seen:
            return {here.file}
        seen = seen | {(module, item)}
        for use_segs, name, _, _ in here.uses:
            if name == item:
                found = self.resolve(module, use_segs, seen)
                if found:
                    return found
        for use_segs, name, _, _ in here.uses:
            if name is None:
                found = self.resolve(module, use_segs + [item], seen)
                if found:
                    return found
        return {here.file}

    def edges(self) -> dict[Path, dict[Path, list[str]]]:
        """file -> file it depends on -> the paths that make the edge."""
        graph: dict[Path, dict[Path, list[str]]] = {m.file: {} for m in self.modules.values()}
        for module in self.modules.values():
            text = self.texts[module.file]
            found: list[list[str]] = []
            for segs, name, reexport, offset in module.uses:
                if name is None:
                    start = self._start(module.path, segs)
                    if start is not None:
                        found.append(segs + ["*"])
                    continue
                if reexport:
                    body = text[:offset] + text[text.find(";", offset) :]
                    if not re.search(rf"(?<![\w$]){re.escape(name)}(?!\w)", body):
                        continue
                found.append(segs)
            found.extend(module.code_paths)
            for segs in found:
                if segs[-1] == "*":
                    start = self._start(module.path, segs[:-1])
                    if start is None:
                        continue
                    mod, rest = start
                    while rest and rest[0] in self.modules[mod].children:
                        mod, rest = self.modules[mod].children[rest[0]], rest[1:]
                    targets = {self.modules[mod].file}
                else:
                    targets = self.resolve(module.path, segs)
                for target in targets:
                    if target != module.file:
                        graph[module.file].setdefault(target, []).append("::".join(segs))
        return graph


def downward(src: Path, graph: dict[Path, dict[Path, list[str]]]) -> dict:
    """The graph less each module file's edges into its own directory.

    That is ``dir/`` for ``dir/mod.rs`` and ``lib.rs``, ``x/`` for ``x.rs``.
    """
    out = {}
    for file, targets in graph.items():
        own = file.parent if file.name in ("mod.rs", "lib.rs") else file.with_suffix("")
        out[file] = {t: why for t, why in targets.items() if own not in t.parents}
    return out


def levels(src: Path, graph: dict[Path, dict[Path, list[str]]]) -> dict[Path, dict]:
    """Per directory: the graph between its entries (its files, its subdirectories)."""
    out: dict[Path, dict[str, dict[str, list[str]]]] = {}
    for file, targets in graph.items():
        for target, why in targets.items():
            for directory in file.parents:
                if directory != src and src not in directory.parents:
                    break
                if directory not in target.parents:
                    continue
                a = file.relative_to(directory).parts
                b = target.relative_to(directory).parts
                # ``x.rs`` and its children in ``x/`` are one module.
                name_a, name_b = a[0].removesuffix(".rs"), b[0].removesuffix(".rs")
                if name_a != name_b:
                    level = out.setdefault(directory, {})
                    level.setdefault(name_a, {}).setdefault(name_b, []).extend(
                        f"{file.relative_to(src)}: {w}" for w in why
                    )
                break
    return out


def report(graph: dict, comps: list[list], name) -> str:
    lines = []
    for comp in comps:
        lines.append("circle: " + " <-> ".join(name(n) for n in comp))
        members = set(comp)
        for node in comp:
            for target, why in sorted(graph.get(node, {}).items(), key=lambda kv: str(kv[0])):
                if target in members:
                    shown = ", ".join(sorted(set(why))[:4])
                    lines.append(f"  {name(node)} -> {name(target)}: {shown}")
    return "\n".join(lines)


def check(src: Path) -> str:
    """An empty string, or the circles in the crate at ``src``."""
    graph = downward(src, Crate(src).edges())
    problems = [report(graph, cycles(graph), lambda f: str(f.relative_to(src)))]
    for directory, level in sorted(levels(src, graph).items()):
        where = f"{directory.relative_to(src)}/" if directory != src else "src/"
        found = report(level, cycles(level), str)
        if found:
            problems.append(f"in {where}:\n" + found)
    return "\n".join(p for p in problems if p)


def test_checker_catches_a_two_file_circle(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "comm" / "setup").mkdir(parents=True)
    (src / "lib.rs").write_text("pub mod comm;\npub mod config;\n")
    (src / "comm" / "mod.rs").write_text(
        "pub mod setup;\npub mod store;\npub use setup::TcpPeers;\n"
    )
    (src / "comm" / "setup" / "mod.rs").write_text(
        "use crate::comm::store::Store; // a comment: crate::x::y\n"
        "pub struct TcpPeers;\n"
        'fn f() { let s = "super::store::Nope"; Store::new(); }\n'
        "#[cfg(test)]\nmod tests { use super::*; }\n"
    )
    (src / "comm" / "store.rs").write_text("use crate::comm::TcpPeers;\npub struct Store;\n")
    (src / "config.rs").write_text("pub enum Compression { None }\n")
    graph = Crate(src).edges()
    setup, store = src / "comm" / "setup" / "mod.rs", src / "comm" / "store.rs"
    # The re-export in comm/mod.rs is followed to the file that defines it.
    assert set(graph[store]) == {setup}
    assert set(graph[setup]) == {store}
    assert graph[src / "comm" / "mod.rs"] == {}
    problem = check(src)
    assert "comm/setup/mod.rs <-> comm/store.rs" in problem

    # Break it: the store no longer needs TcpPeers; no circle is left.
    (src / "comm" / "store.rs").write_text("pub struct Store;\n")
    assert check(src) == ""

    # A child may use what its parent's mod.rs defines while the mod.rs uses
    # the child: the mod.rs's edges into its own directory are not arrows.
    (src / "comm" / "mod.rs").write_text(
        "pub mod setup;\npub mod store;\npub struct Shared;\nfn f() { setup::TcpPeers; }\n"
    )
    (src / "comm" / "store.rs").write_text("use super::Shared;\npub struct Store;\n")
    assert check(src) == ""

    # Between areas, no file circle: comm/store.rs -> config.rs -> comm/setup.
    (src / "comm" / "setup" / "mod.rs").write_text("pub struct TcpPeers;\n")
    (src / "config.rs").write_text(
        "pub enum Compression { None }\nfn f() { crate::comm::setup::TcpPeers; }\n"
    )
    (src / "comm" / "store.rs").write_text("use crate::config::Compression;\npub struct Store;\n")
    problem = check(src)
    assert problem.startswith("in src/:\ncircle: comm <-> config"), problem


def test_use_trees_are_expanded() -> None:
    assert use_paths("crate::{a::{self, B as C}, d::*, e}") == [
        (["crate", "a"], "a"),
        (["crate", "a", "B"], "C"),
        (["crate", "d"], None),
        (["crate", "e"], "e"),
    ]


def test_rust_crates_have_no_module_circles() -> None:
    problems = []
    for src in CRATES:
        found = check(src)
        if found:
            problems.append(f"{src.relative_to(REPO)}:\n{found}")
    assert not problems, "\n".join(problems)

"""The package's modules import each other without circles, at their tops.

Read from the source (``ast``), not by importing: a module-level import of
one of the package's modules is an edge; the graph must have no cycle
(a strongly connected component of more than one module). A package's
``from . import sub`` depends on ``sub``, not on the package's
``__init__``. An import of one of the package's own modules inside a
function (the usual way to close a circle) is reported too: imports
inside functions are kept for optional dependencies.
"""

from __future__ import annotations

import ast
from pathlib import Path

from _graph_cycles import cycles

ROOT = Path(__file__).resolve().parents[2] / "tiacc_training"
PACKAGE = ROOT.name


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.with_suffix("").relative_to(ROOT.parent).parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (``from .x import``: ``pkg.x``)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _targets(node: ast.AST, module: str, is_package: bool, modules: dict) -> list[str]:
    """The package's modules an import statement loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    assert isinstance(node, ast.ImportFrom)
    base = _base(module, is_package, node)
    subs = [f"{base}.{a.name}" for a in node.names]
    found = [s for s in subs if s in modules]
    if base in modules and len(found) < len(subs):
        found.append(base)  # names defined in the module itself
    return found


def _top_level(tree: ast.Module) -> set[ast.AST]:
    """Import statements that run when the module loads (also under if/try)."""
    top: set[ast.AST] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        stmt = pending.pop()
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            top.add(stmt)
        elif isinstance(stmt, (ast.If, ast.Try)):
            pending += stmt.body + stmt.orelse
            if isinstance(stmt, ast.Try):
                pending += stmt.finalbody
                for handler in stmt.handlers:
                    pending += handler.body
    return top


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """Module-level import edges, and the imports of package modules inside functions."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    inside: list[str] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = _top_level(tree)
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = [t for t in _targets(node, module, is_package, modules) if t != module]
            if node in top:
                edges[module].update(targets)
            elif targets:
                inside.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {targets}")
    return edges, inside


def test_the_checker_finds_a_circle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle() -> None:
    edges, _ = _graph()
    assert f"{PACKAGE}.torch.distributed._runtime" in edges
    assert cycles(edges) == []


def test_no_package_import_inside_a_function() -> None:
    _, inside = _graph()
    assert inside == [], "\n".join(inside)

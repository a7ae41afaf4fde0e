"""One writer of the process's group state: ``_runtime``.

Read from the source (``ast``): outside ``_runtime`` (and ``_state``, which
defines it), no module of ``tiacc_training.torch.distributed`` assigns,
augments or deletes an attribute of ``state`` (the ``_state.state``
object), nor calls one of its methods that change it (``set_engine``,
``set_cuda``, ``retire``...). Tests set fields in fixtures; the package
does not.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tiacc_training" / "torch" / "distributed"
WRITERS = {"_runtime.py", "_state.py"}


def _state_methods() -> set[str]:
    """The methods ``State`` defines (each may change it)."""
    tree = ast.parse((PACKAGE / "_state.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "State":
            found |= {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
    return found


def _names_of_state(tree: ast.Module) -> set[str]:
    """The names a module binds to ``_state.state`` (``from ._state import state as x``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == "_state":
            names |= {a.asname or a.name for a in node.names if a.name == "state"}
    return names


def _is_state(node: ast.expr, names: set[str]) -> bool:
    """Whether ``node`` is the state object: a bound name, or ``_state.state``."""
    if isinstance(node, ast.Name):
        return node.id in names
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "state"
        and isinstance(node.value, ast.Name)
        and node.value.id == "_state"
    )


def writes(source: str, methods: set[str]) -> list[int]:
    """Lines of ``source`` that write ``state``'s attributes or call its methods."""
    tree = ast.parse(source)
    names = _names_of_state(tree)
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in methods:
                targets = [node.func]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and _is_state(sub.value, names):
                    lines.append(node.lineno)
    return sorted(set(lines))


def test_only_runtime_writes_the_state() -> None:
    methods = _state_methods()
    assert methods, "State defines no methods: the reader of _state.py is broken"
    found = {
        path.name: writes(path.read_text(), methods)
        for path in sorted(PACKAGE.glob("*.py"))
        if path.name not in WRITERS
    }
    assert not {name: lines for name, lines in found.items() if lines}, found


def test_the_check_sees_each_kind_of_write() -> None:
    methods = {"set_engine"}
    bound = "from ._state import state as runtime\n"
    for line in ("runtime.engine = 1", "runtime.count += 1", "del runtime.cuda",
                 "runtime.set_engine(x)", "runtime.counters['a'] = 1",
                 "_state.state.engine = 1"):  # fmt: skip
        assert writes(bound + line, methods) == [2], line
    # A reader, another object's attribute, a local named like it.
    assert writes(bound + "x = runtime.engine\nother.engine = 1\nstate.calls += 1", methods) == []

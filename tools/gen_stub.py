#!/usr/bin/env python3
"""Writes `tiacc_training/_engine.pyi`, the type stub of the compiled extension.

The stub is generated from the built `tiacc_training._engine`, so the Rust
bindings (`rust/tiacc-py`) are the one source of its names and types. Each
kind of name carries its type where Python can read it back:

* functions, methods and constructors: the annotated signature that pyo3's
  `#[pyo3(text_signature = "...")]` puts at the head of the doc, e.g.
  `"(self, ptr: int, nbytes: int, bucket: int = 0) -> None"`; a
  constructor's (on `#[new]`) has no return type;
* properties: the getter's doc starts with the type, `int: This rank.` (the
  Google style for properties; pyo3 takes no text signature on a getter);
* exception attributes: the `Attributes:` section of the class doc,
  `path (str): The file.`;
* iterators: the `Yields:` section of the class doc, `tuple[int, bytes]: ...`;
* the aliases the signatures use (`_Path`, ...): the `Type aliases:` section
  of the module doc, `Name = type: what it is.`;
* constants: the type of their value.

A callable without annotations (pyo3's own signature: its text signature is
missing), a property without a type, or a type naming something that is not a
builtin, a class of the module, an alias or one of `IMPORTS` fails the run.
Each section of the stub names the Rust file its items are defined in.

Usage::

    python tools/gen_stub.py          # writes the stub
    python tools/gen_stub.py --check  # exits 1 with a diff when the stub differs
"""

from __future__ import annotations

import argparse
import ast
import builtins
import difflib
import importlib
import inspect
import re
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
STUB = ROOT / "tiacc_training" / "_engine.pyi"
BINDINGS = ROOT / "rust" / "tiacc-py" / "src"
MODULE = "tiacc_training._engine"
LINE = 100  # ruff's line-length (pyproject.toml)
INDENT = "    "

HEADER = '''"""Type stubs of the Rust extension module (see rust/tiacc-py).

Generated from the built extension by tools/gen_stub.py: change the bindings'
text signatures and docs, rebuild, and run it again (`make lint` checks it).
"""'''

# The names a type may use besides builtins, the module's classes and its
# aliases, and the module each is imported from.
IMPORTS = {
    "Any": "typing",
    "Literal": "typing",
    "Optional": "typing",
    "Union": "typing",
    "type_check_only": "typing",
    "Callable": "collections.abc",
    "Iterable": "collections.abc",
    "Iterator": "collections.abc",
    "Mapping": "collections.abc",
    "Sequence": "collections.abc",
    "PathLike": "os",
}

# Special methods whose type the data model fixes.
SPECIAL = {"__len__": "int", "__bool__": "bool", "__hash__": "int"}

# Class attributes that are not part of the stub: what every class has, the
# iterator protocol (written from the `Yields:` section) and pickling.
SKIPPED = {
    "__new__",
    "__doc__",
    "__module__",
    "__dict__",
    "__weakref__",
    "__repr__",
    "__str__",
    "__iter__",
    "__next__",
    "__getnewargs__",
    "__getnewargs_ex__",
    "__reduce__",
    "__getstate__",
    "__setstate__",
}


class StubError(Exception):
    """The bindings do not say a type the stub needs."""


@dataclass
class Names:
    """What a type may name, and the imports the names used so far need."""

    classes: set[str]
    aliases: set[str] = field(default_factory=set)
    used: set[str] = field(default_factory=set)

    def check(self, node: ast.AST, where: str) -> None:
        """Checks the names in a parsed type and notes those to import.

        Args:
            node: The type, parsed.
            where: What the type belongs to, for the error.

        Raises:
            StubError: A name is unknown.
        """
        for sub in ast.walk(node):
            if not isinstance(sub, ast.Name):
                continue
            name = sub.id
            if name in IMPORTS:
                self.used.add(name)
            elif name not in self.classes and name not in self.aliases and not _builtin(name):
                raise StubError(f"{where}: unknown name {name!r} in a type")


def _builtin(name: str) -> bool:
    return isinstance(getattr(builtins, name, None), type)


def render(node: ast.AST) -> str:
    """A type or a default value as the stub writes it (strings in double quotes).

    Args:
        node: The parsed expression.

    Returns:
        Its text.

    Raises:
        StubError: An expression a type or default does not use.
    """
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{render(node.value)}.{node.attr}"
    if isinstance(node, ast.Subscript):
        inner = node.slice
        if isinstance(inner, ast.Tuple):
            items = ", ".join(render(e) for e in inner.elts) if inner.elts else "()"
        else:
            items = render(inner)
        return f"{render(node.value)}[{items}]"
    if isinstance(node, ast.List):
        return "[" + ", ".join(render(e) for e in node.elts) + "]"
    if isinstance(node, ast.Tuple):
        items = [render(e) for e in node.elts]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(node, ast.Constant):
        if node.value is Ellipsis:
            return "..."
        if isinstance(node.value, str) and '"' not in node.value:
            return '"' + repr(node.value)[1:-1].replace("\\'", "'") + '"'
        return repr(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return "-" + render(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return f"{render(node.left)} | {render(node.right)}"
    raise StubError(f"cannot write {ast.dump(node)} in a stub")


def parse_type(text: str, where: str, names: Names) -> str:
    """Parses, checks and renders a type written in a doc.

    Args:
        text: The type.
        where: What it belongs to, for the error.
        names: The names a type may use.

    Returns:
        The type as the stub writes it.

    Raises:
        StubError: It does not parse or names something unknown.
    """
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise StubError(f"{where}: {text!r} is not a type ({e.msg})") from None
    names.check(node, where)
    return render(node)


@dataclass
class Signature:
    """A callable's parameters and return type, as the stub writes them."""

    params: list[str]
    returns: Optional[str]


def text_signature(obj: object, name: str) -> Optional[str]:
    """The text signature pyo3 gave `obj`, or None.

    CPython moves a signature ending in `)` to `__text_signature__`; one with
    a return type stays at the head of `__doc__`, before the `--` line.

    Args:
        obj: A function, method or class of the extension.
        name: Its Python name.

    Returns:
        The signature from its opening parenthesis, or None without one.
    """
    text = getattr(obj, "__text_signature__", None)
    if text:
        return str(text)
    doc = getattr(obj, "__doc__", None) or ""
    head, marker, _ = doc.partition("\n--\n\n")
    if marker and head.startswith(name + "("):
        return head[len(name) :]
    return None


def parse_signature(text: str, where: str, names: Names, *, first: Optional[str]) -> Signature:
    """Parses an annotated text signature.

    Args:
        text: The signature, `(params) -> type` (`(params)` for a constructor).
        where: What it belongs to, for the errors.
        names: The names a type may use.
        first: The unannotated first parameter it must start with (`self`,
            `cls`), or None for one without.

    Returns:
        The parameters (without `first`) and the return type.

    Raises:
        StubError: It does not parse, or a parameter or the return lacks a type.
    """
    text = re.sub(r"^\(\$module(?:, |(?=\)))", "(", text)  # C functions of a module
    text = re.sub(r"\$(self|cls|type)\b", r"\1", text)
    try:
        tree = ast.parse(f"def _{text}: ...")
    except SyntaxError as e:
        raise StubError(f"{where}: text signature {text!r} does not parse ({e.msg})") from None
    func = tree.body[0]
    assert isinstance(func, ast.FunctionDef)
    args = func.args
    positional = [*args.posonlyargs, *args.args]
    if first is not None:
        if not positional or positional[0].arg != first:
            raise StubError(f"{where}: text signature {text!r} must start with {first!r}")
        if positional[0].annotation is not None:
            raise StubError(f"{where}: {first!r} takes no annotation")

    def param(arg: ast.arg, default: Optional[ast.expr], prefix: str = "") -> str:
        if arg.annotation is None:
            raise StubError(f"{where}: parameter {arg.arg!r} has no type (text signature {text!r})")
        names.check(arg.annotation, where)
        out = f"{prefix}{arg.arg}: {render(arg.annotation)}"
        return out if default is None else f"{out} = {render(default)}"

    params: list[str] = []
    defaults: list[Optional[ast.expr]] = [None] * (len(positional) - len(args.defaults))
    defaults += args.defaults
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        if i > 0 or first is None:
            params.append(param(arg, default))
        if args.posonlyargs and i == len(args.posonlyargs) - 1:
            params.append("/")
    if args.vararg is not None:
        params.append(param(args.vararg, None, "*"))
    elif args.kwonlyargs:
        params.append("*")
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults):
        params.append(param(arg, kw_default))
    if args.kwarg is not None:
        params.append(param(args.kwarg, None, "**"))
    returns = None
    if func.returns is not None:
        names.check(func.returns, where)
        returns = render(func.returns)
    return Signature(params, returns)


def doc_section(doc: Optional[str], title: str) -> list[str]:
    """The entries of a Google-style section of a doc, each on one line.

    Args:
        doc: The doc.
        title: The section's title, without the colon.

    Returns:
        Each entry with its continuation lines joined, in order; empty when
        the doc has no such section.
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    if f"{title}:" not in lines:
        return []
    entries: list[str] = []
    for line in lines[lines.index(f"{title}:") + 1 :]:
        if not line.startswith(" "):
            break
        if len(line) - len(line.lstrip()) <= len(INDENT) or not entries:
            entries.append(line.strip())
        else:
            entries[-1] += " " + line.strip()
    return entries


def def_lines(indent: str, name: str, params: list[str], returns: str) -> list[str]:
    """A stub `def`, split over lines the way the formatter splits it.

    Args:
        indent: The indentation of the `def`.
        name: The function's name.
        params: Its parameters, written out.
        returns: Its return type.

    Returns:
        The lines.
    """
    head = f"{indent}def {name}("
    tail = f") -> {returns}: ..."
    one = head + ", ".join(params) + tail
    if len(one) <= LINE:
        return [one]
    middle = indent + INDENT + ", ".join(params)
    if len(middle) <= LINE:
        return [head, middle, indent + tail]
    return [head, *(f"{indent}{INDENT}{p}," for p in params), indent + tail]


def comment(text: str) -> list[str]:
    """`text` as comment lines that fit the line length.

    Args:
        text: The comment.

    Returns:
        The lines.
    """
    return textwrap.wrap(text, LINE - 2, initial_indent="# ", subsequent_indent="# ")


def rust_files() -> dict[str, Path]:
    """The Rust file that defines each Python name of the bindings.

    Returns:
        Python name -> file, for functions (`#[pyfunction]`), classes
        (`#[pyclass]`, by their `name = "..."` or struct name), exceptions
        (`create_exception!`) and what a module adds by name (`m.add("...")`).
    """
    found: dict[str, Path] = {}
    patterns = [
        (r"#\[pyfunction\].*?\bfn\s+(\w+)", None),
        (r"#\[pyclass(?:\(([^)]*)\))?\].*?\bstruct\s+(\w+)", "class"),
        (r"create_exception!\(\s*[\w.]+\s*,\s*(\w+)", None),
        (r"\.add\(\s*\"(\w+)\"", None),
    ]
    for path in sorted(BINDINGS.glob("*.rs")):
        text = path.read_text(encoding="utf-8")
        for pattern, kind in patterns:
            for m in re.finditer(pattern, text, re.S):
                if kind == "class":
                    renamed = re.search(r'\bname\s*=\s*"(\w+)"', m.group(1) or "")
                    name = renamed.group(1) if renamed else m.group(2)
                else:
                    name = m.group(1)
                found.setdefault(name, path)
    return found


@dataclass
class Share:
    """Members that one bindings macro defines on several classes.

    Attributes:
        base: The stub-only base class that holds them (`_EngineSetupView` for
            `engine_setup_view!`), declared with `typing.type_check_only`: at
            run time the classes have no common base.
        classes: The classes the macro is invoked for, in order.
        members: The names of the methods and getters the macro defines.
    """

    base: str
    classes: list[str]
    members: set[str]


def macro_shares() -> list[Share]:
    """The members a bindings macro gives two or more classes.

    A `macro_rules!` of the bindings whose body holds a `#[pymethods]` block
    defines the same methods on every class it is invoked for
    (`engine_setup_view!(CommEngine);`); the stub writes them once, in a base.

    Returns:
        One `Share` for each such macro invoked for two classes or more.
    """
    texts = [p.read_text(encoding="utf-8") for p in sorted(BINDINGS.glob("*.rs"))]
    shares = []
    for text in texts:
        for m in re.finditer(r"macro_rules!\s+(\w+)\s*\{(.*?)\n\}", text, re.S):
            name, body = m.groups()
            if "#[pymethods]" not in body:
                continue
            classes = [c for t in texts for c in re.findall(rf"\b{name}!\(\s*(\w+)\s*\)", t)]
            if len(classes) < 2:
                continue
            base = "_" + "".join(word.capitalize() for word in name.split("_"))
            shares.append(Share(base, classes, set(re.findall(r"\bfn\s+(\w+)\s*\(", body))))
    return shares


def section_title(path: Path) -> str:
    """The comment naming a Rust file: its path and the first sentence of its docs.

    Args:
        path: The file.

    Returns:
        The comment's text.
    """
    paragraph: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line[3:].strip() if line.startswith("//!") else ""
        if not text and paragraph:
            break
        if text:
            paragraph.append(text)
    m = re.match(r"(.+?\.)(?:\s|$)", " ".join(paragraph))
    where = path.relative_to(ROOT).as_posix()
    return f"{where}: {m.group(1)}" if m else where


class Generator:
    """Walks the extension module and writes its stub."""

    def __init__(self, module: types.ModuleType) -> None:
        """Prepares to walk `module`.

        Args:
            module: The extension module.
        """
        self.module = module
        self.all: list[str] = list(module.__all__)
        classes = {n for n in self.all if isinstance(getattr(module, n), type)}
        self.names = Names(classes)
        entries = []
        for entry in doc_section(module.__doc__, "Type aliases"):
            m = re.fullmatch(r"(\w+) = (.+?): (.*)", entry)
            if m is None:
                raise StubError(f"module doc: type alias {entry!r} is not 'Name = type: text'")
            entries.append(m.groups())
            self.names.aliases.add(m.group(1))
        # (name, type, what it is)
        self.aliases = [
            (name, parse_type(text, f"alias {name}", self.names), what)
            for name, text, what in entries
        ]
        self.shares = macro_shares()
        for share in self.shares:
            missing = [c for c in share.classes if c not in classes]
            if missing:
                raise StubError(f"{share.base}: no class {', '.join(missing)} in the module")

    def constant(self, name: str, value: object) -> list[str]:
        """The stub of a module constant, typed by its value."""

        def typed(v: object) -> str:
            if isinstance(v, (bool, int, float, str, bytes)):
                return type(v).__name__
            if isinstance(v, tuple):
                return "tuple[" + (", ".join(typed(x) for x in v) or "()") + "]"
            raise StubError(f"{name}: no stub type for a constant of {type(v).__name__}")

        return [f"{name}: {typed(value)}"]

    def function(
        self,
        name: str,
        func: object,
        indent: str = "",
        first: Optional[str] = None,
        where: Optional[str] = None,
    ) -> list[str]:
        """The stub of a function or method, from its text signature."""
        where = where or name
        text = text_signature(func, name)
        if text is None:
            raise StubError(f"{where}: no text signature")
        sig = parse_signature(text, where, self.names, first=first)
        if sig.returns is None:
            raise StubError(f"{where}: text signature {text!r} has no return type")
        params = [first, *sig.params] if first else sig.params
        return def_lines(indent, name, params, sig.returns)

    def exception(self, name: str, cls: type) -> list[str]:
        """The stub of an exception class: its bases and documented attributes."""
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        body = []
        for entry in doc_section(cls.__doc__, "Attributes"):
            m = re.fullmatch(r"(\w+) \((.+)\): .*", entry)
            if m is None:
                raise StubError(f"{name}: attribute {entry!r} is not 'name (type): text'")
            attr, text = m.groups()
            body.append(f"{INDENT}{attr}: {parse_type(text, f'{name}.{attr}', self.names)}")
        if not body:
            return [f"class {name}({bases}): ..."]
        return [f"class {name}({bases}):", *body]

    def members(
        self, name: str, cls: type, keep: Callable[[str], bool]
    ) -> tuple[list[str], list[str]]:
        """The stubs of the attributes of `cls` that `keep` accepts.

        Args:
            name: The class's name (for errors).
            cls: The class.
            keep: Whether an attribute's stub is wanted, by its name.

        Returns:
            The special methods' and properties' lines, and the methods'.
        """
        properties: list[str] = []
        methods: list[str] = []
        for attr in sorted(vars(cls)):
            if not keep(attr):
                continue
            value = inspect.getattr_static(cls, attr)
            where = f"{name}.{attr}"
            if attr in SPECIAL:
                properties += def_lines(INDENT, attr, ["self"], SPECIAL[attr])
            elif attr in SKIPPED:
                continue
            elif attr.startswith("__"):
                raise StubError(f"{where}: no stub for this special method (see SPECIAL)")
            elif isinstance(value, (types.GetSetDescriptorType, types.MemberDescriptorType)):
                first_line = (value.__doc__ or "").strip().split("\n", 1)[0]
                m = re.match(r"(.+?): ", first_line + " ")
                if m is None:
                    raise StubError(f"{where}: the getter's doc must start with 'type: '")
                kind = parse_type(m.group(1), where, self.names)
                properties += [f"{INDENT}@property", f"{INDENT}def {attr}(self) -> {kind}: ..."]
            elif isinstance(value, staticmethod):
                methods.append(f"{INDENT}@staticmethod")
                methods += self.function(attr, value.__func__, INDENT, None, where)
            elif isinstance(value, (classmethod, types.ClassMethodDescriptorType)):
                methods.append(f"{INDENT}@classmethod")
                methods += self.function(attr, getattr(cls, attr), INDENT, "cls", where)
            elif callable(value):
                methods += self.function(attr, value, INDENT, "self", where)
            else:
                raise StubError(f"{where}: no stub for a {type(value).__name__}")
        return properties, methods

    def shared_base(self, share: Share) -> list[str]:
        """The stub-only base holding what `share`'s macro defines.

        Every class must have the members, with the same stub.
        """
        stubs = []
        for name in share.classes:
            cls = getattr(self.module, name)
            absent = sorted(m for m in share.members if m not in vars(cls))
            if absent:
                raise StubError(f"{name}: {share.base} members {', '.join(absent)} missing")
            properties, methods = self.members(name, cls, share.members.__contains__)
            stubs.append(properties + methods)
        if any(other != stubs[0] for other in stubs[1:]):
            raise StubError(f"{share.base}: the classes {share.classes} type its members apart")
        self.names.used.add("type_check_only")
        return ["@type_check_only", f"class {share.base}:", *stubs[0]]

    def klass(self, name: str, cls: type) -> list[str]:
        """The stub of a class: constructor, special methods, properties, methods."""
        bases = [b.__name__ for b in cls.__bases__ if b is not object]
        shared: set[str] = set()
        for share in self.shares:
            if name in share.classes:
                bases.append(share.base)
                shared |= share.members
        body: list[str] = []
        yields = doc_section(cls.__doc__, "Yields")
        if yields:
            m = re.match(r"(.+?): ", yields[0] + " ")
            assert m is not None
            item = parse_type(m.group(1), f"{name} (Yields)", self.names)
            self.names.used.add("Iterator")
            bases.insert(0, f"Iterator[{item}]")
            if "__next__" not in vars(cls):
                raise StubError(f"{name}: documents what it yields but has no __next__")
            body += def_lines(INDENT, "__next__", ["self"], item)
        elif "__next__" in vars(cls) or "__iter__" in vars(cls):
            raise StubError(f"{name}: an iterator needs a 'Yields:' section in its doc")
        init = text_signature(cls, name)
        if init is not None:
            sig = parse_signature(init, f"{name}.__init__", self.names, first=None)
            if sig.returns is not None:
                raise StubError(f"{name}: a constructor's text signature has no return type")
            body[:0] = def_lines(INDENT, "__init__", ["self", *sig.params], "None")
        properties, methods = self.members(name, cls, lambda attr: attr not in shared)
        body += properties + methods
        head = f"class {name}({', '.join(bases)})" if bases else f"class {name}"
        return [f"{head}:", *body] if body else [f"{head}: ..."]

    def generate(self) -> str:
        """The whole stub."""
        files = rust_files()
        lib = BINDINGS / "lib.rs"
        sections: dict[Path, list[str]] = {}
        for name in self.all:
            sections.setdefault(files.get(name, lib), []).append(name)
        blocks: list[list[str]] = []
        emitted: set[str] = set()
        for path, section in sections.items():
            objs = {n: getattr(self.module, n) for n in section}
            consts = [n for n in section if not callable(objs[n])]
            funcs = [n for n in section if callable(objs[n]) and not isinstance(objs[n], type)]
            classes = ordered_classes([objs[n] for n in section if isinstance(objs[n], type)])
            first = True
            for group in (consts, funcs):
                if not group:
                    continue
                lines: list[str] = comment(section_title(path)) if first else []
                first = False
                for n in group:
                    if group is consts:
                        lines += self.constant(n, objs[n])
                    else:
                        lines += self.function(n, objs[n])
                blocks.append(lines)
            for cls in classes:
                lines = comment(section_title(path)) if first else []
                first = False
                for share in self.shares:
                    if cls.__name__ in share.classes and share.base not in emitted:
                        emitted.add(share.base)
                        blocks.append(lines + self.shared_base(share))
                        lines = []
                if issubclass(cls, BaseException):
                    lines += self.exception(cls.__name__, cls)
                else:
                    lines += self.klass(cls.__name__, cls)
                blocks.append(lines)
        aliases: list[str] = []
        for name, text, what in self.aliases:
            aliases += comment(what) + [f"{name} = {text}"]
        imports = imports_block(self.names.used)
        head = [HEADER.splitlines(), imports] + ([aliases] if aliases else [])
        return "\n\n".join("\n".join(b) for b in head + blocks) + "\n"


def ordered_classes(classes: list[type]) -> list[type]:
    """`classes` in their order, except that a base comes before its subclasses.

    Args:
        classes: The classes, in the module's order.

    Returns:
        The classes, bases first.
    """
    done: list[type] = []

    def visit(cls: type) -> None:
        if cls in done:
            return
        for base in cls.__bases__:
            if base in classes:
                visit(base)
        done.append(cls)

    for cls in classes:
        visit(cls)
    return done


def imports_block(used: set[str]) -> list[str]:
    """The import lines of the names `used`, sorted as the linter sorts them.

    Args:
        used: The names the stub's types use from `IMPORTS`.

    Returns:
        The lines.
    """
    by_module: dict[str, list[str]] = {}
    for name in used:
        by_module.setdefault(IMPORTS[name], []).append(name)
    return [
        f"from {module} import {', '.join(sorted(names))}"
        for module, names in sorted(by_module.items())
    ]


def main(argv: Optional[list[str]] = None) -> int:
    """Writes the stub, or with `--check` compares it with the one checked in.

    Args:
        argv: The command line (without the program).

    Returns:
        The exit status: 1 when `--check` finds a difference or the bindings
        lack a type, 0 otherwise.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 with a diff when the stub differs"
    )
    parser.add_argument("--output", type=Path, default=STUB, help="the stub (default: %(default)s)")
    args = parser.parse_args(argv)
    if sys.version_info < (3, 10):
        # The class text signatures (constructors) of an abi3 extension are
        # readable from Python 3.10 on.
        print("gen_stub.py needs Python >= 3.10", file=sys.stderr)
        return 1
    sys.path.insert(0, str(ROOT))
    try:
        module = importlib.import_module(MODULE)
    except ImportError as e:
        print(f"cannot import {MODULE} ({e}): build it first (make setup)", file=sys.stderr)
        return 1
    try:
        text = Generator(module).generate()
    except StubError as e:
        print(f"gen_stub.py: {e}", file=sys.stderr)
        return 1
    if not args.check:
        args.output.write_text(text, encoding="utf-8")
        return 0
    old = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
    if old == text:
        return 0
    shown = args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output
    sys.stdout.writelines(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            text.splitlines(keepends=True),
            f"{shown} (checked in)",
            f"{shown} (from the built extension)",
        )
    )
    print(f"{shown} differs from the bindings: run `python tools/gen_stub.py`", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

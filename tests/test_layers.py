"""The package's structure: no import cycle inside rvz/, layers that import downward, an
engine that calls its host only through ``rvz._fast.host.Host``, and a node that assigns no
field of the engine's objects (it calls the part that owns the field).

Both checks read the source with ``ast`` (nothing is imported), so they see every import:
module level, inside functions (lazy imports), under ``try``, relative (``from . import x``,
``from ..errors import y``) and absolute (``import rvz.node``, ``from rvz import x``), and
``importlib.import_module("rvz....")`` with a literal name.

* The cycle check ignores imports under ``if TYPE_CHECKING:``: they never run.
* The layer check counts them: an annotation naming a class of a higher layer is still a
  dependency on that layer (a transport that types its owner as ``Node`` knows the Node).

The Cython-only twins (``.pyx``) are not read: each has a ``.py`` of the same name that is.
"""

from __future__ import annotations

import ast
import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import rvz

# Bottom to top.  A module may import modules of its own layer and of the layers below it.
# Patterns are fnmatch patterns on dotted module names; every module under rvz/ must match
# exactly one row (test_every_module_has_a_layer).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors",       ("rvz.errors",)),
    ("hot paths",    ("rvz._fast", "rvz._fast.keys", "rvz._fast.table", "rvz._fast.deadlines",
                      "rvz._fast.codec", "rvz._fast.recvpool", "rvz._fast.arrays",
                      "rvz._fast.format")),
    # the protocol engine and the parts whose state it holds
    ("engine",       ("rvz._fast.engine", "rvz._fast.host", "rvz._fast.peers",
                      "rvz._fast.holding", "rvz._fast.steps", "rvz._fast.wire",
                      "rvz._fast.requests", "rvz._fast.credit", "rvz._fast.routes",
                      "rvz._fast.batches", "rvz._fast.into")),
    # picks the compiled or the pure-Python variant of the two layers above
    ("impl switch",  ("rvz._impl",)),
    # usable by every layer above _fast
    ("utilities",    ("rvz.rendezvous", "rvz.cluster", "rvz.runner", "rvz.types", "rvz.poll")),
    # the protocol's parts that need no compiled twin (sans-IO)
    ("protocol",     ("rvz.handshake",)),
    ("transports",   ("rvz.connection", "rvz.onesided", "rvz.onesided.*")),
    # Node, and its compiled base (send and recv), which rvz._impl loads like the hot paths
    ("node",         ("rvz._fast.calls", "rvz.options", "rvz.node", "rvz.nodestate",
                      "rvz.links", "rvz.peering", "rvz.heartbeat", "rvz.waiting",
                      "rvz.closing")),
    # the node for synchronous code: a loop thread and blocking calls (rvz exports it)
    ("blocking",     ("rvz.blocking",)),
    ("public API",   ("rvz",)),
    # optional exporters of what the public API reports
    ("exporters",    ("rvz.metrics",)),
    ("bench",        ("rvz.bench", "rvz.bench.*")),
]

PACKAGE = "rvz"
# The node and its parts (its base classes, each in a module of its own).
NODE_MODULES = ("node.py", "nodestate.py", "links.py", "peering.py", "heartbeat.py", "waiting.py",
                "closing.py")
ROOT = os.path.dirname(os.path.abspath(rvz.__file__))


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    type_only: bool   # under ``if TYPE_CHECKING:``


# -- reading the package ------------------------------------------------------------------------


def modules_of(root: str, package: str) -> dict[str, str]:
    """Dotted module name -> path, for every ``.py`` file of the package at ``root``."""
    found: dict[str, str] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        rel = os.path.relpath(folder, root)
        parts = [package] + ([] if rel == "." else rel.split(os.sep))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            stem = name[:-3]
            dotted = ".".join(parts if stem == "__init__" else parts + [stem])
            found[dotted] = os.path.join(folder, name)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _raw_imports(tree: ast.AST) -> list[tuple[ast.AST, bool]]:
    """Every import-like node of ``tree`` with whether it sits under ``if TYPE_CHECKING:``."""
    out: list[tuple[ast.AST, bool]] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for statement in node.body:
                visit(statement, True)
            for statement in node.orelse:   # the else branch is what runs
                visit(statement, type_only)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append((node, type_only))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node, type_only))
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imports_of(root: str, package: str) -> tuple[dict[str, str], list[Import]]:
    """The package's modules and every import from one of them to another."""
    modules = modules_of(root, package)
    edges: list[Import] = []
    for importer, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = os.path.basename(path) == "__init__.py"
        # the package relative imports start from
        here = importer if is_package else importer.rpartition(".")[0]
        for found, type_only in _raw_imports(tree):
            node: Any = found
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = here.split(".")
                    base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    # ``from pkg import sub`` imports the submodule pkg.sub, else a name of pkg
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            else:  # importlib.import_module("...")
                targets = [node.args[0].value]
            for target in targets:
                if target not in modules:
                    continue  # outside the package
                # importing a.b.c runs the __init__ of a.b too, unless the importer lives in it
                implied = [a for a in _ancestors(target)
                           if a in modules and a not in _ancestors(importer) and a != importer]
                for t in [target, *implied]:
                    if t != importer:
                        edges.append(Import(importer, t, node.lineno, type_only))
    return modules, edges


# -- cycles -------------------------------------------------------------------------------------


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle (``[a, b, ..., a]``) per strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def strongconnect(v: str) -> None:  # Tarjan; the package is small, recursion is fine
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles = []
    for component in components:
        members = set(component)
        start = component[0]
        # breadth-first from start back to start, inside the component: a shortest cycle
        paths = {start: [start]}
        frontier = [start]
        cycle: list[str] | None = None
        while frontier and cycle is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph.get(v, ())):
                    if w == start:
                        cycle = paths[v] + [start]
                        break
                    if w in members and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if cycle is not None:
                    break
            frontier = nxt
        assert cycle is not None
        cycles.append(cycle)
    return cycles


def runtime_graph(edges: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        if not e.type_only:
            graph.setdefault(e.importer, set()).add(e.target)
    return graph


def test_no_import_cycle_inside_rvz() -> None:
    modules, edges = imports_of(ROOT, PACKAGE)
    assert "rvz.node" in modules and "rvz._fast.table" in modules   # read the right tree
    cycles = find_cycles(runtime_graph(edges))
    where = {(e.importer, e.target): e.line for e in edges if not e.type_only}
    described = ["  " + " -> ".join(c) + "\n    (" + ", ".join(
        f"{a}:{where[(a, b)]} imports {b}" for a, b in zip(c, c[1:], strict=False)) + ")" for c in cycles]
    assert not cycles, "import cycles inside rvz/:\n" + "\n".join(described)


def test_the_cycle_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    # A package whose only cycles go through a relative ``from . import``, a lazy import in
    # a function and an ``importlib.import_module``; TYPE_CHECKING imports make none.
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "def f():\n    from .sub.c import x\n",
        "sub/__init__.py": "",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..b import B\n"
                    "else:\n    from .. import a\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.e\n",
        "e.py": "import importlib\nimportlib.import_module('pkg.f')\n",
        "f.py": "import pkg.e\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    modules, edges = imports_of(str(pkg), "pkg")
    assert set(modules) == {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c", "pkg.d", "pkg.e",
                            "pkg.f"}
    cycles = find_cycles(runtime_graph(edges))
    assert sorted(sorted(set(c)) for c in cycles) == [
        ["pkg.a", "pkg.b", "pkg.sub.c"],
        ["pkg.e", "pkg.f"],
    ], cycles
    assert Import("pkg.d", "pkg.e", 3, True) in edges       # seen, but type-only
    assert Import("pkg.b", "pkg.sub", 2, False) in edges     # b -> sub.c also runs sub/__init__


# -- layers -------------------------------------------------------------------------------------


def layer_of(module: str) -> int | None:
    hits = [i for i, (_, patterns) in enumerate(LAYERS)
            if any(fnmatch.fnmatchcase(module, p) for p in patterns)]
    return hits[0] if len(hits) == 1 else None


def test_every_module_has_a_layer() -> None:
    modules, _ = imports_of(ROOT, PACKAGE)
    unplaced = [m for m in sorted(modules) if layer_of(m) is None]
    assert not unplaced, f"modules without exactly one row in LAYERS: {unplaced}"


def test_layers_import_downward_only() -> None:
    _, edges = imports_of(ROOT, PACKAGE)
    upward = []
    for e in sorted(set(edges), key=lambda e: (e.importer, e.line, e.target)):
        here, there = layer_of(e.importer), layer_of(e.target)
        if here is None or there is None:
            continue  # reported by test_every_module_has_a_layer
        if there > here:
            upward.append(f"  {e.importer} ({LAYERS[here][0]}) line {e.line} imports {e.target} "
                          f"({LAYERS[there][0]})" + (" [under TYPE_CHECKING]" if e.type_only else ""))
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


# -- calls across the engine's boundary ---------------------------------------------------------


def _tree(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _methods(tree: ast.AST, class_name: str | None = None) -> set[str]:
    """The names of the methods defined in ``tree`` (in class ``class_name`` only, if given)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and class_name in (None, node.name):
            names |= {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def _fast_sources() -> dict[str, ast.Module]:
    folder = os.path.join(ROOT, "_fast")
    return {name: _tree(os.path.join(folder, name))
            for name in sorted(os.listdir(folder)) if name.endswith(".py")}


def host_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, name)`` of every attribute read from the engine's host (``<x>.host.name``)."""
    return [(node.lineno, node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "host"]


def test_the_engine_calls_its_host_only_through_the_host_interface() -> None:
    declared = _methods(_tree(os.path.join(ROOT, "_fast", "host.py")), "Host")
    assert declared, "rvz/_fast/host.py declares no Host methods"
    assert not [n for n in declared if n.startswith("_")], "Host names a private method"
    # No private method of the node is called from the engine, through the host or not.
    node_private = {n for module in NODE_MODULES
                    for n in _methods(_tree(os.path.join(ROOT, module)))
                    if n.startswith("_") and not n.startswith("__")}
    wrong = []
    for name, tree in _fast_sources().items():
        own = _methods(tree)
        for line, attr in host_calls(tree):
            if attr not in declared:
                wrong.append(f"  rvz/_fast/{name}:{line} calls host.{attr}, not in Host")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in node_private - own
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                wrong.append(f"  rvz/_fast/{name}:{node.lineno} reaches the node's {node.attr}")
    assert not wrong, "calls from the engine into its host outside Host:\n" + "\n".join(wrong)


def test_the_host_check_sees_a_call_outside_the_interface() -> None:
    tree = ast.parse("class Core:\n    def f(self):\n        self.host._start_link(1)\n")
    assert host_calls(tree) == [(3, "_start_link")]


# Fields of its connections that the node owns (rvz.connection.Connection's life cycle, not
# the engine's ``Wire``), and of exceptions.
def _connection_fields() -> set[str]:
    tree = _tree(os.path.join(ROOT, "connection.py"))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            return {t.attr for a in ast.walk(node) if isinstance(a, (ast.Assign, ast.AnnAssign))
                    for t in (a.targets if isinstance(a, ast.Assign) else [a.target])
                    if isinstance(t, ast.Attribute)}
    raise AssertionError("rvz/connection.py has no __init__")


def foreign_assignments(tree: ast.AST, allowed: set[str]) -> list[tuple[int, str]]:
    """``(line, target)`` of each assignment (or ``del``) to an attribute of an object other
    than ``self``, but for the attribute names in ``allowed``."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del))
                        and not (isinstance(sub.value, ast.Name) and sub.value.id == "self")
                        and sub.attr not in allowed):
                    found.append((node.lineno, ast.unparse(sub)))
    return found


@pytest.mark.parametrize("module", NODE_MODULES)
def test_the_node_assigns_no_field_of_the_engine(module: str) -> None:
    allowed = _connection_fields() | {"__cause__"}
    wrong = foreign_assignments(_tree(os.path.join(ROOT, module)), allowed)
    assert not wrong, f"rvz/{module} assigns fields it does not own:\n" + "\n".join(
        f"  line {line}: {target}" for line, target in wrong)


def test_the_assignment_check_sees_every_form() -> None:
    tree = ast.parse("core.running = 1\npeer.credit += 2\nself._core.closed = 3\n"
                     "del peer.link\nx: int\nself.mine = 4\nerr.__cause__ = 5\n")
    assert [t for _, t in foreign_assignments(tree, {"__cause__"})] == [
        "core.running", "peer.credit", "self._core.closed", "peer.link"]

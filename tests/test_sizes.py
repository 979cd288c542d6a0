"""Size rules for the code under rvz/: no class over 600 lines, no function over 80.

A class or function past its bound is listed in ``OVER`` with the size it has now: it may
shrink, never grow, and leaves the list once within the bound (the test fails on a stale
entry, so the list only gets shorter).  Read with ``ast``: nothing is imported.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

import rvz

ROOT = os.path.dirname(os.path.abspath(rvz.__file__))
CLASS_MAX = 600
FUNCTION_MAX = 80

# (module path under rvz/, qualified name) -> its size in lines today, a ceiling.  None is
# over its bound now; an entry would need a measured reason (a hot loop a split slows).
OVER: dict[tuple[str, str], int] = {}


def definitions() -> Iterator[tuple[str, str, str, int]]:
    """(path, qualified name, "class" or "function", lines) of every class and function."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            yield from _walk(rel, tree, "")


def _walk(rel: str, node: ast.AST, prefix: str) -> Iterator[tuple[str, str, str, int]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            qualified = prefix + child.name
            kind = "class" if isinstance(child, ast.ClassDef) else "function"
            assert child.end_lineno is not None
            yield rel, qualified, kind, child.end_lineno - child.lineno + 1
            yield from _walk(rel, child, qualified + ".")
        else:
            yield from _walk(rel, child, prefix)


def test_no_class_or_function_outgrows_its_bound() -> None:
    grown = []
    for rel, name, kind, lines in definitions():
        bound = OVER.get((rel, name), CLASS_MAX if kind == "class" else FUNCTION_MAX)
        if lines > bound:
            grown.append(f"{kind} {name} in rvz/{rel}: {lines} lines, at most {bound}")
    assert not grown, "\n".join(grown)


def test_every_exception_to_the_bounds_is_still_needed() -> None:
    sizes = {(rel, name): (kind, lines) for rel, name, kind, lines in definitions()}
    stale = []
    for (rel, name), ceiling in OVER.items():
        if (rel, name) not in sizes:
            stale.append(f"{name} in rvz/{rel} is gone: drop it from OVER")
            continue
        kind, lines = sizes[(rel, name)]
        bound = CLASS_MAX if kind == "class" else FUNCTION_MAX
        if lines <= bound:
            stale.append(f"{name} in rvz/{rel} is within {bound} lines now: drop it from OVER")
        elif lines < ceiling:
            stale.append(f"{name} in rvz/{rel} shrank to {lines} lines: lower its ceiling")
    assert not stale, "\n".join(stale)

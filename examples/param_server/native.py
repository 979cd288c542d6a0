"""Which variant of the table core runs: compiled (Cython) or the same source as Python.

``RVZ_NO_EXTENSIONS=1`` (any non-empty value but ``0``) forces the pure-Python source, as
for rvz itself; otherwise the compiled ``_table`` module is used when it was built, and the
source when it was not. ``implementation()`` says which one this process runs.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
from types import ModuleType

_NAME = f"{__package__}._table"


def _load_source() -> ModuleType:
    """``_table.py`` as Python, even when a compiled module sits beside it."""
    path = os.path.join(os.path.dirname(__file__), "_table.py")
    loader = importlib.machinery.SourceFileLoader(_NAME + "_py", path)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load(variant: str) -> ModuleType:
    """The table core of one variant, ``"compiled"`` or ``"python"`` (ImportError if the
    compiled one was not built)."""
    if variant == "python":
        return _load_source()
    if variant == "compiled":
        module = importlib.import_module(_NAME)
        if (module.__file__ or "").endswith(".py"):
            raise ImportError(f"{_NAME} is not compiled (loaded {module.__file__})")
        return module
    raise ValueError(f"unknown implementation {variant!r}: 'compiled' or 'python'")


def _select() -> tuple[str, ModuleType]:
    if os.environ.get("RVZ_NO_EXTENSIONS", "") not in ("", "0"):
        return "python", load("python")
    try:
        return "compiled", load("compiled")
    except ImportError:
        return "python", load("python")


_variant, core = _select()
RowTable = core.RowTable
normal_fill = core.normal_fill
shard_split = core.shard_split
scatter_rows = core.scatter_rows
gather_rows = core.gather_rows


def implementation() -> str:
    """``"compiled"`` or ``"python"``: which table core this process runs."""
    return _variant

"""The one switch between the compiled and the pure-Python hot paths.

``RVZ_NO_EXTENSIONS=1`` (any non-empty value but ``0``) forces pure Python.  Otherwise the
Cython-compiled modules of ``rvz._fast`` are used, and pure Python only if they were not
built (a source checkout), which ``implementation()`` then reports.

Both variants can be loaded side by side with ``load("compiled")`` and ``load("python")``,
for benchmarks that compare them in one process.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType, SimpleNamespace

MODULES = ("arrays", "keys", "table", "codec", "recvpool", "peers", "steps", "holding", "wire",
           "requests", "credit", "routes", "deadlines", "engine", "batches", "calls")
_PACKAGE = "rvz._fast"


def _forced_python() -> bool:
    value = os.environ.get("RVZ_NO_EXTENSIONS", "")
    return value not in ("", "0")


def _is_compiled(module: ModuleType) -> bool:
    return not (module.__file__ or "").endswith(".py")


def _load_source(name: str) -> ModuleType:
    """Load ``rvz/_fast/<name>.py`` even when a compiled module sits beside it."""
    full = f"{_PACKAGE}.{name}"
    existing = sys.modules.get(full)
    if existing is not None and not _is_compiled(existing):
        return existing
    package = importlib.import_module(_PACKAGE)
    path = os.path.join(os.path.dirname(package.__file__ or ""), name + ".py")
    loader = importlib.machinery.SourceFileLoader(full, path)
    spec = importlib.util.spec_from_loader(full, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    # Registered under its real name so relative imports inside it resolve; restored below
    # by load() when the caller only wanted a side-by-side copy.
    sys.modules[full] = module
    loader.exec_module(module)
    return module


def load(variant: str) -> SimpleNamespace:
    """The hot-path modules of one variant: ``"compiled"`` or ``"python"``.

    Raises ``ImportError`` if the compiled variant was asked for but was not built.
    """
    if variant == "compiled":
        mods = {name: importlib.import_module(f"{_PACKAGE}.{name}") for name in MODULES}
        for name, module in mods.items():
            if not _is_compiled(module):
                raise ImportError(f"rvz's compiled module {_PACKAGE}.{name} is not built "
                                  f"(loaded {module.__file__})")
        return SimpleNamespace(name="compiled", **mods)
    if variant == "python":
        saved = {name: sys.modules.get(f"{_PACKAGE}.{name}") for name in MODULES}
        # keys first: table and codec import only errors, but the order documents intent.
        mods = {name: _load_source(name) for name in MODULES}
        for name, previous in saved.items():
            if previous is not None:
                sys.modules[f"{_PACKAGE}.{name}"] = previous
        return SimpleNamespace(name="python", **mods)
    raise ValueError(f"unknown implementation {variant!r}: 'compiled' or 'python'")


def _select() -> SimpleNamespace:
    if _forced_python():
        return load("python")
    try:
        return load("compiled")
    except ImportError:
        return load("python")


active = _select()
keys = active.keys
table = active.table
codec = active.codec
arrays = active.arrays
recvpool = active.recvpool
peers = active.peers
holding = active.holding
steps = active.steps
wire = active.wire
requests = active.requests
credit = active.credit
routes = active.routes
deadlines = active.deadlines
engine = active.engine
batches = active.batches
calls = active.calls


def implementation() -> str:
    """``"compiled"`` or ``"python"``: which hot paths this process runs."""
    return str(active.name)

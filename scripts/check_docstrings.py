"""Fails (exit 1) when a public name of rvz lacks a docstring, as the API reference sees it.

Public: every name in ``rvz.__all__`` and in the other documented modules' ``__all__`` (or
their public names), and the public methods and properties of the classes among them.
Type aliases are documented by a ``#:`` comment above them.  Uses pdoc's own reading of
the docstrings, so what passes here is what scripts/docs renders.
"""

from __future__ import annotations

import sys

import pdoc.doc

# The modules of the API reference (scripts/docs renders the same list).
MODULES = ("rvz", "rvz.cluster", "rvz.types", "rvz.metrics", "rvz.blocking")


def missing(module_name: str, documented: set[int]) -> list[str]:
    module = pdoc.doc.Module.from_name(module_name)
    out = []
    if not module.docstring:
        out.append(module_name)
    public = getattr(module.obj, "__all__", None)
    for member in module.members.values():
        if public is not None and member.name not in public or member.name.startswith("_"):
            continue
        if not member.docstring and not _documented_elsewhere(member, documented):
            out.append(f"{module_name}.{member.name}")
        if isinstance(member, pdoc.doc.Class) and not issubclass(member.obj, BaseException):
            for sub in member.own_members:
                if (not sub.name.startswith("_")
                        and isinstance(sub, (pdoc.doc.Function, pdoc.doc.Variable))
                        and not _slot(sub) and not sub.docstring):
                    out.append(f"{module_name}.{member.name}.{sub.name}")
    return out


def _documented_elsewhere(member: pdoc.doc.Doc, documented: set[int]) -> bool:
    """A re-exported type alias (``rvz.Value``) is documented where it is defined
    (``rvz.types``): pdoc reads a variable's docstring from its own module's source only."""
    return isinstance(member, pdoc.doc.Variable) and id(member.default_value) in documented


def documented_variables() -> set[int]:
    out = set()
    for name in MODULES:
        for member in pdoc.doc.Module.from_name(name).members.values():
            if isinstance(member, pdoc.doc.Variable) and member.docstring:
                out.add(id(member.default_value))
    return out


def _slot(member: pdoc.doc.Doc) -> bool:
    """An instance attribute without a getter of its own (a ``__slots__`` entry or a plain
    attribute): documented in its class's docstring, as pdoc shows it."""
    return isinstance(member, pdoc.doc.Variable) and not isinstance(
        getattr(member, "default_value", None), property)


def main() -> int:
    documented = documented_variables()
    problems = [name for module in MODULES for name in missing(module, documented)]
    for name in problems:
        print(f"missing docstring: {name}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} public names have no docstring", file=sys.stderr)
        return 1
    print(f"every public name of {', '.join(MODULES)} has a docstring")
    return 0


if __name__ == "__main__":
    sys.exit(main())

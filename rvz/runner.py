"""``rvz.run``: run a coroutine on uvloop when it is installed, else on asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from .types import LoopName

T = TypeVar("T")


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """``"uvloop"`` or ``"asyncio"``: what the (running) loop is."""
    loop = loop or asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def new_event_loop(name: LoopName = "auto") -> asyncio.AbstractEventLoop:
    """A new loop: ``"uvloop"``, ``"asyncio"``, or ``"auto"`` (uvloop if installed)."""
    if name not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"loop must be 'auto', 'uvloop' or 'asyncio', not {name!r}")
    if name != "asyncio":
        try:
            import uvloop
        except ImportError:
            if name == "uvloop":
                raise RuntimeError("uvloop was asked for but is not installed "
                                   "(pip install uvloop)") from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T], *, loop: LoopName = "auto", debug: bool | None = None) -> T:
    """Run ``main`` to completion on a fresh loop and return its result.

    ``loop="auto"`` (the default) runs it on uvloop when that is installed, else on asyncio;
    ``"uvloop"`` or ``"asyncio"`` asks for one.  ``debug`` sets the loop's debug mode.
    """
    if hasattr(asyncio, "Runner"):  # Python 3.11+
        with asyncio.Runner(loop_factory=lambda: new_event_loop(loop), debug=debug) as runner:
            return runner.run(main)
    new = new_event_loop(loop)  # Python 3.10
    try:
        asyncio.set_event_loop(new)
        if debug is not None:
            new.set_debug(debug)
        return new.run_until_complete(main)
    finally:
        try:
            new.run_until_complete(new.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            new.close()

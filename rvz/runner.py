"""``rvz.run``: run a coroutine on uvloop when it is installed, else on asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
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


async def wait_for(aw: Awaitable[Any], timeout: float | None) -> Any:
    """``asyncio.wait_for(aw, timeout)``, except that a cancellation of the caller is never lost.

    Before Python 3.12, ``wait_for`` returns the result of an awaitable that finished in the
    loop iteration in which its caller was cancelled, and the cancellation is gone: the task
    runs on (a ``TaskGroup`` whose sibling failed waits for it; an ``asyncio.timeout`` that
    expired does not fire).  Here the cancellation wins, as it does when ``aw`` is awaited
    without a timeout.  The timeout raises ``asyncio.TimeoutError`` and cancels ``aw``."""
    if timeout is None:
        return await aw
    loop = asyncio.get_running_loop()
    fut = asyncio.ensure_future(aw)
    task = asyncio.current_task()
    # Cancellations requested of the caller so far (Python 3.11+; before, a cancellation
    # that comes as the time runs out is taken for the timeout).
    counted = getattr(task, "cancelling", None)
    before = counted() if counted is not None else 0
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        fut.cancel()

    handle = loop.call_later(timeout, expire)
    try:
        return await fut
    except asyncio.CancelledError:
        if expired and (counted is None or counted() <= before):
            raise asyncio.TimeoutError() from None
        raise
    finally:
        handle.cancel()

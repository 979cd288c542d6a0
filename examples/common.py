"""Small helpers shared by the examples: running coroutines together, picking free ports,
and the launchers' signal handling."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Coroutine
from typing import Any

import rvz


async def run_together(*coros: Coroutine[Any, Any, Any]) -> list[Any]:
    """Run ``coros`` concurrently; the first failure cancels the others and is raised.

    ``asyncio.gather`` would let the siblings of a failed task run on (and hang on keys the
    failed one will never send); ``TaskGroup`` would do this but needs Python 3.11.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        # Wait for the cancelled ones so none outlives us (and none logs "never retrieved").
        await asyncio.gather(*tasks, return_exceptions=True)


free_ports = rvz.cluster.free_ports


class Stopped(BaseException):
    """The launcher got SIGTERM or SIGINT. Raised in its main thread (a ``BaseException``,
    so no ``except Exception`` swallows it) so that every ``finally`` and ``with`` block runs
    and stops the child processes before the launcher exits with ``exit_code``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 143 for SIGTERM, 130 for SIGINT


def stop_on_signals() -> None:
    """In a launcher's main thread: SIGTERM and SIGINT raise ``Stopped``. Without this,
    SIGTERM (what ``timeout`` and service managers send) ends the launcher at once and leaves
    its children running, re-parented to init; SIGINT prints a traceback. A no-op outside the
    main thread (only it can have signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, frame: Any) -> None:
        # The clean-up that follows is bounded; a second signal must not cut it short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def child_signals() -> None:
    """In a launcher's child process: ignore SIGINT. A Ctrl-C reaches the whole process
    group; the launcher then stops its children itself (SIGTERM), without a traceback from
    each of them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

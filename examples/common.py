"""Small helpers shared by the examples: running coroutines together, picking free ports."""

from __future__ import annotations

import asyncio
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

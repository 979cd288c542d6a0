"""One-sided (RDMA-style) transports for rvz: a provider-independent engine and two providers.

* ``shm``: same-host peers in different processes; pool memory is ``memfd`` shared memory
  the peer writes into directly, completions arrive through a pipe the event loop watches.
* ``verbs``: RDMA NICs through pyverbs (optional extra ``rdma``, imported lazily).

Use them through ``rvz.Node(..., transport="shm" | "verbs" | "auto")``; see docs/rdma.md.
``available()`` tells which work on this machine and why the others do not.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..errors import TransportError
from .engine import Channel, Engine, Options
from .hub import TRANSPORTS, Hub, decide, make_provider
from .memlock import check_memlock, memlock_limit

__all__ = ["TRANSPORTS", "Channel", "Engine", "Hub", "Options", "available", "check_memlock",
           "decide", "make_provider", "memlock_limit"]


def available(options: dict[str, Any] | None = None) -> dict[str, str | None]:
    """``{"shm": None or why not, "verbs": None or why not}`` for this process.

    Cheap and side-effect free apart from opening (and closing) the device.
    """
    opts = Options(options)
    out: dict[str, str | None] = {}
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        own = True
    else:
        own = False
    try:
        for name in ("shm", "verbs"):
            try:
                provider = make_provider(name, loop, opts)
                provider.open()
                provider.close()
                out[name] = None
            except TransportError as exc:
                out[name] = str(exc)
    finally:
        if own:
            loop.close()
    return out

"""Busy polling: the event loop stays awake while a recv waits for a peer (``Node(busy_poll=)``).

A loop with nothing to do sleeps in the kernel (``epoll_wait``), and the reply that wakes it
pays for the wake-up.  On a virtual machine that price is most of a small round trip: the
idle virtual CPU halts, and the peer's write reaches it through the hypervisor (figures
in ``bench/README.md``, "Busy polling").

``BusyPoll`` keeps one callback in the loop's ready queue, rescheduling itself, while a recv
of the node waits on a remote value, for at most ``budget`` seconds after the last such recv
began.  A loop with a ready callback asks the kernel for events without sleeping (a zero
timeout), so a reply is handled as soon as it lands; nothing here touches a socket, which
makes it work the same on asyncio's loop and uvloop and for every transport whose arrivals
the loop watches.  The price is a CPU spinning while it waits: off by default, as an
embedded library must not spend CPU unasked; ``budget`` bounds the spin of a wait that
lasts.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

# A wait longer than this is no round trip: spinning through it only burns a CPU.
MAX_BUDGET = 1.0  # seconds


def check_budget(seconds: Any) -> None:
    """ValueError unless ``seconds`` is a busy-poll budget: a number, 0 (off) <= it <
    ``MAX_BUDGET``.  What ``Node(busy_poll=)`` and the command lines that set it accept."""
    if not isinstance(seconds, (int, float)) or not 0 <= seconds < MAX_BUDGET:
        raise ValueError(f"busy_poll must be >= 0 and < {MAX_BUDGET:g} second, not {seconds!r}")


class BusyPoll:
    """Keeps ``loop`` polling while ``begin`` / ``end`` pairs are open, up to ``budget`` s
    after the last ``begin``."""

    __slots__ = ("loop", "budget", "waiting", "until", "running", "spins")

    def __init__(self, loop: asyncio.AbstractEventLoop, budget: float) -> None:
        if not (budget > 0 and math.isfinite(budget)):
            raise ValueError(f"a busy-poll budget is a positive number of seconds, not {budget!r}")
        self.loop = loop
        self.budget = budget
        self.waiting = 0       # recvs waiting on a peer's value
        self.until = 0.0       # time.monotonic() at which polling stops, waiters or not
        self.running = False   # the callback is in the ready queue
        self.spins = 0         # loop passes made awake for a waiter (stats)

    def begin(self) -> None:
        """A recv starts waiting on a remote value."""
        self.waiting += 1
        # time.monotonic, not loop.time(): uvloop's clock moves in milliseconds, more than a
        # budget measured in tens of microseconds.
        self.until = time.monotonic() + self.budget
        if not self.running:
            self.running = True
            self.loop.call_soon(self._spin)

    def end(self) -> None:
        """That recv is over (value, error, timeout or cancellation)."""
        self.waiting -= 1

    def _spin(self) -> None:
        if self.waiting > 0 and time.monotonic() < self.until:
            self.spins += 1
            self.loop.call_soon(self._spin)
        else:
            self.running = False

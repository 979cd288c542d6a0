"""The timeouts of a node's waits: every armed deadline under one timer of the loop.

A recv (or recv_many, or a local rendezvous) with a timeout arms a deadline here rather
than a timer of the loop's own.  uvloop makes a libuv timer handle for each ``call_later``
and closes it again on ``cancel``: about 5,000 instructions a recv, more than the rest of
a recv that finds its value at once (``python bench/roundtrip.py --timeout 30``).  Here a
deadline is an entry in a heap, and the loop's one timer is moved only when a deadline
comes before the one it is set for; a wait that ends first cancels its entry, which is
dropped when it surfaces or when no live deadline is left.
"""

from __future__ import annotations

from asyncio import BaseEventLoop
from heapq import heapify, heappop, heappush
from time import monotonic_ns
from typing import Any

try:  # Cython's own module; a compiled build sees the constant True
    import cython
    COMPILED = cython.compiled
except ImportError:  # pure Python without Cython installed
    COMPILED = False

INF = float("inf")
# Dead entries kept at most: beyond this many, and more than the live ones, they are swept.
SWEEP_AT = 256


def _loop_times() -> tuple:
    """The ``time`` methods of the loops known to count CLOCK_MONOTONIC in seconds, as
    ``time.monotonic`` does: deadlines on those are taken from the clock itself, without a
    method call (uvloop's clock lags the real one by up to a loop iteration: a deadline
    taken from the real clock is never earlier than the loop's own would be)."""
    times: list[Any] = [BaseEventLoop.time]
    try:
        import uvloop
        times.append(uvloop.Loop.time)
    except ImportError:
        pass
    return tuple(times)


LOOP_TIMES = _loop_times()


def now_s() -> float:
    """Monotonic seconds (compiled: ``clock_gettime`` itself)."""
    if COMPILED:
        return monotonic_ns_c() * 1e-9  # type: ignore[name-defined]  # noqa: F821
    return monotonic_ns() * 1e-9


class Deadline:
    """One armed timeout, a handle like the loop's: ``cancel()`` before it is due and its
    callback never runs (after, it does nothing)."""

    __slots__ = ("callback", "args", "owner")

    def __init__(self, owner: Deadlines, callback: Any, args: tuple) -> None:
        self.owner = owner
        self.callback = callback
        self.args = args

    def cancel(self) -> None:
        if self.callback is not None:
            self.callback = None
            self.args = ()
            self.owner.cancelled()

    def cancelled(self) -> bool:
        return self.callback is None


class Deadlines:
    """The armed deadlines of one event loop, earliest first, and the loop timer set for
    the earliest."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop           # the event loop whose one timer serves them
        self._heap: list = []      # (when, number, Deadline); cancelled ones until swept
        self._number = 0           # orders deadlines due at the same time as they came
        self._live = 0             # entries not cancelled
        self._timer: Any = None    # the loop's handle, set for ``_armed_at``
        self._armed_at = INF
        # A deadline this close is due: uvloop's clock counts milliseconds, and its own
        # timers fire on the nearest one.
        self._slack = getattr(loop, "_clock_resolution", 0.001)
        # A loop of another clock (a test loop's virtual time) is asked for its own.
        self._own_clock = type(loop).time in LOOP_TIMES

    def arm(self, delay: float, callback: Any, args: tuple) -> Deadline:
        """``callback(*args)`` in ``delay`` seconds, as ``loop.call_later`` would."""
        when = self._now() + delay
        deadline = Deadline.__new__(Deadline)  # (compiled: no __init__ call to pay)
        deadline.owner = self
        deadline.callback = callback
        deadline.args = args
        self._number += 1
        heappush(self._heap, (when, self._number, deadline))
        self._live += 1
        if when < self._armed_at:
            self._set_timer(when)
        return deadline

    def cancelled(self) -> None:
        """A deadline was cancelled (``Deadline.cancel``): with none live, the heap is
        emptied; otherwise dead entries are swept once they outnumber the live ones."""
        self._live -= 1
        heap = self._heap
        if self._live == 0:
            heap.clear()  # the loop's timer may still fire: it finds nothing due
        elif len(heap) > SWEEP_AT and len(heap) > 2 * self._live:
            heap[:] = [entry for entry in heap if entry[2].callback is not None]
            heapify(heap)

    def live(self) -> int:
        """Deadlines armed and not yet due nor cancelled."""
        return self._live

    def entries(self) -> int:
        """Entries kept: the live deadlines and the cancelled ones not yet swept."""
        return len(self._heap)

    def _now(self) -> float:
        return now_s() if self._own_clock else self.loop.time()

    def _set_timer(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._fire)
        self._armed_at = when

    def _fire(self) -> None:
        """The loop's timer: run every deadline due, then set the timer for the next."""
        self._timer = None
        self._armed_at = INF
        heap = self._heap
        due = self._now() + self._slack
        while heap:
            when, _number, deadline = heap[0]
            callback = deadline.callback
            if callback is None:
                heappop(heap)
                continue
            if when > due:
                if when < self._armed_at:  # (a callback may have set it already)
                    self._set_timer(when)
                return
            heappop(heap)
            args = deadline.args
            deadline.callback = None
            deadline.args = ()
            self._live -= 1
            try:
                callback(*args)
            except Exception as exc:  # as the loop does for a timer's callback that raises
                self.loop.call_exception_handler({
                    "message": f"exception in the timeout callback {callback!r}",
                    "exception": exc})

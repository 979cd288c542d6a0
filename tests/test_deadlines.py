"""The timeouts of waits under one loop timer (rvz._fast.deadlines): order, cancellation,
bounded memory, failing callbacks, loops of another clock, and recvs of one node whose
timeouts come in any order."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import rvz
from rvz import _impl

from .conftest import eventually, key, pair

Deadlines = _impl.deadlines.Deadlines


async def test_deadlines_fire_earliest_first_whatever_order_they_were_armed_in() -> None:
    timers = Deadlines(asyncio.get_running_loop())
    fired: list[str] = []
    for name, delay in (("late", 0.06), ("early", 0.01), ("middle", 0.03)):
        timers.arm(delay, fired.append, (name,))
    assert timers.live() == 3
    await eventually(lambda: len(fired) == 3, "all three deadlines")
    assert fired == ["early", "middle", "late"]
    assert timers.live() == 0


async def test_a_cancelled_deadline_never_runs_and_a_late_cancel_does_nothing() -> None:
    timers = Deadlines(asyncio.get_running_loop())
    fired: list[str] = []
    dropped = timers.arm(0.01, fired.append, ("dropped",))
    kept = timers.arm(0.02, fired.append, ("kept",))
    dropped.cancel()
    assert dropped.cancelled() and not kept.cancelled()
    assert timers.live() == 1
    await eventually(lambda: fired == ["kept"], "the deadline left armed")
    kept.cancel()  # after it ran: nothing to undo
    dropped.cancel()
    assert timers.live() == 0 and fired == ["kept"]


async def test_cancelled_entries_are_swept_while_a_long_deadline_stays_armed() -> None:
    """A recv that ends before its timeout leaves a dead entry behind: they never pile up."""
    timers = Deadlines(asyncio.get_running_loop())
    long = timers.arm(3600, lambda: None, ())
    most = 0
    for _ in range(20000):
        timers.arm(30, lambda: None, ()).cancel()
        most = max(most, timers.entries())
    assert timers.live() == 1
    assert most <= 300  # swept past 256 dead entries (SWEEP_AT), not one per recv
    long.cancel()
    assert timers.entries() == 0  # none live: all dropped at once


async def test_a_callback_that_raises_is_reported_and_the_others_still_run() -> None:
    loop = asyncio.get_running_loop()
    timers = Deadlines(loop)
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        fired: list[str] = []

        def boom() -> None:
            raise ValueError("from a timeout callback")

        timers.arm(0.01, boom, ())
        timers.arm(0.01, fired.append, ("after",))
        await eventually(lambda: fired == ["after"], "the deadline after the failing one")
        assert len(reported) == 1 and isinstance(reported[0]["exception"], ValueError)
    finally:
        loop.set_exception_handler(previous)


class VirtualLoop:
    """A loop whose clock is its own (as a test loop's virtual time is): what Deadlines
    asks of a loop, with a timer the test runs by moving the clock."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.timers: list[tuple[float, Any]] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Any) -> Any:
        entry = (when, callback)
        self.timers.append(entry)
        loop = self

        class Handle:
            def cancel(self) -> None:
                if entry in loop.timers:
                    loop.timers.remove(entry)
        return Handle()

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for entry in sorted(self.timers, key=lambda e: e[0]):
            if entry[0] <= self.now and entry in self.timers:
                self.timers.remove(entry)
                entry[1]()


def test_a_loop_of_another_clock_is_asked_for_its_time() -> None:
    loop = VirtualLoop()
    timers = Deadlines(loop)
    fired: list[str] = []
    timers.arm(5.0, fired.append, ("five",))
    timers.arm(2.0, fired.append, ("two",))
    assert [when for when, _ in loop.timers] == [1002.0]  # moved once, to the earlier one
    loop.advance(1.0)
    assert fired == []
    loop.advance(1.5)
    assert fired == ["two"] and [when for when, _ in loop.timers] == [1005.0]
    loop.advance(3.0)
    assert fired == ["two", "five"] and loop.timers == []


async def test_a_short_recv_timeout_fires_while_a_longer_one_is_armed(
        cluster: rvz.ClusterSpec) -> None:
    """Each recv's timeout is its own: one of 0.05 s armed after one of 30 s expires on
    time, and the long one still gets its value."""
    async with pair(cluster) as (w, p):
        patient = asyncio.ensure_future(p.recv(key("patient"), timeout=30))
        with pytest.raises(TimeoutError, match="short"):
            await asyncio.wait_for(p.recv(key("short"), timeout=0.05), 10)
        assert not patient.done()
        await w.send(key("patient"), b"value")
        assert await asyncio.wait_for(patient, 10) == b"value"

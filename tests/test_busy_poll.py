"""Busy polling (``Node(busy_poll=)``, ``rvz.poll.BusyPoll``): the loop stays awake while a
recv waits on a peer, for at most the budget, and only then; every way a recv ends closes
its wait; values arrive as without it.  On both implementations and both loops; what it
saves in latency is the benchmark's (``rvz-bench pingpong --busy-poll``), not a test's.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest

import rvz
from rvz.poll import BusyPoll

from .conftest import PS, WORKER, eventually, key, pair, pending, settle

# long enough that no wait of these tests outlasts it unless a test means it to
LONG = 0.9


def poll_of(node: rvz.Node) -> BusyPoll:
    poll = node._poll
    assert isinstance(poll, BusyPoll)
    return poll


@pytest.mark.parametrize("mode", ["send", "recv"])
async def test_a_remote_recv_keeps_the_loop_polling_until_its_value_comes(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode, ps={"busy_poll": LONG}) as (w, p):
        poll = poll_of(p)
        waiting = await pending(p.recv(key("x"), timeout=10), time=0.05)
        assert poll.waiting == 1 and poll.running
        before = poll.spins
        await asyncio.sleep(0.02)  # a timer still fires while the loop polls
        assert poll.spins > before > 0
        await w.send(key("x"), np.arange(3))
        assert (await waiting).tolist() == [0, 1, 2]
        assert poll.waiting == 0
        await settle()
        assert not poll.running  # nothing waits: the loop may sleep again
        spins = poll.spins
        await asyncio.sleep(0.02)
        assert poll.spins == spins
        assert p.stats()["busy_poll"] == {"budget": LONG, "spins": spins}
        assert w.stats()["busy_poll"] is None and w._poll is None


async def test_a_wait_longer_than_the_budget_stops_polling_and_still_gets_its_value(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "send", ps={"busy_poll": 0.01}) as (w, p):
        poll = poll_of(p)
        waiting = asyncio.ensure_future(p.recv(key("late"), timeout=10))
        await eventually(lambda: poll.waiting == 1 and not poll.running, "polling gave up")
        spins = poll.spins
        await asyncio.sleep(0.05)
        assert poll.spins == spins and poll.waiting == 1
        await w.send(key("late"), np.arange(2))
        assert (await waiting).tolist() == [0, 1]
        assert poll.waiting == 0


async def test_a_recv_of_a_local_key_does_not_poll(cluster) -> None:  # type: ignore[no-untyped-def]
    async with rvz.Node(cluster, "ps", 0, "send", busy_poll=LONG) as p:
        poll = poll_of(p)
        local = key("here", src=PS, dst=PS)
        waiting = await pending(p.recv(local, timeout=10))
        assert poll.waiting == 0 and not poll.running and poll.spins == 0
        await p.send(local, np.arange(1))
        assert (await waiting).tolist() == [0]
        assert poll.spins == 0


@pytest.mark.parametrize("mode", ["send", "recv"])
async def test_every_way_a_wait_ends_closes_it(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode, ps={"busy_poll": LONG}) as (w, p):
        poll = poll_of(p)
        with pytest.raises(TimeoutError):
            await p.recv(key("t"), timeout=0.05)
        assert poll.waiting == 0
        cancelled = await pending(p.recv(key("c"), timeout=10), time=0.02)
        assert poll.waiting == 1
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert poll.waiting == 0
        # a batch of a remote and a local key polls once, and ends like a single recv
        local = key("mine", src=PS, dst=PS)
        batch = await pending(p.recv_many([key("b1"), local], timeout=10), time=0.02)
        assert poll.waiting == 1 and poll.running
        await w.send(key("b1"), np.arange(2))
        await p.send(local, np.arange(3))
        first, second = await batch
        assert first.tolist() == [0, 1] and second.tolist() == [0, 1, 2]
        assert poll.waiting == 0
        with pytest.raises(TimeoutError):
            await p.recv_many([key("b2"), key("b3")], timeout=0.05)
        assert poll.waiting == 0
        # a batch of local keys only does not poll
        spins = poll.spins
        await settle()
        only_local = await pending(p.recv_many([local], timeout=10), time=0.02)
        assert poll.waiting == 0 and poll.spins == spins
        await p.send(local, np.arange(1))
        assert [v.tolist() for v in await only_local] == [[0]]
        # aborting the node fails the waiting recv, which closes its wait
        failing = await pending(p.recv(key("a"), timeout=10), time=0.02)
        p.abort()
        with pytest.raises(rvz.Aborted):
            await failing
        assert poll.waiting == 0


@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_ping_pong_between_two_polling_nodes_carries_every_value(cluster, mode, transport) -> None:  # type: ignore[no-untyped-def]
    both: dict[str, Any] = {"busy_poll": 0.0002, "transport": transport}
    if transport == "shm":  # every value through the shared-memory channel, none on TCP
        both["onesided"] = {"tcp_max": -1}
    async with pair(cluster, mode, worker=both, ps=both) as (w, p):
        ping = key("ping")
        pong = key("pong", src=PS, dst=WORKER)

        async def echo() -> None:
            for _ in range(300):
                value = await p.recv(ping, timeout=10)
                await p.send(pong, value + 1)

        task = asyncio.ensure_future(echo())
        for i in range(300):
            await w.send(ping, np.array([i]))
            assert (await w.recv(pong, timeout=10)).tolist() == [i + 1]
        await task
        for node in (w, p):
            poll = poll_of(node)
            assert poll.spins > 0 and poll.waiting == 0
            if transport == "shm":  # the values came through the channels, whose completions
                # the polling loop found on the descriptor it watches
                channels = [ch for e in node._onesided.engines.values() for ch in e.channels.values()]
                assert sum(ch.stats["tcp"] for ch in channels) == 0
                assert sum(ch.stats["inline"] + ch.stats["writes"] for ch in channels) >= 300


@pytest.mark.parametrize("bad", [-0.001, 1.0, math.nan, math.inf, "0.1", None])
def test_a_bad_busy_poll_is_refused_at_construction(cluster, bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(rvz.ConfigError, match="busy_poll"):
        rvz.Node(cluster, "ps", 0, busy_poll=bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
async def test_a_busy_poll_budget_is_a_positive_number_of_seconds(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="budget"):
        BusyPoll(asyncio.get_running_loop(), bad)

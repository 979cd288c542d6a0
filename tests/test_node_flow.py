"""Flow control and closing: backpressure in both modes, graceful close, linger."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import rvz
from rvz import _impl
from rvz.cluster import split_address

from .conftest import (
    FAST,
    PS,
    WORKER,
    after_each_read,
    eventually,
    frame_starts,
    key,
    pair,
    pending,
    provider_or_skip,
    record_writes,
    settle,
)
from .hostile import MANY_FIXED

MIB = 1 << 20
SIZE = 256 << 10          # bytes per array
COUNT = 40


def array(i: int) -> np.ndarray:
    return np.full(SIZE // 4, i, np.float32)


def queued(node: rvz.Node, k: rvz.Key) -> int:
    """Values of ``k`` queued in ``node``'s step-0 table; an empty table may be dropped at a
    heartbeat (it is made again on use), which counts as none."""
    table = node._tables.get(0)
    return 0 if table is None else table.queued(str(k))


async def until_one_waits(send: Callable[[int], Awaitable[None]]) -> asyncio.Future[None]:
    """Call ``send(0)``, ``send(1)``, ... until one waits (for credit): that one, pending."""
    for i in range(8):
        waiting = asyncio.ensure_future(send(i))
        await settle()
        if not waiting.done():
            return waiting
        waiting.result()
    raise AssertionError("the push window never filled")


async def send_count(w: rvz.Node, k: rvz.Key) -> None:
    """``array(0)`` to ``array(COUNT - 1)`` on ``k``, each send awaited."""
    for i in range(COUNT):
        await w.send(k, array(i))


async def _linked(w: rvz.Node, p: rvz.Node) -> None:
    """One exchange from ``w`` to ``p``, so that a connection between them is up."""
    await w.send(key("warm"), np.array([0]))
    assert int((await p.recv(key("warm"), timeout=5))[0]) == 0


async def stalled_push(w: rvz.Node, p: rvz.Node, k: rvz.Key) -> asyncio.Future[None]:
    """Link ``w`` to ``p`` (Send-Driven, a push window of MIB), then fill the window with
    values of ``k`` that ``p`` does not take: the send that waits for credit, pending."""
    await _linked(w, p)
    return await until_one_waits(lambda i: w.send(k, array(i)))


@pytest.mark.loop_timeout(30)
async def test_send_driven_backpressure_bounds_memory_and_loses_nothing(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "send", push_window=MIB) as (w, p):
        k = key("flood")
        producer = asyncio.ensure_future(send_count(w, k))
        await eventually(lambda: queued(p, k) >= 1,
                         "the first pushes arrived")
        await asyncio.sleep(0.5)
        # The consumer does not recv: the producer is held back by the push window ...
        assert not producer.done()
        waiting = queued(p, k)
        assert 1 <= waiting <= MIB // SIZE + 1, waiting
        # ... and nothing is piled up in its socket buffer either.
        conn = w._peers[("ps", 0)].link  # the connection our traffic to it uses
        assert conn is not None
        assert conn.transport.get_write_buffer_size() <= MIB + SIZE
        # Once the consumer drains, everything arrives, in order.
        for i in range(COUNT):
            got = await p.recv(k, timeout=10)
            assert got.shape == (SIZE // 4,) and got[0] == i and got[-1] == i
        await producer
        assert queued(p, k) == 0


@pytest.mark.loop_timeout(30)
async def test_abandoned_pushes_leave_the_queue_behind_one_that_waits(cluster) -> None:  # type: ignore[no-untyped-def]
    """Sends that time out or are cancelled while an earlier push waits for credit take
    their values out of the peer's queue at once: a producer retrying on a timeout behind a
    send without one grew the queue (and kept every value) by one a try."""
    async with pair(cluster, "send", push_window=MIB, claim_timeout=None) as (w, p):
        k = key("stalled")
        waiting = await stalled_push(w, p, k)   # holds the head of the queue, no timeout
        queue = w._peers[("ps", 0)].queue
        try:
            assert len(queue) == 1
            for i in range(50):
                with pytest.raises(TimeoutError, match="send of .*retry.* to /job:ps"):
                    await w.send(key("retry"), array(i), timeout=0)
                given_up = asyncio.ensure_future(w.send(key("retry"), array(i)))
                await settle(2)
                given_up.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await given_up
            left = len(queue)
            assert left == 1, f"{left} pushes queued, one waits"
            # Nothing abandoned arrives: the values the window held, then the one that waited.
            fits = MIB // (SIZE + 64)
            got = [int((await p.recv(k, timeout=10))[0]) for _ in range(fits + 1)]
            assert got == list(range(fits + 1)), got
            await waiting
            with pytest.raises(TimeoutError):
                await p.recv(key("retry"), timeout=0.2)
            assert not queue
        finally:
            waiting.cancel()   # (done already, unless the test failed)


class _Walked(collections.deque):  # type: ignore[type-arg]
    """A push queue that counts the items walked through (``for item in queue``)."""

    def __init__(self) -> None:
        super().__init__()
        self.walked = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        for item in super().__iter__():
            self.walked += 1
            yield item


@pytest.mark.loop_timeout(30)
async def test_sends_that_give_up_together_do_not_each_search_the_queue(cluster) -> None:  # type: ignore[no-untyped-def]
    """Sends whose pushes wait in the queue give up together: the first takes its push out
    and the pump drops the others' (done already) from the head.  None of the others may
    search every queue for its push (n sends timing out at once would cost n * n): a push
    no longer queued is known as such."""
    n = 20
    async with rvz.Node(cluster, "worker", 0, "send", **{**FAST, "connect_timeout": 30.0}) as w:
        queue = _Walked()
        w._core.routes.peer(("ps", 0)).queue = queue   # its consumer is not up: pushes wait
        giving_up = [asyncio.ensure_future(w.send(key(f"gives_up{i}"), array(i))) for i in range(n)]
        staying = [asyncio.ensure_future(w.send(key(f"stays{i}"), array(i))) for i in range(n)]
        try:
            await settle()
            assert len(queue) == 2 * n
            for task in giving_up:
                task.cancel()
            for result in await asyncio.gather(*giving_up, return_exceptions=True):
                assert isinstance(result, asyncio.CancelledError)
            walked = queue.walked
            assert len(queue) == n
            assert walked <= n, f"{walked} queued pushes walked for {n} sends"
        finally:
            for task in giving_up + staying:
                task.cancel()
            await asyncio.gather(*giving_up, *staying, return_exceptions=True)
        assert not queue


@pytest.mark.loop_timeout(30)
async def test_recv_driven_hold_limit_slows_the_producer(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "recv", hold_limit=MIB, claim_timeout=None) as (w, p):
        k = key("held_flood")
        await w.send(key("linked"), array(0))  # linked first: this test is about the hold limit
        assert (await p.recv(key("linked"), timeout=10))[0] == 0

        producer = await pending(send_count(w, k), 0.3)
        assert w._held_bytes <= MIB + SIZE, w._held_bytes
        assert queued(w, k) <= MIB // SIZE + 1
        for i in range(COUNT):
            got = await p.recv(k, timeout=10)
            assert got[0] == i and got[-1] == i
        await producer
        assert w._held_bytes == 0 and w._held_count == 0


@pytest.mark.loop_timeout(30)
async def test_held_values_pushed_unclaimed_count_against_hold_limit_until_written(cluster) -> None:  # type: ignore[no-untyped-def]
    """Values pushed at claim_timeout wait for credit in the push queue, and count against
    hold_limit there: released when queued, a consumer that took none of them let the
    sends behind them hold the limit again every claim_timeout, and the producer's queue
    grew without bound.  Now the sends stop at the limit plus the consumer's window."""
    limit, window, size = 256 << 10, 256 << 10, 32 << 10
    async with pair(cluster, "recv", hold_limit=limit, push_window=window, claim_timeout=0.1) as (w, p):
        await _linked(w, p)
        sent = 0
        with pytest.raises(TimeoutError, match="hold limit"):
            for i in range(200):   # the old code sent them all, 6.4 MiB, in about two seconds
                await w.send(key("untaken"), np.full(size // 4, i, np.float32), timeout=0.6)
                sent += 1
        queue = w._core.routes.peer(p.id).queue
        assert sent * size <= limit + window + size, sent
        assert w._held_bytes + 64 * w._held_count <= limit   # MESSAGE_COST a value
        assert w._held_bytes >= sum(item[6] for item in queue) > 0   # the queued count as held
        for i in range(sent):      # and nothing was lost or reordered
            assert int((await p.recv(key("untaken"), timeout=5))[0]) == i
        await eventually(lambda: w._held_bytes == 0 and w._held_count == 0, "all released")


@pytest.mark.loop_timeout(30)
async def test_a_send_waiting_for_hold_room_sees_a_request_after_its_table_was_dropped(cluster) -> None:  # type: ignore[no-untyped-def]
    """A Recv-Driven send waiting for room under hold_limit goes as soon as its consumer
    asks for its key.  It kept the step's table it began with: when the values filling the
    limit had all been pushed at claim_timeout (they wait for credit, counted as held) that
    table was empty and dropped at a heartbeat, the consumer's request parked in a new one,
    and the send never saw it: send and recv both waited for ever."""
    limit, window, size = 256 << 10, 128 << 10, 32 << 10
    async with pair(cluster, "recv", hold_limit=limit, push_window=window, claim_timeout=0.1) as (w, p):
        await _linked(w, p)
        with pytest.raises(TimeoutError, match="hold limit"):
            for i in range(200):   # nobody takes these: pushed at claim_timeout, stuck at the window
                await w.send(key("untaken"), np.full(size // 4, i, np.float32), timeout=0.6)
        await eventually(lambda: 0 not in w._tables, "the empty step-0 table dropped")
        waiting = await pending(w.send(key("asked"), np.full(size // 4, -1, np.float32)), 0.2)
        await eventually(lambda: 0 not in w._tables, "the empty step-0 table dropped again")
        got = await p.recv(key("asked"), timeout=10)
        assert got[0] == -1
        await asyncio.wait_for(waiting, 10)


@pytest.mark.loop_timeout(30)
async def test_a_send_waiting_for_hold_room_fails_when_its_consumer_is_gone() -> None:
    """Room under hold_limit comes only when consumers fetch.  A send waiting for it whose
    consumer died waited for ever; now it dials the consumer, as a Send-Driven recv does
    its producer, and fails with PeerLost once that cannot be reached (connect_timeout).
    The dead consumer's values stay held (for its next incarnation): with lost_hold_limit=0
    they count in full for the other consumers too, and a send to another consumer that
    times out says who fills the limit."""
    cluster = rvz.ClusterSpec.loopback({"worker": 1, "ps": 2})
    opts = {**FAST, "hold_limit": MIB, "claim_timeout": None, "connect_timeout": 1.0,
            "peer_timeout": 1.0}
    opts_w = {**opts, "lost_hold_limit": 0}
    async with rvz.Node(cluster, "worker", 0, "recv", **opts_w) as w, \
            rvz.Node(cluster, "ps", 0, "recv", **opts) as p0, \
            rvz.Node(cluster, "ps", 1, "recv", **opts) as p1:
        await _linked(w, p0)
        k = key("orphaned")
        waiting = await pending(send_count(w, k), 0.3)
        held = w.stats()["peers"][p0.name]["held_values"]
        assert held == MIB // (SIZE + 64)   # 64 B a value counts too
        p0.abort()
        with pytest.raises(rvz.PeerLost, match=r"ps/replica:0/task:0"):
            await asyncio.wait_for(waiting, 10)
        with pytest.raises(rvz.PeerLost):   # the limit is still full of values for the dead
            await asyncio.wait_for(w.send(k, array(99)), 10)
        other = key("other", dst=p1.name + "/device:CPU:0")
        await w.send(key("hello", dst=other.dst), np.arange(1), mode="send")
        await p1.recv(key("hello", dst=other.dst), timeout=5)      # ps:1 is connected
        with pytest.raises(TimeoutError, match=rf"held for {p0.name} \(not connected\): "
                                               rf"{held} values"):
            await w.send(other, array(0), timeout=0.3)
        assert w.stats()["peers"][p1.name]["held_values"] == 0


@pytest.mark.loop_timeout(30)
async def test_a_send_timed_out_on_the_hold_limit_names_who_fills_it_without_a_walk(cluster) -> None:  # type: ignore[no-untyped-def]
    """A send that times out waiting for room under hold_limit says who fills it from each
    consumer's count, not from a walk of every key held (100k keys held took each such
    timeout 0.2-0.5 s, and every send waiting for room times out with it)."""
    async with rvz.Node(cluster, "worker", 0, "recv",
                        **{**FAST, "hold_limit": MIB, "claim_timeout": None}) as w:
        fits = MIB // (SIZE + 64)
        for i in range(fits):   # one key each, for a consumer that is not up
            await w.send(key(f"held{i}"), array(i))
        walks: list[int] = []
        held_keys = w._held_keys
        w._held_keys = lambda: walks.append(1) or held_keys()  # type: ignore[method-assign]
        consumer = w._peers[("ps", 0)].name
        with pytest.raises(TimeoutError, match=rf"held for {consumer} \(not connected\): "
                                               rf"{fits} values"):
            await w.send(key("one_more"), array(fits), timeout=0.3)
        assert not walks, "the tables were walked for the message"


def _to(node: rvz.Node, name: str) -> rvz.Key:
    """A key from worker:0 to ``node`` (a task of job ps)."""
    return key(name, dst=node.name + "/device:CPU:0")


def check_held_counts(node: rvz.Node) -> None:
    """The node's held counts are the sums of its consumers', those of the lost apart."""
    core, peers = node._core, node._peers.values()
    assert core.holding.held_bytes == sum(p.held_bytes for p in peers)
    assert core.holding.held_count == sum(p.held_count for p in peers)
    assert core.holding.hold_reserved == sum(p.hold_reserved for p in peers)
    assert core.holding.lost_bytes == sum(p.held_bytes for p in peers if p.lost)
    assert core.holding.lost_count == sum(p.held_count for p in peers if p.lost)
    assert core.holding.lost_reserved == sum(p.hold_reserved for p in peers if p.lost)


# Three tasks for the lost-consumer tests: the producer worker:0, consumers ps:0 and ps:1.
LOST_OPTS = {**FAST, "hold_limit": MIB, "claim_timeout": None, "connect_timeout": 1.0,
             "peer_timeout": 1.0}
FITS = MIB // (SIZE + 64)   # values of SIZE held at once under hold_limit (64 B each count)


@pytest.mark.loop_timeout(40)
async def test_a_lost_consumers_held_values_do_not_stall_the_sends_to_the_others() -> None:
    """ps:0 dies with hold_limit full of its values.  They stay held for its next
    incarnation, and they counted against the limit for every consumer: each Recv-Driven
    send to ps:1, alive and taking its values, waited for room only ps:0 could make, until
    its timeout.  A lost consumer's values now count apart, up to lost_hold_limit (here
    its default, hold_limit): the sends to ps:1 go, one already waiting too; those to
    ps:0 still wait and fail with PeerLost; its next incarnation gets its values in order,
    and they count in full again."""
    cluster = rvz.ClusterSpec.loopback({"worker": 1, "ps": 2})
    async with rvz.Node(cluster, "worker", 0, "recv", **LOST_OPTS) as w, \
            rvz.Node(cluster, "ps", 1, "recv", **LOST_OPTS) as p1:
        p0 = await rvz.Node(cluster, "ps", 0, "recv", **LOST_OPTS).start()
        mine, other = key("orphaned"), _to(p1, "other")
        try:
            await _linked(w, p0)
            await w.send(_to(p1, "hello"), np.arange(1))
            assert int((await p1.recv(_to(p1, "hello"), timeout=5))[0]) == 0
            waiting = await pending(send_count(w, mine), 0.3)    # ps:0 takes none
            assert w.stats()["peers"][p0.name]["held_values"] == FITS
            # While ps:0 is connected, its values share the limit with everyone's.
            blocked = await pending(w.send(other, array(100)), 0.2)
            p0.abort()
            await asyncio.wait_for(blocked, 5)   # ps:0 is lost: room for ps:1
            assert w._core.holding.lost_count == FITS
            check_held_counts(w)
            with pytest.raises(rvz.PeerLost, match=r"ps/replica:0/task:0"):
                await asyncio.wait_for(waiting, 10)
            # ps:1's own values count as ever: its sends hold up to the limit, then wait.
            more = await pending(send_count(w, other), 0.3)
            assert w.stats()["peers"][p1.name]["held_values"] == FITS
            assert w.stats()["peers"][p0.name]["held_values"] == FITS   # nothing dropped
            assert w._held_bytes + 64 * w._held_count <= 2 * MIB   # hold + lost_hold_limit
            check_held_counts(w)
            for i in [100, *range(COUNT)]:
                assert int((await p1.recv(other, timeout=5))[0]) == i
            await asyncio.wait_for(more, 10)
            with pytest.raises(rvz.PeerLost):   # the limit is full for ps:0 itself
                await asyncio.wait_for(w.send(mine, array(99)), 10)
        finally:
            p0.abort()
        async with rvz.Node(cluster, "ps", 0, "recv", **LOST_OPTS) as p0:
            assert int((await p0.recv(mine, timeout=5))[0]) == 0   # its values, oldest first
            # Connected again, the two it has not taken count in full: one value for ps:1
            # fits beside them, a second waits until ps:0 takes its own.
            await asyncio.wait_for(w.send(other, array(0)), 5)
            later = await pending(w.send(other, array(1)), 0.2)
            assert w._core.holding.lost_count == 0
            check_held_counts(w)
            for i in range(1, FITS):
                assert int((await p0.recv(mine, timeout=5))[0]) == i
            await asyncio.wait_for(later, 5)
            for i in range(2):
                assert int((await p1.recv(other, timeout=5))[0]) == i
            assert w._held_count == 0
            check_held_counts(w)


@pytest.mark.loop_timeout(30)
async def test_a_consumer_that_never_came_up_does_not_stall_the_sends_to_the_others() -> None:
    """Values held for a consumer never connected count apart too: the limit full of them,
    a send to it fails with PeerLost (it cannot be reached), one to a live consumer goes,
    and the consumer that comes up late gets them all, in order."""
    cluster = rvz.ClusterSpec.loopback({"worker": 1, "ps": 2})
    async with rvz.Node(cluster, "worker", 0, "recv", **LOST_OPTS) as w, \
            rvz.Node(cluster, "ps", 1, "recv", **LOST_OPTS) as p1:
        mine, other = key("early"), _to(p1, "other")
        for i in range(FITS):
            await asyncio.wait_for(w.send(mine, array(i)), 5)   # held for ps:0, not up yet
        with pytest.raises(rvz.PeerLost, match=r"ps/replica:0/task:0"):
            await asyncio.wait_for(w.send(mine, array(FITS)), 10)
        # (Not connected yet either, ps:1 counts everything at first: its send dials it,
        # and once linked, ps:0's values count apart.)
        await asyncio.wait_for(w.send(other, array(7)), 5)
        assert int((await p1.recv(other, timeout=5))[0]) == 7
        async with rvz.Node(cluster, "ps", 0, "recv", **LOST_OPTS) as p0:
            for i in range(FITS):
                assert int((await p0.recv(mine, timeout=5))[0]) == i
        assert w._held_count == 0


@pytest.mark.loop_timeout(30)
async def test_values_held_for_lost_consumers_count_against_hold_limit_beyond_lost_hold_limit() -> None:
    """What lost consumers hold beyond lost_hold_limit counts for the live ones: memory
    held stays under hold_limit + lost_hold_limit, and a live consumer's sends wait at
    the rest of the limit (then go as it takes its values, in order)."""
    cluster = rvz.ClusterSpec.loopback({"worker": 1, "ps": 2})
    lost_limit = MIB // 2
    async with rvz.Node(cluster, "worker", 0, "recv", **LOST_OPTS,
                        lost_hold_limit=lost_limit) as w, \
            rvz.Node(cluster, "ps", 1, "recv", **LOST_OPTS) as p1:
        p0 = await rvz.Node(cluster, "ps", 0, "recv", **LOST_OPTS).start()
        mine, other = key("orphaned"), _to(p1, "other")
        try:
            await _linked(w, p0)
            waiting = await pending(send_count(w, mine), 0.3)
        finally:
            p0.abort()
        with pytest.raises(rvz.PeerLost):
            await asyncio.wait_for(waiting, 10)
        beyond = FITS * (SIZE + 64) - lost_limit          # what counts of ps:0's values
        more = await pending(send_count(w, other), 0.3)
        assert w.stats()["peers"][p1.name]["held_values"] == (MIB - beyond) // (SIZE + 64)
        assert w._held_bytes + 64 * w._held_count <= MIB + lost_limit
        check_held_counts(w)
        for i in range(COUNT):
            assert int((await p1.recv(other, timeout=5))[0]) == i
        await asyncio.wait_for(more, 10)


def test_lost_hold_limit_defaults_to_hold_limit_and_takes_bytes_only(cluster) -> None:  # type: ignore[no-untyped-def]
    assert rvz.Node(cluster, "worker", 0, hold_limit=1000).lost_hold_limit == 1000
    assert rvz.Node(cluster, "worker", 0, lost_hold_limit=0).lost_hold_limit == 0
    for bad in (-1, 1.5, "1"):
        with pytest.raises(rvz.ConfigError, match="lost_hold_limit"):
            rvz.Node(cluster, "worker", 0, lost_hold_limit=bad)


@pytest.mark.loop_timeout(30)
async def test_recv_driven_hold_limit_counts_each_value_and_wakes_producers_in_bulk(cluster) -> None:  # type: ignore[no-untyped-def]
    # Held values count MESSAGE_COST bytes each, as in the push window, so tiny values are
    # bounded in number too.  Producers waiting for room look again once an eighth of the
    # limit is free, not at every value taken: each look wakes every waiting task.
    cost = 64  # MESSAGE_COST, "64 B per value" in the docs
    fits = 64
    async with pair(cluster, "recv", hold_limit=fits * (8 + cost), claim_timeout=None) as (w, p):
        await w.send(key("linked"), array(0))  # linked first: this test is about the hold limit
        assert (await p.recv(key("linked"), timeout=10))[0] == 0
        core = w._core
        looks = 0

        class Counting(collections.deque):  # type: ignore[type-arg]
            def append(self, waiter: Any) -> None:  # every wait for room, first or again
                nonlocal looks
                looks += 1
                super().append(waiter)

        core.holding.hold_waiters = Counting()
        keys = [key(f"tiny{j}") for j in range(16)]
        per_key = 8

        async def produce(k: rvz.Key) -> None:
            for i in range(per_key):
                await w.send(k, np.full(1, i, np.int64))   # 8 bytes each

        producers = [asyncio.ensure_future(produce(k)) for k in keys]
        try:
            # (sends that fit complete at once: the first producers are done)
            await eventually(lambda: w._held_count == fits and len(core.holding.hold_waiters) == sum(
                not t.done() for t in producers) > 0, "the limit reached, the other producers wait")
            assert w._held_count == fits, w._held_count   # 8-byte values: 64 of them, not 576
            for k in keys:
                for i in range(per_key):
                    assert (await p.recv(k, timeout=10))[0] == i
            await asyncio.wait_for(asyncio.gather(*producers), 10)
        finally:
            for task in producers:
                task.cancel()
        # 64 values waited for room, taken one by one: waking all 8 waiting producers at
        # every value taken would be up to 8 looks per value; an eighth of the limit at a
        # time, up to 8 looks per 8 values.
        waited = len(keys) * per_key - fits
        assert looks <= 2 * waited, (looks, waited)
        assert w._held_bytes == 0 and w._held_count == 0


@pytest.mark.loop_timeout(20)
async def test_one_value_larger_than_the_window_still_goes(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "send", push_window=MIB) as (w, p):
        big = np.arange(3 * MIB // 8, dtype=np.float64)
        await w.send(key(), big)         # nothing else in flight: it goes
        later = await pending(w.send(key(), np.arange(3)))  # waits for the window
        np.testing.assert_array_equal(await p.recv(key(), timeout=10), big)
        await later
        assert (await p.recv(key(), timeout=10)).tolist() == [0, 1, 2]


@pytest.mark.parametrize("concurrent_consumer", [False, True])
@pytest.mark.loop_timeout(30)
async def test_graceful_close_delivers_send_driven_pushes(cluster, concurrent_consumer) -> None:  # type: ignore[no-untyped-def]
    async with rvz.Node(cluster, "ps", 0, "send", **FAST) as p:
        k = key("flushed")
        sizes = [10, 3 * MIB, 0, 5000, 2 * MIB, 1, 300000] * 3
        received: list[np.ndarray] = []

        async def consume() -> None:
            for _ in sizes:
                received.append(await p.recv(k, timeout=10))

        consumer = asyncio.ensure_future(consume()) if concurrent_consumer else None
        window = 4 * MIB if concurrent_consumer else 64 * MIB
        async with rvz.Node(cluster, "worker", 0, "send", **{**FAST, "push_window": window}) as w:
            for i, n in enumerate(sizes):
                await w.send(k, np.full(n, i % 251, np.uint8))
        assert w.state == "closed"
        # The producer is gone; what it sent is all here.
        if consumer is not None:
            await consumer
        else:
            await consume()
        assert [v.shape[0] for v in received] == sizes
        for i, v in enumerate(received):
            assert v.size == 0 or (v[0] == i % 251 and v[-1] == i % 251)


@pytest.mark.loop_timeout(20)
async def test_recv_driven_close_delivers_held_values(cluster) -> None:  # type: ignore[no-untyped-def]
    """Values a Recv-Driven producer still holds at close are pushed to their consumer,
    which has asked for none of them yet; close() does not wait for it to ask."""
    async with rvz.Node(cluster, "ps", 0, "recv", **{**FAST, "connect_timeout": 0.5}) as p:
        w = await rvz.Node(cluster, "worker", 0, "recv",
                           **{**FAST, "linger": 10.0, "claim_timeout": None}).start()
        k = key("lingering")
        for i in range(3):
            await w.send(k, np.array([i]))
        await w.send(k, np.zeros(MIB, np.uint8))
        await asyncio.wait_for(w.close(), 8)   # well within the 10 s linger
        assert w.state == "closed"
        # the consumer asks only now, and still gets everything, in order
        got = [int((await p.recv(k, timeout=5))[0]) for _ in range(3)]
        assert got == [0, 1, 2]
        assert (await p.recv(k, timeout=5)).nbytes == MIB
        # nothing more from a closed producer: PeerLost, not a hang
        with pytest.raises(rvz.PeerLost):
            await p.recv(k, timeout=8)


@pytest.mark.loop_timeout(20)
async def test_close_says_bye_on_a_connection_still_in_its_handshake(cluster, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A producer closes while a second connection to its consumer is in the handshake on
    its side (it has not read the consumer's HELLO) but complete on the consumer's (which
    read the producer's).  That connection must end with BYE too: ended without one, the
    consumer took the producer for lost and reset the first connection, and with it the
    values close() had pushed there that it had not read yet."""
    async with pair(cluster, "recv", claim_timeout=None) as (w, p):
        await _linked(w, p)  # the consumer dialled: the link both sides use
        on_p = p._peers[("worker", 0)]
        first = on_p.out
        # The producer dials too; the consumer's side of that connection keeps what it
        # writes (its HELLO, its pings), so the producer never completes the handshake.
        kept: list[bytes] = []
        make = p._connection

        def connection(outbound: bool, peer: Any = None) -> Any:
            conn = make(outbound, peer)
            if not outbound and not kept:
                conn.write_frame = kept.append
            return conn

        monkeypatch.setattr(p, "_connection", connection)
        w._spawn(w._dial(w._peers[("ps", 0)], asyncio.get_running_loop().create_future()))
        await eventually(lambda: any(c.ready for c in on_p.inbound),
                         "the consumer completed the handshake of the producer's dial")
        second = next(iter(on_p.inbound))
        on_w = w._peers[("ps", 0)]
        assert on_w.out is None and [c.ready for c in w._conns].count(False) == 1
        k = key("held_at_close")
        for i in range(5):
            await w.send(k, np.array([i]))
        assert w._held_count == 5
        # What close() pushes on the first connection waits, unread, in the consumer's socket
        # until the second connection has ended.
        first.transport.pause_reading()
        closing = asyncio.ensure_future(w.close())
        await eventually(lambda: second.closed, "the second connection ended")
        if not first.closed:
            first.transport.resume_reading()
        await closing
        await eventually(lambda: first.closed, "the consumer read the first connection to its end")
        assert queued(p, k) == 5, f"the first connection ended with {first.close_reason!r}"
        assert first.bye_received, first.close_reason
        assert [int((await p.recv(k, timeout=5))[0]) for _ in range(5)] == [0, 1, 2, 3, 4]


@pytest.mark.loop_timeout(20)
async def test_a_connection_made_after_abort_is_closed_at_once(cluster) -> None:  # type: ignore[no-untyped-def]
    """abort() fails the connections it knows of.  One whose dial or accept completes after
    it (its task cancelled too late, or an accepted socket whose protocol starts in the next
    loop pass) must close as well: left open, it told the peer the node was alive until the
    peer's peer_timeout, and its HELLO handshake ran on a node that is gone."""
    async with pair(cluster, "recv", peer_timeout=30.0) as (w, p):
        w.abort(RuntimeError("gone"))
        peer = w._core.routes.peer(p.id)
        host, port = split_address(peer.address)
        _, late = await asyncio.get_running_loop().create_connection(
            lambda: w._connection(outbound=True, peer=peer), host, port)
        await eventually(lambda: late.closed, "the connection made after abort() closed")
        assert isinstance(late.close_reason, rvz.Aborted)
        assert "gone" in str(late.close_reason) and not late.ready
        assert late.bytes_out == 0, "it said HELLO for a node that is gone"
        on_p = p._core.routes.peer(w.id)
        await eventually(lambda: not on_p.live_connections(), "the consumer's side closed too")


@pytest.mark.loop_timeout(20)
async def test_a_push_given_credit_after_close_said_bye_is_not_reported_sent(cluster) -> None:  # type: ignore[no-untyped-def]
    """close() gave up on a Send-Driven push still waiting for credit (after ``linger``)
    and said BYE.  Credit that comes after that must not let the push go: nothing may
    follow BYE, so its write would be dropped while its ``send`` returned as delivered."""
    async with pair(cluster, "send", push_window=MIB, worker={"linger": 0.2}) as (w, p):
        stalled = await stalled_push(w, p, key("late"))
        link = w._core.routes.peer(p.id).link
        consumer_side = p._core.routes.peer(w.id).link
        consumer_side.transport.pause_reading()  # close() waits for the consumer
        closing = asyncio.ensure_future(w.close())
        await eventually(lambda: w._said_bye, "close() said BYE")
        assert not stalled.done()
        w._core.on_credit(link, MIB)  # the consumer's credit, arriving now
        with pytest.raises(rvz.Aborted):
            await asyncio.wait_for(stalled, 5)
        consumer_side.transport.resume_reading()
        await closing


@pytest.mark.loop_timeout(20)
async def test_a_request_gets_the_unclaimed_push_waiting_for_credit_before_later_values(cluster) -> None:  # type: ignore[no-untyped-def]
    """Recv-Driven: values nobody asked for within claim_timeout are pushed, and with the
    window full they wait for credit in the producer's queue.  A request that comes then must
    be answered with the oldest of them, not with a later value of the key still held: that
    one would reach the consumer first (received 0, 1, 2, 5, 6, 3, 4)."""
    window = 2 * (8 + 64)   # two 8-byte values
    async with pair(cluster, "recv", push_window=window, claim_timeout=0.1) as (w, p):
        await _linked(w, p)
        to_consumer = w._core.routes.peer(p.id)
        await eventually(lambda: to_consumer.credit == window, "the warm-up's credit came back")
        fill, k = key("fill"), key("ordered")
        for i in range(2):   # pushed once unclaimed, and never taken: the window stays full
            await w.send(fill, np.array([i]))
        await eventually(lambda: queued(p, fill) == 2, "the unclaimed fill was pushed")
        for i in range(2):
            await w.send(k, np.array([i]))
        await eventually(lambda: len(to_consumer.queue) == 2, "k's first values wait for credit")
        for i in range(2, 4):   # held: their claims are not due yet
            await w.send(k, np.array([i]))
        assert [int((await p.recv(k, timeout=5))[0]) for _ in range(4)] == [0, 1, 2, 3]


@pytest.mark.loop_timeout(20)
async def test_a_cancelled_close_closes_the_node_at_once(cluster) -> None:  # type: ignore[no-untyped-def]
    """close() lingers while a push waits for credit.  A caller that gives up on it (its
    wait_for timed out) must not leave the node half-closed: it kept its server, its
    heartbeats and its connections, and every later close(), ``async with``'s own too,
    waited forever."""
    async with pair(cluster, "send", push_window=MIB, worker={"linger": 10.0}) as (w, p):
        stalled = await stalled_push(w, p, key("full"))
        with pytest.raises((asyncio.TimeoutError, TimeoutError)):
            await asyncio.wait_for(w.close(), 0.2)
        assert w.state == "closed"
        with pytest.raises(rvz.Aborted, match=r"close\(\) was cancelled"):
            await stalled
        await asyncio.wait_for(w.close(), 5)   # at once: the node is closed
        on_p = p._core.routes.peer(w.id)
        await eventually(lambda: not on_p.live_connections(), "the consumer's side closed")


@pytest.mark.loop_timeout(20)
async def test_abort_during_close_ends_it_with_the_aborts_cause(cluster) -> None:  # type: ignore[no-untyped-def]
    """abort() while close() lingers: close() ends without finishing the node a second
    time, so what fails carries the abort's cause (close() put its own in its place)."""
    async with pair(cluster, "send", push_window=MIB, worker={"linger": 10.0}) as (w, p):
        stalled = await stalled_push(w, p, key("full"))
        closing = asyncio.ensure_future(w.close())
        await settle()
        cause = RuntimeError("given up")
        w.abort(cause)
        await asyncio.wait_for(closing, 2)
        with pytest.raises(rvz.Aborted) as failed:
            await stalled
        assert failed.value.__cause__ is cause
        with pytest.raises(rvz.Aborted) as later:
            await w.send(key("after"), np.arange(1))
        assert later.value.__cause__ is cause


@pytest.mark.loop_timeout(20)
async def test_calls_while_close_lingers_fail_with_node_closed(cluster) -> None:  # type: ignore[no-untyped-def]
    """Once close() began, a new call and a Recv-Driven batch that waited for hold room
    fail with NodeClosed, an Aborted, as they would on the closed node: shutdown code that
    catches Aborted missed the plain RvzError they raised.  (close() pushes the held values,
    which wakes the batch; its next item then found the node closing.)"""
    async with pair(cluster, "recv", hold_limit=64 << 10, push_window=64 << 10,
                    worker={"linger": 10.0}) as (w, p):
        await _linked(w, p)
        k = key("z")
        batch = asyncio.ensure_future(
            w.send_many([(k, np.full(16384, i, np.float32)) for i in range(40)]))
        await eventually(lambda: len(w._core.holding.hold_waiters) > 0, "the batch waits for hold room")
        closing = asyncio.ensure_future(w.close())
        await settle()
        assert w.state == "closing"
        with pytest.raises(rvz.NodeClosed, match="is closing"):
            await w.send(key("during"), np.arange(1))
        with pytest.raises(rvz.NodeClosed, match="is closing"):
            await w.recv(key("back", src=PS, dst=WORKER), timeout=1)
        with pytest.raises(rvz.Aborted):
            await asyncio.wait_for(batch, 5)
        w.abort()
        await asyncio.wait_for(closing, 5)
        assert float((await p.recv(k, timeout=5))[0]) == 0.0  # what was sent still arrived


@pytest.mark.loop_timeout(5)
async def test_recv_driven_close_gives_up_after_linger(cluster, caplog) -> None:  # type: ignore[no-untyped-def]
    w = await rvz.Node(cluster, "worker", 0, "recv",
                       **{**FAST, "linger": 0.3, "claim_timeout": None}).start()
    await w.send(key("unfetched"), np.arange(10))
    assert w._held_count == 1
    with caplog.at_level(logging.WARNING, logger="rvz"):
        await w.close()                    # nobody ever fetches it
    assert w.state == "closed" and w._held_count == 0
    assert any("1 values undelivered" in r.getMessage() for r in caplog.records)
    # The push close() made failed and was reported once, by rvz: asyncio must not report
    # it again, when the future is collected, as an exception nobody retrieved.
    failed = [d for d in w._closing_pushes if d.done() and not d.cancelled()]
    assert len(failed) == 1
    assert not failed[0]._log_traceback  # checked first: exception() below clears it
    assert isinstance(failed[0].exception(), rvz.Aborted)


@pytest.mark.loop_timeout(20)
async def test_unclaimed_held_values_are_pushed_during_close(cluster) -> None:  # type: ignore[no-untyped-def]
    async with rvz.Node(cluster, "ps", 0, "send", **FAST) as p:
        async with rvz.Node(cluster, "worker", 0, "recv",
                            **{**FAST, "linger": 10.0, "claim_timeout": 0.2}) as w:
            for i in range(3):
                await w.send(key("claimed"), np.array([i]))
        # the consumer waited locally and never asked; the values were pushed to it
        got = [int((await p.recv(key("claimed"), timeout=5))[0]) for _ in range(3)]
        assert sorted(got) == [0, 1, 2]


@pytest.mark.loop_timeout(20)
async def test_held_values_nobody_asks_for_are_pushed_at_claim_timeout(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "recv", claim_timeout=0.2) as (w, p):
        await _linked(w, p)
        k = key("unasked")
        for i in range(3):
            await w.send(k, np.array([i]))
        assert w._held_bytes > 0
        await eventually(lambda: w._held_bytes == 0 and queued(p, k) == 3,
                         "the held values were pushed to the consumer")
        assert [int((await p.recv(k, timeout=5))[0]) for _ in range(3)] == [0, 1, 2]


@pytest.mark.loop_timeout(20)
async def test_held_values_of_a_key_the_consumer_pulls_wait_claim_timeout_after_its_request(cluster) -> None:  # type: ignore[no-untyped-def]
    """A request that takes a held value marks its key as pulled: the values held with it
    stay held for claim_timeout after that request (its consumer is likely to ask for them
    too, and a push could overtake that answer), then are pushed, in order."""
    async with pair(cluster, "recv", claim_timeout=2.0) as (w, p):
        await _linked(w, p)
        k = key("pulled")
        for i in range(3):
            await w.send(k, np.array([i]))
        held = w._held_bytes
        assert int((await p.recv(k, timeout=5))[0]) == 0   # asked for and answered
        assert 0 < w._held_bytes < held
        await asyncio.sleep(0.5)  # ten heartbeats, a quarter of claim_timeout
        assert w._held_bytes > 0 and queued(p, k) == 0     # still held, none pushed
        await eventually(lambda: queued(p, k) == 2, "the held values were pushed", within=5.0)
        assert w._held_bytes == 0
        assert [int((await p.recv(k, mode="send", timeout=5))[0]) for _ in range(2)] == [1, 2]


@pytest.mark.loop_timeout(20)
async def test_the_claims_of_a_pulled_keys_taken_values_are_dropped_when_due(cluster) -> None:  # type: ignore[no-untyped-def]
    """Every held value leaves a claim, and a request takes the key's oldest value, not the
    claim.  Due while its consumer pulls the key, the claims of values taken since were put
    off again with the value still held: a stream of held values, always pulled, grew them
    by one a message, and the heartbeat re-inserted each (rvz-bench's Recv-Driven 64 B batch
    row stalled the producer's loop for ten seconds, and the consumer's heartbeat timed out)."""
    timeout = 10.0   # the heartbeat's own passes find nothing due here
    async with pair(cluster, "recv", claim_timeout=timeout) as (w, p):
        await _linked(w, p)
        k = key("pulled")
        await w.send(k, np.array([0]))
        for i in range(1, 102):   # one value always held, each recv takes the one before
            if i == 101:
                await asyncio.sleep(0.01)   # (uvloop's clock ticks in milliseconds)
            await w.send(k, np.array([i]))
            assert int((await p.recv(k, timeout=5))[0]) == i - 1
        core = w._core
        assert len(core.holding.claims[0, str(k)]) == 102   # a claim a value held
        asked = core.holding.asked[(0, str(k))]
        # The clock just before claim_timeout after the last request: the claims held
        # before the last value are due, and the key counts as pulled.
        w._push_unclaimed(asked + timeout - 1e-6)
        assert list(core.holding.claims) == [(0, str(k))], "the warm-up key's claim was kept"
        assert len(core.holding.claims[0, str(k)]) == 1, "the claims of values taken were kept"
        assert queued(p, k) == 0 and w._held_bytes > 0   # the held one stays held
        assert int((await p.recv(k, timeout=5))[0]) == 101


@pytest.mark.loop_timeout(30)
async def test_the_claims_pass_looks_only_at_keys_whose_claims_came_due(cluster) -> None:  # type: ignore[no-untyped-def]
    """Each heartbeat's claims pass looks at the keys whose time came, not at every key
    with held values (it walked them all: 100k keys held took each heartbeat 0.1-0.6 s).
    A key is looked at once its oldest claim is due: until then, the claims of its values
    taken since stay.  The keys of a consumer that is lost when they come due are set aside
    until it is back (they were looked at again at every heartbeat), then pushed to it."""
    timeout = 10.0   # the passes are run here by hand, at the times they are given
    slow = {**FAST, "heartbeat": 30.0, "peer_timeout": 60.0, "claim_timeout": timeout}
    keys = [key(f"held{i}") for i in range(3)]
    async with rvz.Node(cluster, "worker", 0, "recv", **slow) as w:
        core = w._core
        async with rvz.Node(cluster, "ps", 0, "recv", **slow) as p:
            await _linked(w, p)
            for k in keys:
                for i in range(2):
                    await w.send(k, np.array([i]))
            for k in keys:   # a request takes each key's oldest value
                assert int((await p.recv(k, timeout=5))[0]) == 0
            w._push_unclaimed(w._loop.time())   # none due
            for k in keys:
                assert len(core.holding.claims[0, str(k)]) == 2, "a key not due yet was looked at"
        peer = w._peers[("ps", 0)]
        await eventually(lambda: not peer.live_connections(), "the consumer is gone")
        later = w._loop.time() + 2 * timeout
        # due, and set aside: nobody to push to
        assert core.holding.due_claims(later, core.routes.route) == []
        assert [len(core.holding.claims[0, str(k)]) for k in keys] == [1, 1, 1]
        assert core.holding.due_claims(later + timeout, core.routes.route) == [], \
            "the lost consumer's keys were looked at again"
        async with rvz.Node(cluster, "ps", 0, "recv", **slow) as p:
            await w.send(key("again"), np.array([0]))
            assert int((await p.recv(key("again"), timeout=5))[0]) == 0   # it is back
            w._push_unclaimed(w._loop.time() + 3 * timeout)
            got = [int((await p.recv(k, mode="send", timeout=5))[0]) for k in keys]
            assert got == [1, 1, 1] and w._held_count == 0


@pytest.mark.loop_timeout(20)
async def test_held_values_of_a_pulled_key_wait_for_credit_and_a_request_takes_them_first(cluster) -> None:  # type: ignore[no-untyped-def]
    """Past that time, a held value of a pulled key is pushed like any other, and behind a
    full push window it waits for credit.  The consumer's next request (which needs no
    credit) is answered with it, not with a later value: the key's values stay in order."""
    window = 4096
    async with pair(cluster, "recv", claim_timeout=0.2, push_window=window) as (w, p):
        await _linked(w, p)
        k, filler = key("pulled"), key("filler")
        for i in range(3):
            await w.send(k, np.array([i]))
        assert int((await p.recv(k, timeout=5))[0]) == 0   # asked for: the key is pulled
        peer = w._peers[("ps", 0)]
        blocked = asyncio.ensure_future(w.send(filler, np.zeros(window, np.uint8), mode="send"))
        await eventually(lambda: peer.credit < 64, "the window is spent")
        await eventually(lambda: queued(w, k) == 0, "the pulled values were pushed",
                         within=5.0)
        assert queued(p, k) == 0 and len(peer.queue) == 2   # waiting for credit, in order
        assert w._held_count == 2   # and counted against hold_limit until they are written
        assert [int((await p.recv(k, mode="recv", timeout=5))[0]) for _ in range(2)] == [1, 2]
        assert (await p.recv(filler, timeout=5)).nbytes == window
        await asyncio.wait_for(blocked, 5)


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.loop_timeout(20)
async def test_a_consumer_waiting_locally_gets_a_pulled_value_behind_a_full_window(cluster, batch) -> None:  # type: ignore[no-untyped-def]
    """A model-based probe's hang: the consumer once asked for both keys, then waits
    locally (``mode="send"``).  Their values come as unclaimed pushes; one of ``a`` stays
    untaken in the consumer's table, and ``b``'s next value is larger than the credit left.
    Kept held until it could be written at once, it never went: nothing returned credit,
    and nothing asked.  Now it waits for credit, the producer says so (CREDIT 0), and the
    consumer, whose window is full of values nobody takes, asks for it."""
    window = 16384
    async with pair(cluster, "recv", claim_timeout=0.2, push_window=window) as (w, p):
        a, b = key("a"), key("b")
        for i in range(3):
            await w.send(a, np.full(4, i, np.float32))
        for i in range(2):
            await w.send(b, np.full(window, i, np.float32))   # four windows each
        assert int((await p.recv(a, timeout=5))[0]) == 0
        assert int((await p.recv(b, timeout=5))[0]) == 0
        if batch:
            got = await p.recv_many([a, b], mode="send", timeout=5)
        else:
            got = [await p.recv(a, mode="send", timeout=5), await p.recv(b, mode="send", timeout=5)]
        assert [int(v[0]) for v in got] == [1, 1]
        assert int((await p.recv(a, timeout=5))[0]) == 2


@pytest.mark.loop_timeout(20)
async def test_a_send_waiting_for_hold_room_keeps_its_turn(cluster) -> None:  # type: ignore[no-untyped-def]
    """A Recv-Driven value near ``hold_limit`` waits until the values held leave room.
    Smaller sends that come after it wait behind it: letting them in while they fit kept
    a value or two held at all times, and the large one waited for ever (a model-based
    probe: a stream of small values on one key starved a large one on another)."""
    limit = 8192
    async with pair(cluster, "recv", hold_limit=limit) as (w, p):
        await _linked(w, p)
        a, b = key("a"), key("b")
        await w.send(a, np.array([0]))                             # held
        large = asyncio.ensure_future(w.send(b, np.zeros(limit - 64, np.uint8)))  # fits alone
        await settle()
        assert not large.done()                                   # no room beside a#0
        later = asyncio.ensure_future(w.send(a, np.array([1])))  # would fit beside a#0
        await settle()
        assert not later.done(), "a later send went ahead of the one waiting for room"
        assert int((await p.recv(a, timeout=5))[0]) == 0         # room: the large one goes
        await asyncio.wait_for(large, 5)
        assert not later.done()                                   # no room beside it
        assert (await p.recv(b, timeout=5)).nbytes == limit - 64
        await asyncio.wait_for(later, 5)
        assert int((await p.recv(a, timeout=5))[0]) == 1


@pytest.mark.parametrize("mode", ["recv", "send"])
@pytest.mark.loop_timeout(5)
async def test_close_is_not_held_by_a_dial_to_a_dead_peer(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    p = await rvz.Node(cluster, "ps", 0, mode,
                       **{**FAST, "linger": 30.0, "connect_timeout": 30.0}).start()
    task = await pending(p.recv(key("from_nobody")), 0.2)  # keeps dialling the absent worker
    task.cancel()
    await p.close()   # nothing to deliver: must not wait out the 30 s linger
    assert p.state == "closed"


@pytest.mark.loop_timeout(15)
async def test_close_twice_and_close_before_start(cluster) -> None:  # type: ignore[no-untyped-def]
    never = rvz.Node(cluster, "ps", 0)
    await never.close()
    assert never.state == "closed"
    async with pair(cluster, "send") as (w, p):
        await w.send(key(), np.arange(2))
        assert (await p.recv(key(), timeout=5)).tolist() == [0, 1]
        await asyncio.gather(w.close(), w.close())
        assert w.state == "closed"
        with pytest.raises(rvz.Aborted):
            await w.send(key(), np.arange(2))


@pytest.mark.parametrize("next_waiter", [True, False])
@pytest.mark.loop_timeout(20)
async def test_cancel_after_delivery_keeps_the_push_window_whole(cluster, next_waiter) -> None:  # type: ignore[no-untyped-def]
    """A pushed value delivered to a recv that is cancelled before it runs goes to the next
    waiter (or back to the queue); either way the producer gets its window back once the
    value is consumed, so repeated races cannot shrink the window until pushes stall."""

    window = 16 * (SIZE + 1024)
    async with pair(cluster, "send", push_window=window) as (w, p):
        # The producer's link is up before the reads are watched: a push on a connection
        # made later would not be seen by ``check`` (and the recv would simply complete).
        await w.send(key("warm"), array(1))
        assert (await p.recv(key("warm"), timeout=5))[0] == 1
        k = key("raced")
        for i in range(6):
            first = await pending(p.recv(k, timeout=10), 0.02)
            second = await pending(p.recv(k, timeout=10), 0.02) if next_waiter else None
            table = p._tables[0]
            before = table.waiting(str(k))
            fired: list[bool] = []

            def check(first=first, table=table, before=before, fired=fired) -> None:  # type: ignore[no-untyped-def]
                if table.waiting(str(k)) < before and not fired:
                    fired.append(True)
                    first.cancel()  # the value reached first's waiter: cancelled before it runs

            with after_each_read([c for c in p._conns if not c.closed], check):
                await w.send(k, array(i))
                with pytest.raises(asyncio.CancelledError):
                    await first
            got = await (second if second is not None else p.recv(k, timeout=5))
            assert got[0] == i
        credit = w._peers[("ps", 0)]
        await eventually(lambda: credit.credit == window,
                         f"the producer's window is whole again (credit {credit.credit} of {window})")


@pytest.mark.loop_timeout(15)
async def test_a_value_given_back_survives_the_heartbeat_dropping_empty_tables(cluster) -> None:  # type: ignore[no-untyped-def]
    """The heartbeat drops step tables that are empty.  A value delivered to a recv that is
    cancelled before it runs leaves its table empty until the recv gives it back; a
    heartbeat that runs in between must not drop that table, or the value is given back to
    a table nobody reads and lost (seen once in CI)."""

    async with pair(cluster, "send") as (w, p):
        # The producer's link is up before the reads are watched: a push on a connection
        # made later would not be seen by ``check`` (and the recv would simply complete).
        await w.send(key("warm"), array(1))
        assert (await p.recv(key("warm"), timeout=5))[0] == 1
        k = key("swept")
        first = await pending(p.recv(k, timeout=10), 0.02)
        table = p._tables[0]

        fired: list[bool] = []

        def check() -> None:
            if table.waiting(str(k)) == 0 and not fired:  # delivered to first's waiter ...
                fired.append(True)
                first.cancel()               # ... first is cancelled ...
                p._tick_handle.cancel()      # ... and a heartbeat runs before it wakes
                p._tick()

        with after_each_read([c for c in p._conns if not c.closed], check):
            await w.send(k, array(7))
            with pytest.raises(asyncio.CancelledError):
                await first
        got = await p.recv(k, timeout=5)
        assert got[0] == 7


@pytest.mark.parametrize("mode", ["recv", "send"])
@pytest.mark.loop_timeout(15)
async def test_cleanup_by_a_producer_that_never_used_the_step(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    """The consumer waits on step 5; the producer fails before sending anything in it and
    cleans the step up.  The consumer must not hang."""

    async with pair(cluster, mode) as (w, p):
        await w.send(key("warmup"), np.arange(1))          # the two are connected
        assert (await p.recv(key("warmup"), timeout=5)).tolist() == [0]
        waiting = await pending(p.step(5).recv(key("never_sent"), timeout=10))
        await w.step(5).cleanup("producer failed in step 5")
        with pytest.raises(rvz.Aborted) as info:
            await waiting
        assert "producer failed in step 5" in str(info.value)
        assert str(info.value).count(str(key("never_sent"))) == 1, str(info.value)


@pytest.mark.parametrize("by", ["producer", "consumer"])
@pytest.mark.loop_timeout(15)
async def test_cleanup_fails_a_send_driven_send_still_waiting_for_credit(cluster, by) -> None:  # type: ignore[no-untyped-def]
    """Sends of step 6 fill the push window (the consumer takes none) and the next one waits
    for credit; then either side cleans the step up.  That send fails with ``Aborted``
    naming its key, and its value never leaves: a step-0 send queued behind it goes, and it
    is the only value the consumer gets."""
    async with pair(cluster, "send", push_window=MIB) as (w, p):
        await w.send(key("warmup"), np.arange(1))  # the two are connected
        assert (await p.recv(key("warmup"), timeout=5)).tolist() == [0]
        k = key("stalled")
        stalled = await until_one_waits(lambda i: w.step(6).send(k, array(i)))
        behind = asyncio.ensure_future(w.send(key("behind"), np.arange(3)))
        await settle()
        assert not behind.done()  # it keeps its place behind the stalled send
        await (w if by == "producer" else p).step(6).cleanup("step 6 failed")
        with pytest.raises(rvz.Aborted) as info:
            await asyncio.wait_for(stalled, 5)
        assert "step 6 failed" in str(info.value) and str(k) in str(info.value)
        await asyncio.wait_for(behind, 5)
        assert (await p.recv(key("behind"), timeout=5)).tolist() == [0, 1, 2]
        with pytest.raises(rvz.Aborted):
            await p.step(6).recv(k, timeout=1)
        assert w._core.routes.peer(p.id).queue == collections.deque()


@pytest.mark.parametrize("mode", ["recv", "send"])
@pytest.mark.loop_timeout(20)
async def test_send_timeout_under_backpressure_means_not_sent(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    """A send that times out waiting for backpressure did not send: the value never arrives,
    the values before and after it do, in order."""

    limits = {"push_window": MIB} if mode == "send" else {"hold_limit": MIB, "claim_timeout": None}
    async with pair(cluster, mode, **limits) as (w, p):
        k = key("patience")
        sent = []
        i = 0
        while True:   # fill the window / hold limit until a send has to wait
            try:
                await w.send(k, array(i), timeout=0.2)
            except TimeoutError as exc:
                assert str(k) in str(exc)
                break
            sent.append(i)
            i += 1
            assert i < 50, "backpressure never applied"
        timed_out = i
        after = list(range(timed_out + 1, timed_out + 4))

        async def send_more() -> None:
            for j in after:
                await w.send(k, array(j))

        more = asyncio.ensure_future(send_more())
        got = [int((await p.recv(k, timeout=5))[0]) for _ in range(len(sent) + len(after))]
        await more
        assert got == sent + after                  # in order, and nothing lost ...
        with pytest.raises(TimeoutError):
            await p.recv(k, timeout=0.3)            # ... and the timed-out value never comes


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.loop_timeout(30)
async def test_a_window_full_of_one_key_does_not_block_a_recv_of_another(cluster, transport) -> None:  # type: ignore[no-untyped-def]
    # Send-Driven, the consumer waits for key b while key a's values, which it takes only
    # afterwards, fill the whole push window: b's value must still come (asked for), every
    # value of both keys arrives once and in order, and the producer's sends all complete.
    # Over shm (every value through the channel), the producer's request for credit (TCP)
    # may arrive before the values that fill the window: the consumer, holding none yet,
    # waits for them to arrive untaken before it asks (Core.check_stuck).
    kw: dict[str, Any] = {}
    if transport == "shm":
        kw = {"transport": provider_or_skip("shm"), "onesided": {"tcp_max": -1, "chunk_size": 4 << 20}}
    async with pair(cluster, "send", push_window=MIB, **kw) as (w, p):
        ka, kb = key("first"), key("second")

        async def produce(k: rvz.Key, first: int, count: int) -> None:
            for i in range(count):
                await w.send(k, array(first + i))

        # Two producer tasks: a's sends fill the window first, b's wait behind them.
        producer = asyncio.gather(produce(ka, 0, COUNT), produce(kb, 100, 3))
        try:
            for i in range(3):
                got = await p.recv(kb, timeout=10)
                assert got[0] == 100 + i and got[-1] == 100 + i
            # The window stayed the bound: a's values were not all pushed meanwhile.
            assert queued(p, ka) <= MIB // SIZE + 2
            for i in range(COUNT):
                got = await p.recv(ka, timeout=10)
                assert got[0] == i and got[-1] == i
            await asyncio.wait_for(producer, 10)
        finally:
            producer.cancel()
        assert queued(p, ka) == 0 and queued(p, kb) == 0


@pytest.mark.loop_timeout(30)
async def test_a_batch_waiting_behind_a_full_window_is_asked_for(cluster) -> None:  # type: ignore[no-untyped-def]
    # The same with recv_many: the batch waits for keys whose pushes are stuck behind a
    # window full of another key's values.
    async with pair(cluster, "send", push_window=MIB) as (w, p):
        kfill = key("fill")
        lanes = [key(f"lane{j}") for j in range(3)]

        async def fill() -> None:
            for i in range(COUNT):
                await w.send(kfill, array(i))

        producer = asyncio.gather(
            fill(), w.send_many([(k, array(200 + j)) for j, k in enumerate(lanes)]))
        try:
            got = await p.recv_many(lanes, timeout=10)
            assert [int(v[0]) for v in got] == [200, 201, 202]
            for i in range(COUNT):
                assert (await p.recv(kfill, timeout=10))[0] == i
            await asyncio.wait_for(producer, 10)
        finally:
            producer.cancel()


PING, PONG = key("ping", src=PS, dst=WORKER), key("pong")


@contextlib.asynccontextmanager
async def recv_driven_echo(cluster: Any) -> AsyncIterator[tuple[Any, Any]]:
    """Two Recv-Driven nodes ``(p, conn)``: ``conn`` the connection ``p`` dialled (both use
    it), and a task on the other node that answers each ``PING`` with a ``PONG`` of the same
    value, until a negative one, which the block's end sends.  No heartbeat within the
    test: a ping or a credit return of its own would be a lone frame between exchanges.

    The block starts once both ends have learnt the exchange: a round in which each wrote
    its answer and its next request in one write.  Until then an end may write them apart,
    and when the kernel hands the other end the two writes in two reads (it may, on a
    loaded machine) that end learns later too; how many rounds that takes is the
    machine's, not rvz's."""
    async with pair(cluster, "recv", heartbeat=5.0, peer_timeout=30.0) as (w, p):
        async def echo() -> None:
            while True:
                value = await w.recv(PING, timeout=10)
                await w.send(PONG, value)
                if value[0] < 0:
                    return

        await w.send(key("warmup"), np.arange(1))
        await p.recv(key("warmup"), timeout=5)
        conn = p._peers[("worker", 0)].link
        assert conn is not None
        other = w._peers[("ps", 0)].link
        assert other is not None
        echoing = asyncio.ensure_future(echo())
        try:
            peer = p._peers[("worker", 0)]
            together = [[_impl.codec.DATA, _impl.codec.REQUEST]]
            for i in range(1000, 1020):
                ours, ours_transport = record_writes(conn)
                theirs, theirs_transport = record_writes(other)
                try:
                    await p.send(PING, np.array([i]))
                    assert (await p.recv(PONG, timeout=5))[0] == i
                    await eventually(lambda: any(c.parked for c in peer.live_connections()),
                                     "the echo asked for the next ping")
                finally:
                    conn.transport, other.transport = ours_transport, theirs_transport
                if ours == together and theirs == together:
                    break
            else:
                raise AssertionError(f"never an exchange in one write: {ours}, {theirs}")
            yield p, conn
            await p.send(PING, np.array([-1]))
            await p.recv(PONG, timeout=5)
            await asyncio.wait_for(echoing, 5)
        finally:
            echoing.cancel()


@pytest.mark.loop_timeout(20)
async def test_recv_driven_exchange_writes_answer_and_next_request_together(cluster) -> None:  # type: ignore[no-untyped-def]
    # A node that answers a request and then asks for its reply (Recv-Driven ping-pong)
    # writes the two frames in one write once it has seen that pattern: not the answer at
    # once and the request at the end of the iteration, which costs a second write here and
    # a second wake-up at the peer.  That write leaves as the recv that queued the request
    # suspends, not one loop iteration later.  A lone frame goes back to leaving at once.
    async with recv_driven_echo(cluster) as (p, conn):
        peer = p._peers[("worker", 0)]

        def asked() -> bool:
            return any(c.parked for c in peer.live_connections())

        early: list[bool] = []
        written, transport = record_writes(conn, early=early)
        try:
            rounds = 12
            for i in range(rounds):
                # The echo's request for this ping is parked here: the send answers it.
                await eventually(asked, "the echo asked for a ping")
                await p.send(PING, np.array([i]))
                assert (await p.recv(PONG, timeout=5))[0] == i
            data = _impl.codec.DATA
            request = _impl.codec.REQUEST
            # Every exchange writes the answer and the next request together, in one write
            assert written == [[data, request]] * rounds, written
            # ... from within the recv call: its iteration's flush had not run yet
            assert early == [True] * rounds, (written, early)
            # A lone answer (no request after it in its iteration): held once, as the
            # last iteration wrote two frames, and written by the flush after it, in the
            # next loop pass; the next lone answer leaves within the send call.
            for i in (100, 101):
                await eventually(asked, "the echo asked for a ping")
                before = len(written)
                await p.send(PING, np.array([i]))
                assert (len(written) > before) == (i == 101), written
                await settle(2)
                assert written[before:] == [[data]], written
                assert (await p.recv(PONG, timeout=5))[0] == i
        finally:
            conn.transport = transport


@pytest.mark.loop_timeout(20)
async def test_the_flush_ending_a_recv_driven_group_takes_no_loop_pass_of_its_own(cluster) -> None:  # type: ignore[no-untyped-def]
    # An answer and the next request leave together from the recv's call; the flush that
    # ends their group was scheduled by the read that woke the task (``flush_after_read``),
    # so it runs in that same loop pass: the next pass finds it done.  Scheduled by the
    # held answer, from the task, it cost a pass of its own (a poll of the kernel) on every
    # message of a Recv-Driven ping-pong.
    async with recv_driven_echo(cluster) as (p, conn):
        loop = asyncio.get_running_loop()
        written, transport = record_writes(conn)
        passes: list[tuple[int, bool]] = []  # per loop pass: writes so far, a flush pending
        ticking = True

        def tick() -> None:
            passes.append((len(written), bool(conn._flush_scheduled)))
            if ticking:
                loop.call_soon(tick)

        tick()
        try:
            for i in range(12):
                await p.send(PING, np.array([i]))
                assert (await p.recv(PONG, timeout=5))[0] == i
        finally:
            ticking = False
            conn.transport = transport
    group = [_impl.codec.DATA, _impl.codec.REQUEST]
    assert written == [group] * 12, written
    groups = range(12)
    # the first pass that saw each group's write: its flush had run
    after = [next(pending for seen, pending in passes if seen > n) for n in groups]
    assert after == [False] * len(groups), (written, passes)


@pytest.mark.loop_timeout(20)
async def test_a_lone_push_leaves_at_once_without_an_end_of_iteration_flush(cluster) -> None:  # type: ignore[no-untyped-def]
    # A frame that leaves alone schedules no end-of-iteration flush (a 64 B ping-pong paid
    # that callback on every message).  The next frame within ALONE_NS (1 ms) of it, with no
    # word from the peer since, waits for the flush it schedules, as the rest of a burst
    # did; a read from the peer lets the next frame leave alone again at once.
    async with pair(cluster, "send", heartbeat=5.0, peer_timeout=30.0) as (w, p):
        back = key("back", src=PS, dst=WORKER)
        await w.send(key("warmup"), np.arange(1))
        await p.recv(key("warmup"), timeout=5)
        await p.send(back, np.arange(1))        # both ways over the connection w dialled
        await w.recv(back, timeout=5)
        conn = w._peers[("ps", 0)].link
        assert conn is not None
        written, transport = record_writes(conn)
        data = _impl.codec.DATA_MANY
        try:
            await asyncio.sleep(0.01)              # longer than ALONE_NS since w last wrote
            await w.send(key(), np.array([1]))
            assert written == [[data]]             # within the call ...
            assert not conn._flush_scheduled       # ... and nothing scheduled after it
            # Within ALONE_NS of the first push, the second must come: an hour here, as a
            # process paused by a loaded machine between two lines can lapse 1 ms.  (Set
            # after the first: a frame w wrote alone before it would hold it for an hour.)
            default, conn.alone_ns = conn.alone_ns, 3600 * 10**9
            await w.send(key(), np.array([2]))          # the same iteration, within alone_ns
            assert written == [[data]] and conn._flush_scheduled
            conn.alone_ns = default
            await eventually(lambda: len(written) == 2, "the flush wrote the second push")
            assert written[1] == [data] and not conn._flush_scheduled
            # The second push was a group of two: the next iteration's first frame waits
            # for its flush too (``_hold_first``), and that one wrote a single frame.
            await w.send(key(), np.array([3]))
            assert len(written) == 2
            await eventually(lambda: len(written) == 3, "the flush wrote the third push")
            # The third wrote one frame: the next leaves alone again, and after a read from
            # the peer, so does the one after it (ALONE_NS or not).
            await w.send(key(), np.array([4]))
            assert len(written) == 4 and not conn._flush_scheduled
            await p.send(back, np.arange(1))
            await w.recv(back, timeout=5)
            await w.send(key(), np.array([5]))
            assert len(written) == 5 and not conn._flush_scheduled
        finally:
            conn.transport = transport
        assert [int((await p.recv(key(), timeout=5))[0]) for _ in range(5)] == [1, 2, 3, 4, 5]


@pytest.mark.loop_timeout(20)
async def test_the_sends_of_one_iteration_are_packed_into_data_many_frames(cluster) -> None:  # type: ignore[no-untyped-def]
    # Send-Driven pushes that follow each other in the write buffer go as DATA_MANY frames,
    # one per run of one step: a push of another step, or any other frame in between, ends
    # the run. Every key still gets its values in order, in every step.
    a, b = key("a"), key("b")
    async with pair(cluster, "send", heartbeat=5.0, peer_timeout=30.0) as (w, p):
        await w.send(a, np.array([-1]))
        assert (await p.recv(a, timeout=5))[0] == -1   # linked
        conn = w._peers[("ps", 0)].link
        assert conn is not None
        written: list[bytes] = []
        _, transport = record_writes(conn, written)
        # No push leaves alone for being over 1 ms after the one before it, as one may when
        # a loaded machine pauses the process between two sends.
        default, conn.alone_ns = conn.alone_ns, 3600 * 10**9
        try:
            await asyncio.sleep(0)
            plan = [(a, 0)] * 3 + [(b, 0)] * 3 + [(a, 7), (b, 7)] + [(a, 0), (b, 0)]
            for i, (k, step) in enumerate(plan):  # no await in between that suspends
                await w.send(k, np.array([i]), step=step)
            await asyncio.sleep(0)   # the end of the iteration flushes the rest
        finally:
            conn.transport, conn.alone_ns = transport, default
        frames = [(ftype, *MANY_FIXED.unpack_from(data, meta))
                  for data in written for ftype, meta in frame_starts(data)]
        many = _impl.codec.DATA_MANY
        assert all(f[0] == many for f in frames), frames
        # by step, in order: one run of step 0 (the first push may leave alone, at once),
        # one of step 7, one of step 0 again
        runs: list[list[int]] = []
        for _, s, c in frames:
            if runs and runs[-1][0] == s:
                runs[-1][1] += c
            else:
                runs.append([s, c])
        assert runs == [[0, 6], [7, 2], [0, 2]], frames
        assert len(frames) <= 4, frames
        for step in (0, 7):
            for k in (a, b):
                expected = [i for i, (kk, s) in enumerate(plan) if kk is k and s == step]
                got = await p.recv_many([k] * len(expected), step=step, timeout=5)
                assert [int(x[0]) for x in got] == expected


def peer_stats(node: rvz.Node, other: rvz.Node) -> dict[str, Any]:
    return dict(node.stats()["peers"][other.name])


def over(transport: str) -> dict[str, Any]:
    """``pair``'s options for ``transport``: none for TCP, shm's (or skip without it)."""
    return {"transport": provider_or_skip("shm")} if transport == "shm" else {}


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.loop_timeout(30)
async def test_more_recvs_than_the_producer_parks_wait_their_turn_and_all_arrive(cluster, transport) -> None:  # type: ignore[no-untyped-def]
    # The producer parks at most 8 requests per connection (max_parked, said in its HELLO)
    # and closes a connection that sends more.  A consumer waiting for 80 values it has not
    # sent yet (a recv_many of 50 keys and 30 recvs) sends 8 requests and holds the rest
    # back; each answer lets one more go.  Every value arrives, in order; nothing is lost.
    async with pair(cluster, "recv", worker={"max_parked": 8}, **over(transport)) as (w, p):
        await w.send(key("linked"), array(0))
        await p.recv(key("linked"), timeout=10)
        keys = [key(f"batch{i}") for i in range(50)]
        batch = asyncio.ensure_future(p.recv_many(keys, timeout=20))
        singles = [asyncio.ensure_future(p.recv(key("single"), timeout=20)) for _ in range(30)]
        await eventually(lambda: peer_stats(p, w)["outstanding_requests"] == 80,
                         "the consumer asks for all 80 values")
        await eventually(lambda: peer_stats(w, p)["parked_requests"] == 8,
                         "the producer parks 8 requests")
        assert peer_stats(p, w)["held_back_requests"] == 72
        await settle()
        assert peer_stats(w, p)["parked_requests"] == 8   # and never more
        for i in range(50):
            await w.send(keys[i], np.full(4, i))
        for i in range(30):
            await w.send(key("single"), np.full(4, 100 + i))
        assert [int(v[0]) for v in await batch] == list(range(50))
        assert [int((await s)[0]) for s in singles] == [100 + i for i in range(30)]
        stats = peer_stats(p, w)
        assert stats["held_back_requests"] == 0 and stats["outstanding_requests"] == 0
        assert stats["state"] == "connected"


@pytest.mark.loop_timeout(30)
async def test_held_back_recvs_that_time_out_do_not_pile_up(cluster) -> None:  # type: ignore[no-untyped-def]
    # Recvs that keep timing out behind a producer that parks no more leave their requests
    # in the held-back queue only until it is swept; a request that then fits still goes.
    async with pair(cluster, "recv", worker={"max_parked": 2}) as (w, p):
        await w.send(key("linked"), array(0))
        await p.recv(key("linked"), timeout=10)
        parked = [asyncio.ensure_future(p.recv(key(f"parked{i}"), timeout=20)) for i in range(2)]
        await eventually(lambda: peer_stats(w, p)["parked_requests"] == 2, "two parked")
        peer = p._peers[w.id]
        for _ in range(3000):
            with pytest.raises(TimeoutError):
                await p.recv(key("never"), timeout=0.0001)
        # The producer was never sent a third request (it would have closed the connection,
        # and the two parked recvs would have failed with PeerLost).
        assert not any(f.done() for f in parked)
        assert peer_stats(w, p)["parked_requests"] == 2
        assert len(peer.held_back) <= 1024 + 1, len(peer.held_back)
        assert peer_stats(p, w)["held_back_requests"] == 0
        late = asyncio.ensure_future(p.recv(key("late"), timeout=20))
        await w.send(key("parked0"), array(1))         # room for one: "late" is asked for
        assert int((await parked[0])[0]) == 1
        await w.send(key("late"), array(2))
        assert int((await late)[0]) == 2
        await w.send(key("parked1"), array(3))
        assert int((await parked[1])[0]) == 3
        assert not peer.held_back and not peer.asking


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.loop_timeout(30)
async def test_cancelled_requests_are_forgotten_once_the_producer_dropped_them(cluster, transport) -> None:  # type: ignore[no-untyped-def]
    # Each Recv-Driven recv that times out cancels its request.  The consumer remembers the
    # id, since an answer may cross the CANCEL; it kept every id until a cap of 65536,
    # though the producer had dropped the parked request and no answer would ever come.
    # Now the producer says so (ERROR "cancelled") and the consumer forgets it.
    async with pair(cluster, "recv", **over(transport)) as (w, p):
        await w.send(key("linked"), array(0))
        await p.recv(key("linked"), timeout=10)
        core = p._core
        for _ in range(300):
            with pytest.raises(TimeoutError):
                await p.recv(key("never"), timeout=0.0005)
        await eventually(lambda: peer_stats(w, p)["parked_requests"] == 0, "all dropped")
        await eventually(lambda: not core.requests.cancelled, "every cancelled id forgotten")
        assert len(core.requests.cancel_order) <= 2 * 1024 + 1, len(core.requests.cancel_order)
        # An answer that crosses its CANCEL is still taken as an answer: the surplus value
        # waits for the next recv (a push beyond the window would close the connection).
        late = asyncio.ensure_future(p.recv(key("late"), timeout=10))
        await eventually(lambda: peer_stats(w, p)["parked_requests"] == 1, "parked")
        await w.send(key("late"), array(1))
        late.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await late
        assert int((await p.recv(key("late"), timeout=10))[0]) == 1
        await eventually(lambda: not core.requests.cancelled, "the crossed answer settles its id")
        assert peer_stats(p, w)["state"] == "connected"


@pytest.mark.loop_timeout(30)
async def test_a_producer_that_parks_nothing_is_not_asked_and_pushes_at_claim_timeout(cluster) -> None:  # type: ignore[no-untyped-def]
    # max_parked=0: the consumer never sends that producer a request (it would close the
    # connection); its held values reach the recvs at claim_timeout, pushed.
    async with pair(cluster, "recv", worker={"max_parked": 0}) as (w, p):
        await w.send(key("linked"), array(0))  # held, then pushed: nothing was asked
        await p.recv(key("linked"), timeout=10)
        got = asyncio.ensure_future(p.recv_many([key("a"), key("b")], timeout=20))
        one = asyncio.ensure_future(p.recv(key("c"), timeout=20))
        await eventually(lambda: peer_stats(p, w)["held_back_requests"] == 3, "3 held back")
        await w.send(key("a"), array(1))
        await w.send(key("b"), array(2))
        await w.send(key("c"), array(3))
        assert [int(v[0]) for v in await got] == [1, 2]
        assert int((await one)[0]) == 3
        assert peer_stats(w, p)["parked_requests"] == 0
        assert peer_stats(p, w)["state"] == "connected"


@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.loop_timeout(20)
async def test_a_send_cancelled_as_its_wait_ends_stays_cancelled(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    """A send with a timeout waits for the push window (Send-Driven) or for room under
    hold_limit (Recv-Driven).  Its task is cancelled in the read that ends the wait, before
    the send runs again (a TaskGroup sibling failed, an ``asyncio.timeout`` expired): the
    cancellation must reach the task.  ``asyncio.wait_for`` before Python 3.12 returned
    instead and dropped it, so the send went on (and a task in a loop of sends ran on)."""

    limits = {"push_window": 2 * (SIZE + 1024)} if mode == "send" else {
        "hold_limit": 2 * (SIZE + 1024), "claim_timeout": None}
    async with pair(cluster, mode, **limits) as (w, p):
        k = key("cut")
        sends = asyncio.ensure_future(w.send(k, array(0)))
        await sends
        if mode == "recv":  # the consumer is linked, so the request below reads at once
            await w.send(k, array(1))
            assert (await p.recv(k, timeout=5))[0] == 0
        waiting = await until_one_waits(lambda i: w.send(k, array(10 + i), timeout=10))
        fired: list[bool] = []

        def ended() -> bool:  # the wait is over: the queued push left / a held value went
            if mode == "send":
                return w.stats()["peers"]["/job:ps/replica:0/task:0"]["queued_pushes"] == 0
            return w.stats()["held"]["values"] < held

        held = w.stats()["held"]["values"]

        def check() -> None:
            if not fired and not waiting.done() and ended():
                fired.append(True)
                waiting.cancel()

        with after_each_read([c for c in w._conns if not c.closed], check):
            p_recv = asyncio.ensure_future(p.recv(k, timeout=5))
            await eventually(lambda: bool(fired), "the wait ended in a read")
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await p_recv

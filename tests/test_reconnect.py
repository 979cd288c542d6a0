"""Exactly-once delivery across a connection reset between two live processes.

A connection that breaks (reset, or closed without BYE) while both nodes live is made again,
and what was in flight on it is neither lost nor delivered twice: every value a producer
numbered and the consumer did not acknowledge is sent again, the consumer drops the copies
it has, and its requests on the broken connection are asked again.  Each test breaks the
producer's link (or the consumer's) right after sends that returned, several times in a row.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import pytest

import rvz
from rvz import _impl
from rvz.errors import TransportError
from rvz.onesided import shm

from .conftest import PS, WORKER, eventually, key, pair, provider_or_skip

SIZE = 4096  # bytes of each value: small values, packed into DATA_MANY frames
# Every value through the one-sided channel: inline messages, slots, destinations.
ONESIDED = {"tcp_max": -1}


def value(i: int, size: int = SIZE) -> np.ndarray:
    return np.full(size // 8, i, dtype=np.int64)


async def reset(node: rvz.Node, peer: tuple[str, int]) -> list[Any]:
    """Break every connection ``node`` has to ``peer`` as a reset would (once it has one)."""
    await eventually(lambda: peer in node._peers and any(
        c.ready for c in node._peers[peer].live_connections()), f"{node.name} connected to {peer}")
    conns = [c for c in node._peers[peer].live_connections() if c.ready]
    for conn in conns:
        conn.fail(ConnectionResetError("reset by the test"))
    return conns


async def relinked(node: rvz.Node, peer: tuple[str, int], broken: list[Any]) -> None:
    """Wait until ``node`` has a ready connection to ``peer`` other than ``broken``."""
    state = node._peers[peer]
    await eventually(lambda: any(c.ready and c not in broken for c in state.live_connections()),
                     f"{node.name} connected to {peer} again")


@pytest.mark.parametrize("side", ["producer", "consumer"])
@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.loop_timeout(60)
async def test_values_in_flight_survive_resets(cluster, mode: str, side: str) -> None:  # type: ignore[no-untyped-def]
    """Bursts of sends, each followed by a reset of the link: every value arrives once,
    in order (the defect this guards against lost half of them, silently)."""
    await stream_across_resets(cluster, mode, side, 4, 252, SIZE)


@pytest.mark.parametrize("size", [SIZE, 300 << 10])
@pytest.mark.parametrize("side", ["producer", "consumer"])
@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.loop_timeout(60)
async def test_values_in_flight_on_a_one_sided_channel_survive_resets(  # type: ignore[no-untyped-def]
        cluster, mode: str, side: str, size: int) -> None:
    """The same over shm, every value through the channel (inline, in slots, or written
    into the destination a Recv-Driven consumer offered): each carries its number."""
    await stream_across_resets(cluster, mode, side, 3, 40, size,
                               transport=provider_or_skip("shm"), onesided=ONESIDED)


async def stream_across_resets(cluster: rvz.ClusterSpec, mode: str, side: str, rounds: int,
                               burst: int, size: int, nodes: dict[str, rvz.Node] | None = None,
                               **options: Any) -> None:
    """Send ``rounds`` bursts of ``burst`` values, resetting ``side``'s connections after
    each; the consumer must get every value once, in order.  ``nodes``, if given, gets the
    two nodes as ``"w"`` and ``"p"`` once they run."""
    async with pair(cluster, mode, push_window=max(1 << 20, 4 * size), **options) as (w, p):
        if nodes is not None:
            nodes.update(w=w, p=p)
        k = key("blip")
        got: list[int] = []

        async def consume() -> None:
            while len(got) < rounds * burst:
                v = await p.recv(k, timeout=20)
                assert isinstance(v, np.ndarray)
                got.append(int(v[0]))

        consumer = asyncio.ensure_future(consume())
        try:
            n = 0
            for _ in range(rounds):
                for _ in range(burst):
                    await w.send(k, value(n, size))
                    n += 1
                node, other = (w, ("ps", 0)) if side == "producer" else (p, ("worker", 0))
                broken = await reset(node, other)
                await relinked(node, other, broken)
            await asyncio.wait_for(consumer, 30)
        finally:
            consumer.cancel()
        assert got == list(range(rounds * burst))
        # Nothing is kept once the consumer acknowledged everything.
        await eventually(lambda: w._peers[("ps", 0)].kept() == 0, "every value acknowledged")


@pytest.mark.parametrize("size", [SIZE, 300 << 10])
@pytest.mark.parametrize("every", [2, 3, 5, 7])
@pytest.mark.loop_timeout(60)
async def test_values_survive_a_consumer_that_resets_as_its_offers_arrive(  # type: ignore[no-untyped-def]
        cluster, monkeypatch, every: int, size: int) -> None:
    """Recv-Driven over shm, the consumer resets its connection as every ``every``-th
    offer of its memory reaches the producer, which finds that region gone (the consumer
    freed it as it reset): two resets at once, from both ends, with values taken by
    requests meanwhile.  Every value still arrives once, in order."""
    real = shm.ShmEndpoint.add_region
    offers = itertools.count(1)
    nodes: dict[str, rvz.Node] = {}

    def add_region(self: Any, desc: dict[str, Any]) -> None:
        if next(offers) % every:
            return real(self, desc)
        for conn in nodes["p"]._peers[("worker", 0)].live_connections():
            conn.fail(ConnectionResetError("reset by the test"))
        try:
            raise FileNotFoundError(2, "No such file or directory")
        except FileNotFoundError as exc:
            raise TransportError(f"shm: memory region {desc['rk']} is gone") from exc

    monkeypatch.setattr(shm.ShmEndpoint, "add_region", add_region)
    await stream_across_resets(cluster, "recv", "consumer", 10, 20, size, nodes,
                               transport=provider_or_skip("shm"), onesided=ONESIDED)


@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.loop_timeout(60)
async def test_a_batch_across_resets_arrives_whole(cluster, mode: str) -> None:  # type: ignore[no-untyped-def]
    """send_many and recv_many of many keys, with the link reset while the batch crosses."""
    async with pair(cluster, mode, push_window=1 << 20) as (w, p):
        keys = [key(f"batch_{i}") for i in range(300)]
        for round_ in range(3):
            recv = asyncio.ensure_future(p.recv_many(keys, timeout=20))
            await asyncio.sleep(0)
            await w.send_many([(k, value(round_ * 1000 + i)) for i, k in enumerate(keys)])
            broken = await reset(w, ("ps", 0))
            await relinked(w, ("ps", 0), broken)
            values = await asyncio.wait_for(recv, 30)
            assert [int(v[0]) for v in values] == [round_ * 1000 + i for i in range(300)]
        # No value came twice: nothing is left queued on the consumer's side.
        stats = p.stats()
        assert all(s["queued_values"] == 0 for s in stats["steps"].values()), stats["steps"]


@pytest.mark.loop_timeout(60)
async def test_recv_driven_requests_parked_across_a_reset_are_answered_once(cluster) -> None:  # type: ignore[no-untyped-def]
    """Recvs waiting (their requests parked at the producer) when the link resets: the
    consumer asks again, and each recv gets one value, in order, none lost or doubled."""
    async with pair(cluster, "recv") as (w, p):
        k = key("parked")
        recvs = [asyncio.ensure_future(p.recv(k, timeout=20)) for _ in range(20)]
        await eventually(lambda: ("ps", 0) in w._peers and sum(
            len(c.parked) for c in w._peers[("ps", 0)].live_connections()) == 20,
            "the producer parked every request")
        broken = await reset(p, ("worker", 0))
        await relinked(p, ("worker", 0), broken)
        for i in range(20):
            await w.send(k, value(i))
        values = await asyncio.wait_for(asyncio.gather(*recvs), 30)
        assert [int(v[0]) for v in values] == list(range(20))
        await w.send(k, value(99))  # the next value is the next one, not an old copy
        assert int((await p.recv(k, timeout=10))[0]) == 99


@pytest.mark.loop_timeout(30)
async def test_a_refused_reconnect_fails_waiting_recvs_with_peer_lost(cluster) -> None:  # type: ignore[no-untyped-def]
    """A reset from a process that is gone: the reconnect is refused, and what waits on it
    fails with PeerLost at once, not after connect_timeout."""
    w = await rvz.Node(cluster, "worker", 0, "send", heartbeat=0.05, peer_timeout=2.0,
                       connect_timeout=20.0).start()
    try:
        async with rvz.Node(cluster, "ps", 0, "send", heartbeat=0.05, peer_timeout=2.0,
                            connect_timeout=20.0) as p:
            await w.send(key("first"), value(1))
            assert int((await p.recv(key("first"), timeout=5))[0]) == 1
            waiting = asyncio.ensure_future(p.recv(key("never"), timeout=15))
            await asyncio.sleep(0)
            w.abort()  # its listener closes and its connections reset
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(rvz.PeerLost):
                await waiting
            assert loop.time() - start < 5.0
    finally:
        w.abort()


def offer_a_region_that_is_gone(channel: Any, k: rvz.Key) -> None:
    """Hand the producer's ``channel`` an offer of slots in a region the consumer no longer
    has (no such fd in its process), as one still on the way when it reset would be."""
    gone = {"rk": 1 << 40, "n": 4096, "fd": 1 << 20, "ino": 1, "a": 0}
    channel.on_frames([(_impl.codec.ONESIDED, {"op": "slots", "k": k, "m": [gone], "s": []})])


@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.loop_timeout(60)
async def test_a_region_its_owner_closed_before_its_offer_arrived_is_a_reset(  # type: ignore[no-untyped-def]
        cluster, mode: str) -> None:
    """A consumer that resets its connection frees the regions it offered on it; an offer
    still on the way names a region that is gone.  That is a reset, not a lost peer: the
    pair connects again and the stream goes on, nothing lost or doubled."""
    async with pair(cluster, mode, transport=provider_or_skip("shm"), onesided=ONESIDED) as (w, p):
        k = key("gone")
        for i in range(10):
            await w.send(k, value(i, 300 << 10))
        got = [int((await p.recv(k, timeout=10))[0]) for _ in range(5)]
        conn = w._peers[("ps", 0)].link
        channel = conn.dataplane
        assert channel is not None, "the values went one-sided"
        offer_a_region_that_is_gone(channel, k)
        assert isinstance(conn.close_reason, ConnectionResetError), conn.close_reason
        await relinked(w, ("ps", 0), [conn])
        for i in range(10, 20):
            await w.send(k, value(i, 300 << 10))
        got += [int((await p.recv(k, timeout=10))[0]) for _ in range(15)]
        assert got == list(range(20))


@pytest.mark.loop_timeout(60)
async def test_a_value_a_request_takes_as_its_channel_fails_goes_again(cluster) -> None:  # type: ignore[no-untyped-def]
    """Recv-Driven over shm: a value that meets a parked request just after the request's
    channel failed (its connection aborts, and is not closed yet) is numbered, kept and sent
    again on the next connection, not lost between the table and the dead channel."""
    async with pair(cluster, "recv", transport=provider_or_skip("shm"), onesided=ONESIDED) as (w, p):
        k = key("taken")
        await w.send(k, value(0))
        assert int((await p.recv(k, timeout=10))[0]) == 0
        peer = w._peers[("ps", 0)]
        waiting = asyncio.ensure_future(p.recv(k, timeout=20))
        await eventually(lambda: any(c.parked for c in peer.live_connections()),
                         "the request is parked at the producer")
        (conn,) = [c for c in peer.live_connections() if c.parked]
        offer_a_region_that_is_gone(conn.dataplane, k)
        assert conn.dataplane.failed is not None and not conn.closed
        await w.send(k, value(1))            # taken by the parked request, in this pass
        assert int((await waiting)[0]) == 1
        await w.send(k, value(2))
        assert int((await p.recv(k, timeout=10))[0]) == 2
        await eventually(lambda: peer.kept() == 0, "every value acknowledged")


@pytest.mark.loop_timeout(60)
async def test_answers_lost_on_a_connection_other_than_the_link_go_again(cluster) -> None:  # type: ignore[no-untyped-def]
    """A one-sided channel answers a request on the connection it came on, which need not
    be the producer's link (after resets, each side may have dialled its own).  When that
    connection breaks with an answer lost in flight, the answer goes again on the link,
    though nothing of it went on the connection's own stream."""
    async with pair(cluster, "recv", transport=provider_or_skip("shm"), onesided=ONESIDED) as (w, p):
        k = key("elsewhere")
        await w.send(k, value(0))
        assert int((await p.recv(k, timeout=10))[0]) == 0    # on the connection p dialled
        peer = w._peers[("ps", 0)]
        asked = peer.link
        assert asked is not None and asked.dataplane is not None
        ours = await w._new_dial(peer)                       # and one w dialled: its link
        w._link_ready(peer, ours)
        assert peer.link is ours and asked.ready and not asked.closed
        waiting = asyncio.ensure_future(p.recv(k, timeout=20))
        await eventually(lambda: bool(asked.parked), "the request is parked on its connection")
        # The answer's write is lost with the connection, as one into a region the consumer
        # unmapped as it reset would be.
        channel = asked.dataplane
        channel.write_value = lambda *args: None
        await w.send(k, value(1))
        assert peer.kept() >= 1 and not waiting.done()
        asked.fail(ConnectionResetError("reset by the test"))
        assert int((await waiting)[0]) == 1
        await w.send(k, value(2))
        assert int((await p.recv(k, timeout=10))[0]) == 2
        await eventually(lambda: peer.kept() == 0, "every value acknowledged")


@pytest.mark.loop_timeout(30)
async def test_a_dial_that_gives_up_after_the_peer_dialled_us_fails_nothing_of_it() -> None:
    """The worker's dial to the ps is refused until its ``connect_timeout`` (as when the ps
    is a restarted process, not up yet); meanwhile the ps dials the worker.  That dial giving
    up fails neither the ps's connection nor what the worker waits for from it."""
    worker_port, ps_port, nobody = rvz.cluster.free_ports(3)
    worker = f"127.0.0.1:{worker_port}"
    seen_by_worker = {"worker": [worker], "ps": [f"127.0.0.1:{nobody}"]}  # every dial refused
    async with rvz.Node(seen_by_worker, "worker", 0, "send", heartbeat=0.05, peer_timeout=5.0,
                        connect_timeout=1.0) as w, \
            rvz.Node({"worker": [worker], "ps": [f"127.0.0.1:{ps_port}"]}, "ps", 0, "send",
                     heartbeat=0.05, peer_timeout=5.0) as p:
        sending = asyncio.ensure_future(w.send(key("up"), value(1)))  # its dial starts
        await eventually(lambda: ("ps", 0) in w._peers and w._dialling(w._peers[("ps", 0)]),
                         "the worker dialling the ps")
        await p.send(key("down", src=PS, dst=WORKER), value(2))  # the ps dials the worker
        assert int((await w.recv(key("down", src=PS, dst=WORKER), timeout=5))[0]) == 2
        waiting = asyncio.ensure_future(w.recv(key("later", src=PS, dst=WORKER), timeout=15))
        await eventually(lambda: not w._dialling(w._peers[("ps", 0)]), "the worker's dial ended")
        await sending
        assert int((await p.recv(key("up"), timeout=5))[0]) == 1
        await p.send(key("later", src=PS, dst=WORKER), value(3))
        assert int((await waiting)[0]) == 3
        assert w.stats()["peers"]["/job:ps/replica:0/task:0"]["state"] == "connected"

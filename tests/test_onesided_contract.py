"""The contract of the one-sided engine, run on every provider that works here.

``shm`` runs everywhere (Linux); ``verbs`` runs only where pyverbs and an RDMA device with
an active port exist, and is skipped with the reason otherwise.  Both remote modes, many
keys in flight, slot exhaustion and credit return, shape changes mid-stream, a peer killed
with SIGKILL in the middle of its writes, abort and step clean-up.

The two-process tests run this file as a script for the peer (``python -m
tests.test_onesided_contract peer ...``); the peer is always killed and reaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import rvz
import rvz.onesided
from rvz import _impl

from .conftest import FAST, PS, WORKER, eventually, key, pair, provider_or_skip, record_writes

HERE = os.path.dirname(os.path.abspath(__file__))
# Small pool chunks: registering (populating) a chunk costs time, tests need little memory.
# Every push goes through the channel (tcp_max -1): this file tests the one-sided engine,
# small values included; which way a push takes by default is tested on its own below.
OPTS: dict[str, Any] = {"chunk_size": 4 << 20, "tcp_max": -1}


@pytest.fixture(params=["shm", "verbs"])
def transport(request: pytest.FixtureRequest) -> str:
    return provider_or_skip(str(request.param))


def channels(node: rvz.Node) -> list[Any]:
    return [ch for e in node._onesided.engines.values() for ch in e.channels.values()]


def stats(node: rvz.Node, what: str) -> int:
    return sum(ch.stats[what] for ch in channels(node))


def values() -> list[Any]:
    return [np.arange(10, dtype=np.int64), np.full((), 3.5, np.float32), np.zeros((0, 7), np.float32),
            np.random.default_rng(1).standard_normal((300, 257)), np.ones(1 << 18, np.bool_),
            b"bytes value", bytes(range(256)) * 400, np.arange(100, dtype=np.complex128),
            np.arange(60, dtype=np.uint16).reshape(3, 4, 5)[:, ::2]]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, bytes):
        return isinstance(b, bytes) and a == b
    return bool(isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and np.array_equal(a, b))


# -- both modes -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.loop_timeout(40)
async def test_values_arrive_intact_in_both_modes(cluster: rvz.ClusterSpec, transport: str,
                                                  mode: str) -> None:
    async with pair(cluster, mode, transport=transport, onesided=OPTS) as (w, p):
        for round_ in range(2):  # the second round uses cached slots / metadata
            for i, v in enumerate(values()):
                k = key(f"v{i}")
                await w.send(k, v)
                got = await p.recv(k, timeout=10)
                assert same(v.copy() if isinstance(v, np.ndarray) else v, got), (i, round_)
                if isinstance(got, np.ndarray):
                    got[...] = 0  # received arrays are the receiver's, writable
        assert w.transport_for(PS) == transport and p.transport_for(WORKER) == transport
        assert stats(w, "writes") > 0 and stats(w, "inline") > 0
        if mode == "recv":
            assert stats(w, "meta") > 0  # first sight of each large key: metadata first
    # nothing of the pools stays allocated once the arrays are gone and the nodes closed


@pytest.mark.loop_timeout(30)
async def test_recv_driven_writes_straight_into_the_destination(cluster: rvz.ClusterSpec,
                                                                transport: str) -> None:
    async with pair(cluster, "recv", transport=transport, onesided=OPTS) as (w, p):
        k = key("dst")
        first = np.arange(50000, dtype=np.float32)
        await w.send(k, first)
        assert np.array_equal(await p.recv(k, timeout=10), first)
        metas = stats(w, "meta")
        for i in range(5):  # same dtype/shape: the request carries the destination
            v = first + i
            await w.send(k, v)
            got = await p.recv(k, timeout=10)
            assert np.array_equal(got, v)
            block_owner = got.base
            assert block_owner is not None and type(block_owner).__name__ == "_Owner"
        assert stats(w, "meta") == metas


# -- many keys in flight ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.loop_timeout(40)
async def test_many_keys_in_flight_keep_fifo_per_key(cluster: rvz.ClusterSpec, transport: str,
                                                     mode: str) -> None:
    nkeys, per_key = 40, 4

    async with pair(cluster, mode, transport=transport, onesided=OPTS) as (w, p):
        async def consume(i: int) -> list[int]:
            out = []
            for _ in range(per_key):
                v = await p.recv(key(f"k{i}"), timeout=20)
                out.append(int(v[0]))
                assert v.shape == ((i % 5 + 1) * 1000,)
            return out

        consumers = [asyncio.ensure_future(consume(i)) for i in range(nkeys)]
        for j in range(per_key):
            for i in range(nkeys):
                await w.send(key(f"k{i}"), np.full((i % 5 + 1) * 1000, j, np.int32))
        results = await asyncio.gather(*consumers)
        assert all(r == list(range(per_key)) for r in results)


# -- slots: exhaustion and credit return ---------------------------------------------------------


@pytest.mark.loop_timeout(30)
async def test_slot_exhaustion_queues_in_order_and_credit_returns(cluster: rvz.ClusterSpec,
                                                                  transport: str) -> None:
    n = 12

    opts = {**OPTS, "max_slots": 2, "slot_budget": 1 << 20}
    async with pair(cluster, "send", transport=transport, onesided=opts) as (w, p):
        k = key("slots")
        for i in range(n):  # the push window allows it; the slots do not
            await w.send(k, np.full(100000, i, np.float32))
        (out,) = [ch for ch in channels(w) if ch.remote_slots or ch.out_pending]
        await eventually(lambda: len(out.out_pending.get(k_text(k), ())) > 0,
                         "values wait for slots on the producer")
        assert sum(1 for ch in channels(w) for _ in ch.out_pending) == 1
        assert w._onesided.busy()
        for i in range(n):
            assert int((await p.recv(k, timeout=10))[0]) == i
        await eventually(lambda: not out.out_pending, "the producer's queue drained")
        assert stats(p, "grants") >= n  # each consumed slot came back as a new grant
        (inn,) = [ch for ch in channels(p) if ch.slot_imms]
        assert len(inn.slot_imms[k_text(k)]) <= 2  # never more than max_slots outstanding


@pytest.mark.loop_timeout(30)
async def test_a_want_ahead_of_its_last_slots_write_is_granted_when_the_budget_is_short(
        cluster: rvz.ClusterSpec) -> None:
    # A producer asks for slots (over TCP) once it filled its last one, whose write the
    # consumer learns of from the completion pipe: the want can come first.  The consumer
    # then counts the filled slot as the producer's and grants nothing, expecting to grant it
    # again when the write shows up.  If by then a key that waits for budget took the room,
    # that refill does not fit: the want must still be served, not forgotten (the producer
    # waited for a grant until grant_timeout failed the channel, losing what was in it).
    # Holding the consumer's completion queue makes that order certain.
    provider_or_skip("shm")
    small, large = 100_000, 175_000   # float32: 2 slots of the small size fit, not 3
    opts = {**OPTS, "max_slots": 1, "slot_budget": 1 << 20}
    async with pair(cluster, "send", transport="shm", onesided=opts) as (w, p):
        a, b = key("a"), key("b")
        await w.send(a, np.full(small, 0, np.float32))
        assert int((await p.recv(a, timeout=10))[0]) == 0

        def a_slot() -> Any:   # the producer's channel, once it holds a's slot granted again
            return next((ch for ch in channels(w) if ch.remote_slots.get(k_text(a))), None)

        await eventually(lambda: a_slot() is not None, "a's slot granted again")
        (inn,) = [ch for ch in channels(p) if ch.slot_imms]
        cq = inn.ep.cq
        loop = asyncio.get_running_loop()
        sent: list[str] = []
        control = inn._control
        inn._control = lambda fields: (sent.append(fields["op"]), control(fields))
        loop.remove_reader(cq.fd)   # writes land, their completions wait in the pipe
        try:
            await w.send(a, np.full(small, 1, np.float32))   # fills a's only slot
            await w.send(a, np.full(small, 2, np.float32))   # no slot: a wants one
            await w.send(b, np.full(large, 3, np.float32))   # no room: b waits for budget
            await eventually(lambda: k_text(b) in inn.wanted, "b waits for budget")
            assert inn.slot_imms.get(k_text(a)), "a's filled slot is still unseen"
            # b's wait asks for a's slot back; the producer has filled it, so it gives back
            # nothing.  That slot is not asked for again (a revoke and its empty answer
            # went back and forth over TCP until the write was seen).
            await eventually(lambda: "revoke" in sent, "a's slot asked back")
            await asyncio.sleep(0.2)   # room for a second revoke to be sent
            assert sent.count("revoke") == 1, sent
        finally:
            inn._control = control
            loop.add_reader(cq.fd, inn.engine._on_cq, cq)
        # b takes the room a's slot gives back; a is served once b's slot is written.
        assert [int((await p.recv(a, timeout=10))[0]) for _ in range(2)] == [1, 2]
        assert int((await p.recv(b, timeout=10))[0]) == 3
        assert not inn.wanted


@pytest.mark.loop_timeout(40)
async def test_a_recv_waiting_for_a_push_on_its_way_does_not_ask_for_the_next(
        cluster: rvz.ClusterSpec, transport: str) -> None:
    # A push window of one value: every push after the first waits for credit and says so
    # (CREDIT 0, over TCP) while the value before it may still be on its way through the
    # channel, which the consumer serves from another file descriptor.  A consumer that has
    # no credit to return because it holds nothing yet must not read that as a window full
    # of values nobody took (a Send-Driven deadlock): its waiting recv would ask for its
    # value Recv-Driven, the request would be answered with the next value instead, and on a
    # one-sided channel the request reserves a destination for it at once (a tensor more of
    # memory, 64 MiB in rvz-bench's 64 MiB stream).
    n, size = 12, 1 << 20
    async with pair(cluster, "send", transport=transport, onesided=OPTS,
                    push_window=size) as (w, p):
        k = key("whole-window")
        await w.send(k, np.arange(1))
        await p.recv(k, timeout=10)  # linked, and the channel is up
        conn = p._peers[("worker", 0)].link
        assert conn is not None and conn.dataplane is not None
        written, real = record_writes(conn)
        try:
            async def produce() -> None:
                for i in range(n):
                    await w.send(k, np.full(size // 4, i, np.float32))

            producer = asyncio.ensure_future(produce())
            try:
                for i in range(n):
                    got = await p.recv(k, timeout=10)
                    assert got.shape == (size // 4,) and got[0] == i and got[-1] == i
                await asyncio.wait_for(producer, 10)
            finally:
                producer.cancel()
        finally:
            conn.transport = real
        # The producer did wait for credit (each value fills the window) ...
        assert w.stats()["waits"]["producer"] >= n - 1
        # ... and every value came pushed: the consumer never asked for one.
        asks = {_impl.codec.REQUEST, _impl.codec.REQUESTS}
        assert not [t for t in written if asks & set(t)], written
        assert stats(w, "writes") >= n


def k_text(k: rvz.Key) -> str:
    return str(k)


# -- which way a push goes: the connection or the channel ------------------------------------------


def out_channel(node: rvz.Node) -> Any:
    (ch,) = channels(node)
    return ch


def ways(ch: Any) -> tuple[int, int, int]:
    """(pushes kept on the TCP connection, inline messages, one-sided writes) so far."""
    st = ch.stats
    return st["tcp"], st["inline"] - st["tcp"], st["writes"]


@pytest.mark.loop_timeout(30)
async def test_a_keys_first_push_picks_its_way_and_keeps_it(cluster: rvz.ClusterSpec,
                                                            transport: str) -> None:
    small, large = np.arange(16, dtype=np.int64), np.arange(40000, dtype=np.int64)
    assert small.nbytes <= 1024 < large.nbytes
    async with pair(cluster, "send", transport=transport,
                    onesided={**OPTS, "tcp_max": 1024}) as (w, p):
        s, big = key("starts-small"), key("starts-large")
        await w.send(s, small)
        assert np.array_equal(await p.recv(s, timeout=10), small)
        ch = out_channel(w)
        assert ways(ch) == (1, 0, 0)          # over the connection, nothing one-sided
        await w.send(big, large)
        assert np.array_equal(await p.recv(big, timeout=10), large)
        assert ways(ch) == (1, 0, 1)          # a one-sided write
        # Sizes now alternate on both keys, sent back to back before anything is received:
        # each key stays on its way, so its values arrive in order.
        for i in range(6):
            for k in (s, big):
                await w.send(k, (large if i % 2 else small) + i)
        for k in (s, big):
            for i in range(6):
                assert np.array_equal(await p.recv(k, timeout=10), (large if i % 2 else small) + i)
        assert ways(ch) == (7, 3, 4)          # s: 6 more on TCP; big: 3 inline + 3 writes
        assert p.stats()["steps"].get(0, {}).get("queued_values", 0) == 0


class HeldWrites:
    """Stands in for a connection's transport and keeps what is written until ``release``."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.real, self.held = conn, conn.transport, []
        conn.transport = self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def write(self, data: Any) -> None:
        self.held.append(bytes(data))

    def writelines(self, parts: Any) -> None:
        self.held.append(b"".join(bytes(part) for part in parts))

    def release(self) -> None:
        self.conn.transport = self.real
        for data in self.held:
            self.real.write(data)


@pytest.mark.parametrize("way", ["tcp", "channel"])
@pytest.mark.loop_timeout(30)
async def test_an_answer_never_overtakes_the_pushes_of_its_key(cluster: rvz.ClusterSpec,
                                                               transport: str, way: str) -> None:
    # A Send-Driven key that its consumer also asks for (recv(mode="recv") here; the
    # deadlock rule does the same): the producer answers the request with the key's next
    # value, which must not arrive before the key's push still on its way.  That push is
    # held back on whichever way the key's values take: in the producer's socket (the key
    # started with a push within tcp_max), or in the channel, waiting for a slot it asks
    # for over that socket.  The consumer knows the key's shape, so it offers a
    # destination the answer could be written into at once.
    opts = {**OPTS, "tcp_max": 1 << 20 if way == "tcp" else -1}
    size = 64 << 10   # beyond a provider message: a slot write or a destination write
    async with pair(cluster, "send", transport=transport, onesided=opts) as (w, p):
        k = key("mixed")
        await w.send(k, np.full(size // 8, -1, np.int64))
        assert int((await p.recv(k, timeout=10))[0]) == -1   # linked; the key's way is set
        ch = out_channel(w)
        assert ways(ch)[0] == (1 if way == "tcp" else 0)
        if way == "channel":
            # The consumer granted the key fresh slots: give them back (as after its
            # revoke), so that the next push waits for the slot it asks for.
            text, inn = k_text(k), out_channel(p)
            await eventually(lambda: 0 < len(ch.remote_slots.get(text, ()))
                             == len(inn.slot_imms.get(text, ())), "the slot grants arrived")
            ch._control({"op": "rel", "k": text, "s": [s[0] for s in ch.remote_slots.pop(text)]})
            await eventually(lambda: text not in inn.slot_imms, "the slots were given back")
        peer = w._peers[("ps", 0)]
        held = HeldWrites(peer.link)
        try:
            await w.send(k, np.full(size // 8, 0, np.int64))        # pushed, held back
            # (on TCP at the end of the loop iteration: the push before it left alone)
            await eventually(lambda: bool(held.held if way == "tcp"
                                          else ch.out_pending.get(k_text(k))),
                             "the push is on its way")
            asking = asyncio.ensure_future(p.recv(k, mode="recv", timeout=10))
            await eventually(lambda: any(c.parked for c in peer.live_connections()),
                             "the producer holds the consumer's request")
            await w.send(k, np.full(size // 8, 1, np.int64))        # the request's answer
            await asyncio.sleep(0.2)   # room for an answer that would overtake to arrive
            assert not asking.done(), "the answer overtook the push before it"
        finally:
            held.release()
        assert int((await asking)[0]) == 0
        assert int((await p.recv(k, timeout=10))[0]) == 1
        assert ways(ch)[0] == (3 if way == "tcp" else 0)   # the answer took the key's way


async def _each_side_linked_its_own(w: rvz.Node, p: rvz.Node) -> tuple[Any, Any, Any]:
    """Both nodes dialled, each linked the connection it dialled (as after a simultaneous
    dial): returns the producer ``w`` as the consumer ``p`` sees it, ``p``'s link and the
    connection ``w`` pushes on."""
    producer = p._core.routes.peer(("worker", 0))
    theirs = await p._link(producer)               # the consumer dials, both link it
    await eventually(lambda: ("ps", 0) in w._peers and w._peers[("ps", 0)].link is not None,
                     "the producer linked the consumer's connection")
    consumer = w._peers[("ps", 0)]
    dialled = asyncio.get_running_loop().create_future()
    await w._dial(consumer, dialled)               # the producer dials as well ...
    w._link_ready(consumer, dialled.result())      # ... and pushes on its own
    await eventually(lambda: any(c.ready and c.dataplane is not None
                                 for c in producer.inbound), "the second channel is up")
    (ours,) = producer.inbound
    assert producer.link is theirs and ours is not theirs
    return producer, theirs, ours


@contextlib.contextmanager
def _unread(p: rvz.Node, conn: Any) -> Iterator[None]:
    """Hold ``p``'s reader of the channel on ``conn``: writes land, their completions wait."""
    (ch,) = [c for c in channels(p) if c.conn is conn]
    cq = ch.ep.cq
    loop = asyncio.get_running_loop()
    loop.remove_reader(cq.fd)
    try:
        yield
    finally:
        loop.add_reader(cq.fd, ch.engine._on_cq, cq)


@pytest.mark.loop_timeout(30)
async def test_a_stuck_keys_answer_stays_behind_its_push_when_each_side_dialled(
        cluster: rvz.ClusterSpec, transport: str) -> None:
    # Both nodes dialled (as when they dial at once) and each pushes and asks on the one
    # it dialled: the producer's pushes travel on its connection, the consumer's requests
    # on the other.  When the window is full of values nobody took, the consumer's waiting
    # recvs ask for theirs (``Core.unblock``); the producer answers with the push it queued,
    # and a one-sided channel answers on the request's connection.  Two channels' writes
    # reach the consumer in no set order, so that answer could overtake the key's push still
    # unread on the producer's channel.  Holding the consumer's reader of that channel makes
    # the overtaking certain, if the answer takes the other one.
    size = 64 << 10
    window = 4 * (size + 64)   # four values (and what each costs beyond its bytes)
    async with pair(cluster, "send", transport=transport, onesided=OPTS,
                    push_window=window) as (w, p):
        _, _, ours = await _each_side_linked_its_own(w, p)
        fill, k = key("fill"), key("stuck")
        for i in range(3):                             # three quarters of the window, untaken
            await w.send(fill, np.full(size // 4, i, np.float32))
        await eventually(lambda: 0 in p._tables and p._tables[0].queued(k_text(fill)) == 3,
                         "the fill arrived")
        recvs = [asyncio.ensure_future(p.recv(k, timeout=10)) for _ in range(2)]
        with _unread(p, ours):
            await w.send(k, np.full(size // 4, 100, np.float32))   # the last quarter
            # No credit for the next: the consumer, asked for it, has none to return and
            # asks for both values of k; the producer answers the first request with this
            # push, taken out of its queue (the send completes).
            await asyncio.wait_for(w.send(k, np.full(size // 4, 101, np.float32)), 10)
            await asyncio.sleep(0.2)   # room for an answer that would overtake to arrive
            assert not recvs[0].done(), "the answer overtook the push before it"
        assert [int((await r)[0]) for r in recvs] == [100, 101]
        for i in range(3):
            assert int((await p.recv(fill, timeout=10))[0]) == i


@pytest.mark.loop_timeout(30)
async def test_a_recv_driven_recv_of_a_pushed_key_stays_behind_its_pushes_when_each_side_dialled(
        cluster: rvz.ClusterSpec, transport: str) -> None:
    # Mixed modes on one key after a simultaneous dial: the producer pushes on its
    # connection, and a ``recv(mode="recv")`` asks for the next value.  The answer goes on
    # the request's connection; on the consumer's own link it could overtake the push still
    # unread on the producer's channel.  The request goes where the pushes come from
    # (``Core.request_link``), so the answer queues behind them.
    size = 64 << 10
    async with pair(cluster, "send", transport=transport, onesided=OPTS) as (w, p):
        producer, theirs, ours = await _each_side_linked_its_own(w, p)
        k = key("mixed")
        await w.send(k, np.full(size // 4, 0, np.float32))
        assert int((await p.recv(k, timeout=10))[0]) == 0   # a push read: its connection known
        assert producer.pushes_on is ours
        with _unread(p, ours):
            await w.send(k, np.full(size // 4, 1, np.float32))   # pushed, not read yet
            asked = asyncio.ensure_future(p.recv(k, mode="recv", timeout=10))
            await eventually(lambda: any(c.parked for c in w._peers[("ps", 0)].live_connections()),
                             "the request is parked at the producer")
            (request,) = p._core.requests.by_id.values()
            assert request.conn is ours
            await w.send(k, np.full(size // 4, 2, np.float32))    # answers the parked request
            await asyncio.sleep(0.2)   # room for an answer that would overtake to arrive
            assert not asked.done(), "the answer overtook the push before it"
        assert int((await asked)[0]) == 1
        assert int((await p.recv(k, timeout=10))[0]) == 2


@pytest.mark.loop_timeout(30)
async def test_a_keys_requests_stay_on_one_connection_while_one_is_unanswered(
        cluster: rvz.ClusterSpec, transport: str) -> None:
    # Two requests of one key on two connections could be answered in either order: a key
    # that waits for an answer on the consumer's link keeps asking there after the
    # producer's first push arrives on its own connection (``Core.key_link``); a key with
    # nothing outstanding asks on the new one.  Holding the consumer's reader of its link's
    # channel would let an answer on the other one overtake.
    async with pair(cluster, "recv", transport=transport, onesided=OPTS) as (w, p):
        producer, theirs, ours = await _each_side_linked_its_own(w, p)
        consumer = w._peers[("ps", 0)]

        def parked() -> int:
            return sum(len(c.parked) for c in consumer.live_connections())

        waiting, fresh, pushed = key("waiting"), key("fresh"), key("pushed")
        first = asyncio.ensure_future(p.recv(waiting, timeout=10))
        await eventually(lambda: parked() == 1, "the first request is parked")
        await w.send(pushed, np.ones(4), mode="send")   # its first push: on w's connection
        assert int((await p.recv(pushed, mode="send", timeout=10))[0]) == 1
        assert producer.pushes_on is ours
        later = asyncio.ensure_future(p.recv_many([waiting, fresh], timeout=10))
        await eventually(lambda: parked() == 3, "the batch's requests are parked")
        conns = {r.key: r.conn for r in p._core.requests.by_id.values() if r.key != k_text(waiting)}
        assert conns == {k_text(fresh): ours}
        with _unread(p, theirs):
            for i in range(2):
                await w.send(waiting, np.full(4, i))
            await w.send(fresh, np.full(4, 7))
            await asyncio.sleep(0.2)   # room for an answer that would overtake to arrive
            assert not first.done(), "the second request's answer overtook the first's"
        assert int((await first)[0]) == 0
        assert [int(v[0]) for v in await later] == [1, 7]


@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.loop_timeout(30)
async def test_shm_default_keeps_small_values_on_the_connection(cluster: rvz.ClusterSpec,
                                                                mode: str) -> None:
    # Small pushes, and answers up to answer_tcp_max (no destination is offered for them),
    # stay on the TCP connection; a large value goes through the channel.
    provider_or_skip("shm")
    async with pair(cluster, mode, transport="shm", onesided={"chunk_size": 4 << 20}) as (w, p):
        for i in range(20):
            await w.send(key("tiny"), np.full(8, i, np.float32))
        for i in range(5):   # 32 KiB: within shm's tcp_max and answer_tcp_max
            await w.send(key("mid"), np.full(8192, i, np.float32))
        await w.send(key("huge"), np.ones(1 << 19))   # 4 MiB: above shm's tcp_max
        for i in range(20):
            assert int((await p.recv(key("tiny"), timeout=10))[0]) == i
        for i in range(5):
            assert int((await p.recv(key("mid"), timeout=10))[0]) == i
        assert np.array_equal(await p.recv(key("huge"), timeout=10), np.ones(1 << 19))
        ch = out_channel(w)
        tcp, inline, writes = ways(ch)
        assert (tcp, inline) == (25, 0) and writes >= 1, (tcp, inline, writes)
        if mode == "recv":
            assert ch.inline_limit <= ch.answer_tcp_max <= ch.tcp_max


@pytest.mark.loop_timeout(30)
async def test_keys_beyond_the_remembered_ones_go_one_sided(cluster: rvz.ClusterSpec,
                                                            transport: str) -> None:
    async with pair(cluster, "send", transport=transport,
                    onesided={**OPTS, "tcp_max": 1024}) as (w, p):
        await w.send(key("first"), np.ones(4))
        assert np.array_equal(await p.recv(key("first"), timeout=10), np.ones(4))
        ch = out_channel(w)
        ch.conn.key_ways_max = 1          # the connection remembers one key from now on
        for i in range(3):
            await w.send(key("later"), np.full(4, i))
            await w.send(key("first"), np.full(4, i))
        for i in range(3):
            assert int((await p.recv(key("later"), timeout=10))[0]) == i
            assert int((await p.recv(key("first"), timeout=10))[0]) == i
        assert ways(ch) == (4, 3, 0)          # first: always TCP; later: always the channel
        assert len(ch.conn.key_ways) == 1


# -- shape changes ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.loop_timeout(30)
async def test_shape_and_dtype_change_mid_stream(cluster: rvz.ClusterSpec, transport: str,
                                                 mode: str) -> None:
    shapes = [((1000,), np.float32), ((1000,), np.float32), ((3000,), np.float32),
              ((30, 100), np.float32), ((30, 100), np.float64), ((10,), np.int8),
              ((5000,), np.int64), ((5000,), np.int64)]

    async with pair(cluster, mode, transport=transport, onesided=OPTS) as (w, p):
        k = key("shape")
        for i, (shape, dtype) in enumerate(shapes):
            v = np.full(shape, i, dtype)
            if mode == "recv":  # the consumer asks first, with its stale metadata
                task = asyncio.ensure_future(p.recv(k, timeout=10))
                await asyncio.sleep(0.01)
                await w.send(k, v)
                got = await task
            else:
                await w.send(k, v)
                got = await p.recv(k, timeout=10)
            assert same(v, got), i
        if mode == "recv":
            assert stats(w, "meta") >= 4  # first sight plus three changes (int8 goes inline)


@pytest.mark.loop_timeout(30)
async def test_answers_queued_behind_a_metadata_update_keep_fifo(cluster: rvz.ClusterSpec,
                                                                 transport: str) -> None:
    async with pair(cluster, "recv", transport=transport, onesided=OPTS) as (w, p):
        k = key("fifo")
        await w.send(k, np.zeros(4000, np.float32))
        await p.recv(k, timeout=10)  # metadata (4000,) float32 cached
        waits = [asyncio.ensure_future(p.recv(k, timeout=10)) for _ in range(3)]
        await asyncio.sleep(0.05)  # three requests carry (4000,) float32 destinations
        await w.send(k, np.full(8000, 1, np.float32))   # mismatch: META, re-ask
        await w.send(k, np.full(4000, 2, np.float32))   # would match: must wait behind
        await w.send(k, np.full(4000, 3, np.float32))
        got = await asyncio.gather(*waits)
        assert [int(g[0]) for g in got] == [1, 2, 3]


# -- abort, step clean-up, cancel -------------------------------------------------------------


def dests(node: rvz.Node) -> int:
    return sum(1 for ch in channels(node) for t in ch.targets.values() if t.kind == 2)


@pytest.mark.loop_timeout(30)
async def test_step_cleanup_aborts_and_frees_destinations(cluster: rvz.ClusterSpec,
                                                          transport: str) -> None:
    async with pair(cluster, "recv", transport=transport, onesided=OPTS) as (w, p):
        k = key("step")
        await w.step(1).send(k, np.ones(20000))
        await p.step(1).recv(k, timeout=10)        # metadata cached
        waiting = asyncio.ensure_future(p.step(7).recv(k, timeout=10))
        await eventually(lambda: dests(p) == 1, "the request offered a destination")
        await w.step(7).cleanup("step 7 is over")
        with pytest.raises(rvz.Aborted) as info:
            await waiting
        assert "step 7 is over" in str(info.value)
        await eventually(lambda: dests(p) == 0, "the destination was freed")
        # the channel still works for other steps
        await w.step(8).send(k, np.ones(20000) * 8)
        assert (await p.step(8).recv(k, timeout=10))[0] == 8


@pytest.mark.loop_timeout(30)
async def test_cancelled_request_frees_its_destination(cluster: rvz.ClusterSpec,
                                                       transport: str) -> None:
    async with pair(cluster, "recv", transport=transport, onesided=OPTS) as (w, p):
        k = key("cancel")
        await w.send(k, np.ones(20000))
        await p.recv(k, timeout=10)
        with pytest.raises(TimeoutError):
            await p.recv(k, timeout=0.2)
        await eventually(lambda: dests(p) == 0, "the producer released the destination")
        await w.send(k, np.ones(20000) * 2)  # the next value goes to the next recv
        assert (await p.recv(k, timeout=10))[0] == 2


@pytest.mark.loop_timeout(30)
async def test_a_cancelled_request_that_offered_no_destination_is_forgotten(
        cluster: rvz.ClusterSpec, transport: str) -> None:
    """A request for a key whose shape the consumer does not know offers no destination.
    Cancelled before an answer came, the consumer's channel kept it in its asks for ever,
    one entry per such request (keys named by a batch id grew them without bound).  The
    producer now says "gone" for every parked request it drops on a CANCEL."""
    async with pair(cluster, "recv", transport=transport, onesided=OPTS) as (w, p):
        await w.send(key("warm"), np.ones(20000))
        assert (await p.recv(key("warm"), timeout=10))[0] == 1
        assert channels(p), "the pair talks over a one-sided channel"
        for i in range(20):
            with pytest.raises(TimeoutError):
                await p.recv(key(f"never{i}"), timeout=0.05)
        await eventually(lambda: sum(len(ch.asks) for ch in channels(p)) == 0,
                         "the cancelled requests were forgotten")
        await w.send(key("never3"), np.ones(20000) * 3)   # a late value still arrives
        assert (await p.recv(key("never3"), timeout=10))[0] == 3


@pytest.mark.loop_timeout(30)
async def test_abort_fails_pending_operations_and_frees_the_pool(cluster: rvz.ClusterSpec,
                                                                 transport: str) -> None:
    async with pair(cluster, "send", transport=transport, onesided=OPTS) as (w, p):
        k = key("abort")
        await w.send(k, np.ones(100000))
        kept = await p.recv(k, timeout=10)           # an array in the pool, still alive
        pending = asyncio.ensure_future(p.recv(k, timeout=10))
        await asyncio.sleep(0.05)
        engine = p._onesided.engines[transport]
        p.abort(RuntimeError("operator abort"))
        with pytest.raises(rvz.Aborted) as info:
            await pending
        assert isinstance(info.value.__cause__, RuntimeError)
        assert engine.closed and engine.pool.closed
        assert kept.sum() == 100000                  # its block outlives the pool
        del kept
        engine.pool.reclaim()
        assert engine.pool.stats()["chunks"] == 0


@pytest.mark.loop_timeout(30)
async def test_graceful_close_delivers_what_was_sent(cluster: rvz.ClusterSpec, transport: str) -> None:
    p = await rvz.Node(cluster, "ps", 0, "send", transport=transport, onesided=OPTS, **FAST).start()
    try:
        async with rvz.Node(cluster, "worker", 0, "send", transport=transport, onesided={
                **OPTS, "max_slots": 1, "slot_budget": 1}, **FAST) as w:
            for i in range(6):
                await w.send(key("bye"), np.full(50000, i))
        # w closed: everything it accepted was delivered before its BYE
        for i in range(6):
            assert int((await p.recv(key("bye"), timeout=10))[0]) == i
    finally:
        await p.close()


# -- negotiation --------------------------------------------------------------------------------


@pytest.mark.loop_timeout(30)
async def test_asking_for_shm_with_a_tcp_peer_fails_with_the_reason(cluster: rvz.ClusterSpec,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "rvz"):
        async with rvz.Node(cluster, "worker", 0, "send", transport="shm", onesided=OPTS, **FAST) as w, \
                rvz.Node(cluster, "ps", 0, "send", transport="tcp", **FAST):
            with pytest.raises((rvz.PeerLost, rvz.TransportError)) as info:
                await w.send(key("x"), np.ones(10), timeout=5)
            text = f"{info.value} {info.value.__cause__}"
            assert "shm" in text and "tcp" in text, text


@pytest.mark.loop_timeout(30)
async def test_auto_picks_shm_on_one_host_and_logs_it(cluster: rvz.ClusterSpec,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "rvz"):
        async with pair(cluster, "send", transport="auto", onesided=OPTS) as (w, p):
            assert w.transport_for(PS) == "auto"   # nothing decided before a connection
            await w.send(key("a"), np.ones(5000))
            await p.recv(key("a"), timeout=10)
            assert w.transport_for(PS) == "shm" and p.transport_for(WORKER) == "shm"
    chosen = [r for r in caplog.records if "transport to /job:ps/replica:0/task:0 is shm" in r.getMessage()]
    # Under its module's logger, which the README names (it logged as "rvz" itself, so
    # ``logging.getLogger("rvz.onesided")`` could not narrow the log down to it).
    assert chosen and all(r.name == "rvz.onesided.hub" for r in chosen), [r.name for r in chosen]


@pytest.mark.loop_timeout(30)
async def test_auto_with_a_tcp_peer_uses_tcp(cluster: rvz.ClusterSpec) -> None:
    async with rvz.Node(cluster, "worker", 0, "recv", transport="auto", onesided=OPTS, **FAST) as w, \
            rvz.Node(cluster, "ps", 0, "recv", transport="tcp", **FAST) as p:
        await w.send(key("a"), np.ones(5000))
        assert np.array_equal(await p.recv(key("a"), timeout=10), np.ones(5000))
        assert w.transport_for(PS) == "tcp" and p.transport_for(WORKER) == "tcp"


@pytest.mark.loop_timeout(10)
async def test_unknown_transport_and_option_are_refused(cluster: rvz.ClusterSpec) -> None:
    with pytest.raises(ValueError, match="transport must be one of"):
        rvz.Node(cluster, "ps", 0, transport="rdma")
    with pytest.raises(ValueError, match="unknown onesided option"):
        await rvz.Node(cluster, "ps", 0, transport="shm", onesided={"slots": 3}).start()


# -- two processes ------------------------------------------------------------------------------


def peer_main(argv: list[str]) -> None:
    """The other process: ``peer CLUSTER ROLE MODE TRANSPORT COUNT SIZE``."""
    cluster, role, mode, transport = json.loads(argv[0]), argv[1], argv[2], argv[3]
    count, size = int(argv[4]), int(argv[5])

    async def main() -> None:
        job = "worker" if role == "producer" else "ps"
        async with rvz.Node(cluster, job, 0, mode, transport=transport, onesided=OPTS,
                            heartbeat=0.05, peer_timeout=5.0, linger=2.0) as node:
            print("ready", flush=True)
            if role == "producer":
                for i in range(count):
                    await node.send(key("p", iter=i % 4), np.full(size // 8, i, np.int64))
            else:
                while True:
                    await node.recv(key("p", iter=0), timeout=60)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    rvz.run(main())


def spawn(cluster: rvz.ClusterSpec, role: str, mode: str, transport: str, count: int,
          size: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.test_onesided_contract", "peer",
                             json.dumps(cluster.as_dict()), role, mode, transport, str(count), str(size)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(HERE))
    return proc


async def wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
    assert line.startswith("ready"), f"peer did not start: {line!r}"


def reap(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.loop_timeout(40)
async def test_two_processes_exchange(cluster: rvz.ClusterSpec, transport: str, mode: str) -> None:
    count, size = 24, 1 << 20
    proc = spawn(cluster, "producer", mode, transport, count, size)
    try:
        await wait_ready(proc)
        async with rvz.Node(cluster, "ps", 0, mode, transport=transport, onesided=OPTS, **FAST) as p:
            for i in range(count):
                got = await p.recv(key("p", iter=i % 4), timeout=20)
                assert got.shape == (size // 8,) and int(got[0]) == i and int(got[-1]) == i
            assert p.transport_for(WORKER) == transport
    finally:
        reap(proc)


@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.loop_timeout(40)
async def test_producer_killed_mid_write_fails_waiters_with_peer_lost(cluster: rvz.ClusterSpec,
                                                                      transport: str, mode: str) -> None:
    proc = spawn(cluster, "producer", mode, transport, 1 << 30, 4 << 20)
    try:
        await wait_ready(proc)
        async with rvz.Node(cluster, "ps", 0, mode, transport=transport, onesided=OPTS, **FAST) as p:
            for i in range(3):
                await p.recv(key("p", iter=i), timeout=20)
            # the producer is writing continuously (send) or serving requests (recv)
            waiting = [asyncio.ensure_future(p.recv(key("p", iter=3), timeout=30)) for _ in range(50)]
            await asyncio.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL)
            results = await asyncio.gather(*waiting, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            assert errors, "the kill happened after every value arrived"
            for err in errors:
                assert isinstance(err, rvz.PeerLost), repr(err)
            engine = p._onesided.engines[transport]
            await eventually(lambda: not engine.channels, "the dead peer's channel is closed")
            # the node keeps working
            await p.send(rvz.Key(PS, PS, "local"), np.ones(3))
            assert (await p.recv(rvz.Key(PS, PS, "local"), timeout=5)).sum() == 3
    finally:
        reap(proc)


@pytest.mark.loop_timeout(40)
async def test_consumer_killed_mid_write_fails_the_producer_cleanly(cluster: rvz.ClusterSpec,
                                                                    transport: str) -> None:
    proc = spawn(cluster, "consumer", "send", transport, 0, 0)
    try:
        await wait_ready(proc)
        async with rvz.Node(cluster, "worker", 0, "send", transport=transport, onesided=OPTS,
                            **FAST) as w:
            value = np.ones(1 << 19)
            for _ in range(5):
                await w.send(key("p", iter=0), value, timeout=20)
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises((rvz.PeerLost, rvz.TransportError)):
                for _ in range(10000):  # pushes stop once the loss is noticed
                    await w.send(key("p", iter=0), value, timeout=20)
            engine = w._onesided.engines[transport]
            await eventually(lambda: not engine.channels, "the dead peer's channel is closed")
    finally:
        reap(proc)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "peer":
    peer_main(sys.argv[2:])

"""Failures: a peer killed or frozen mid-wait, a peer not up yet or never up, a peer that
sends garbage.  Every failure is an rvz error that names the key and the peer and keeps the
original cause; none is a hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from typing import Any

import numpy as np
import pytest

import rvz
from rvz import _impl

from .conftest import FAST, PS, WORKER, eventually, free_ports, key, pair, pending
from .procs import ready_process

MODES = ["recv", "send"]
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER_ID = ("worker", 0)


def peer_process(cluster: rvz.ClusterSpec, job: str, task: int, mode: str) -> Any:
    """Run tests/peer_node.py; always killed and reaped on the way out."""
    return ready_process([sys.executable, os.path.join(HERE, "peer_node.py"),
                          json.dumps(cluster.as_dict()), job, str(task), mode])


def connected(node: rvz.Node, task_id: tuple = WORKER_ID) -> bool:
    peer = node._peers.get(task_id)
    return peer is not None and any(c.ready for c in peer.live_connections())


def check_names_key_and_peer(err: BaseException, k: rvz.Key, peer: str) -> None:
    message = str(err)
    assert str(k) in message, message
    assert peer in message, message
    assert err.__cause__ is not None, f"{err!r} lost its cause"


# -- a peer process that dies or freezes ------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_peer_killed_while_recv_waits(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    with peer_process(cluster, "worker", 0, mode) as proc:
        async with rvz.Node(cluster, "ps", 0, mode, **{**FAST, "peer_timeout": 1.0}) as p:
            k = key("from_the_dead")
            task = asyncio.ensure_future(p.recv(k, timeout=20))
            await eventually(lambda: connected(p), "connected to the peer process")
            await asyncio.sleep(0.05)
            assert not task.done()
            proc.kill()
            with pytest.raises(rvz.PeerLost) as info:
                await task
            check_names_key_and_peer(info.value, k, "/job:worker")
            assert isinstance(info.value.__cause__, OSError)  # the connection reset, not a timeout


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_frozen_peer_is_lost_by_heartbeat(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    with peer_process(cluster, "worker", 0, mode) as proc:
        async with rvz.Node(cluster, "ps", 0, mode, **{**FAST, "peer_timeout": 0.5}) as p:
            k = key("from_the_frozen")
            task = asyncio.ensure_future(p.recv(k, timeout=20))
            await eventually(lambda: connected(p), "connected to the peer process")
            # Connected and alive: heartbeats keep it so for longer than peer_timeout.
            await asyncio.sleep(0.8)
            assert not task.done()
            proc.send_signal(signal.SIGSTOP)  # the socket stays open, nothing answers
            with pytest.raises(rvz.PeerLost) as info:
                await task
            check_names_key_and_peer(info.value, k, "/job:worker")
            assert isinstance(info.value.__cause__, TimeoutError)
            assert "heartbeat" in str(info.value)


@pytest.mark.loop_timeout(15)
async def test_consumer_killed_while_a_push_waits_for_the_window(cluster) -> None:  # type: ignore[no-untyped-def]
    with peer_process(cluster, "ps", 0, "send") as proc:
        settings = {**FAST, "peer_timeout": 1.0, "push_window": 1 << 20}
        async with rvz.Node(cluster, "worker", 0, "send", **settings) as w:
            k = key("into_the_void")
            chunk = np.zeros(256 << 10, np.uint8)
            blocked = None

            def queued() -> int:
                peer = w.stats()["peers"].get("/job:ps/replica:0/task:0")
                return 0 if peer is None else int(peer["queued_pushes"])

            # Connected first (a send dials): a push queued for the link, not for credit,
            # may go out on a connection the consumer opened just before it died, and
            # complete.
            await w.send(key("dial"), np.zeros(1))
            await eventually(lambda: connected(w, ("ps", 0)), "connected to the consumer")
            for _ in range(20):   # the consumer never receives: the window fills
                send = asyncio.ensure_future(w.send(k, chunk))
                # each send either completes or waits in the peer's queue for credit
                await eventually(lambda s=send: s.done() or queued() > 0, "the push went or waits")
                if not send.done():
                    blocked = send
                    break
                send.result()
            assert blocked is not None, "the push window never filled"
            proc.kill()
            with pytest.raises(rvz.PeerLost) as info:
                await blocked
            check_names_key_and_peer(info.value, k, "/job:ps")


# -- connecting -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_consumer_first_connects_once_the_producer_starts(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with rvz.Node(cluster, "ps", 0, mode, **FAST) as p:
        task = await pending(p.recv(key(), timeout=10), 0.3)   # the producer is not up
        async with rvz.Node(cluster, "worker", 0, mode, **FAST) as w:
            await w.send(key(), np.arange(4))
            assert (await task).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_producer_first_connects_once_the_consumer_starts(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with rvz.Node(cluster, "worker", 0, mode, **FAST) as w:
        send = asyncio.ensure_future(w.send(key(), np.arange(3)))
        await asyncio.sleep(0.3)                            # the consumer is not up
        async with rvz.Node(cluster, "ps", 0, mode, **FAST) as p:
            await send
            assert (await p.recv(key(), timeout=10)).tolist() == [0, 1, 2]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_recv_from_a_peer_that_never_comes_up(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with rvz.Node(cluster, "ps", 0, mode, **{**FAST, "connect_timeout": 0.3}) as p:
        k = key("never")
        with pytest.raises(rvz.PeerLost) as info:
            await p.recv(k, timeout=10)
        check_names_key_and_peer(info.value, k, "/job:worker")
        assert isinstance(info.value.__cause__, OSError)
        assert cluster.address("worker", 0) in str(info.value)


@pytest.mark.loop_timeout(15)
async def test_push_to_a_peer_that_never_comes_up(cluster) -> None:  # type: ignore[no-untyped-def]
    async with rvz.Node(cluster, "worker", 0, "send", **{**FAST, "connect_timeout": 0.3}) as w:
        k = key("nobody_home")
        with pytest.raises(rvz.PeerLost) as info:
            await w.send(k, np.arange(3))
        check_names_key_and_peer(info.value, k, "/job:ps")
        assert isinstance(info.value.__cause__, OSError)


@pytest.mark.loop_timeout(15)
async def test_peer_closing_gracefully_fails_waiters_with_peer_lost(cluster) -> None:  # type: ignore[no-untyped-def]
    async with rvz.Node(cluster, "ps", 0, "recv", **FAST) as p:
        w = await rvz.Node(cluster, "worker", 0, "recv", **FAST).start()
        await w.send(key("first"), np.arange(1))
        assert (await p.recv(key("first"), timeout=5)).tolist() == [0]
        task = await pending(p.recv(key("second"), timeout=10))
        await w.close()
        with pytest.raises(rvz.PeerLost) as info:
            await task
        check_names_key_and_peer(info.value, key("second"), "/job:worker")


# -- a peer that speaks garbage --------------------------------------------------------------


def three_task_cluster() -> rvz.ClusterSpec:
    ports = free_ports(3)
    return rvz.ClusterSpec({"worker": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"],
                            "raw": [f"127.0.0.1:{ports[2]}"]})


RAW_HELLO = _impl.codec.encode_hello({"v": _impl.codec.VERSION, "job": "raw", "task": 0,
                                      "inc": 5, "order": sys.byteorder})


def bad_data_frame(key_text: str) -> bytes:
    value, code, shape, nbytes = _impl.codec.describe(np.arange(2, dtype=np.int64))
    return (_impl.codec.encode_data(0, 0, key_text.encode(), code, shape, nbytes)
            + bytes(_impl.codec.payload_view(value)))


GARBAGE = {
    "not-a-frame": b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 64,
    "bad-hello": _impl.codec.encode_hello({"v": 1}),
    "hello-wrong-version": _impl.codec.encode_hello({"v": 99, "job": "raw", "task": 0, "inc": 1}),
    "hello-unknown-task": _impl.codec.encode_hello({"v": _impl.codec.VERSION, "job": "nobody",
                                                    "task": 3, "inc": 1}),
    "hello-bad-types": _impl.codec.encode_hello({"v": _impl.codec.VERSION, "job": "raw",
                                                 "task": [1], "inc": "x"}),
    "hello-negative-max-parked": _impl.codec.encode_hello({"v": _impl.codec.VERSION, "job": "raw",
                                                           "task": 0, "inc": 1, "park": -1}),
    "hello-max-parked-not-a-number": _impl.codec.encode_hello(
        {"v": _impl.codec.VERSION, "job": "raw", "task": 0, "inc": 1, "park": "x"}),
    "malformed-key": RAW_HELLO + bad_data_frame("not;a;key"),
    "key-without-task": RAW_HELLO + bad_data_frame("/device:CPU:0;0;/job:ps/task:0;x;0:0"),
    "misrouted-key": RAW_HELLO + bad_data_frame(str(key("x"))),  # claims to come from worker
    "request-malformed-key": RAW_HELLO + _impl.codec.encode_request(0, 1, b"a;b"),
    "data-unknown-task": RAW_HELLO + bad_data_frame(str(key("x", src="/job:nope/task:0"))),
    "request-unknown-task": RAW_HELLO + _impl.codec.encode_request(
        0, 1, str(key("x", src="/job:ps/task:0", dst="/job:nope/task:1")).encode()),
    "error-bad-fields": RAW_HELLO + _impl.codec._encode_map(_impl.codec.ERROR, {"req": "x"}),
    "msgpack-garbage": RAW_HELLO + _impl.codec._encode_map(_impl.codec.ERROR, {1: 2}) + b"\x07",
}


@pytest.mark.parametrize("name", sorted(GARBAGE))
@pytest.mark.loop_timeout(15)
async def test_garbage_from_a_peer_closes_only_that_connection(name) -> None:  # type: ignore[no-untyped-def]
    cluster = three_task_cluster()

    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    async with pair(cluster, "recv") as (w, p):
        # a healthy exchange is under way
        task = await pending(p.recv(key("healthy"), timeout=10))
        host, port = cluster.address("ps", 0).split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(GARBAGE[name])
            await writer.drain()
            # The node closes that connection (its HELLO may come first).
            data = await asyncio.wait_for(reader.read(), 5)
            assert data == b"" or data.startswith(_impl.codec.encode_hello({"v": 0})[:2])
        finally:
            writer.close()
        await w.send(key("healthy"), np.arange(2))
        assert (await task).tolist() == [0, 1]
        await w.send(key("healthy"), np.arange(3))
        assert (await p.recv(key("healthy"), timeout=5)).tolist() == [0, 1, 2]
    assert unhandled == [], [c.get("message") for c in unhandled]


@pytest.mark.loop_timeout(15)
async def test_error_frame_for_an_unknown_request_is_ignored() -> None:
    cluster = three_task_cluster()

    async with pair(cluster, "recv") as (w, p):
        host, port = cluster.address("ps", 0).split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(RAW_HELLO + _impl.codec.encode_error(12345, 0, "k", "x", "m")
                         + _impl.codec.encode_ping())
            await writer.drain()
            with pytest.raises(asyncio.TimeoutError):
                # the connection stays open: a stray answer is not a protocol violation
                await asyncio.wait_for(reader.read(), 0.3)
        finally:
            writer.close()
        await w.send(key(), np.arange(2))
        assert (await p.recv(key(), timeout=5)).tolist() == [0, 1]



@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(20)
async def test_a_restarted_peer_is_a_new_incarnation_and_works_again(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with rvz.Node(cluster, "ps", 0, mode, **FAST) as p:
        first = rvz.Node(cluster, "worker", 0, mode, incarnation=1, **FAST)
        await first.start()
        try:
            await first.send(key("before", incarnation=1), np.arange(3))
            assert (await p.recv(key("before", incarnation=1), timeout=5)).tolist() == [0, 1, 2]
            waiting = await pending(p.recv(key("lost", incarnation=1), timeout=10))
        finally:
            first.abort(RuntimeError("worker crashed"))  # no BYE: the peer just vanishes
        with pytest.raises(rvz.PeerLost) as info:
            await waiting
        check_names_key_and_peer(info.value, key("lost", incarnation=1), "/job:worker")
        assert p._peers[WORKER_ID].incarnation == 1
        # The worker comes back on the same address with a new incarnation.
        async with rvz.Node(cluster, "worker", 0, mode, incarnation=2, **FAST) as second:
            await second.send(key("after", incarnation=2), np.arange(2))
            assert (await p.recv(key("after", incarnation=2), timeout=5)).tolist() == [0, 1]
            assert p._peers[WORKER_ID].incarnation == 2


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.loop_timeout(20)
async def test_a_second_process_with_a_peers_task_id_is_refused_not_taken_in_turns(
        cluster, transport) -> None:  # type: ignore[no-untyped-def]
    # Two processes started as worker/0 (their cluster specs disagree on its address, so
    # both can listen). The second to reach ps looks like a restart and replaces the first;
    # the first must then be refused, clearly, and not replace the second in its turn (each
    # time failing what the other held, over and over).
    # A port of its own: neither node of ``cluster`` is listening yet, so a draw alone
    # could return one of theirs.
    taken = {cluster.address(job, 0) for job in ("worker", "ps")}
    port = next(p for p in free_ports(3) if f"127.0.0.1:{p}" not in taken)
    other = rvz.ClusterSpec({"worker": [f"127.0.0.1:{port}"], "ps": [cluster.address("ps", 0)]})
    opts = {**FAST, "transport": transport}
    async with rvz.Node(cluster, "ps", 0, "send", **opts) as p, \
            rvz.Node(cluster, "worker", 0, "send", **opts) as first, \
            rvz.Node(other, "worker", 0, "send", **opts) as second:
        await first.send(key("one"), np.arange(1))
        assert (await p.recv(key("one"), timeout=5)).tolist() == [0]
        await second.send(key("two"), np.arange(2))
        assert (await p.recv(key("two"), timeout=5)).tolist() == [0, 1]
        assert p._peers[WORKER_ID].incarnation == second.incarnation
        # ps dropped the first one's connection for the second's: the first one sees it go.
        await eventually(lambda: not connected(first, ("ps", 0)), "the first lost its link")
        # The first one talks to ps again: refused, saying why, and not retried for ever.
        back = key("back", src=PS, dst=WORKER)
        with pytest.raises((rvz.PeerLost, rvz.AuthError)) as info:
            await first.recv(back, mode="recv", timeout=5)
        assert "two processes run as /job:worker/replica:0/task:0" in str(info.value)
        assert p._peers[WORKER_ID].incarnation == second.incarnation
        await second.send(key("three"), np.arange(3))
        assert (await p.recv(key("three"), timeout=5)).tolist() == [0, 1, 2]
        first.abort(RuntimeError("the misconfigured one stops"))


@pytest.mark.loop_timeout(20)
async def test_a_dial_that_connects_to_itself_is_dropped_not_taken_for_the_peer(cluster) -> None:  # type: ignore[no-untyped-def]
    # Dialling a local port nobody listens on can connect the socket to itself (the kernel
    # picked that port as the source port). Such a connection must never be taken for the
    # peer: it is closed at once, so the dial tries again.
    async with rvz.Node(cluster, "worker", 0, "send", **FAST) as w:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.connect(sock.getsockname())  # simultaneous open with itself
        sock.setblocking(False)
        peer = w._core.routes.peer(("ps", 0))
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: w._connection(outbound=True, peer=peer),
                                               sock=sock)
        await eventually(lambda: conn.closed, "the self-connected socket was closed")
        # uvloop closed the fd with the transport, but this transport closed before
        # create_connection returned, and uvloop then leaves ``sock`` owning the closed fd's
        # number: collected later, it would close that number again, by then another
        # socket's (a later test's listener: its dials then hung on uvloop). asyncio's
        # transport has already detached it (fileno() is -1 there).
        sock.detach()
        assert isinstance(conn.close_reason, ConnectionRefusedError), conn.close_reason
        assert not conn.ready and peer.link is not conn



class Refusing:
    """A transport as uvloop's is once its connection is gone and before
    ``connection_lost`` reached the protocol: it refuses writes."""

    def __init__(self, closing: bool) -> None:
        self.closing = closing
        self.writes = 0

    def write(self, data: Any) -> None:
        self.writes += 1
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; "
                           "the handler is closed")

    writelines = write

    def is_closing(self) -> bool:
        return self.closing


async def test_a_write_refused_by_a_closing_transport_is_dropped_not_raised(cluster) -> None:  # type: ignore[no-untyped-def]
    """A frame queued before the connection was lost is flushed after it: uvloop refuses
    that write where asyncio drops it.  Dropped either way (what it carried is kept until
    acknowledged and goes again); a refusal by a transport that is not closing is raised."""
    async with pair(cluster, "send") as (w, p):
        await w.send(key("a"), b"first")
        assert await p.recv(key("a"), timeout=5) == b"first"
        (conn,) = [c for c in w._conns if c.ready]
        live = conn.transport
        try:
            # A frame leaves at once or at the flush, as the write timing of the moment
            # decides (``Wire._at_once``): the refusal may come from either call.
            conn.transport = gone = Refusing(closing=True)
            conn.write_frame(_impl.codec.encode_ping())
            conn.flush()
            assert gone.writes == 1
            conn.transport = broken = Refusing(closing=False)
            with pytest.raises(RuntimeError, match="handler is closed"):
                conn.write_frame(_impl.codec.encode_ping())
                conn.flush()
            assert broken.writes == 1
        finally:
            conn.transport = live
        await w.send(key("a"), b"second", timeout=10)
        assert await p.recv(key("a"), timeout=10) == b"second"

"""Bounds: a hostile or buggy peer can neither rob a node nor make it grow.

Each test is one attack, played by ``tests.hostile.Hostile`` (a raw protocol
client) against a node: the node must survive and its legitimate traffic must still flow.
Memory attacks run against a victim node in its own process (``tests.hostile.victim``), so its
peak RSS and virtual size are measured apart from the test's and printed (run with ``-s``).
The cluster: worker:0 (a real node), worker:1 (the identity the raw client uses), ps:0.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import numpy as np
import pytest

import rvz
from rvz import _impl

from .conftest import FAST, eventually, free_ports, key, pair
from .hostile import GiB, Hostile, MiB, data_frame, data_header, hello_fields, key_text, victim

codec = _impl.codec
W0 = ("worker", 0)
W1 = ("worker", 1)
PS0 = ("ps", 0)
W1_NAME = "/job:worker/replica:0/task:1"
U8 = codec.dtype_code(np.dtype(np.uint8))
COST = 64  # what one message costs in the push window beyond its payload
VICTIM = {"heartbeat": 0.05, "linger": 0.5, "peer_timeout": 30.0}


def three_tasks() -> rvz.ClusterSpec:
    w0, w1, p0 = free_ports(3)
    return rvz.ClusterSpec({"worker": [f"127.0.0.1:{w0}", f"127.0.0.1:{w1}"],
                            "ps": [f"127.0.0.1:{p0}"]})


def mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB"


def report(attack: str, before: dict[str, int], after: dict[str, int], extra: str = "") -> None:
    """One line per memory attack: the victim's RSS before and its peak during the attack."""
    print(f"\n[{rvz.loop_name()}/{rvz.implementation()}] {attack}: victim RSS {mib(before['VmRSS'])}"
          f" -> peak {mib(after['VmHWM'])}, VmSize {mib(before['VmSize'])} -> peak "
          f"{mib(after['VmPeak'])} {extra}")


async def legit_traffic_flows(cluster: rvz.ClusterSpec, v: Any, mode: str = "send") -> None:
    """The real worker:0 sends the victim ps:0 a value, and the victim receives it."""
    async with rvz.Node(cluster, "worker", 0, mode, **FAST) as w:
        await w.send(key("legit"), np.full(1000, 9, np.uint8), timeout=10)
        got = await v.call("recv", key=str(key("legit")), timeout=10)
        assert got.get("values") == [[1000, 9, True]], got


def step_stats(stats: dict[str, Any], step: int = 0) -> dict[str, int]:
    steps = stats["stats"]["steps"]
    return dict(steps.get(str(step), steps.get(step, {})))


def peer_stats(stats: dict[str, Any], name: str = W1_NAME) -> dict[str, Any]:
    return dict(stats["stats"]["peers"].get(name, {}))


# -- identity: who may take what ---------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, "s3cret-hostile-test"], ids=["no-secret", "secret"])
def test_a_request_for_another_tasks_value_gets_wrong_endpoint(run, secret) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        async with pair(cluster, "recv", secret=secret, claim_timeout=None) as (w, p):
            mine = key_text("for_worker0", PS0, W0)
            value = np.arange(6)
            await p.send(mine, value)                 # ps:0 holds it for worker:0
            h = await Hostile.connect(p.address)
            try:
                await h.hello("worker", 1, secret=secret)
                await h.send(codec.encode_request(0, 41, mine.encode()))
                event = await h.read_event()
                while event is not None and event[0] in ("AUTH", codec.PING, codec.CREDIT):
                    event = await h.read_event()
                assert event is not None and event[0] == codec.ERROR, event
                assert event[1]["req"] == 41 and event[1]["code"] == "WrongEndpoint", event
            finally:
                h.close()
            assert p.stats()["held"]["values"] == 1       # the value stayed
            got = await w.recv(mine, timeout=5)           # and the real worker:0 gets it
            assert got.tolist() == value.tolist()
            assert p.stats()["held"] == {"values": 0, "bytes": 0}

    run(body(), timeout=20)


def test_remote_frames_never_touch_a_nodes_local_keys(run) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        # A long linger: close() must not wait for a hold count gone wrong.
        p = rvz.Node(cluster, "ps", 0, "recv", **{**FAST, "linger": 60.0, "claim_timeout": None})
        await p.start()
        try:
            local = key_text("to_myself", PS0, PS0)
            await p.send(local, np.arange(3))
            h = await Hostile.connect(p.address)
            try:
                await h.hello("worker", 1)
                await h.send(codec.encode_request(0, 9, local.encode()))
                event = await h.read_event()
                assert event is not None and event[0] == codec.ERROR, event
                assert event[1]["code"] == "WrongEndpoint", event
            finally:
                h.close()
            # A value pushed for the local key is refused: that connection is closed.
            h = await Hostile.connect(p.address)
            try:
                await h.hello("worker", 1)
                await h.send(data_frame(0, 0, local, np.full(3, 99)))
                got = await h.events_until_closed(5)
                assert not any(e[0] == codec.DATA for e in got), got
            finally:
                h.close()
            assert (await p.recv(local, timeout=5)).tolist() == [0, 1, 2]
            stats = p.stats()
            assert stats["steps"].get(0, {}).get("queued_values", 0) == 0, stats["steps"]
            assert stats["held"] == {"values": 0, "bytes": 0}
            assert p._held_count == 0
        finally:
            await asyncio.wait_for(p.close(), 10)  # well within the linger of 60 s

    run(body(), timeout=20)


def test_a_data_many_frame_with_one_misrouted_key_queues_none_of_its_values(run) -> None:  # type: ignore[no-untyped-def]
    """A DATA_MANY frame is checked whole before any of its values is queued: one key that
    does not route from the sender to us (here, the node's own local key) closes that
    connection, and the frame's valid values are not kept either."""
    async def body() -> None:
        cluster = three_tasks()
        async with pair(cluster, "send") as (w, p):
            good = key_text("good", W1, PS0)
            local = key_text("to_myself", PS0, PS0)
            h = await Hostile.connect(p.address)
            try:
                await h.hello("worker", 1, mode="send")
                await h.send(codec.encode_data_many(0, [(good.encode(), np.arange(3)),
                                                        (local.encode(), np.arange(2))]))
                await h.events_until_closed(5)
            finally:
                h.close()
            stats = p.stats()
            assert stats["steps"].get(0, {}).get("queued_values", 0) == 0, stats["steps"]
            with pytest.raises((TimeoutError, rvz.PeerLost)):  # (lost once its close is seen)
                await p.recv(good, timeout=0.2)
            # Empty frames make no step tables (steps a peer makes are a bounded resource).
            h = await Hostile.connect(p.address)
            try:
                await h.hello("worker", 1, mode="send")
                def made() -> int:  # tables of those steps (a heartbeat drops empty ones)
                    return len([s for s in p.stats()["steps"] if s >= 100])

                def read() -> int:  # messages p read from us (values and control frames)
                    return int(p.stats()["peers"].get(W1_NAME, {}).get("messages_in", 0))

                before = read()
                await h.send(b"".join(codec.encode_data_many(100 + i, []) for i in range(50))
                             + codec.encode_ping())
                seen = 0
                for _ in range(5000):  # every loop iteration until the PING after them is read
                    seen = max(seen, made())
                    if read() > before:
                        break
                    await asyncio.sleep(0)
                assert max(seen, made()) == 0, seen
            finally:
                h.close()
            # A well-formed frame from the same identity is taken, in order.
            h = await Hostile.connect(p.address)
            try:
                await h.hello("worker", 1, mode="send")
                await h.send(codec.encode_data_many(0, [(good.encode(), np.arange(i))
                                                        for i in range(4)]))
                got = await p.recv_many([good] * 4, timeout=5)
                assert [g.tolist() for g in got] == [list(range(i)) for i in range(4)]
            finally:
                h.close()
            await w.send(key("after"), np.arange(2))
            assert (await p.recv(key("after"), timeout=5)).tolist() == [0, 1]

    run(body(), timeout=20)


def test_a_producer_that_ignores_credit_with_data_many_frames_is_closed(run) -> None:  # type: ignore[no-untyped-def]
    """The push window counts every value of a DATA_MANY frame: a producer that sends them
    past twice the window is closed, and what the node kept stays within that bound."""
    async def body() -> None:
        cluster = three_tasks()
        window = 256 << 10
        async with pair(cluster, "send", ps={"push_window": window}) as (w, p):
            k = key_text("flood", W1, PS0)
            h = await Hostile.connect(p.address)
            try:
                await h.hello("worker", 1, mode="send")
                frame = codec.encode_data_many(0, [(k.encode(), np.full(4000, 7, np.uint8))] * 7)
                written = await h.flood(frame for _ in range(200))  # 5.6 MB at 256 KiB
                await h.events_until_closed(10)
            finally:
                h.close()
            assert written < 200
            queued = p.stats()["steps"].get(0, {}).get("queued_values", 0)
            assert 7 <= queued and queued * (4000 + COST) <= 2 * window + 7 * (4000 + COST), queued
            assert all(int(x[0]) == 7 for x in await p.recv_many([k] * queued, timeout=5))
            await w.send(key("after"), np.arange(2))
            assert (await p.recv(key("after"), timeout=5)).tolist() == [0, 1]

    run(body(), timeout=30)


# -- memory: credit ------------------------------------------------------------------------------


def test_a_producer_that_ignores_credit_is_closed_and_its_accepted_values_kept(run) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        window = 1 * MiB
        size = 64 << 10
        async with victim(cluster, "ps", 0, "send", push_window=window, **VICTIM) as v:
            before = v.mem()
            k = key_text("flood", W1, PS0)
            h = await Hostile.connect(v_address(cluster))
            try:
                node_hello = await h.hello("worker", 1)
                assert node_hello.get("win") == window, node_hello
                await eventually_async(v, lambda s: peer_stats(s).get("state") == "connected",
                                       "the victim read our HELLO")
                total = 1280  # 80 MiB against a window of 1 MiB
                frames = (data_frame(0, 0, k, np.full(size, i % 256, np.uint8)) for i in range(total))
                written = await h.flood(frames)
                await h.events_until_closed(10)
            finally:
                h.close()
            assert written < total, "the victim took 80 MiB against a 1 MiB window"
            stats = await v.call("stats")
            report("producer ignoring credit (80 MiB at a 1 MiB window)", before, v.mem())
            queued = step_stats(stats).get("queued_values", 0)
            # The documented bound: twice the window (what a producer that reconnected
            # cannot know it still owes is allowed for), and one message more.
            assert 1 <= queued and queued * (size + COST) <= 2 * window + size + COST, (queued, stats)
            unreturned = peer_stats(stats).get("unreturned")
            assert unreturned is not None and unreturned <= 2 * window + size + COST, stats
            assert stats["unhandled"] == []
            # The values accepted before the overrun are kept, in order.
            got = await v.call("recv", key=k, count=queued, timeout=5)
            assert got.get("values") == [[size, i % 256, True] for i in range(queued)], got
            await legit_traffic_flows(cluster, v)

    run(body(), timeout=40)


def test_answers_to_our_requests_do_not_count_against_the_push_window(run) -> None:  # type: ignore[no-untyped-def]
    """Answers need no credit: the window does not count them.  On a one-sided connection an
    answer the producer sent after a push can arrive first (the push waits for slots, the
    answer is written into its destination at once), so a push arriving behind an answer
    the consumer has not credited back yet is within the window.  Played here by a raw
    producer answering a request whose recv timed out (its value stays queued, so no
    credit goes back), then pushing a whole window."""
    async def body() -> None:
        cluster = three_tasks()
        window = 1 * MiB
        async with pair(cluster, "send", ps={"push_window": window}) as (w, p):
            asked, pushed = key_text("asked", W1, PS0), key_text("pushed", W1, PS0)
            h = await Hostile.connect(p.address)
            try:
                await h.hello("worker", 1, mode="send")
                with pytest.raises(TimeoutError):
                    await p.recv(asked, mode="recv", timeout=0.3)
                event = await h.read_event()
                while event is not None and event[0] != codec.REQUEST:
                    event = await h.read_event()
                assert event is not None, "the consumer never asked"
                await h.send(data_frame(0, event[2], asked, np.full(window, 1, np.uint8))
                             + data_frame(0, 0, pushed, np.full(window, 2, np.uint8)))
                got = await p.recv(pushed, timeout=5)
                assert got.nbytes == window and got[0] == 2
                assert (await p.recv(asked, timeout=5))[0] == 1   # the late answer, kept
                await asyncio.sleep(0.2)
                peer = peer_stats({"stats": p.stats()})
                assert peer["state"] == "connected" and not h.eof, peer   # not closed
                assert peer["unreturned"] <= 2 * (window + COST), peer
            finally:
                h.close()

    run(body(), timeout=20)


@pytest.mark.parametrize("size", [100, 64 << 10, 1 << 20], ids=["small", "64KiB", "1MiB"])
def test_a_value_in_the_same_write_as_hello_is_accepted(run, size) -> None:  # type: ignore[no-untyped-def]
    # A producer may push as soon as it read the node's HELLO, so its HELLO and its first
    # value can reach the node in one read: that is no violation.
    async def body() -> None:
        cluster = three_tasks()
        async with pair(cluster, "send") as (w, p):
            h = await Hostile.connect(p.address)
            try:
                k = key_text("eager", W1, PS0)
                value = np.full(size, 5, np.uint8)
                assert await h.send(codec.encode_hello(hello_fields("worker", 1, 7, mode="send"))
                                    + data_frame(0, 0, k, value))
                got = await p.recv(k, timeout=3)
                assert got.nbytes == size and (got == 5).all()
            finally:
                h.close()
            await w.send(key("after"), np.arange(2))
            assert (await p.recv(key("after"), timeout=5)).tolist() == [0, 1]

    run(body(), timeout=20)


def v_address(cluster: rvz.ClusterSpec) -> str:
    return cluster.address("ps", 0)


def test_the_push_window_survives_reconnects(run) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        window = 1 * MiB
        size = 64 << 10
        fits = window // (size + COST)        # what one window holds: 15 messages
        async with victim(cluster, "ps", 0, "send", push_window=window, **VICTIM) as v:
            before = v.mem()
            k = key_text("again", W1, PS0)
            most = 0
            for drop in range(4):             # a first connection and 3 reconnects
                h = await Hostile.connect(v_address(cluster))
                try:
                    await h.hello("worker", 1, 7)  # the same process: the same incarnation
                    await eventually_async(v, lambda s: peer_stats(s).get("state") == "connected",
                                           "the victim read our HELLO")
                    await h.flood(data_frame(0, 0, k, np.full(size, drop, np.uint8))
                                  for _ in range(fits))
                    await asyncio.sleep(0.1)
                finally:
                    h.close()
                stats = await v.call("stats")
                queued = step_stats(stats).get("queued_values", 0)
                most = max(most, queued)
                assert queued * (size + COST) <= 2 * window + size + COST, (drop, queued, stats)
            report("credit reset by reconnecting (4 connections)", before, v.mem(),
                   f"most values held {most} ({mib(most * size)})")
            assert most >= 1
            got = await v.call("recv", key=k, count=most, timeout=5)
            assert len(got.get("values", [])) == most, got
            await legit_traffic_flows(cluster, v)

    run(body(), timeout=40)


# -- memory: parked requests and steps -----------------------------------------------------------


def requests_frames(first: int, count: int, steps: int, name: str, src: tuple[str, int],
                    per_frame: int = 500) -> list[bytes]:
    """REQUESTS frames for ``count`` distinct never-sent keys, spread over ``steps`` steps."""
    frames = []
    for start in range(first, first + count, per_frame):
        n = min(per_frame, first + count - start)
        entries = [(i + 1, key_text(f"{name}_{i}", src, W1).encode()) for i in range(start, start + n)]
        frames.append(codec.encode_requests(1 + (start // per_frame) % steps, entries))
    return frames


def test_parked_requests_are_capped_and_gone_when_the_requester_leaves(run) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        cap = 5000
        async with victim(cluster, "ps", 0, "recv", max_parked=cap, **VICTIM) as v:
            before = v.mem()
            h = await Hostile.connect(v_address(cluster))
            try:
                await h.hello("worker", 1)
                # Up to the cap: parked, the connection stays.
                assert await h.flood(requests_frames(0, cap, 50, "never", PS0))
                await eventually_async(v, lambda s: peer_stats(s).get("parked_requests") == cap,
                                       "the victim parked exactly max_parked requests")
                # 125k more: that connection is closed.
                written = await h.flood(requests_frames(cap, 125_000, 50, "never", PS0))
                await h.events_until_closed(10)
            finally:
                h.close()
            assert written < 250, "130k requests were all taken"
            # Once the requester left, nothing of it stays in the tables.
            stats = await eventually_async(
                v, lambda s: not s["stats"]["steps"] and not peer_stats(s).get("parked_requests"),
                "the requests and their tables are gone")
            report("130k requests for keys never sent", before, v.mem())
            assert stats["unhandled"] == []
            await legit_traffic_flows(cluster, v)

    run(body(), timeout=50)


def test_a_request_id_reused_while_parked_closes_the_connection(run) -> None:  # type: ignore[no-untyped-def]
    """A second request with the id of a parked one replaced it in the connection's count:
    50k of them escaped max_parked, and all but the last outlived the connection in their
    keys' queues (step 0 never expires)."""
    async def body() -> None:
        cluster = three_tasks()
        async with victim(cluster, "ps", 0, "recv", **VICTIM) as v:
            h = await Hostile.connect(v_address(cluster))
            try:
                await h.hello("worker", 1)
                await h.send(b"".join(codec.encode_request(0, 7, key_text(f"dup_{i}", PS0, W1).encode())
                                      for i in range(3)))
                await h.events_until_closed(5)
            finally:
                h.close()
            stats = await eventually_async(
                v, lambda s: not s["stats"]["steps"] and not peer_stats(s).get("parked_requests"),
                "nothing of the requester stays in the tables")
            assert stats["unhandled"] == []
            await legit_traffic_flows(cluster, v)

    run(body(), timeout=30)


def test_error_replies_for_a_dead_step_are_bounded_by_answer_backlog(run) -> None:  # type: ignore[no-untyped-def]
    """Requests in a step the peer itself cleaned up get one ERROR each; a peer that never
    reads them was not closed (4 GiB in 12 s in the probe that found it), unlike one whose
    requests get WrongEndpoint."""
    async def body() -> None:
        cluster = three_tasks()
        async with victim(cluster, "ps", 0, "recv", answer_backlog=1 * MiB, **VICTIM) as v:
            h = await Hostile.connect(v_address(cluster), rcvbuf=4096)
            try:
                await h.hello("worker", 1)
                await h.send(codec.encode_abort_step(1, "over"))
                await h.flood(requests_frames(0, 100_000, 1, "d" * 100, PS0, per_frame=100))
                # The replies are not read until the victim gives up: reading them would drain
                # the backlog that closes it.  (100,000 requests take the pure-Python victim
                # seconds on a loaded machine.)
                await eventually_logged(v, "does not read the replies", within=30)
                await h.events_until_closed(10)
            finally:
                h.close()
            stats = await v.call("stats")
            assert stats["unhandled"] == []
            await legit_traffic_flows(cluster, v)

    run(body(), timeout=60)


async def eventually_logged(v: Any, text: str, within: float) -> None:
    """Poll the victim's warnings until one contains ``text``; fail showing them."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        logs = await v.call("logs")
        if any(text in line for line in logs["lines"]):
            return
        if loop.time() > end:
            raise AssertionError(f"never logged {text!r}: {logs['lines'][-10:]}")
        await asyncio.sleep(0.05)


async def eventually_async(v: Any, predicate: Any, what: str, within: float = 8.0) -> dict[str, Any]:
    """Poll the victim's stats until ``predicate(stats)`` holds; fail naming ``what``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        stats = await v.call("stats")
        if predicate(stats):
            return dict(stats)
        if loop.time() > end:
            raise AssertionError(f"never happened: {what}: {stats['stats']['peers']} "
                                 f"steps={list(stats['stats']['steps'])[:20]}")
        await asyncio.sleep(0.05)


def test_steps_made_by_a_peer_are_capped_and_expire_when_idle(run) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        cap = 200
        async with victim(cluster, "ps", 0, "send", max_steps=cap, step_idle=1.0, **VICTIM) as v:
            before = v.mem()
            k = key_text("stepper", W1, PS0)
            h = await Hostile.connect(v_address(cluster))
            try:
                await h.hello("worker", 1)
                batches = (b"".join(data_frame(s, 0, k, b"x") for s in range(start, start + 1000))
                           for start in range(1, 50_001, 1000))
                written = await h.flood(batches)
                await h.events_until_closed(10)
            finally:
                h.close()
            assert written < 50, "50k steps were all taken"
            stats = await v.call("stats")
            assert len(stats["stats"]["steps"]) <= cap, len(stats["stats"]["steps"])
            # step_idle: the tables nothing touches any more are dropped.
            await eventually_async(v, lambda s: not s["stats"]["steps"],
                                   "idle steps were dropped", within=10)
            report("50k steps never cleaned up", before, v.mem())
            await legit_traffic_flows(cluster, v)

    run(body(), timeout=50)


def test_a_step_idle_for_step_idle_seconds_fails_its_waiters(run, caplog) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        async with pair(cluster, "send", ps={"step_idle": 0.3}) as (w, p):
            with caplog.at_level(logging.INFO, logger="rvz"):
                with pytest.raises(rvz.Aborted) as info:
                    await p.recv(key("never"), step=77, timeout=10)
            assert "77" in str(info.value), str(info.value)
            # A recv failed: a warning that says so, not an INFO line.
            expired = [r for r in caplog.records if "step 77 expired" in r.getMessage()]
            assert [(r.levelno, r.getMessage().split("; ")[1]) for r in expired] == [
                (logging.WARNING, "dropped 0 value(s) of 0 key(s), failed 1 recv(s)")]
            await w.send(key("later"), np.arange(2))
            assert (await p.recv(key("later"), timeout=5)).tolist() == [0, 1]

    run(body(), timeout=20)


# -- memory: connections -------------------------------------------------------------------------


def test_unidentified_connections_are_capped_and_timed_out(run) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        cap = 16
        async with victim(cluster, "ps", 0, "send", max_unidentified=cap, hello_timeout=2.0,
                          **VICTIM) as v:
            before = v.mem()
            silent = [await Hostile.connect(v_address(cluster)) for _ in range(100)]
            try:
                # The victim accepts them: at most ``cap`` wait for a HELLO once the close
                # callbacks of those beyond it have run (each counts until its own has).
                await eventually_async(v, lambda s: 1 <= s["stats"]["unidentified"] <= cap,
                                       f"at most {cap} silent connections waiting")
                # Every one of them is closed: at once beyond the cap, the rest at hello_timeout.
                await asyncio.gather(*(h.events_until_closed(10) for h in silent))
            finally:
                for h in silent:
                    h.close()
            await eventually_async(v, lambda s: s["stats"]["unidentified"] == 0,
                                   "no unidentified connection left")
            report("100 connections that never say HELLO", before, v.mem())
            await legit_traffic_flows(cluster, v)

    run(body(), timeout=40)


def test_connections_with_a_refused_handshake_count_as_unidentified(run) -> None:  # type: ignore[no-untyped-def]
    """A refused handshake (a HELLO asking for a secret the node does not have) leaves the
    connection waiting for the peer to read the ERROR and hang up.  Those did not count:
    1,500 of them held 390 MB until hello_timeout, with max_unidentified at 8."""
    async def body() -> None:
        cluster = three_tasks()
        cap = 8
        async with victim(cluster, "ps", 0, "send", max_unidentified=cap, hello_timeout=5.0,
                          **VICTIM) as v:
            fds_before = len(os.listdir(f"/proc/{v.proc.pid}/fd"))
            refused = [await Hostile.connect(v_address(cluster)) for _ in range(60)]
            try:
                for h in refused:  # never read: the node's ERROR stays unread
                    await h.send(codec.encode_hello(hello_fields("worker", 1, 7, auth=True,
                                                                 nonce=os.urandom(16))))
                await asyncio.sleep(0.3)
                stats = await v.call("stats")
                assert stats["stats"]["unidentified"] <= cap, stats["stats"]["unidentified"]
                # the node's own sockets: the refused connections beyond the cap are gone
                held = len(os.listdir(f"/proc/{v.proc.pid}/fd")) - fds_before
                assert held <= cap + 2, f"the node holds {held} more file descriptors"
            finally:
                for h in refused:
                    h.close()
            await legit_traffic_flows(cluster, v)

    run(body(), timeout=40)


def test_six_hundred_identified_connections_that_only_ping(run) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        async with victim(cluster, "ps", 0, "send", **VICTIM) as v:
            await v.call("reset_peak")
            before = v.mem()
            conns: list[Hostile] = []

            async def one() -> Hostile:
                h = await Hostile.connect(v_address(cluster))
                conns.append(h)
                await h.hello("worker", 1, 7)
                await h.send(codec.encode_ping())
                return h

            try:
                for _ in range(75):   # 600, 8 at a time: never more than 8 unidentified
                    await asyncio.gather(*(one() for _ in range(8)))
                # (a peer's hello() returns once it read the node's HELLO, which the node
                # writes before it reads the peer's: the last ones may still be in flight)
                stats = await eventually_async(v, lambda s: s["stats"]["unidentified"] == 0,
                                               "every connection completed its handshake")
                after = v.mem()
                report("600 connections that say HELLO then only ping", before, after,
                       f"({(after['VmHWM'] - before['VmRSS']) / 600 / 1024:.0f} KiB each)")
                assert stats["stats"]["unidentified"] == 0
                assert stats["unhandled"] == []
                await legit_traffic_flows(cluster, v)
            finally:
                for h in conns:
                    h.close()

    run(body(), timeout=50)


def test_a_connection_refused_for_max_unidentified_gets_no_hello(run) -> None:  # type: ignore[no-untyped-def]
    """A connection beyond max_unidentified is refused before anything is written to it.
    It used to get the node's HELLO first: a Send-Driven dialler without a secret took it
    as ready and its sends returned, while the node had reset it, and nothing arrived.  Now
    the dialler sees no HELLO and dials again: what its sends report as sent arrives."""
    async def body() -> None:
        cluster = three_tasks()
        options = {**FAST, "max_unidentified": 2, "hello_timeout": 30.0, "peer_timeout": 30.0}
        async with rvz.Node(cluster, "ps", 0, "send", **options) as p:
            silent = [await Hostile.connect(p.address) for _ in range(2)]
            try:
                await eventually(lambda: p.stats()["unidentified"] == 2, "2 unidentified")
                extra = await Hostile.connect(p.address)
                try:
                    assert await extra.events_until_closed(5) == []  # not even a HELLO
                finally:
                    extra.close()
                async with rvz.Node(cluster, "worker", 0, "send", **FAST) as w:
                    dials: list[int] = []
                    dial = w._connection

                    def counted(outbound: bool, peer: Any = None) -> Any:
                        dials.append(1)
                        return dial(outbound, peer)

                    w._connection = counted  # type: ignore[method-assign]
                    sends = [asyncio.ensure_future(w.send(key(f"v{i}"), np.full(10, i), timeout=15))
                             for i in range(20)]
                    # Refused again and again (or, before, taken as ready: the sends return).
                    await eventually(lambda: len(dials) >= 3 or all(s.done() for s in sends),
                                     "three dials refused")
                    for h in silent:
                        h.close()
                    results = await asyncio.gather(*sends, return_exceptions=True)
                    sent = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
                    assert sent == list(range(20)), results
                    for i in sent:
                        got = await p.recv(key(f"v{i}"), timeout=5)
                        assert got.tolist() == [i] * 10
            finally:
                for h in silent:
                    h.close()

    run(body(), timeout=40)


def reserved(node: rvz.Node) -> int:
    """Bytes of large payloads the node's connections have arrays reserved for and still
    wait for (each header admitted reserves its whole payload)."""
    return sum(int(c.decoder.payload_left()) for c in node._conns if not c.closed)


def test_large_pushes_started_at_once_on_several_connections_share_one_window(run) -> None:  # type: ignore[no-untyped-def]
    """Eight connections of one peer each start a push of 16 MiB at once, against a window
    of 1 MiB.  Each header used to pass on its own (nothing was unreturned yet) and reserve
    its array: eight payloads at once (eight times max_payload, at worst).  What is
    still arriving now counts against the window across the peer's connections: one is
    admitted, the others are refused at their header, and the reservation is given back
    when the connections close."""
    async def body() -> None:
        cluster = three_tasks()
        window = 1 * MiB
        size = 16 * MiB
        options = {"push_window": window, "peer_timeout": 30.0}
        async with pair(cluster, "send", ps=options) as (w, p):
            conns = [await Hostile.connect(p.address) for _ in range(8)]
            peak = 0

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, reserved(p))
                    await asyncio.sleep(0.002)

            watcher = asyncio.ensure_future(watch())
            try:
                for h in conns:
                    await h.hello("worker", 1, 7)
                header = data_header(0, 0, key_text("big", W1, PS0), U8, (size,), size)
                await asyncio.gather(*(h.send(header + bytes(4096)) for h in conns))
                closed = await asyncio.gather(*(h.events_until_closed(5) for h in conns),
                                              return_exceptions=True)
                peak = max(peak, reserved(p))
                assert peak <= size, f"{peak / MiB:.0f} MiB reserved at once"
                assert all(not isinstance(c, BaseException) for c in closed), closed
            finally:
                watcher.cancel()
                for h in conns:
                    h.close()
            await eventually(lambda: reserved(p) == 0, "no payload reserved")
            stats = p.stats()["peers"][W1_NAME]
            assert stats["arriving"] == 0 and stats["unreturned"] == 0, stats
            await w.send(key("legit"), np.full(1000, 9, np.uint8), timeout=10)
            assert (await p.recv(key("legit"), timeout=10)).tolist() == [9] * 1000

    run(body(), timeout=30)


async def trickle(h: Hostile, data: bytes, rate: int, tick: float = 0.02) -> bool:
    """Write ``data`` at about ``rate`` bytes/s; False once the node has closed."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    sent = 0
    while sent < len(data):
        due = int((loop.time() - start + tick) * rate)
        if due > sent and not await h.send(data[sent:due]):
            return False
        sent = max(sent, due)
        await asyncio.sleep(tick)
    return True


@pytest.mark.parametrize("rate", ["slower", "faster"])
def test_a_payload_trickled_below_min_rate_is_closed_and_its_reservation_freed(run, rate, caplog) -> None:  # type: ignore[no-untyped-def]
    """A producer that trickles a payload kept its connection, and the array reserved at
    the header, for ever: bytes came at every heartbeat.  Past peer_timeout a payload must
    now keep up min_rate on average.  One trickled at a fifth of it is closed (the reason
    names min_rate) and its reservation freed; one at thrice min_rate, a slow but working
    link, arrives."""
    async def body() -> None:
        cluster = three_tasks()
        min_rate = 128 << 10
        options = {**FAST, "peer_timeout": 0.5, "min_rate": min_rate}
        async with rvz.Node(cluster, "ps", 0, "send", **options) as p:
            k = key_text("slow", W1, PS0)
            value = np.full(512 << 10, 3, np.uint8)  # about 1.3 s at thrice min_rate
            h = await Hostile.connect(p.address)
            try:
                await h.hello("worker", 1, 7)
                if rate == "faster":
                    assert await trickle(h, data_frame(0, 0, k, value), 3 * min_rate)
                    got = await p.recv(k, timeout=10)
                    assert got.nbytes == value.nbytes and (got == 3).all()
                else:
                    with caplog.at_level(logging.WARNING, logger="rvz"):
                        delivered = await asyncio.wait_for(
                            trickle(h, data_frame(0, 0, k, value), min_rate // 5), 10)
                        assert not delivered, "the node kept a payload far below min_rate"
                        await eventually(lambda: reserved(p) == 0, "the reservation freed")
                    assert any("min_rate" in r.getMessage() for r in caplog.records), \
                        [r.getMessage() for r in caplog.records]
                    assert p.stats()["peers"][W1_NAME]["arriving"] == 0
            finally:
                h.close()

    run(body(), timeout=30)


# -- memory: headers and backlog -----------------------------------------------------------------


HUGE = 15 * GiB


@pytest.mark.parametrize("variant", ["push", "unknown-answer", "bytes"])
def test_a_15_gib_header_is_refused_before_any_allocation(run, variant) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        async with victim(cluster, "ps", 0, "send", **VICTIM) as v:
            before = v.mem()
            k = key_text("huge", W1, PS0)
            if variant == "bytes":
                header = data_header(0, 0, k, codec.BYTES_CODE, (), HUGE)
            else:
                header = data_header(0, 0 if variant == "push" else 4242, k, U8, (HUGE,), HUGE)
            for _ in range(8):
                h = await Hostile.connect(v_address(cluster))
                try:
                    await h.hello("worker", 1, 7)
                    await h.send(header + bytes(MiB))
                    await h.events_until_closed(3)
                finally:
                    h.close()
            after = v.mem()
            report(f"8 DATA headers of 15 GiB ({variant})", before, after)
            assert after["VmPeak"] < max(before["VmPeak"], before["VmSize"]) + GiB, (before, after)
            stats = await v.call("stats")
            assert step_stats(stats).get("queued_values", 0) == 0
            await legit_traffic_flows(cluster, v)

    run(body(), timeout=40)


def wmem_max() -> int:
    """The most a TCP socket's kernel send buffer holds here (tcp_wmem's maximum)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 4 * MiB


def test_answers_to_a_requester_that_never_reads_wait_beyond_the_backlog(run) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        backlog = 4 * MiB
        count = 40
        async with victim(cluster, "ps", 0, "recv", answer_backlog=backlog,
                          claim_timeout=None, **VICTIM) as v:
            held = key_text("held", PS0, W1)
            await v.call("send", key=held, size=MiB, count=count)   # 40 MiB held for worker:1
            await v.call("reset_peak")
            before = v.mem()
            h = await Hostile.connect(v_address(cluster), rcvbuf=4096)
            try:
                await h.hello("worker", 1)
                asks = [codec.encode_request(0, 1 + i, held.encode()) for i in range(count)]
                assert await h.send(b"".join(asks))
                await asyncio.sleep(0.5)   # the victim answers what it may, then waits
                after = v.mem()
            finally:
                h.close()
            # Beyond the backlog (plus one answer, the kernel's send buffer and ours) the
            # answers waited: once the requester is gone their values are held again.
            most = (backlog + MiB + wmem_max() + MiB) // MiB
            stats = await eventually_async(v, lambda s: peer_stats(s).get("state") != "connected",
                                           "the requester left")
            report(f"a requester that never reads ({count} x 1 MiB asked)", before, after,
                   f"{count - stats['held']} answered, {stats['held']} held back")
            assert stats["held"] >= count - most, (stats["held"], most)
            assert stats["unhandled"] == []
            await legit_traffic_flows(cluster, v, "recv")

    run(body(), timeout=40)


def test_a_requester_that_never_reads_cannot_make_the_victim_hold_past_hold_limit(run) -> None:  # type: ignore[no-untyped-def]
    # Requests waiting for values not sent yet take each value at once, whatever is held;
    # with a requester that never reads, the answers wait in the victim.  They count as
    # held: past hold_limit the victim's sends wait (and time out) instead of each value
    # moving into answers that never leave.
    async def body() -> None:
        cluster = three_tasks()
        limit = 8 * MiB
        count = 64
        async with victim(cluster, "ps", 0, "recv", answer_backlog=2 * MiB, hold_limit=limit,
                          claim_timeout=None, **VICTIM) as v:
            held = key_text("asked", PS0, W1)
            h = await Hostile.connect(v_address(cluster), rcvbuf=4096)
            try:
                await h.hello("worker", 1)
                asks = [codec.encode_request(0, 1 + i, held.encode()) for i in range(count)]
                assert await h.send(b"".join(asks))
                await eventually_async(v, lambda s: peer_stats(s).get("parked_requests") == count,
                                       "the requests are parked")
                sent = await v.call("send", key=held, size=MiB, count=count, send_timeout=1.0)
                stats = await v.call("stats")
            finally:
                h.close()
            assert sent.get("error") == "TimeoutError", sent
            deferred = peer_stats(stats)["deferred_answers"]
            assert 0 < deferred <= limit // MiB, stats
            assert stats["stats"]["held"]["bytes"] <= limit, stats["stats"]["held"]
            assert stats["unhandled"] == []
            await legit_traffic_flows(cluster, v, "recv")

    run(body(), timeout=40)


def test_a_requester_that_never_reads_cannot_make_the_victim_buffer_errors(run) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        async with victim(cluster, "ps", 0, "recv", answer_backlog=4 * MiB, max_parked=2000,
                          **VICTIM) as v:
            await v.call("reset_peak")
            before = v.mem()
            h = await Hostile.connect(v_address(cluster), rcvbuf=4096)
            try:
                await h.hello("worker", 1)
                # 200k requests whose key the victim is not the source of: each would cost it
                # an ERROR frame about three times the request's size.
                wrong = requests_frames(0, 200_000, 1, "wrong", W0)
                written = await h.flood(wrong)
                await asyncio.sleep(0.3)
                stats = await v.call("stats")
                after = v.mem()
            finally:
                h.close()
            growth = after["VmHWM"] - before["VmRSS"]
            report("a requester that never reads (200k requests answered by ERROR)", before, after,
                   f"growth {mib(growth)}; {written} of {len(wrong)} frames written")
            assert growth < 48 * MiB, (before, after)
            assert stats["unhandled"] == []
            await legit_traffic_flows(cluster, v)

    run(body(), timeout=40)


# -- errors that escape --------------------------------------------------------------------------


def hello(**fields: Any) -> bytes:
    return codec.encode_hello({**hello_fields("worker", 1, 7), **fields})


GOOD_HELLO = hello()
PS_KEY = key_text("x", W1, PS0)

# The connection must be closed (a ProtocolError on it).
MUST_CLOSE = {
    "hello-task-inf": hello(task=float("inf")),
    "hello-task-nan": hello(task=float("nan")),
    "hello-task-huge": hello(task=(1 << 64) - 1),
    "hello-task-negative": hello(task=-(1 << 63)),
    "hello-inc-inf": hello(inc=float("inf")),
    "hello-inc-negative": hello(inc=-1),
    "hello-win-inf": hello(win=float("inf")),
    "hello-job-map": hello(job={"a": 1}),
    "data-1-pib": GOOD_HELLO + data_header(0, 0, PS_KEY, U8, (1 << 50,), 1 << 50),
    "data-shape-overflow": GOOD_HELLO + data_header(0, 0, PS_KEY, codec.dtype_code(np.dtype(np.float64)),
                                                    (1 << 40, 1 << 40), 8),
    "data-empty-overflow": GOOD_HELLO + data_header(0, 0, PS_KEY, codec.dtype_code(np.dtype(np.float64)),
                                                    (0, 1 << 62, 1 << 62), 0),
}
# Either refused or harmless: no exception may escape, and the node keeps serving.
MAY_STAY = {
    "hello-win-huge": hello(win=(1 << 64) - 1),
    "hello-win-negative": hello(win=-5),
    "credit-huge": GOOD_HELLO + codec.encode_credit((1 << 64) - 1),
    "cancel-huge": GOOD_HELLO + codec.encode_cancel((1 << 64) - 1),
    "request-huge-ids": GOOD_HELLO + codec.encode_request(
        (1 << 64) - 1, (1 << 64) - 1, key_text("y", PS0, W1).encode()),
    "error-req-huge": GOOD_HELLO + codec.encode_error((1 << 64) - 1, (1 << 64) - 1, "k", "x", "m"),
    "error-req-negative": GOOD_HELLO + codec._encode_map(codec.ERROR, {"req": -(1 << 63), "step": -1}),
    "abort-step-huge": GOOD_HELLO + codec.encode_abort_step((1 << 64) - 1, "x"),
    "onesided-on-tcp": GOOD_HELLO + codec.encode_onesided({"op": (1 << 64) - 1, "len": -1}),
    "data-huge-step": GOOD_HELLO + data_frame((1 << 64) - 1, 0, PS_KEY, np.arange(3)),
}


@pytest.mark.parametrize("name", sorted(MUST_CLOSE) + sorted(MAY_STAY))
def test_overflowing_fields_close_only_that_connection(run, name) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        loop = asyncio.get_running_loop()
        unhandled: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
        async with pair(cluster, "recv") as (w, p):
            waiting = asyncio.ensure_future(p.recv(key("healthy"), timeout=10))
            h = await Hostile.connect(p.address)
            try:
                await h.send(MUST_CLOSE.get(name) or MAY_STAY[name])
                if name in MUST_CLOSE:
                    got = await h.events_until_closed(5)
                    # our HELLO, and the ERROR that says why it closes (after a handshake)
                    assert all(e[0] == codec.HELLO or (e[0] == codec.ERROR and e[1]["code"]
                                                      == "protocol") for e in got), got
                else:
                    await h.is_open_after(0.2)
            finally:
                h.close()
            await w.send(key("healthy"), np.arange(2))
            assert (await waiting).tolist() == [0, 1]
            await w.send(key("healthy"), np.arange(3))
            assert (await p.recv(key("healthy"), timeout=5)).tolist() == [0, 1, 2]
        assert unhandled == [], [c.get("message") for c in unhandled]

    run(body(), timeout=20)


def test_an_answer_too_large_to_allocate_fails_only_that_connection(run) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        loop = asyncio.get_running_loop()
        unhandled: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
        # The consumer allows any payload size, so only the allocation itself can fail.
        async with pair(cluster, "recv", ps={"max_payload": 1 << 60, "connect_timeout": 1.0}) as (w, p):
            h = await Hostile.connect(p.address)
            try:
                await h.hello("worker", 1, 7)
                k = key_text("impossible", W1, PS0)
                waiting = asyncio.ensure_future(p.recv(k, timeout=10))
                event = await h.read_event()
                while event is not None and event[0] != codec.REQUEST:
                    event = await h.read_event()
                assert event is not None, "the consumer never asked"
                _, step, request_id, _ = event
                # 1 PiB: more than any address space; np.empty raises MemoryError.
                await h.send(data_header(step, request_id, k, U8, (1 << 50,), 1 << 50) + bytes(4096))
                await h.events_until_closed(5)
            finally:
                h.close()
            with pytest.raises(rvz.RvzError):
                await waiting
            await w.send(key("healthy"), np.arange(2))
            assert (await p.recv(key("healthy"), timeout=5)).tolist() == [0, 1]
        assert unhandled == [], [c.get("message") for c in unhandled]

    run(body(), timeout=25)


@pytest.mark.parametrize("size", [1000, 8 * MiB])
@pytest.mark.loop_timeout(30)
async def test_an_answer_to_another_peers_request_closes_the_connection(size: int) -> None:
    """A member of the cluster sends DATA with the id of a request that went to another
    peer: its connection closes (at the header for a large value), the request stays
    outstanding, and the producer asked answers it.  Before, such "answers" were taken
    (40 of 8 MiB over a 1 MiB window) and the request was lost to its producer."""
    cluster = three_tasks()
    async with pair(cluster, "recv", push_window=1 * MiB) as (w, p):
        k = key("asked")
        recv = asyncio.ensure_future(p.recv(k, timeout=20))
        await asyncio.sleep(0)
        (request_id,) = list(p._core.requests.by_id)
        h = await Hostile.connect(p.address)
        try:
            await h.hello("worker", 1)
            await h.send(data_frame(0, request_id, key_text("stolen", W1, PS0),
                                    np.full(size, 1, np.uint8)))
            await h.events_until_closed(5)
        finally:
            h.close()
        assert h.eof
        assert not recv.done()
        assert request_id in p._core.requests.by_id  # still its producer's to answer
        await w.send(k, np.arange(3))
        assert (await recv).tolist() == [0, 1, 2]

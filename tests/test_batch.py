"""The batch API: ``Node.send_many`` / ``recv_many``, their ``Step`` forms, and
``Rendezvous.send_many`` / ``recv_many``.

The contract under test:

* a batch means the single calls in order: FIFO per key (a key may appear several times in
  one ``recv_many``), ``WrongEndpoint``, ``Aborted``, ``PeerLost``, both modes and mixed;
* ``WrongEndpoint`` is raised before anything is taken or sent;
* ``recv_many`` is all or nothing: when it fails (timeout, cancellation, abort, lost peer)
  every value already given to it goes back to the head of its key's queue, in order, so
  the next plain ``recv`` of that key gets it;
* an interrupted ``send_many`` sent the items before the one that was blocked, and none after.

Producers are worker/0 (and worker/1 in the three-task tests), the consumer is ps/0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import random
import sys
import weakref
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import rvz

from .conftest import FAST, PS, WORKER, eventually, key, pair, pending, settle
from .procs import ready_process

MODES = ["recv", "send"]
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER1 = "/job:worker/replica:0/task:1/device:CPU:0"


def local(name: str = "l", **kw: Any) -> rvz.Key:
    """A key from ps/0 to itself."""
    return key(name, src=PS, dst=PS, **kw)


def back(name: str = "b") -> rvz.Key:
    """A key from ps/0 to worker/0: ps/0 must not recv it, worker/0 must not send it."""
    return key(name, src=PS, dst=WORKER)


def v(i: int) -> np.ndarray:
    return np.array([i], np.int64)


def ints(values: list[Any]) -> list[int]:
    return [int(x[0]) for x in values]


async def drain(node: rvz.Node, k: Any, n: int, **kw: Any) -> list[int]:
    """``n`` plain recvs of ``k``."""
    return [int((await node.recv(k, timeout=5, **kw))[0]) for _ in range(n)]


async def nothing_more(node: rvz.Node, k: Any, **kw: Any) -> None:
    """No value of ``k`` is left (none was duplicated)."""
    with pytest.raises(TimeoutError):
        await node.recv(k, timeout=0.1, **kw)


# -- FIFO and round trips -------------------------------------------------------------------


@pytest.mark.parametrize("consumer_first", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_fifo_with_repeated_keys(cluster, mode, consumer_first) -> None:  # type: ignore[no-untyped-def]
    a, b = key("a"), key("b")
    items = [(a, v(0)), (b, v(10)), (a, v(1)), (b, v(11)), (a, v(2)), (a, v(3)), (b, v(12))]
    keys = [a, b, a, a, b, a, b]
    async with pair(cluster, mode) as (w, p):
        if consumer_first:
            batch = await pending(p.recv_many(keys, timeout=10))
            assert await w.send_many(items) is None
            got = await batch
        else:
            assert await w.send_many(items) is None
            got = await p.recv_many(keys, timeout=10)
        assert isinstance(got, list)
        assert ints(got) == [0, 10, 1, 2, 11, 3, 12]
        await nothing_more(p, a)
        await nothing_more(p, b)


@pytest.mark.parametrize("where", ["remote", "local"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_values_of_a_batch_that_waited_are_freed_with_the_result(cluster, mode, where) -> None:  # type: ignore[no-untyped-def]
    """Dropping ``recv_many``'s list frees its arrays at once, not at the next cyclic GC.

    A waiting batch and its per-key waiters refer to each other; left so, the batch's values
    lived until the cyclic GC ran, and a large array kept its receive-pool block busy: the
    pool then allocated (and faulted in) a new block for every batch."""
    keys = [key("big"), key("big2")] if where == "remote" else [local("l1"), local("l2")]
    size = 1 << 18  # received straight into a pool block when it comes from a peer
    async with pair(cluster, mode) as (w, p):
        sender = w if where == "remote" else p
        gc_was = gc.isenabled()
        gc.disable()
        try:
            for round_ in range(3):
                batch = await pending(p.recv_many(keys, timeout=10))
                await sender.send_many([(k, np.full(size, round_, np.uint8)) for k in keys])
                got = await batch
                assert [int(x[0]) for x in got] == [round_, round_]
                refs = [weakref.ref(x) for x in got]
                del got, batch
                # asyncio's loop holds the wake-up that ran this step, and through it the
                # batch's result, until the step ends.
                await asyncio.sleep(0)
                assert [i for i, r in enumerate(refs) if r() is not None] == []  # none alive
        finally:
            if gc_was:
                gc.enable()
        if where == "remote":
            # Both blocks came back after each round: no more than a round's worth, plus
            # the pool's spare, were ever made.
            pool = p.stats()["recv_pool"]
            assert pool, "the arrays were expected on receive-pool blocks"
            assert sum(blocks for blocks, _free, _target in pool.values()) <= 3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_a_batch_is_served_before_later_recvs_of_its_keys(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    # FIFO among receivers: a batch waits on all of its keys from the start, so a recv issued
    # after it gets the next value of a key, not the batch's.
    a, b = key("a"), key("b")
    async with pair(cluster, mode) as (w, p):
        batch = await pending(p.recv_many([a, b], timeout=10))
        later = await pending(p.recv(b, timeout=10))
        await w.send_many([(b, v(10)), (b, v(11)), (a, v(0))])
        assert ints(await batch) == [0, 10]
        assert int((await later)[0]) == 11


VALUE_DTYPES = [np.bool_, np.int8, np.uint16, np.int32, np.int64, np.float32, np.float64,
                np.complex64]
VALUE_SHAPES = [(), (0,), (1,), (3,), (2, 2), (5,)]


def small_values(n: int) -> list[Any]:
    rng = np.random.default_rng(7)
    out: list[Any] = []
    for i in range(n):
        if i % 50 == 49:
            out.append(rng.bytes(int(rng.integers(0, 20))))
            continue
        dtype = VALUE_DTYPES[int(rng.integers(len(VALUE_DTYPES)))]
        shape = VALUE_SHAPES[int(rng.integers(len(VALUE_SHAPES)))]
        out.append(np.array(rng.standard_normal(shape) * 100, dtype=dtype))
    return out


@pytest.mark.parametrize("consumer_first", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(30)
async def test_a_thousand_small_arrays_round_trip_exactly(cluster, mode, consumer_first) -> None:  # type: ignore[no-untyped-def]
    values = small_values(1000)
    keys = [key(f"k{i % 10}") for i in range(1000)]   # 10 keys, 100 values each
    async with pair(cluster, mode) as (w, p):
        if consumer_first:
            batch = await pending(p.recv_many(keys, timeout=20))
            await w.send_many(zip(keys, values, strict=True))   # any iterable of pairs
            got = await batch
        else:
            await w.send_many(list(zip(keys, values, strict=True)))
            got = await p.recv_many(keys, timeout=20)
        assert len(got) == len(values)
        for i, (sent, came) in enumerate(zip(values, got, strict=True)):
            if isinstance(sent, bytes):
                assert type(came) is bytes and came == sent, i
            else:
                assert came.dtype == sent.dtype and came.shape == sent.shape, i
                np.testing.assert_array_equal(came, sent, err_msg=f"value {i}")


@pytest.mark.parametrize("linked", [False, True])
@pytest.mark.loop_timeout(30)
async def test_a_recv_driven_batch_of_long_keys_asks_in_several_frames(cluster, linked) -> None:  # type: ignore[no-untyped-def]
    """1000 keys of 200-byte names: their requests are far over one REQUESTS frame's
    metadata bound, so they go in several frames, whether the link is up at the recv_many
    or comes up after it. No fallback: nothing pushes unclaimed values here."""
    keys = [key(f"{i:04d}" + "n" * 196) for i in range(1000)]
    async with pair(cluster, "recv", claim_timeout=None) as (w, p):
        if linked:
            await w.send(key("hello"), v(-1))
            assert ints([await p.recv(key("hello"), timeout=5)]) == [-1]
        await w.send_many([(k, v(i)) for i, k in enumerate(keys)])
        got = await p.recv_many(keys, timeout=20)
        assert ints(got) == list(range(1000))


@pytest.mark.loop_timeout(30)
async def test_a_send_driven_batch_before_the_link_starts_one_link_task_per_peer(cluster) -> None:  # type: ignore[no-untyped-def]
    """A consumer-first ``recv_many`` of 2000 keys of one producer, no link yet: it watches
    for the producer with one background task, not one per key (2000 tasks took seconds
    at 100k keys)."""
    keys = [key(f"early{i}") for i in range(2000)]
    async with rvz.Node(cluster, "ps", 0, "send", **FAST) as p:   # the producer is not up yet
        before = len(p._tasks)
        batch = await pending(p.recv_many(keys, timeout=20))
        assert len(p._tasks) - before <= 2, len(p._tasks) - before  # the link, and its dial
        async with rvz.Node(cluster, "worker", 0, "send", **FAST) as w:
            await w.send_many([(k, v(i)) for i, k in enumerate(keys)])
            assert ints(await batch) == list(range(2000))


@pytest.mark.loop_timeout(30)
async def test_send_driven_batches_go_as_data_many_frames_and_keep_every_order(cluster) -> None:  # type: ignore[no-untyped-def]
    """Small pushes of a ``send_many`` to one consumer leave as DATA_MANY frames (far fewer
    frames than values); a large value, a key local to the producer and a frame bound in
    between split the runs, and every key still gets its values in order."""
    from rvz._impl import codec
    rng = np.random.default_rng(5)
    names = [key(f"r{i}") for i in range(3)]
    mine = key("mine", src=WORKER, dst=WORKER)
    items: list[tuple[Any, Any]] = []
    for i in range(600):
        if i % 97 == 50:
            items.append((names[i % 3], np.full(100_000, i, np.int32)))  # alone: 400 KB
        elif i % 41 == 7:
            items.append((mine, v(i)))
        elif i % 13 == 3:
            items.append((names[i % 3], f"bytes {i}".encode()))
        else:
            items.append((names[i % 3], rng.integers(0, 1 << 40, int(rng.integers(0, 300)))))
    async with pair(cluster, "send") as (w, p):
        await w.send(names[0], v(-1))  # the link is up: the batch is not queued behind a dial
        assert ints([await p.recv(names[0], timeout=5)]) == [-1]
        stats = w.stats()["peers"]["/job:ps/replica:0/task:0"]
        await w.send_many(items)
        after = w.stats()["peers"]["/job:ps/replica:0/task:0"]
        remote = [x for k, x in items if k is not mine]
        assert after["messages_out"] - stats["messages_out"] == len(remote)  # values, not frames
        # The bytes written: a DATA frame per value would be 36 bytes + shape + key +
        # payload each; packed, a small value costs 8 + shape + key + payload, and each
        # DATA_MANY frame 28 bytes. Each split (a large value, a key of our own) ends a
        # frame, and a frame is at least half full otherwise.
        shapes = [codec.describe(x) for x in remote]
        small = sum(8 + 8 * len(shape) + len(str(names[0])) + n
                    for _, _, shape, n in shapes if n <= 16384)
        large = sum(36 + 8 * len(shape) + len(str(names[0])) + n
                    for _, _, shape, n in shapes if n > 16384)
        splits = sum(1 for k, x in items if k is mine or codec.describe(x)[3] > 16384)
        frames = 2 * small // codec.MANY_PAYLOAD + 2 * splits + 1
        written = after["bytes_out"] - stats["bytes_out"]
        assert written <= small + large + 28 * frames, (written, small, large, frames)
        assert written < small + large + 28 * len(remote) - 8000  # not one frame a value
        for k in names:
            expected = [x for kk, x in items if kk is k]
            got = await p.recv_many([k] * len(expected), timeout=10)
            for sent, came in zip(expected, got, strict=True):
                if isinstance(sent, bytes):
                    assert came == sent
                else:
                    assert came.dtype == sent.dtype
                    np.testing.assert_array_equal(came, sent)
        assert await drain(w, mine, sum(1 for k, _ in items if k is mine)) == [
            i for i, (k, _) in enumerate(items) if k is mine]
        await nothing_more(p, names[0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_a_value_rvz_cannot_send_fails_the_batch_before_anything_is_sent(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    """An unsendable value anywhere in a ``send_many`` (no array, or a dtype rvz does not
    carry) raises the ``TypeError`` ``send`` raises before any item leaves: the next value
    the consumer gets is one sent after."""
    k, j = key("k"), key("j")
    async with pair(cluster, mode) as (w, p):
        await w.send(k, v(-1))  # the link is up
        assert await drain(p, k, 1) == [-1]
        for bad in ("not an array", np.array([object()], dtype=object)):
            with pytest.raises(TypeError):
                await w.send_many([(k, v(0)), (j, v(1)), (k, bad), (k, v(3))])
        await w.send_many([(k, v(4)), (j, v(5))])  # the connection is still good
        assert ints(await p.recv_many([k, j], timeout=5)) == [4, 5]


def test_requests_split_keeps_every_frame_within_bounds() -> None:
    from rvz._fast import codec
    entries = [(i, (f"{i:05d}" + "k" * (i % 300)).encode()) for i in range(3000)]
    frames = codec.encode_requests_split(7, entries)
    assert len(frames) > 1
    seen = []
    for frame in frames:
        meta = len(frame) - codec.HEADER_SIZE
        assert meta <= codec.MAX_META
        step, count = codec._REQUESTS_FIXED.unpack_from(frame, codec.HEADER_SIZE)
        assert step == 7 and 0 < count <= codec.MAX_REQUESTS
        pos = codec.HEADER_SIZE + codec._REQUESTS_FIXED.size
        for _ in range(count):
            request_id, klen = codec._ENTRY.unpack_from(frame, pos)
            pos += codec._ENTRY.size
            seen.append((request_id, frame[pos:pos + klen]))
            pos += klen
        assert pos == len(frame)
    assert seen == entries
    # a frame is refused past its bounds, as before
    with pytest.raises(ValueError):
        codec.encode_requests(7, entries)


@pytest.mark.loop_timeout(15)
async def test_empty_batches(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "recv") as (w, p):
        assert await w.send_many([]) is None
        assert await w.send_many(iter(())) is None
        assert await p.recv_many([]) == []
        assert await p.recv_many([], timeout=0.1) == []   # nothing to wait for
        assert await w.step(2).send_many([]) is None
        assert await p.step(2).recv_many([]) == []
        # and the nodes work as before
        await w.send_many([(key(), v(1))])
        assert ints(await p.recv_many([key()], timeout=5)) == [1]
    rv = rvz.Rendezvous()
    assert rv.send_many([]) is None
    assert await rv.recv_many([]) == []
    assert rv.pending(key()) == (0, 0)


@pytest.mark.loop_timeout(15)
async def test_empty_batches_fail_where_any_call_would(cluster) -> None:  # type: ignore[no-untyped-def]
    # "Every pending and later operation of the step fails with Aborted", and so does every
    # operation of a closed node: empty batches too, though they have nothing to do.
    async with pair(cluster, "send") as (w, p):
        await w.step(5).send(key(), v(1))
        assert ints(await p.step(5).recv_many([key()], timeout=5)) == [1]
        await p.step(5).cleanup()
        await eventually(lambda: 5 in w._core.steps.dead_steps, "the clean-up reached the worker")
        for node in (w, p):
            with pytest.raises(rvz.Aborted, match="5"):
                await node.step(5).send_many([])
            with pytest.raises(rvz.Aborted, match="5"):
                await node.step(5).recv_many([])
    for node in (w, p):
        with pytest.raises(rvz.Aborted):
            await node.send_many([])
        with pytest.raises(rvz.Aborted):
            await node.recv_many([])
    rv = rvz.Rendezvous()
    rv.abort(ValueError("stop"))
    with pytest.raises(rvz.Aborted) as info:
        await rv.recv_many([])
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.loop_timeout(15)
async def test_rendezvous_checks_keys_and_timeouts_as_a_node_does() -> None:
    # Every key of a send_many is checked before anything is queued, and a timeout must be
    # None or >= 0; values pass as they are (the table alone).
    rv = rvz.Rendezvous()
    a = key("a")
    with pytest.raises(rvz.KeyFormatError):
        rv.send_many([(a, v(0)), ("not a key", v(1))])
    assert rv.pending(a) == (0, 0)  # nothing went in
    for call in (rv.recv(a, timeout=-1), rv.recv_many([a], timeout=-0.5)):
        with pytest.raises(ValueError, match="timeout"):
            await call
    scalar = np.float16(1.5)
    rv.send_many([(a, scalar), (a, b"raw")])
    first, second = await rv.recv_many([a, a], timeout=1)
    assert first is scalar and second == b"raw"


@pytest.mark.loop_timeout(15)
async def test_per_call_mode_overrides(cluster) -> None:  # type: ignore[no-untyped-def]
    keys = [key("x"), key("y"), key("x")]
    items = [(k, v(i)) for i, k in enumerate(keys)]
    # Recv-Driven nodes, pushed batch: the consumer waits locally (nothing is requested),
    # so it gets the values only if send_many really pushed them.
    async with pair(cluster, "recv", claim_timeout=None) as (w, p):
        await w.send_many(items, mode="send")
        assert ints(await p.recv_many(keys, mode="send", timeout=5)) == [0, 1, 2]
        await w.step(4).send_many(items, mode="send")
        assert ints(await p.step(4).recv_many(keys, mode="send", timeout=5)) == [0, 1, 2]
    # Send-Driven nodes, held batch, fetched by a Recv-Driven batch.
    async with pair(cluster, "send", claim_timeout=None) as (w, p):
        await w.send_many(items, mode="recv")
        assert ints(await p.recv_many(keys, mode="recv", timeout=5)) == [0, 1, 2]
        await w.step(4).send_many(items, mode="recv")
        assert ints(await p.step(4).recv_many(keys, mode="recv", timeout=5)) == [0, 1, 2]
        with pytest.raises(ValueError):
            await w.send_many(items, mode="push")
        with pytest.raises(ValueError):
            await p.recv_many(keys, mode="push", timeout=1)


# -- several peers and local keys in one call --------------------------------------------------


@contextlib.asynccontextmanager
async def trio(modes: tuple[str, str, str]) -> AsyncIterator[tuple[rvz.Node, rvz.Node, rvz.Node]]:
    """worker/0, worker/1 and ps/0 with these default modes, all running."""
    cluster = rvz.ClusterSpec.loopback({"worker": 2, "ps": 1})
    async with rvz.Node(cluster, "worker", 0, modes[0], **FAST) as w0, \
            rvz.Node(cluster, "worker", 1, modes[1], **FAST) as w1, \
            rvz.Node(cluster, "ps", 0, modes[2], **FAST) as p:
        yield w0, w1, p


# default modes of (worker/0, worker/1, ps/0)
TRIO_MODES = [("recv", "recv", "recv"), ("send", "send", "send"), ("recv", "send", "send"),
              ("send", "recv", "recv")]


@pytest.mark.parametrize("modes", TRIO_MODES, ids=["-".join(m) for m in TRIO_MODES])
@pytest.mark.loop_timeout(20)
async def test_keys_of_two_peers_and_local_keys_in_one_call(modes) -> None:  # type: ignore[no-untyped-def]
    x = key("x")                              # worker/0 -> ps/0
    y = key("y", src=WORKER1)                 # worker/1 -> ps/0
    lo = local("lo")                          # ps/0 -> ps/0
    across = key("across", dst=WORKER1)       # worker/0 -> worker/1
    mine = key("mine", dst=WORKER)            # worker/0 -> worker/0
    async with trio(modes) as (w0, w1, p):
        # one send_many to three destinations: ps/0, worker/1 and worker/0 itself
        await w0.send_many([(x, v(0)), (across, v(7)), (mine, v(8))])
        batch = await pending(p.recv_many([x, lo, y, str(x), lo, y], timeout=10))
        await w0.send_many([(x, v(1))])
        await w1.send_many([(y, v(100)), (y, v(101))])
        await p.send_many([(lo, v(50)), (lo, v(51))])
        assert ints(await batch) == [0, 50, 100, 1, 51, 101]
        assert ints(await w1.recv_many([across], timeout=5)) == [7]
        assert ints(await w0.recv_many([mine], timeout=5)) == [8]

        # a partial timeout across both peers: everything delivered is still there
        never = key("never", src=WORKER1)
        await w0.send(x, v(2))
        await w1.send(y, v(102))
        await p.send(lo, v(52))
        with pytest.raises(TimeoutError):
            await p.recv_many([y, x, lo, never, x], timeout=0.3)
        await w0.send(x, v(3))
        assert await drain(p, x, 2) == [2, 3]
        assert await drain(p, y, 1) == [102]
        assert await drain(p, lo, 1) == [52]
        await nothing_more(p, x)


# -- a batch that times out or is cancelled ----------------------------------------------------


@pytest.mark.parametrize("how", ["timeout", "cancel"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(20)
async def test_interrupted_recv_many_loses_nothing(cluster, mode, how) -> None:  # type: ignore[no-untyped-def]
    a, b, never, marker = key("a"), key("b"), key("never"), key("marker")
    async with pair(cluster, mode) as (w, p):
        await w.send_many([(a, v(0)), (a, v(1)), (b, v(10))])
        batch = await pending(p.recv_many([a, b, a, a, never], timeout=0.5 if how == "timeout"
                                          else 10))
        await w.send(a, v(2))   # the batch's third value of a, delivered while it waits
        await w.send(a, v(3))   # one more than the batch asked for
        # Everything sent so far has reached ps/0 once the marker has (one ordered stream).
        await w.send(marker, v(0))
        await p.recv(marker, timeout=5)
        await settle()
        if how == "timeout":
            with pytest.raises(TimeoutError) as info:
                await batch
            assert type(info.value) is TimeoutError
            assert str(never) in str(info.value)
        else:
            batch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await batch
        # every value is there once, in the order it was sent
        assert await drain(p, a, 4) == [0, 1, 2, 3]
        assert await drain(p, b, 1) == [10]
        await nothing_more(p, a)
        # and no waiter of the batch is left to swallow a later value
        await w.send_many([(never, v(99)), (a, v(4))])
        assert ints(await p.recv_many([never, a], timeout=5)) == [99, 4]


@pytest.mark.parametrize("target", ["rendezvous", "recv", "send"])
@pytest.mark.loop_timeout(20)
async def test_values_that_come_back_twice_keep_their_order(cluster, target) -> None:  # type: ignore[no-untyped-def]
    # The head of a key came back with the value behind it (a failed batch); a second batch
    # takes it again and fails too: it goes back ahead of that value, as it was (it keeps
    # the stamp it came back with, not a fresh one, which ranked it behind).
    a, never = key("a"), key("never")
    async with contextlib.AsyncExitStack() as stack:
        if target == "rendezvous":
            rv = rvz.Rendezvous()
            rv.send_many([(a, v(0)), (a, v(1))])
            recv_many: Any = rv.recv_many
        else:
            w, p = await stack.enter_async_context(pair(cluster, target))
            await w.send_many([(a, v(0)), (a, v(1))])
            recv_many = p.recv_many
        for keys in ([a, a, never], [a, never]):
            with pytest.raises(TimeoutError):
                await recv_many(keys, timeout=0.3)
        assert ints(await recv_many([a, a], timeout=5)) == [0, 1]


@contextlib.asynccontextmanager
async def local_table(cluster: rvz.ClusterSpec, target: str) -> AsyncIterator[tuple[Any, Any]]:
    """``(send_many, endpoint)`` of one table: a ``Rendezvous``, or a node's local keys
    (their table is the one a consumer's recv and recv_many wait in, in both modes)."""
    if target == "rendezvous":
        rv = rvz.Rendezvous()
        yield rv.send_many, rv
    else:
        async with rvz.Node(cluster, "ps", 0, "recv", **FAST) as node:
            yield node.send_many, node


@pytest.mark.parametrize("target", ["rendezvous", "node"])
@pytest.mark.loop_timeout(10)
async def test_a_value_given_back_past_a_waiter_already_gone_keeps_its_place(cluster, target) -> None:  # type: ignore[no-untyped-def]
    # A batch holds [0, 1] of a key whose only waiter is another batch's slot, cancelled a
    # moment before: the first batch fails in the same pass, before the slot has left the
    # key.  0 must go back to its place at the head, not behind 1 (the slot no longer wants
    # it, and a put past it queued the value as if it were new).
    a, never = local("a"), local("never")
    async with local_table(cluster, target) as (send_many, end):
        await _maybe(send_many([(a, v(0)), (a, v(1))]))
        holder = await pending(end.recv_many([a, a, never], timeout=10))
        late = await pending(end.recv_many([a, never], timeout=10))
        holder.cancel()  # first, so it restores before the late batch leaves the key
        late.cancel()
        for task in (holder, late):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert ints(await end.recv_many([a, a], timeout=5)) == [0, 1]


@pytest.mark.parametrize("target", ["rendezvous", "node"])
@pytest.mark.parametrize("taker", ["recv", "recv_many"])
@pytest.mark.loop_timeout(10)
async def test_a_value_passed_on_and_given_back_again_keeps_its_place(cluster, target, taker) -> None:  # type: ignore[no-untyped-def]
    # 0 and 1 are taken by two batches; a third receiver waits.  The first batch fails: 0
    # goes on to the waiter.  The second fails: 1 is queued again.  The waiter fails too,
    # after 0 reached it: 0 must go back ahead of 1, where it was taken from, not by the
    # place of the waiter (which came after both).
    a, never = local("a"), local("never")
    async with local_table(cluster, target) as (send_many, end):
        await _maybe(send_many([(a, v(0)), (a, v(1))]))
        first = await pending(end.recv_many([a, never], timeout=10))
        second = await pending(end.recv_many([a, never], timeout=10))
        waiter = await pending(end.recv(a, timeout=10) if taker == "recv"
                               else end.recv_many([a, never], timeout=10))
        # The first batch restores in its task's next step; the callback queued behind that
        # step finds 0 delivered to the waiter, which has not resumed yet, and cancels it.
        first.cancel()
        asyncio.get_running_loop().call_soon(lambda: (second.cancel(), waiter.cancel()))
        for task in (first, second, waiter):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert ints(await end.recv_many([a, a], timeout=5)) == [0, 1]


@pytest.mark.parametrize("target", ["rendezvous", "node"])
@pytest.mark.parametrize("taker", ["recv", "recv_many"])
@pytest.mark.loop_timeout(10)
async def test_a_send_before_a_cancelled_batch_resumed_keeps_fifo(cluster, target, taker) -> None:  # type: ignore[no-untyped-def]
    # A batch holds 0 and waits for a second value of the key; a receiver waits behind it.
    # The batch is cancelled and 1 is sent before the batch's task has run (the cancel only
    # marks it): 1 must not go to the waiter past 0, which the batch gives back when it
    # resumes.  FIFO: the waiter gets 0, the next recv 1.
    a, never = local("a"), local("never")
    async with local_table(cluster, target) as (send_many, end):
        await _maybe(send_many([(a, v(0))]))
        batch = await pending(end.recv_many([a, a], timeout=10))
        waiter = await pending(end.recv(a, timeout=10) if taker == "recv"
                               else end.recv_many([a, never], timeout=10))
        batch.cancel()
        await _maybe(send_many([(a, v(1))]))  # (does not suspend: the batch has not resumed)
        with pytest.raises(asyncio.CancelledError):
            await batch
        if taker == "recv":
            assert ints([await waiter]) == [0]
        else:
            await _maybe(send_many([(never, v(9))]))
            assert ints(await waiter) == [0, 9]
        assert ints(await end.recv_many([a], timeout=5)) == [1]


async def _maybe(result: Any) -> Any:
    """Await ``result`` if it is awaitable (``Rendezvous.send_many`` is not)."""
    return await result if asyncio.iscoroutine(result) else result


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.loop_timeout(30)
async def test_fifo_survives_receivers_failing_together(seed) -> None:  # type: ignore[no-untyped-def]
    # Several receivers (recv and recv_many) wait at once and are cancelled together, in
    # random order, some a loop step later than others, while values keep coming: values
    # pass from a failing receiver to the next and come back more than once.  No value is
    # lost or doubled, and what is left in a key's queue is in order.
    rng = random.Random(seed)
    rv = rvz.Rendezvous()
    loop = asyncio.get_running_loop()
    keys = [key(f"k{i}") for i in range(2)]
    sent = [0] * len(keys)
    got: list[list[int]] = [[] for _ in keys]

    def send_some() -> None:
        for _ in range(rng.randint(0, 2)):
            i = rng.randrange(len(keys))
            rv.send(keys[i], v(sent[i]))
            sent[i] += 1

    for _ in range(200):
        send_some()
        receivers = []
        for _ in range(rng.randint(1, 4)):
            picks = [rng.randrange(len(keys)) for _ in range(rng.randint(1, 3))]
            if len(picks) == 1 and rng.random() < 0.5:
                aw: Any = rv.recv(keys[picks[0]], timeout=rng.choice([0, 0.001, 0.01]))
            else:
                aw = rv.recv_many([keys[i] for i in picks], timeout=rng.choice([0, 0.001, 0.01]))
            receivers.append((picks, asyncio.ensure_future(aw)))
        await asyncio.sleep(0)
        for _picks, task in rng.sample(receivers, len(receivers)):
            if rng.random() < 0.6:
                (task.cancel() if rng.random() < 0.5 else loop.call_soon(task.cancel))
            if rng.random() < 0.3:
                loop.call_soon(send_some)
        done = await asyncio.gather(*(task for _, task in receivers), return_exceptions=True)
        for (picks, _), values in zip(receivers, done, strict=True):
            if isinstance(values, BaseException):
                assert isinstance(values, (TimeoutError, asyncio.TimeoutError,
                                           asyncio.CancelledError)), values
                continue
            # (One receiver may get a key's values out of order: a value that came back
            # after it took a later one is the head of the queue when its next slot waits.)
            for i, value in zip(picks, values if isinstance(values, list) else [values],
                                strict=True):
                got[i].append(int(value[0]))
    for i, k in enumerate(keys):
        rest = ints(await rv.recv_many([k] * (sent[i] - len(got[i])), timeout=1))
        assert rest == sorted(rest), (i, rest)
        assert sorted(got[i] + rest) == list(range(sent[i])), i
        assert rv.pending(k) == (0, 0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.loop_timeout(20)
async def test_fifo_survives_any_mix_of_failed_batches(seed) -> None:  # type: ignore[no-untyped-def]
    # Batches over a few keys that time out, are cancelled or complete, while values keep
    # coming: every key's values reach the receivers once each, in the order sent.
    rng = random.Random(seed)
    rv = rvz.Rendezvous()
    keys = [key(f"k{i}") for i in range(3)]
    sent = [0] * len(keys)
    got: list[list[int]] = [[] for _ in keys]
    for _ in range(300):
        for _ in range(rng.randint(0, 3)):
            i = rng.randrange(len(keys))
            rv.send(keys[i], v(sent[i]))
            sent[i] += 1
        picks = [rng.randrange(len(keys)) for _ in range(rng.randint(1, 4))]
        batch = asyncio.ensure_future(rv.recv_many([keys[i] for i in picks],
                                                   timeout=rng.choice([0, 0.001, None])))
        await asyncio.sleep(0)
        if not batch.done() and rng.random() < 0.5:
            batch.cancel()
        try:
            values = await asyncio.wait_for(batch, 0.01)
        except (TimeoutError, asyncio.TimeoutError, asyncio.CancelledError):  # (3.10: two)
            continue
        for i, value in zip(picks, values, strict=True):
            got[i].append(int(value[0]))
    for i, k in enumerate(keys):  # the rest, still queued
        got[i] += ints(await rv.recv_many([k] * (sent[i] - len(got[i])), timeout=1))
        assert got[i] == list(range(sent[i])), (i, got[i])
        assert rv.pending(k) == (0, 0)


@pytest.mark.loop_timeout(15)
async def test_failed_batches_do_not_leak_push_credit(cluster) -> None:  # type: ignore[no-untyped-def]
    # Send-Driven: a value a failed batch gives back is consumed later, by a plain recv, and
    # its credit must then return to the producer: 12 rounds push 3x the window.
    a, never = key("a"), key("never")
    async with pair(cluster, "send", worker={"push_window": 64 << 10}) as (w, p):
        for i in range(12):
            await w.send(a, np.full(16 << 10, i, np.uint8), timeout=5)
            if i % 2:
                with pytest.raises(TimeoutError):
                    await p.recv_many([a, never], timeout=0.05)
            else:
                batch = await pending(p.recv_many([never, a], timeout=5), 0.05)
                batch.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await batch
            assert int((await p.recv(a, timeout=5))[0]) == i


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_cancel_after_the_batch_was_complete_gives_every_value_back(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    l1, l2 = local("l1"), local("l2")
    async with pair(cluster, mode) as (_, p):
        batch = await pending(p.recv_many([l1, l2, l1], timeout=10))
        await p.send(l1, v(1))
        await p.send(l2, v(2))
        await p.send(l1, v(3))
        await p.send(l1, v(4))
        # The batch has all its values but has not run yet: cancelling it now must not
        # drop them (a local send does not suspend, so the batch did not run meanwhile).
        if batch.cancel():
            with pytest.raises(asyncio.CancelledError):
                await batch
            assert await drain(p, l1, 3) == [1, 3, 4]
            assert await drain(p, l2, 1) == [2]
        else:  # a send suspended and the batch finished first: it got the first values
            assert ints(batch.result()) == [1, 2, 3]
            assert await drain(p, l1, 1) == [4]
        await nothing_more(p, l1)


# -- abort, step clean-up, a lost peer ------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_node_abort_mid_batch(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        await w.send(key("a"), v(0))
        await p.send(local(), v(5))
        batch = await pending(p.recv_many([key("a"), local(), key("never")], timeout=10))
        cause = RuntimeError("the real reason")
        p.abort(cause)
        with pytest.raises(rvz.Aborted) as info:
            await batch
        assert info.value.__cause__ is cause
        with pytest.raises(rvz.Aborted) as info:
            await p.recv_many([key("a")], timeout=1)
        assert info.value.__cause__ is cause
        with pytest.raises(rvz.Aborted):
            await p.send_many([(back(), v(1))])
        with pytest.raises(rvz.Aborted):
            await p.step(3).recv_many([local()], timeout=1)


@pytest.mark.parametrize("by", ["consumer", "producer"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_step_cleanup_mid_batch(cluster, mode, by) -> None:  # type: ignore[no-untyped-def]
    a, never = key("a"), key("never")
    async with pair(cluster, mode) as (w, p):
        ws, ps = w.step(7), p.step(7)
        await ws.send_many([(a, v(0))])
        assert ints(await ps.recv_many([a], timeout=5)) == [0]   # both nodes are in step 7
        await ws.send_many([(a, v(1))])
        batch = await pending(ps.recv_many([a, never, a], timeout=10))
        on_w = await pending(ws.recv_many([back("z"), back("z")], timeout=10))
        other = await pending(p.step(8).recv_many([a, a], timeout=10))
        await w.send(a, v(80))                   # step 0 is not affected either
        await (ps if by == "consumer" else ws).cleanup("step 7 failed on purpose")
        for task in (batch, on_w):   # on both nodes
            with pytest.raises(rvz.Aborted) as info:
                await task
            assert "step 7 failed on purpose" in str(info.value)
        with pytest.raises(rvz.Aborted):
            await ps.recv_many([a], timeout=1)
        with pytest.raises(rvz.Aborted):
            await ws.send_many([(a, v(2))])
        assert not other.done()
        await w.step(8).send_many([(a, v(8)), (a, v(9))])
        assert ints(await other) == [8, 9]
        assert ints(await p.recv_many([a], timeout=5)) == [80]


def peer_process(cluster: rvz.ClusterSpec, job: str, task: int, mode: str) -> Any:
    """tests/peer_node.py in its own process, killed and reaped on the way out."""
    return ready_process([sys.executable, os.path.join(HERE, "peer_node.py"),
                          json.dumps(cluster.as_dict()), job, str(task), mode])


@pytest.mark.loop_timeout(20)
async def test_peer_lost_mid_batch_keeps_the_local_values(cluster) -> None:  # type: ignore[no-untyped-def]
    # One peer process per loop: a Recv-Driven and a Send-Driven batch wait on it together.
    with peer_process(cluster, "worker", 0, "recv") as proc:
        settings = {**FAST, "peer_timeout": 1.0, "connect_timeout": 2.0}
        async with rvz.Node(cluster, "ps", 0, "recv", **settings) as p:
            l1, l2 = local("l1"), local("l2")
            await p.send(l1, v(0))
            await p.send(l2, v(10))
            pulled = asyncio.ensure_future(
                p.recv_many([l1, key("pulled"), l1], mode="recv", timeout=20))
            pushed = await pending(
                p.recv_many([l2, key("pushed"), l2], mode="send", timeout=20), 0.3)
            assert not pulled.done()
            await p.send_many([(l1, v(1)), (l2, v(11))])    # delivered to the waiting batches
            await p.send_many([(l1, v(2)), (l2, v(12))])    # queued behind
            proc.kill()
            for batch in (pulled, pushed):
                with pytest.raises(rvz.PeerLost) as info:
                    await batch
                assert "/job:worker" in str(info.value)
            assert await drain(p, l1, 3) == [0, 1, 2]
            assert await drain(p, l2, 3) == [10, 11, 12]
            await nothing_more(p, l1)


# -- wrong endpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_wrong_endpoint_before_anything_is_taken_or_sent(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    a, lo = key("a"), local()
    stranger = key("stranger", src="/job:nope/replica:0/task:0/device:CPU:0")
    lost = key("lost", dst="/job:ps/replica:0/task:9/device:CPU:0")
    async with pair(cluster, mode) as (w, p):
        await w.send(a, v(0))
        await p.send(lo, v(5))
        await settle()
        # recv: the bad key comes last, after keys that have values
        with pytest.raises(rvz.WrongEndpoint) as info:
            await p.recv_many([lo, a, a, back("misrouted")], timeout=1)
        assert str(back("misrouted")) in str(info.value)
        with pytest.raises(rvz.WrongEndpoint):
            await p.recv_many([lo, a, str(stranger)], timeout=1)
        with pytest.raises(rvz.WrongEndpoint):
            await p.step(3).recv_many([lo, back()], timeout=1)
        assert ints(await p.recv_many([lo, a], timeout=5)) == [5, 0]
        # send: nothing of the batch leaves, even from a generator
        with pytest.raises(rvz.WrongEndpoint) as info:
            await w.send_many([(a, v(1)), (a, v(2)), (back("misrouted"), v(3))])
        assert str(back("misrouted")) in str(info.value)
        with pytest.raises(rvz.WrongEndpoint):
            await w.send_many((k, v(4)) for k in (a, lost))
        with pytest.raises(rvz.WrongEndpoint):
            await w.step(3).send_many([(a, v(6)), (back(), v(7))])
        await nothing_more(p, a)
        await nothing_more(p, a, step=3)
        await w.send(a, v(9))
        assert ints(await p.recv_many([a], timeout=5)) == [9]


# -- an interrupted send_many -----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["timeout", "cancel"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(20)
async def test_interrupted_send_many_sent_a_prefix(cluster, mode, how) -> None:  # type: ignore[no-untyped-def]
    # Backpressure blocks the batch part way: Send-Driven on the push window (the consumer
    # does not recv), Recv-Driven on the hold limit (nobody fetches, nothing is pushed).
    limits = ({"push_window": 1 << 20} if mode == "send" else {"hold_limit": 1 << 20})

    k = key("chunks")
    items = [(k, np.full(256 << 10, i, np.uint8)) for i in range(12)]   # 3 MiB in all
    async with pair(cluster, mode, claim_timeout=None, worker=limits) as (w, p):
        await w.send(key("warm-up"), v(0))     # connected: the batch can only block on limits
        await p.recv(key("warm-up"), timeout=5)
        if how == "timeout":
            with pytest.raises(TimeoutError) as info:
                await w.send_many(items, timeout=0.2)
            assert type(info.value) is TimeoutError
        else:
            batch = await pending(w.send_many(items), 0.2)
            batch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await batch
        got = []
        while True:
            try:
                value = await p.recv(k, timeout=0.2)
            except TimeoutError:
                break
            assert int(value[0]) == int(value[-1])
            got.append(int(value[0]))
        assert 0 < len(got) < len(items), got
        assert got == list(range(len(got)))
        # the next send of the key comes right after that prefix
        await w.send_many([(k, np.full(4, 200, np.uint8))])
        assert (await p.recv(k, timeout=5)).tolist() == [200] * 4


# -- steps -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_step_variants_are_separate_scopes(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    a, b = key("a"), key("b")
    async with pair(cluster, mode) as (w, p):
        s3 = w.step(3)
        await s3.send_many([(a, v(30)), (b, v(31)), (a, v(32))])
        await w.send_many([(a, v(0)), (b, v(1))])
        await w.send_many([(a, v(40))], step=4)
        assert ints(await p.step(4).recv_many([a], timeout=5)) == [40]
        assert ints(await p.recv_many([b, a], timeout=5)) == [1, 0]
        assert ints(await p.step(3).recv_many([a, a], timeout=5)) == [30, 32]
        assert ints(await p.recv_many([b], step=3, timeout=5)) == [31]
        # a Step's recv_many times out like the node's, and gives its values back
        await s3.send_many([(a, v(33))])
        with pytest.raises(TimeoutError):
            await p.step(3).recv_many([a, b], timeout=0.3)
        assert await drain(p, a, 1, step=3) == [33]
        await nothing_more(p, a)


# -- rvz.Rendezvous ------------------------------------------------------------------------------------

A, B = key("ra"), key("rb")


@pytest.mark.loop_timeout(5)
async def test_rendezvous_fifo_with_repeated_keys() -> None:
    rv = rvz.Rendezvous()
    assert rv.send_many([(A, "a0"), (B, "b0"), (A, "a1")]) is None   # never blocks
    assert rv.pending(A) == (2, 0) and rv.pending(B) == (1, 0)
    batch = asyncio.ensure_future(rv.recv_many([A, B, A, str(A), B]))
    await settle()
    assert not batch.done()
    rv.send_many(((k, s) for k, s in [(B, "b1"), (A, "a2")]))
    assert await asyncio.wait_for(batch, 5) == ["a0", "b0", "a1", "a2", "b1"]
    assert rv.pending(A) == (0, 0) and rv.pending(B) == (0, 0)
    assert await rv.recv_many([], timeout=0.1) == []


@pytest.mark.loop_timeout(5)
async def test_rendezvous_partial_timeout_gives_values_back_in_order() -> None:
    rv = rvz.Rendezvous()
    never = key("never")
    rv.send(A, "a0")
    batch = asyncio.ensure_future(rv.recv_many([A, B, A, never], timeout=0.2))
    await settle()
    rv.send(A, "a1")   # delivered to the waiting batch
    rv.send(B, "b0")   # delivered to the waiting batch
    rv.send(A, "a2")   # queued
    with pytest.raises(TimeoutError) as info:
        await batch
    assert type(info.value) is TimeoutError
    assert str(never) in str(info.value)
    assert rv.pending(A) == (3, 0) and rv.pending(B) == (1, 0) and rv.pending(never) == (0, 0)
    assert [await rv.recv(A) for _ in range(3)] == ["a0", "a1", "a2"]
    assert await rv.recv(B) == "b0"


@pytest.mark.loop_timeout(5)
async def test_rendezvous_cancel_mid_batch_and_after_delivery() -> None:
    rv = rvz.Rendezvous()
    # cancelled while it waits for B, holding a0
    rv.send(A, "a0")
    batch = asyncio.ensure_future(rv.recv_many([A, B]))
    await settle()
    rv.send(A, "a1")
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert rv.pending(A) == (2, 0) and rv.pending(B) == (0, 0)
    # cancelled after every value was delivered, before it ran
    batch = asyncio.ensure_future(rv.recv_many([A, B, A, A]))
    await settle()
    rv.send_many([(B, "b0"), (A, "a2"), (A, "a3")])
    assert batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert rv.pending(A) == (4, 0) and rv.pending(B) == (1, 0)
    assert await rv.recv_many([A, A, B, A, A]) == ["a0", "a1", "b0", "a2", "a3"]


@pytest.mark.loop_timeout(5)
async def test_rendezvous_cancelled_batch_hands_values_to_the_next_waiter() -> None:
    rv = rvz.Rendezvous()
    batch = asyncio.ensure_future(rv.recv_many([A, B]))
    await settle()
    single = asyncio.ensure_future(rv.recv(A))
    await settle()
    rv.send(A, "a0")      # goes to the batch, which waits first
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert await asyncio.wait_for(single, 2) == "a0"
    assert rv.pending(A) == (0, 0) and rv.pending(B) == (0, 0)


@pytest.mark.loop_timeout(5)
async def test_rendezvous_later_recv_waits_behind_a_batch() -> None:
    rv = rvz.Rendezvous()
    batch = asyncio.ensure_future(rv.recv_many([A, B]))
    await settle()
    later = asyncio.ensure_future(rv.recv(B))
    await settle()
    rv.send_many([(B, "b0"), (B, "b1"), (A, "a0")])
    assert await asyncio.wait_for(batch, 2) == ["a0", "b0"]
    assert await asyncio.wait_for(later, 2) == "b1"


@pytest.mark.parametrize("where", ["rendezvous", "node"])
@pytest.mark.loop_timeout(10)
async def test_two_failed_batches_give_values_back_in_fifo_order(cluster, where) -> None:  # type: ignore[no-untyped-def]
    # Two batches each hold one value of a key while they wait for other keys.  Whichever
    # fails first, later recvs get the values in the order they were sent.
    rv = rvz.Rendezvous()
    node = await rvz.Node(cluster, "ps", 0, **FAST).start()   # local keys only
    try:
        if where == "rendezvous":
            recv_many, a, n1, n2 = rv.recv_many, A, key("n1"), key("n2")
        else:
            recv_many, a, n1, n2 = node.recv_many, local("a"), local("n1"), local("n2")
        first = asyncio.ensure_future(recv_many([a, n1]))
        await settle()
        second = asyncio.ensure_future(recv_many([a, n2]))
        await settle()
        for value in (b"a0", b"a1"):
            if where == "rendezvous":
                rv.send(a, value)
            else:
                await node.send(a, value)
        await settle()
        first.cancel()         # holds a0: fails first
        await settle()
        second.cancel()        # holds a1
        for task in (first, second):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert await recv_many([a, a], timeout=5) == [b"a0", b"a1"]
    finally:
        node.abort()


@pytest.mark.loop_timeout(5)
async def test_rendezvous_abort_mid_batch() -> None:
    rv = rvz.Rendezvous()
    rv.send(A, "a0")
    batch = asyncio.ensure_future(rv.recv_many([A, B]))
    await settle()
    cause = ValueError("the root cause")
    rv.abort(cause)
    with pytest.raises(rvz.Aborted) as info:
        await batch
    assert info.value.__cause__ is cause
    with pytest.raises(rvz.Aborted) as info:
        await rv.recv_many([A])
    assert info.value.__cause__ is cause
    with pytest.raises(rvz.Aborted):
        rv.send_many([(A, "late")])


@pytest.mark.loop_timeout(5)
async def test_rendezvous_malformed_key_takes_nothing() -> None:
    rv = rvz.Rendezvous()
    rv.send(A, "a0")
    with pytest.raises(rvz.KeyFormatError):
        await rv.recv_many([A, "not;a;key"], timeout=1)
    assert rv.pending(A) == (1, 0)
    assert await rv.recv(A) == "a0"

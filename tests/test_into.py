"""Receiving into the caller's buffer: ``recv(key, into=buf)`` and ``recv_many(keys,
into=[...])``.

A large TCP payload on its way to a waiting recv is read straight into its buffer (counted by
``stats()["into"]``); every other value is copied in.  A value that does not fit fails the
recv with ``BufferMismatch`` and stays queued.  A recv that stops waiting while its payload
lands leaves the buffer alone from then on, and the value goes to the next recv.
"""

from __future__ import annotations

import array
import asyncio
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

import rvz
from rvz import _impl
from rvz._fast.into import Landings, Target

from .conftest import FAST, eventually, key, pair
from .faultproxy import FaultProxy
from .test_codec import feed
from .test_tensors import TORCH_DTYPES

MODES = ["recv", "send"]
BIG = 1 << 20  # float32 items: 4 MiB, above the decoder's direct_min

try:
    import torch
except ImportError:  # the torch extra is not installed
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (pip install 'rvz[torch]')")


def into_stats(node: rvz.Node) -> tuple[int, int]:
    into = node.stats()["into"]
    return into["landed_bytes"], into["copied_bytes"]


def value(i: int, n: int = BIG) -> np.ndarray:
    return np.arange(n, dtype=np.float32) + i


async def posted(aw: Any, node: rvz.Node, k: rvz.Key) -> asyncio.Future[Any]:
    """Start a recv and return once it waits in its key's queue."""
    task = asyncio.ensure_future(aw)
    await eventually(lambda: task.done() or _waiting(node, k), "the recv waits")
    return task


def _waiting(node: rvz.Node, k: rvz.Key) -> bool:
    return any(s["waiting_recvs"] for s in node.stats()["steps"].values())


# -- what a buffer may be ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_values_are_copied_into_buffers_of_every_kind(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    matrix = np.zeros((4, 6), np.float64)
    raw = bytearray(24)
    typed = array.array("i", [0, 0, 0])
    cases: list[tuple[Any, Any, Any]] = [
        (np.zeros((2, 3), np.int16), np.arange(6, dtype=np.int16).reshape(2, 3), None),
        (matrix[1], np.full(6, 2.5), lambda: matrix[1]),             # a row: contiguous
        (matrix[:, 2], np.arange(4, dtype=np.float64), lambda: matrix[:, 2]),  # a column: strided
        (memoryview(raw), np.arange(3, dtype=np.float64), lambda: np.frombuffer(raw, np.float64)),
        (raw, b"x" * 24, lambda: bytes(raw)),
        (typed, np.array([7, 8, 9], np.int32), lambda: np.frombuffer(typed, np.int32)),
    ]
    async with pair(cluster, mode) as (w, p):
        for i, (buf, sent, seen) in enumerate(cases):
            await w.send(key(f"k{i}"), sent)
            out = await p.recv(key(f"k{i}"), into=buf, timeout=5)
            assert out is buf
            got = buf if seen is None else seen()
            if isinstance(sent, bytes):
                assert got == sent
            else:
                assert np.array_equal(got, sent), i
        assert matrix[0].sum() == 0 and matrix[2, 0] == 0  # nothing outside the slices written


@needs_torch
@pytest.mark.parametrize("mode", MODES)
async def test_a_torch_tensor_and_a_slice_of_one_take_their_values(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    big = torch.zeros(8, BIG // 8)
    whole = torch.zeros(BIG, dtype=torch.float32)
    async with pair(cluster, mode) as (w, p):
        for row in (3, 5):
            recv = await posted(p.recv(key("row"), into=big[row], timeout=5), p, key("row"))
            await w.send(key("row"), torch.full((BIG // 8,), float(row)))
            assert (await recv) is not None
        assert big[3].eq(3).all() and big[5].eq(5).all() and big[4].eq(0).all()
        await w.send(key("w"), torch.arange(BIG, dtype=torch.float32))
        assert (await p.recv(key("w"), into=whole, timeout=5)) is whole
        assert torch.equal(whole, torch.arange(BIG, dtype=torch.float32))


@needs_torch
@pytest.mark.parametrize("mode", MODES)
async def test_torch_tensors_of_every_dtype_are_received_into_tensors(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        for name in TORCH_DTYPES:
            dtype = getattr(torch, name)
            for n in (24, BIG // 4):  # staged, then large enough to land
                sent = (torch.arange(n) % 7).to(dtype)
                buf = torch.empty(n, dtype=dtype)
                recv = await posted(p.recv(key(name), into=buf, timeout=5), p, key(name))
                await w.send(key(name), sent)
                assert (await recv) is buf and torch.equal(buf, sent), (name, n)


async def test_buffers_rvz_cannot_write_are_refused_before_anything_is_taken(cluster) -> None:  # type: ignore[no-untyped-def]
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    async with pair(cluster, "send") as (w, p):
        await w.send(key("a"), np.ones(4, np.float32))
        for buf, says in ((frozen, "read-only"), (b"1234567890123456", "read-only"),
                          (memoryview(bytearray(16))[::2], "contiguous"), (3.5, "not builtins.float"),
                          (np.zeros(2, ">f4"), "dtype >f4")):
            with pytest.raises(TypeError, match=says):
                await p.recv(key("a"), into=buf, timeout=5)
        assert np.array_equal(await p.recv(key("a"), timeout=5), np.ones(4, np.float32))
        if torch is not None:
            with pytest.raises(TypeError, match="receive into a torch.Tensor that requires grad"):
                await p.recv(key("a"), into=torch.zeros(4, requires_grad=True), timeout=5)


# -- a value that does not fit -------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("waits", [False, True], ids=["queued", "waiting"])
async def test_a_value_that_does_not_fit_fails_the_recv_and_stays_queued(cluster, mode, waits) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        wrong = [(np.zeros(4, np.float64), r"float64 buffer of shape \(4,\)"),
                 (np.zeros((2, 2), np.float32), r"float32 buffer of shape \(2, 2\)"),
                 (bytearray(12), "buffer of 12 bytes")]
        sent = np.arange(4, dtype=np.float32)
        for i, (buf, says) in enumerate(wrong):
            k = key(f"k{i}")
            if waits:
                recv = await posted(p.recv(k, into=buf, timeout=5), p, k)
                await w.send(k, sent)
            else:
                await w.send(k, sent)
                recv = asyncio.ensure_future(p.recv(k, into=buf, timeout=5))
            with pytest.raises(rvz.BufferMismatch, match=f"float32 value of shape .4,. .16 bytes. "
                                                         f"does not fit into= a {says}"):
                await recv
            assert not buf.any() if isinstance(buf, np.ndarray) else buf == bytearray(12)
            await w.send(k, sent + 1)  # the refused value stays first
            first, second = await p.recv_many([k, k], timeout=5)
            assert np.array_equal(first, sent) and np.array_equal(second, sent + 1)


@pytest.mark.parametrize("mode", MODES)
async def test_recv_many_fills_its_buffers_or_gives_every_value_back(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        a, c = np.zeros(3, np.int64), np.zeros(BIG, np.float32)
        keys = [key("a"), key("b"), key("c")]
        recv = await posted(p.recv_many(keys, into=[a, None, c], timeout=5), p, key("c"))
        await w.send_many([(keys[0], np.arange(3)), (keys[1], b"xy"), (keys[2], value(1))])
        out = await recv
        assert out[0] is a and out[1] == b"xy" and out[2] is c
        assert a.tolist() == [0, 1, 2] and np.array_equal(c, value(1))
        await w.send_many([(keys[0], np.arange(3)), (keys[1], b"z"), (keys[2], value(2, 7))])
        with pytest.raises(rvz.BufferMismatch, match="shape .7,."):
            await p.recv_many(keys, into=[a, None, c], timeout=5)
        again = await p.recv_many(keys, timeout=5)  # all three went back, in order
        assert again[0].tolist() == [0, 1, 2] and again[1] == b"z" and again[2].shape == (7,)
        await w.send_many([(keys[0], np.arange(3) + 1), (keys[1], b"q"), (keys[2], value(3))])
        await eventually(lambda: sum(s["queued_values"] for s in p.stats()["steps"].values()) == 3,
                         "the three values are queued", 10)
        out = await p.recv_many(keys, into=[a, None, c], timeout=5)  # taken at once, no wait
        assert a.tolist() == [1, 2, 3] and out[1] == b"q" and np.array_equal(c, value(3))
        with pytest.raises(ValueError, match="3 keys and 2 into= buffers"):
            await p.recv_many(keys, into=[a, c], timeout=5)


# -- straight from the socket ----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_a_large_value_lands_in_a_waiting_buffer_and_a_queued_one_is_copied(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    buf = np.zeros(BIG, np.float32)
    nbytes = buf.nbytes
    async with pair(cluster, mode) as (w, p):
        for i in range(3):
            recv = await posted(p.recv(key("a"), into=buf, timeout=5), p, key("a"))
            landed, copied = into_stats(p)
            await w.send(key("a"), value(i))
            assert (await recv) is buf and np.array_equal(buf, value(i))
            more_landed, more_copied = into_stats(p)
            # What came with the frame's header in one read is copied from the staging buffer.
            assert more_landed - landed + more_copied - copied == nbytes
            assert more_landed - landed >= nbytes // 2, (more_landed - landed, more_copied - copied)
        await w.send(key("a"), value(9))
        await eventually(lambda: any(s["queued_values"] for s in p.stats()["steps"].values()),
                         "the value is queued", 10)
        landed, copied = into_stats(p)
        assert (await p.recv(key("a"), into=buf, timeout=5)) is buf
        assert into_stats(p) == (landed, copied + nbytes) and np.array_equal(buf, value(9))


@asynccontextmanager
async def slow_pair(mode: str, delay: float) -> Any:
    """worker:0 and ps:0 through fault proxies that hold every 64 KiB chunk ``delay`` s."""
    pw, pp = rvz.cluster.free_ports(2)
    proxies = [await FaultProxy.start(pw), await FaultProxy.start(pp)]
    for proxy in proxies:
        proxy.faults.delay = delay
    try:
        w_spec = rvz.ClusterSpec({"worker": [f"127.0.0.1:{pw}"], "ps": [proxies[1].address]})
        p_spec = rvz.ClusterSpec({"worker": [proxies[0].address], "ps": [f"127.0.0.1:{pp}"]})
        async with rvz.Node(w_spec, "worker", 0, mode, **FAST) as w, \
                rvz.Node(p_spec, "ps", 0, mode, **FAST) as p:
            await w.send(key("warm"), b"")  # connected before the timing starts
            await p.recv(key("warm"), timeout=10)
            yield w, p
    finally:
        for proxy in proxies:
            await proxy.close()


def landing(p: rvz.Node) -> Any:
    """The into= target a payload lands in now, or None."""
    for target in p._core.into.waiting.values():
        if target.decoder is not None:
            return target
    return None


def arriving(p: rvz.Node) -> bool:
    """Whether a large payload is being received into the node's own memory."""
    return any(c.decoder is not None and c.decoder.payload_left() > 0
               for peer in p._core.peers.values() for c in peer.live_connections())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["cancel", "timeout"])
@pytest.mark.loop_timeout(40)
async def test_a_recv_that_stops_waiting_as_its_value_lands_leaves_the_buffer_alone(mode, how) -> None:  # type: ignore[no-untyped-def]
    buf = np.zeros(BIG, np.float32)
    async with slow_pair(mode, 0.01) as (w, p):  # 64 chunks of 10 ms
        recv = await posted(p.recv(key("a"), into=buf, timeout=30 if how == "cancel" else 0.25),
                            p, key("a"))
        send = asyncio.ensure_future(w.send(key("a"), value(5), timeout=30))
        await eventually(lambda: landing(p) is not None or recv.done(), "the value lands", 10)
        if how == "cancel":
            recv.cancel()
        with pytest.raises(asyncio.CancelledError if how == "cancel" else TimeoutError):
            await recv
        assert landing(p) is None
        snapshot = buf.copy()
        got = await p.recv(key("a"), timeout=30)  # the value went on into memory of its own
        await send
        assert np.array_equal(got, value(5))
        assert np.array_equal(buf, snapshot)  # nothing was written after the recv gave up
        # A part had landed: the buffer holds the value's first bytes, and zeros after them.
        landed, sent = snapshot.view(np.uint8), value(5).view(np.uint8)
        first = int(np.flatnonzero(landed != sent)[0])
        assert first > 0 and not landed[first:].any(), first


@pytest.mark.loop_timeout(40)
async def test_a_send_driven_value_already_arriving_moves_into_the_buffer() -> None:
    buf = np.zeros(BIG, np.float32)
    async with slow_pair("send", 0.01) as (w, p):
        send = asyncio.ensure_future(w.send(key("a"), value(3), timeout=30))
        await eventually(lambda: arriving(p), "the value arrives", 10)
        out = await p.recv(key("a"), into=buf, timeout=30)
        await send
        landed, copied = into_stats(p)
        assert out is buf and np.array_equal(buf, value(3))
        assert landed > 0 and landed + copied == buf.nbytes, (landed, copied)


# -- the decoder's side, without a connection ----------------------------------------------




class Waiting:
    """A recv's future that has not completed."""

    def done(self) -> bool:
        return False


def test_the_decoder_lands_adopts_and_unlands_a_payload() -> None:
    codec = _impl.codec
    hello = codec.encode_hello({"v": codec.VERSION, "job": "worker", "task": 0, "inc": 7,
                                "order": "little"})
    sent = value(0, 1 << 16)
    frame = codec.encode_data(0, 0, b"k", codec.dtype_code(sent.dtype), sent.shape, sent.nbytes) \
        + sent.tobytes()

    def decoder(target: Any) -> Any:
        d = codec.Decoder(buffer_size=1 << 16, direct_min=1 << 14)
        d.land = lambda step, request_id, k, code, shape, n: (
            target if target is not None and target.takes(code, shape, n) else None)
        for event in feed(d, hello + frame[:4096]):
            assert event[0] != codec.DATA
        return d

    # lands whole: the event's value is the buffer itself
    buf = np.zeros_like(sent)
    target = Target(buf, Landings({}))
    target.waiter = Waiting()
    d = decoder(target)
    (event,) = feed(d, frame[4096:])
    assert event[4] is buf and np.array_equal(buf, sent)
    # unlanded half-way: the buffer keeps what came, the value arrives whole elsewhere
    buf2 = np.zeros_like(sent)
    target2 = Target(buf2, Landings({}))
    target2.waiter = Waiting()
    d = decoder(target2)
    feed(d, frame[4096:100000])
    target2.stop()
    before = buf2.copy()
    (event,) = feed(d, frame[100000:])
    assert np.array_equal(event[4], sent) and not np.shares_memory(event[4], buf2)
    assert np.array_equal(buf2, before) and buf2.any()
    # adopted half-way: what came is copied over, the rest lands
    buf3 = np.zeros_like(sent)
    d = decoder(None)
    feed(d, frame[4096:100000])
    assert d.arriving(0, "k")
    target3 = Target(buf3, Landings({}))
    target3.waiter = Waiting()
    assert d.adopt(target3)
    (event,) = feed(d, frame[100000:])
    assert event[4] is buf3 and np.array_equal(buf3, sent)
    assert target3.landings.copied + target3.landings.landed == sent.nbytes


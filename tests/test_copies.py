"""Copies on the data path over a real TCP connection.

A received array must own its memory, or sit alone on a block of the receive pool sized
exactly for it: no staging buffer shared with other data behind it, so nothing stale is kept
alive and the payload was not assembled in a temporary first.  A large sent array leaves as
a view of the caller's memory, small frames of one loop iteration leave together in one
write, and so do its large payloads after the first.
"""

from __future__ import annotations

import asyncio
import mmap
from typing import Any

import numpy as np
import pytest

from rvz import _impl

from .conftest import frame_types, key, pair

MODES = ["recv", "send"]


class Recording:
    """Stands in for a connection's transport and records what each write call carried
    (``writelines`` is one gathered write)."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.calls: list[list[Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    def write(self, data: Any) -> None:
        self.calls.append([data])
        self.transport.write(data)

    def writelines(self, chunks: Any) -> None:
        chunks = list(chunks)
        self.calls.append(chunks)
        self.transport.writelines(chunks)

    def chunks(self) -> list[Any]:
        return [chunk for call in self.calls for chunk in call]


def memory_owner(arr: np.ndarray) -> Any:
    """The object at the end of ``arr``'s base chain."""
    obj: Any = arr
    while isinstance(obj, np.ndarray) and obj.base is not None:
        obj = obj.base
    if isinstance(obj, memoryview):  # np.frombuffer over a pool block
        obj = obj.obj
    return obj


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(20)
async def test_received_arrays_own_their_memory(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    values = [np.random.default_rng(1).standard_normal((512, 1024)),   # 4 MiB: direct
              np.arange(70000, dtype=np.int32),                       # just above 64 KiB
              np.arange(300, dtype=np.float32).reshape(10, 30),       # small: staged
              np.array(7, dtype=np.int64)]                            # 0-d
    async with pair(cluster, mode) as (w, p):
        for value in values:
            await w.send(key(), value)
        for value in values:
            got = await p.recv(key(), timeout=10)
            np.testing.assert_array_equal(got, value)
            owner = memory_owner(got)
            if isinstance(owner, mmap.mmap):   # a receive-pool block (a size class), this array's alone
                assert len(owner) >= got.nbytes and got.nbytes >= 65536
            else:
                assert isinstance(owner, np.ndarray), f"backed by {type(owner).__name__}"
                assert owner.flags.owndata
            assert got.flags.writeable and got.flags.c_contiguous


@pytest.mark.loop_timeout(20)
async def test_large_payload_is_written_from_the_callers_memory(cluster) -> None:  # type: ignore[no-untyped-def]
    value = np.arange(1 << 18, dtype=np.float64)  # 2 MiB
    async with pair(cluster, "send") as (w, p):
        await w.send(key(), np.arange(1))         # connected, window granted
        assert (await p.recv(key(), timeout=5)).tolist() == [0]
        # That push left alone; the next frame leaves alone again only after ALONE_NS (1 ms)
        # or a read from the peer (``Wire._at_once``).
        await asyncio.sleep(0.01)
        conn = w._peers[("ps", 0)].link  # the connection our traffic to it uses
        assert conn is not None
        transport = conn.transport
        recording = conn.transport = Recording(transport)
        try:
            await w.send(key(), value)
            got = await p.recv(key(), timeout=10)
        finally:
            conn.transport = transport
        written = recording.chunks()
        np.testing.assert_array_equal(got, value)
        # The payload went to the transport as a view of the sender's array, not copied
        # into a frame buffer, and the header went as a buffer of its own (with uvloop
        # both in one gathered write).
        views = [d for d in written if isinstance(d, memoryview) and d.nbytes == value.nbytes]
        assert len(views) == 1
        assert np.shares_memory(np.frombuffer(views[0], np.uint8), value)
        assert all(len(d) < 4096 for d in written if d is not views[0])


@pytest.mark.loop_timeout(15)
async def test_small_frames_of_one_iteration_leave_in_at_most_two_writes(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "recv") as (w, p):
        await w.send(key("warmup"), np.arange(1))
        await p.recv(key("warmup"), timeout=5)   # connected: its requests go out on its link
        conn = p._peers[("worker", 0)].link  # the connection our traffic to it uses
        assert conn is not None
        transport = conn.transport
        recording = conn.transport = Recording(transport)
        # The 20 tasks run in one iteration; on a loaded machine they may take longer than
        # the window in which a second frame is held after one that left alone.
        conn.alone_ns = 3600 * 10**9
        try:
            keys = [key(f"many{i}") for i in range(20)]
            recvs = asyncio.gather(*(p.recv(k, timeout=5) for k in keys))
            await asyncio.sleep(0.05)
            for i, k in enumerate(keys):
                await w.send(k, np.array([i]))
            got = await recvs
        finally:
            conn.transport = transport
        assert [int(v[0]) for v in got] == list(range(20))
        written = [bytes(d) for d in recording.chunks()]
        with_requests = [frame_types(d).count(_impl.codec.REQUEST) for d in written]
        assert sum(with_requests) == 20
        # The first frame leaves at once (the iteration before wrote one frame), the other 19
        # of that iteration together at its end.
        assert len([n for n in with_requests if n]) <= 2, with_requests
        assert max(with_requests) >= 19, with_requests


@pytest.mark.loop_timeout(20)
async def test_large_payloads_of_one_iteration_leave_in_one_gathered_write(cluster) -> None:  # type: ignore[no-untyped-def]
    """The first large payload of a loop iteration is written at once (unless the iteration
    before wrote a group, or a frame left alone just before); the later ones, and the small
    frames between them, leave in order in one gathered write at its end, and a write
    leaves once ``GATHER_AT`` payload bytes wait."""
    size = 128 << 10                               # large (not copied into a frame buffer)
    async with pair(cluster, "send") as (w, p):
        await w.send(key(), np.arange(1))          # connected, window granted
        assert (await p.recv(key(), timeout=5)).tolist() == [0]
        # That push left alone; the next frame leaves alone again only after ALONE_NS (1 ms)
        # or a read from the peer (``Wire._at_once``).
        await asyncio.sleep(0.01)
        conn = w._peers[("ps", 0)].link
        assert conn is not None
        transport = conn.transport

        def payloads(call: list[Any]) -> int:
            return sum(1 for d in call if isinstance(d, memoryview) and d.nbytes == size)

        recording = conn.transport = Recording(transport)
        try:
            values = [np.full(size, i, np.uint8) for i in range(3)]
            # No await below suspends (the window is open): one loop iteration.
            await w.send(key(), values[0])
            await w.send(key(), np.array([7], np.uint8))
            await w.send(key(), values[1])
            await w.send(key(), values[2])
            first = [int((await p.recv(key(), timeout=10))[0]) for _ in range(4)]
            count = _impl.wire.GATHER_AT // size + 3  # more than one gathered write holds
            many = [np.full(size, 100 + i, np.uint8) for i in range(count)]
            calls_before = len(recording.calls)
            for value in many:
                await w.send(key(), value)
            second = [await p.recv(key(), timeout=10) for _ in range(count)]
        finally:
            conn.transport = transport
        assert first == [0, 7, 1, 2]               # in order, across the gathered write
        for value, got in zip(many, second, strict=True):
            np.testing.assert_array_equal(got, value)
        calls = recording.calls
        carried = [payloads(c) for c in calls[:calls_before] if payloads(c)]
        later = [payloads(c) for c in calls[calls_before:] if payloads(c)]
        if conn.gather:
            # The iteration before wrote one frame: the first leaves alone, then the rest.
            assert carried == [1, 2], carried
            # That iteration wrote a group, so this one's first waits too; a gathered write
            # leaves as soon as GATHER_AT bytes of payload wait.
            per_write = _impl.wire.GATHER_AT // size
            assert later == [per_write, count - per_write], later
        else:  # the transport's writelines would copy: each payload is written by itself
            assert carried == [1, 1, 1] and later == [1] * count

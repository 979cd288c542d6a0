"""Copies on the data path over a real TCP connection.

A received array must own its memory, or sit alone on a block of the receive pool sized
exactly for it: no staging buffer shared with other data behind it, so nothing stale is kept
alive and the payload was not assembled in a temporary first.  A large sent array leaves as
a view of the caller's memory, and small frames of one loop iteration leave together in one
write.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import numpy as np
import pytest

from rvz import _impl

from .conftest import key, pair

MODES = ["recv", "send"]


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
            if isinstance(owner, bytearray):   # a receive-pool block (a size class), this array's alone
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
        conn = w._peers[("ps", 0)].link  # the connection our traffic to it uses
        assert conn is not None
        written: list[Any] = []
        transport = conn.transport
        real_write = transport.write
        real_writelines = transport.writelines

        class Recording:
            """Stands in for the transport and records what is written."""

            def __getattr__(self, name: str) -> Any:
                return getattr(transport, name)

            def write(self, data: Any) -> None:
                written.append(data)
                real_write(data)

            def writelines(self, chunks: Any) -> None:  # gathered: one writev
                chunks = list(chunks)
                written.extend(chunks)
                real_writelines(chunks)

        conn.transport = Recording()
        try:
            await w.send(key(), value)
            got = await p.recv(key(), timeout=10)
        finally:
            conn.transport = transport
        np.testing.assert_array_equal(got, value)
        # The payload went to the transport as a view of the sender's array, not copied
        # into a frame buffer, and the header went as a buffer of its own (with uvloop
        # both in one gathered write).
        views = [d for d in written if isinstance(d, memoryview) and d.nbytes == value.nbytes]
        assert len(views) == 1
        assert np.shares_memory(np.frombuffer(views[0], np.uint8), value)
        assert all(len(d) < 4096 for d in written if d is not views[0])


def frame_types(data: bytes) -> list[int]:
    """The frame types in a run of whole frames."""
    header = struct.Struct("<BBHIQ")
    types, pos = [], 0
    while pos < len(data):
        _, ftype, _, meta_len, payload_len = header.unpack_from(data, pos)
        types.append(ftype)
        pos += header.size + meta_len + payload_len
    assert pos == len(data)
    return types


@pytest.mark.loop_timeout(15)
async def test_small_frames_of_one_iteration_leave_in_at_most_two_writes(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "recv") as (w, p):
        await w.send(key("warmup"), np.arange(1))
        await p.recv(key("warmup"), timeout=5)   # connected: its requests go out on its link
        conn = p._peers[("worker", 0)].link  # the connection our traffic to it uses
        assert conn is not None
        written: list[bytes] = []
        transport = conn.transport
        real_write = transport.write

        class Recording:
            def __getattr__(self, name: str) -> Any:
                return getattr(transport, name)

            def write(self, data: Any) -> None:
                written.append(bytes(data))
                real_write(data)

        conn.transport = Recording()
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
        with_requests = [frame_types(d).count(_impl.codec.REQUEST) for d in written]
        assert sum(with_requests) == 20
        # The first frame leaves at once (the iteration before wrote one frame), the other 19
        # of that iteration together at its end.
        assert len([n for n in with_requests if n]) <= 2, with_requests
        assert max(with_requests) >= 19, with_requests

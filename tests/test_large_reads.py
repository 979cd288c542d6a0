"""Large payloads over TCP: each byte is copied once, and the loop wakes per chunk, not per
segment.

* After a large payload the decoder reads the next header alone (``codec.PEEK`` bytes), so
  the next large payload goes straight into its array instead of through the staging
  buffer; a read that fills that peek (small frames streaming in) brings back full-size
  reads, a shorter one (a credit or a request alone) does not.
* While a large payload arrives and the socket holds less than the rest of it, the socket's
  ``SO_RCVLOWAT`` is a share of what is left of it (``connection.LOWAT_SHARE``, capped at
  ``LOWAT_MAX``, never under ``LOWAT_MIN``), and 1 again once it is in; when the rest is
  there already, it is not touched.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest

import rvz
from rvz import _impl
from rvz import connection as _connection

from .conftest import eventually, pair
from .hostile import Hostile, data_frame, data_header, key_text

codec = _impl.codec
U8 = codec.dtype_code(np.dtype(np.uint8))
W1 = ("worker", 1)
PS0 = ("ps", 0)


def feed(decoder: object, stream: bytes, start: int, end: int) -> tuple[list, int, int]:
    """Deliver ``stream[start:end]`` the way a transport does (each read fills at most the
    buffer the decoder offers).  Returns the events, the bytes that went through the staging
    buffer (reads that were not into a payload's own array) and the largest such read."""
    events: list = []
    staged = 0
    largest = 0
    pos = start
    while pos < end:
        buf = decoder.get_buffer(-1)  # type: ignore[attr-defined]
        direct = decoder.payload_left() > 0  # type: ignore[attr-defined]
        n = min(len(buf), end - pos)
        buf[:n] = stream[pos:pos + n]
        pos += n
        if not direct:
            staged += n
            largest = max(largest, n)
        events += decoder.buffer_updated(n)  # type: ignore[attr-defined]
    return events, staged, largest


def test_the_next_large_payload_is_not_staged_and_small_frames_read_in_full() -> None:
    decoder = codec.Decoder()
    key = key_text("big", W1, PS0)
    size = 1 << 20
    first = np.full(size, 1, np.uint8)
    second = np.full(size, 2, np.uint8)
    smalls = b"".join(data_frame(0, 0, key, np.full(8, i % 256, np.uint8)) for i in range(2000))
    hello = codec.encode_hello({"v": codec.VERSION, "job": "worker", "task": 1, "inc": 1})
    stream = hello + data_frame(0, 0, key, first) + data_frame(0, 0, key, second) + smalls
    split = len(hello) + len(data_frame(0, 0, key, first))
    events, _, _ = feed(decoder, stream, 0, split)
    assert [e[0] for e in events] == [codec.HELLO, codec.DATA]
    assert events[1][4][0] == 1 and events[1][4].nbytes == size
    # The first large payload is in: the next read is one header's worth, not a buffer full
    # of the next payload, so that payload (all but what shared the header's read) goes
    # straight into its array.
    assert len(decoder.get_buffer(-1)) == codec.PEEK
    end_second = split + len(data_frame(0, 0, key, second))
    events, staged, _ = feed(decoder, stream, split, end_second)
    assert len(events) == 1 and events[0][4][-1] == 2 and events[0][4].nbytes == size
    assert staged <= codec.PEEK
    # Small frames after it: reads are full-size again (many frames per read).
    events, _, largest = feed(decoder, stream, end_second, len(stream))
    assert [int(e[4][0]) for e in events] == [i % 256 for i in range(2000)]
    assert largest > codec.PEEK


def test_a_short_read_of_small_frames_between_large_payloads_keeps_the_peek() -> None:
    """A credit or a request between two large payloads (a read that did not fill the peek:
    the socket had nothing more) keeps the next read short, so the next payload is not
    staged and copied; a read that fills the peek means small frames stream in."""
    decoder = codec.Decoder()
    key = key_text("big", W1, PS0)
    size = 1 << 20
    hello = codec.encode_hello({"v": codec.VERSION, "job": "worker", "task": 1, "inc": 1})
    small = data_frame(0, 0, key, np.full(8, 7, np.uint8))
    large = data_frame(0, 0, key, np.full(size, 3, np.uint8))
    stream = hello + large + small + large
    end_first = len(hello) + len(large)
    events, _, _ = feed(decoder, stream, 0, end_first)
    assert [e[0] for e in events] == [codec.HELLO, codec.DATA]
    # The small frame comes alone (all the socket had), read into the peek.
    assert len(decoder.get_buffer(-1)) == codec.PEEK
    events, _, _ = feed(decoder, stream, end_first, end_first + len(small))
    assert len(events) == 1 and int(events[0][4][0]) == 7
    assert len(decoder.get_buffer(-1)) == codec.PEEK  # still peeking
    events, staged, _ = feed(decoder, stream, end_first + len(small), len(stream))
    assert len(events) == 1 and events[0][4].nbytes == size and int(events[0][4][-1]) == 3
    assert staged <= codec.PEEK
    # Small frames that fill the peek: full-size reads again.
    many = b"".join(data_frame(0, 0, key, np.full(8, i % 256, np.uint8)) for i in range(500))
    feed(decoder, many, 0, codec.PEEK)
    assert len(decoder.get_buffer(-1)) > codec.PEEK


def lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


@pytest.mark.loop_timeout(20)
@pytest.mark.parametrize("through", ["libc", "socket object"])
async def test_the_socket_wakes_the_loop_per_chunk_of_a_large_payload(
        through: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if through == "socket object":  # where the C library's setsockopt cannot be loaded
        monkeypatch.setattr(_connection, "_SETSOCKOPT", None)
    else:
        assert _connection._SETSOCKOPT is not None, "this POSIX host has setsockopt in libc"
    cluster = rvz.ClusterSpec.loopback({"worker": 2, "ps": 1})
    # A slow heartbeat: one that sees no read mid-payload turns SO_RCVLOWAT off (slow link).
    async with pair(cluster, "send", heartbeat=1.0, peer_timeout=5.0) as (_w, p):
        k = key_text("big", W1, PS0)
        size = 3 << 20
        value = np.arange(size, dtype=np.uint8)
        h = await Hostile.connect(p.address)
        try:
            await h.hello("worker", 1, mode="send")
            header = data_header(0, 0, k, U8, (size,), size)
            part = 512 << 10
            assert await h.send(header + value[:part].tobytes())

            def conns() -> list:
                return [c for c in p._conns if c.peer is not None and c.peer.name.endswith("task:1")]

            await eventually(lambda: any(0 < c.decoder.payload_left() < size for c in conns()),
                             "the node read the header and the start of the payload")
            (conn,) = conns()
            sock = conn.lowat_sock
            assert sock is not None, "plain TCP: SO_RCVLOWAT is in use"
            # The loop is woken when a chunk of what is left is there, not for every segment
            # (so some of the part we sent may still wait in the socket).
            left = conn.decoder.payload_left()
            assert lowat(sock) == min(left // _connection.LOWAT_SHARE, _connection.LOWAT_MAX) > 1
            assert await h.send(value[part:].tobytes())
            got = await p.recv(k, timeout=10)
            np.testing.assert_array_equal(got, value)
            assert lowat(sock) == 1  # between frames the loop wakes for any byte
        finally:
            h.close()


@pytest.mark.loop_timeout(20)
async def test_reads_reach_the_transport_only_to_tune_and_the_pool_is_kept_without_it(cluster) -> None:  # type: ignore[no-untyped-def]
    """Small frames are read and dispatched by the engine alone (compiled, no interpreted
    frame of the transport); a large payload's reads reach ``tune_read`` only while the
    socket is tuned or when one comes up short with at least LOWAT_SHARE * LOWAT_MIN left.  The engine
    itself has the receive pool prepare its next block after large reads."""
    async with pair(cluster, "send") as (w, p):
        k = key_text("big", ("worker", 0), PS0)
        await w.send(k, np.arange(4, dtype=np.uint8))   # connected, window granted
        await p.recv(k, timeout=5)
        (conn,) = [c for c in p._conns if c.peer is not None and c.peer.name.endswith("task:0")]
        calls: list[tuple[bool, int]] = []
        real = conn.tune_read

        def recording() -> None:
            calls.append((conn.tuning, conn.decoder.payload_left()))
            real()

        conn.tune_read = recording  # type: ignore[method-assign]
        for i in range(200):
            await w.send(k, np.full(64, i % 256, np.uint8))
        for i in range(200):
            assert int((await p.recv(k, timeout=5))[0]) == i % 256
        assert calls == [], "reads of small frames went past the engine"
        pool = p._recv_pool
        assert pool is not None and pool.prepared == 0
        size = 8 << 20
        value = np.arange(size, dtype=np.uint8)
        await w.send(k, value)
        got = await p.recv(k, timeout=10)
        np.testing.assert_array_equal(got, value)
        tunable = _connection.LOWAT_SHARE * _connection.LOWAT_MIN
        assert all(tuning or left >= tunable for tuning, left in calls), calls
        assert not conn.tuning  # the payload is in: tuning ended
        if conn.lowat_sock is not None:  # plain TCP (not a heartbeat's slow-link fallback)
            assert lowat(conn.lowat_sock) == 1
        # ``got`` holds the block it landed on: the pool made a spare after the reads.
        await eventually(lambda: pool.prepared >= 1 and not pool.due, "a spare block prepared")
        assert got.base is not None and pool.held >= 2 * size


def inject(conn: object, data: bytes, reads: list[int]) -> None:
    """Hand ``data`` to ``conn`` as a transport would: each read fills the buffer offered,
    or stops at the length ``reads`` gives next (a short read: the socket had no more)."""
    pos = 0
    while pos < len(data):
        buf = conn.get_buffer(-1)  # type: ignore[attr-defined]
        n = min(len(buf), len(data) - pos, reads.pop(0) if reads else len(data))
        buf[:n] = data[pos:pos + n]
        conn.buffer_updated(n)  # type: ignore[attr-defined]
        pos += n


@pytest.mark.loop_timeout(20)
async def test_a_payload_already_in_the_socket_is_read_without_tuning(cluster) -> None:  # type: ignore[no-untyped-def]
    """When the rest of a payload is in the socket (reads fill the buffer offered, as for a
    consumer that cannot keep up), no socket option changes: SO_RCVLOWAT costs a system
    call each time.  A read that comes up short inside the payload raises it if a share of
    what is left is at least LOWAT_MIN; the read that ends the payload lowers it again."""
    async with pair(cluster, "send") as (w, p):
        k = key_text("big", ("worker", 0), PS0)
        tunable = _connection.LOWAT_SHARE * _connection.LOWAT_MIN
        size = 4 * tunable                            # half of it is worth tuning for
        value = np.arange(size, dtype=np.uint8)
        await w.send(k, value)   # connected, window granted, and the decoder now peeks
        await p.recv(k, timeout=5)
        (conn,) = [c for c in p._conns if c.peer is not None and c.peer.name.endswith("task:0")]
        if conn.lowat_sock is None:
            pytest.skip("SO_RCVLOWAT is not in use on this host")
        # The next header is read alone, so the payload lands in its array by reads of its own.
        assert len(conn.decoder.get_buffer(-1)) == codec.PEEK
        changes: list[int] = []
        real = conn._set_lowat

        def recording(value: int) -> None:
            if value != conn._lowat:
                changes.append(value)
            real(value)

        conn._set_lowat = recording  # type: ignore[method-assign]
        frame = data_header(0, 0, k, U8, (size,), size) + value.tobytes()
        # Synchronous: no read from the socket comes between these.
        inject(conn, frame, [])
        np.testing.assert_array_equal(await p.recv(k, timeout=5), value)
        assert changes == [] and lowat(conn.lowat_sock) == 1
        # The header, then half of what is left, then the rest.
        inject(conn, frame, [codec.PEEK, size // 2])
        np.testing.assert_array_equal(await p.recv(k, timeout=5), value)
        assert len(changes) == 2 and changes[0] > 1 and changes[1] == 1, changes
        assert lowat(conn.lowat_sock) == 1
        # A short read that leaves less than LOWAT_SHARE * LOWAT_MIN (its share would be
        # under LOWAT_MIN): a few more wake-ups cost less.
        small = value[:tunable]
        frame = data_header(0, 0, k, U8, small.shape, small.nbytes) + small.tobytes()
        inject(conn, frame, [codec.PEEK, small.nbytes // 8])
        np.testing.assert_array_equal(await p.recv(k, timeout=5), small)
        assert len(changes) == 2, changes

"""The decoder fuzz, fed through the whole receive path: Connection -> Wire.feed ->
Core.dispatch -> tables, on a running node.

Invariant: whatever a peer sends, the connection either handles it or is closed with a
``ProtocolError``; nothing raises into the event loop, and the node keeps serving others.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np

import rvz

from .conftest import FAST, FakeTransport, frame_types, key, pair
from .test_codec import HELLO, _mutate, _valid_stream, random_chunks


def feed_connection(node: rvz.Node, data: bytes, chunks: Any) -> FakeTransport:
    conn = node._connection(outbound=False)
    transport = FakeTransport()
    conn.connection_made(transport)
    view = memoryview(data)
    sizes = iter(chunks) if chunks is not None else None
    pos = 0
    while pos < len(view) and not transport.is_closing():
        try:
            buf = conn.get_buffer(-1)
        except rvz.ProtocolError:
            break  # a failed decoder refuses to offer more; the transport was closed
        n = min(len(buf), len(view) - pos)
        if sizes is not None:
            n = min(n, next(sizes))
        buf[:n] = view[pos:pos + n]
        pos += n
        conn.buffer_updated(n)  # must never raise
    conn.connection_lost(None)
    return transport


def test_fuzz_through_the_engine_never_escapes_and_the_node_still_works(run, cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        loop = asyncio.get_running_loop()
        escaped: list[Any] = []
        loop.set_exception_handler(lambda _loop, context: escaped.append(context))
        async with pair(cluster, "send", ps={"peer_timeout": 30.0}) as (w, p):
            rng = random.Random(11)
            closed = 0
            for i in range(300):
                data = _mutate(rng, _valid_stream(rng)) if i % 4 else HELLO + bytes(
                    rng.randrange(256) for _ in range(rng.randint(0, 120)))
                transport = feed_connection(p, data, None if i % 3 == 0 else random_chunks(i, 64))
                closed += transport.is_closing()
                await asyncio.sleep(0)
            assert closed > 0          # the fuzz did produce malformed input
            assert not escaped, escaped[:3]
            # the real peer still gets through, in both directions
            await w.send(key("after"), np.arange(5))
            assert (await p.recv(key("after"), timeout=5)).tolist() == list(range(5))

    run(main(), timeout=60)


def test_fuzzed_keys_from_the_wire_never_touch_local_keys(run, cluster) -> None:  # type: ignore[no-untyped-def]
    """DATA whose key is not from the sending peer to us is a protocol error: a value the
    node sent itself (src == dst == ps) is never replaced or taken by a remote frame."""

    async def main() -> None:
        PS = "/job:ps/replica:0/task:0/device:CPU:0"
        local = rvz.Key(src=PS, dst=PS, name="mine")
        async with rvz.Node(cluster, "ps", 0, "send", **FAST) as p:
            await p.send(local, np.arange(3))
            value = np.arange(2, dtype=np.int16)
            out = bytearray()
            rvz._impl.codec.append_data(out, 0, 0, str(local).encode(), 5, (2,), 4, value, True)
            transport = feed_connection(p, HELLO + bytes(out), None)
            # Closed after an ERROR that tells the peer why (not a reset it would take for
            # a broken link, and send the same frame again after reconnecting).
            assert transport.is_closing()
            assert frame_types(bytes(transport.sent))[-1] == rvz._impl.codec.ERROR
            assert (await p.recv(local, timeout=5)).tolist() == [0, 1, 2]

    run(main(), timeout=15)

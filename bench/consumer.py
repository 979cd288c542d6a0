"""A consumer's own cost per received value, in one process, no sockets: ns (or, under
callgrind, instructions) per message to decode, dispatch and take one key's stream, for
whichever implementation loads (``RVZ_NO_EXTENSIONS=1`` for the pure-Python one).

The bytes are what a producer's engine writes for ``await node.send(k, v)`` in a loop
(``--batch`` sends per loop iteration, so small values are packed into DATA_MANY frames as
they are on the wire); they are fed to the consumer's decoder in reads of ``--read`` bytes
(or less, when its staging buffer offers less), as a socket that always has more to give
would, so frames are cut across reads.  After each read the consumer takes every value it
has, one at a time, keeping the previous one alive as ``v = await node.recv(k)`` does, then
lets the loop run what the read scheduled, if anything (credit to return, the receive pool's
next block).
Copying into the read buffer stands for the kernel's copy and is counted too (the same for
every build).

Instructions per message: run under ``valgrind --tool=callgrind`` with ``N=20000`` and
``N=60000`` (one size at a time) and divide the difference of the totals by 40000.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

import numpy as np
from engine import KEYS, NullWire, core  # the engine's probe: its stub host, its cores

import rvz
from rvz import _impl

codec = _impl.codec
KEY = KEYS[0]


class Capture:
    """A transport that keeps what the producer's wire writes."""

    def __init__(self) -> None:
        self.out = bytearray()

    def write(self, data: Any) -> None:
        self.out += data

    def writelines(self, parts: Any) -> None:
        for part in parts:
            self.out += part


class ProbeWire(NullWire):  # type: ignore[misc,valid-type]
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.transport = Capture()


def produced(loop: Any, size: int, batch: int, count: int) -> bytes:
    """The bytes a producer writes for ``count`` sends of ``size`` bytes on one key,
    ``batch`` sends a loop iteration (after its connection's first frames)."""
    producer = core("a", "b", loop)
    peer = producer.routes.peer(("b", 0))
    wire = ProbeWire(producer, True, peer, None)
    wire.ready = True
    peer.link = wire
    value = np.zeros(size, np.uint8)
    wire.flush()
    wire.transport.out.clear()
    for i in range(count):
        producer.send(KEY, value, None, 0, None)
        peer.credit = 1 << 40
        if i % batch == batch - 1:
            wire.flush()
    wire.flush()
    return bytes(wire.transport.out)


def split_seq(data: bytes) -> tuple[bytes, bytes]:
    """``(the frames up to the last SEQ, the rest)``: the rest can be fed again and again
    (its values count on), a SEQ frame only once (a repeated number would be a duplicate)."""
    pos = cut = 0
    while pos < len(data):
        meta, payload = int.from_bytes(data[pos + 4:pos + 8], "little"), \
            int.from_bytes(data[pos + 8:pos + 16], "little")
        end = pos + codec.HEADER_SIZE + meta + payload
        if data[pos + 1] == codec.SEQ:
            cut = end
        pos = end
    return data[:cut], data[cut:]


async def consume(loop: Any, first: bytes, stream: bytes, per_stream: int, n: int,
            read: int) -> float:
    """Feed ``first`` once, then ``stream`` (``per_stream`` values) again and again until
    ``n`` values were taken; seconds spent."""
    consumer = core("b", "a", loop)
    decoder = codec.Decoder(max_payload=codec.DEFAULT_MAX_PAYLOAD,
                            pool=_impl.recvpool.RecvPool(256 << 20))
    peer = consumer.routes.peer(("a", 0))
    wire = ProbeWire(consumer, False, peer, decoder)
    wire.ready = True
    peer.link = wire  # the credit it returns goes out on it
    hello = codec.encode_hello({"v": codec.VERSION})
    decoder.get_buffer(-1)[:len(hello)] = hello
    decoder.buffer_updated(len(hello))
    decoder.get_buffer(-1)[:len(first)] = first
    wire.buffer_updated(len(first))
    source = memoryview(stream)
    recv = consumer.recv
    table = consumer.steps.table(0)
    taken = 0
    at = 0
    value: Any = None
    rounds = -(-n // per_stream)
    t = time.perf_counter()
    for _ in range(rounds):
        at = 0
        while at < len(stream):
            buf = decoder.get_buffer(-1)
            nbytes = min(len(buf), read, len(stream) - at)
            buf[:nbytes] = source[at:at + nbytes]
            at += nbytes
            wire.buffer_updated(nbytes)
            for _ in range(table.queued(KEY)):
                value = recv(KEY, 0, None, None)  # the previous value lives until replaced
                taken += 1
            if loop._ready:  # type: ignore[attr-defined]  # what the read scheduled (credit, pool)
                await asyncio.sleep(0)
                wire.transport.out.clear()
    elapsed = time.perf_counter() - t
    assert taken == rounds * per_stream, (taken, rounds, per_stream)
    assert value is not None
    return elapsed


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,4K,64K")
    ap.add_argument("--read", type=parse_size, default=64 << 10,
                    help="bytes a read gives at most (default 64K)")
    ap.add_argument("--batch", type=int, default=8, help="sends per producer loop iteration")
    args = ap.parse_args()
    loop = asyncio.get_running_loop()
    n = int(os.environ.get("N", "200000"))
    print(f"rvz {rvz.implementation()}: consumer decode + dispatch + take, one key, "
          f"reads of {args.read} bytes, {args.batch} sends a producer iteration")
    for text in args.sizes.split(","):
        size = parse_size(text)
        per_stream = 8 * args.batch  # values in the stream fed over and over
        first, stream = split_seq(produced(loop, size, args.batch, per_stream))
        elapsed = await consume(loop, first, stream, per_stream, n, args.read)
        print(f"{text:>6}: {elapsed / n * 1e9:7.0f} ns/message")


if __name__ == "__main__":
    asyncio.run(main())

"""The protocol engine alone, in one process: ns per message to push, to decode and
dispatch, and to take a queued value, for whichever implementation loads
(``RVZ_NO_EXTENSIONS=1 python bench/engine.py`` for the pure-Python one).

No sockets: the producer's wire discards what it would write (its pushes are packed into
DATA_MANY frames), the consumer's decoder is fed 64 DATA frames at a time (what answers
and large values travel in), then one DATA_MANY frame of 64 values.
Compare the two implementations in back-to-back runs on the same machine.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import numpy as np

import rvz
from rvz import _impl

engine = _impl.engine
codec = _impl.codec
CLUSTER = rvz.ClusterSpec({"a": ["127.0.0.1:1"], "b": ["127.0.0.1:2"]})
A = "/job:a/replica:0/task:0/device:CPU:0"
B = "/job:b/replica:0/task:0/device:CPU:0"
KEYS = [str(rvz.Key(src=A, dst=B, name=f"s{i}", incarnation=1)) for i in range(64)]


class Host:
    """The node's side of the engine (rvz._fast.host.Host), reduced to what a running,
    linked node answers: the benchmark never calls the rest."""

    def check_running(self, key: Any = None) -> None:
        pass

    def start_link(self, peer: Any) -> None:
        pass


class NullTransport:
    """Takes the wire's writes and drops them: the engine alone is measured."""

    def write(self, data: Any) -> None:
        pass

    def writelines(self, parts: Any) -> None:
        pass


class NullWire(_impl.wire.Wire):  # type: ignore[misc,name-defined]
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.transport = NullTransport()

    def fail(self, reason: BaseException) -> None:
        raise reason


def core(job: str, peer: str, loop: Any) -> Any:
    c = engine.Core(Host(), CLUSTER, (job, 0), job, "send", loop, 64 << 20, 256 << 20, None)
    c.attach(loop, threading.get_ident())  # as Node.start does
    c.set_running(True)
    return c


async def main() -> None:
    loop = asyncio.get_running_loop()
    n = int(os.environ.get("N", "200000"))
    value = np.zeros(64, np.uint8)
    producer = core("a", "b", loop)
    peer = producer.routes.peer(("b", 0))
    wire = NullWire(producer, True, peer, None)
    wire.ready = True
    peer.link = wire
    t = time.perf_counter()
    for i in range(n):
        producer.send(KEYS[i & 63], value, None, 0, None)
        if peer.credit < 1 << 20:
            peer.credit = 64 << 20
        if i & 63 == 63:
            wire.flush()
            producer.credit.on_ack(wire, peer.tx_seq)  # the consumer's ACK, with its credit
    print(f"send (push, 64 B):       {(time.perf_counter() - t) / n * 1e9:6.0f} ns/message")

    frames = bytearray()
    for k in KEYS:
        codec.append_data(frames, 0, 0, k.encode(), 3, (64,), 64, value, True)
    consumer = core("b", "a", loop)
    decoder = codec.Decoder()
    cwire = NullWire(consumer, False, consumer.routes.peer(("a", 0)), decoder)
    cwire.ready = True
    hello = codec.encode_hello({"v": codec.VERSION})
    decoder.get_buffer(-1)[:len(hello)] = hello
    decoder.buffer_updated(len(hello))
    rounds = max(1, n // 64)

    def feed_and_take(data: bytes | bytearray, take: Any) -> tuple[float, float]:
        """ns per message to decode and dispatch ``data`` (64 values), and to take them."""
        fed = taken = 0.0
        for _ in range(rounds):
            decoder.get_buffer(-1)[:len(data)] = data
            t = time.perf_counter()
            cwire.feed(len(data))
            t2 = time.perf_counter()
            take()
            fed += t2 - t
            taken += time.perf_counter() - t2
        return fed / (rounds * 64) * 1e9, taken / (rounds * 64) * 1e9

    fed, taken = feed_and_take(frames, lambda: [consumer.recv(k, 0, None, None) for k in KEYS])
    print(f"DATA decode + dispatch:  {fed:6.0f} ns/message")
    print(f"take a queued value:     {taken:6.0f} ns/message")

    # The batch API: send_many of 64 keys, the decode and dispatch of a DATA_MANY frame of
    # 64 values, and take_many of them.
    items = [(k, value) for k in KEYS]
    t = time.perf_counter()
    for _ in range(rounds):
        _impl.batches.send_many(producer, KEYS, _impl.batches.described(items), None, 0, 0)
        peer.credit = 64 << 20
        wire.flush()
        producer.credit.on_ack(wire, peer.tx_seq)
    print(f"send_many (64 x 64 B):   {(time.perf_counter() - t) / (rounds * 64) * 1e9:6.0f} ns/message")
    frame = codec.encode_data_many(0, [(k.encode(), value) for k in KEYS])
    routes = _impl.batches.check_routes(consumer, KEYS, False)
    fed, taken = feed_and_take(frame, lambda: _impl.batches.take_many(consumer, routes, 0))
    print(f"DATA_MANY decode+dispatch: {fed:4.0f} ns/message")
    print(f"take_many (64 keys):     {taken:6.0f} ns/message")


if __name__ == "__main__":
    print(f"rvz {rvz.implementation()} engine")
    asyncio.run(main())

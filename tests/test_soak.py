"""Soak: 8 producers x 8 consumers exchanging many keys, mixed modes, on both loops.

Every producer sends every consumer its own keys once; producers alternate between
Recv-Driven and Send-Driven nodes, consumers too.  Nothing may be lost (every recv gets
its value, intact) or duplicated (a second recv of a delivered key finds nothing), and after
the nodes close the event loop's task count and the process's RSS (less what the allocator
keeps free for reuse) are back near where they were after a warm-up round.  The short
variant (100 keys per pair) runs in CI; ``RVZ_SOAK=1`` runs the long one (10,000 keys per
pair, 640,000 values per loop).  A second soak resets a random producer-consumer
connection every 200 ms while the values cross: still nothing lost or duplicated.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import os
import random
from typing import Any

import numpy as np
import pytest

import rvz

LONG = os.environ.get("RVZ_SOAK", "") not in ("", "0")
KEYS = 10_000 if LONG else 100
N = 8
pytestmark = pytest.mark.timeout(3600 if LONG else 60)
SETTINGS: dict[str, Any] = dict(heartbeat=0.2, peer_timeout=10.0, linger=2.0, connect_timeout=10.0,
                                claim_timeout=0.3)


def dev(job: str, task: int) -> str:
    return f"/job:{job}/replica:0/task:{task}/device:CPU:0"


def rss() -> int:
    """Resident bytes, after handing the allocator's free memory back to the system: glibc
    keeps freed heap memory for reuse (hundreds of MiB after this load), which is not a leak."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def expected(p: int, c: int, k: int) -> np.ndarray:
    # a few sizes, so values take both the small-frame and the large-payload paths
    n = (16, 1000, 20_000)[k % 3]
    return np.full(n, p * 1_000_000 + c * 10_000 + k % 10_000, np.int64)


async def reset_connections(nodes: list[rvz.Node], every: float) -> int:
    """Break a random connection of a random node every ``every`` seconds, as a reset
    would (until cancelled); returns how many were broken."""
    rng = random.Random(7)
    broken = 0
    try:
        while True:
            await asyncio.sleep(every)
            node = rng.choice(nodes)
            conns = [c for peer in node._peers.values() for c in peer.live_connections()
                     if c.ready]
            if conns:
                rng.choice(conns).fail(ConnectionResetError("reset by the soak"))
                broken += 1
    except asyncio.CancelledError:
        return broken


async def round_(keys: int, resets: float | None = None) -> None:
    spec = rvz.ClusterSpec.loopback({"producer": N, "consumer": N})
    producers = [rvz.Node(spec, "producer", i, ("recv", "send")[i % 2], **SETTINGS) for i in range(N)]
    consumers = [rvz.Node(spec, "consumer", i, ("send", "recv")[i % 2], **SETTINGS) for i in range(N)]
    for node in producers + consumers:
        await node.start()
    try:
        def k(p: int, c: int, i: int) -> rvz.Key:
            return rvz.Key(src=dev("producer", p), dst=dev("consumer", c), name=f"k{i}")

        async def produce(p: int) -> None:
            for i in range(keys):
                for c in range(N):
                    await producers[p].send(k(p, c, i), expected(p, c, i), timeout=60)

        async def consume(c: int) -> int:
            got = 0
            for i in range(keys):
                values = await asyncio.gather(*(consumers[c].recv(k(p, c, i), timeout=60)
                                                 for p in range(N)))
                for p, v in enumerate(values):
                    assert np.array_equal(v, expected(p, c, i)), (p, c, i)
                    got += 1
            return got

        breaker = (asyncio.ensure_future(reset_connections(producers + consumers, resets))
                   if resets else None)
        try:
            results = await asyncio.gather(*(produce(p) for p in range(N)),
                                           *(consume(c) for c in range(N)))
        finally:
            if breaker is not None:
                breaker.cancel()
                assert await breaker > 0, "no connection was reset"
        assert sum(r for r in results if r is not None) == N * N * keys   # nothing lost
        # nothing duplicated: no second value behind any delivered key (a sample per pair)
        again = await asyncio.gather(*(consumers[c].recv(k(p, c, i), timeout=0.05)
                                       for c in range(N) for p in range(N)
                                       for i in {0, keys // 2, keys - 1}), return_exceptions=True)
        assert all(isinstance(r, TimeoutError) for r in again), [r for r in again
                                                                 if not isinstance(r, TimeoutError)]
    finally:
        await asyncio.gather(*(node.close() for node in producers + consumers))


def test_soak_nothing_lost_or_duplicated_and_resources_come_back(run: Any) -> None:
    async def main() -> tuple[int, int, int, int]:
        await round_(3)   # warm-up: imports, pools and caches reach their steady size
        gc.collect()
        tasks0, rss0 = len(asyncio.all_tasks()), rss()
        await round_(KEYS)
        await asyncio.sleep(0.1)
        gc.collect()
        return tasks0, rss0, len(asyncio.all_tasks()), rss()

    tasks0, rss0, tasks1, rss1 = run(main(), timeout=3000 if LONG else 50)
    assert tasks1 <= tasks0, f"{tasks1 - tasks0} tasks left behind"
    grown = rss1 - rss0
    assert grown < (256 << 20 if LONG else 64 << 20), f"RSS grew by {grown >> 20} MiB"
    print(f"soak: {N}x{N}x{KEYS} keys, tasks {tasks0}->{tasks1}, RSS {rss0 >> 20}->{rss1 >> 20} MiB")


def test_soak_with_connection_resets_loses_and_duplicates_nothing(run: Any) -> None:
    """The same exchange while a connection is reset every 200 ms: each value still
    arrives once, intact (sent again after the reconnect, its copies dropped)."""
    run(round_(KEYS, resets=0.2), timeout=3000 if LONG else 50)

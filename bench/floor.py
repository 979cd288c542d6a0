"""The asyncio floor under rvz's one-call-per-message stream, in one process.

    python bench/floor.py                      # the table
    python bench/floor.py --messages 50 --repeat 2 --json F   # shorter, and every figure in F

``rvz-bench stream`` runs its 64 B Send-Driven stream in 64 lanes.  Per message a
producer lane does ``await node.send(key, value)`` and ``await asyncio.sleep(0)`` (an
application yields between steps), and a consumer lane ``await node.recv(key)``.  Part
of what that costs is the asyncio of any API of this shape, not rvz's: a coroutine per
call, the task switch of every ``sleep(0)``, and a future and a task wake-up for a
``recv`` that waits.  This script runs those lanes, both sides in one process, over two
rvz nodes on loopback and over a null node whose ``send`` and ``recv`` take the same
arguments and do only what such an API cannot leave out (queue the value, hand it to a
waiting future at the end of the loop iteration or keep it for the next ``recv``).  The
two alternate; each figure is the best of ``--repeat`` runs (the least disturbed by the
rest of the machine).  The null node's time is the floor of this harness; rvz's own work
is the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from collections import deque
from typing import Any

import numpy as np

import rvz

LANES = 64


class NullNode:
    """``send`` and ``recv`` with rvz's signatures and nothing behind them that an
    implementation could leave out."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._out: list[tuple[str, Any]] = []
        self._values: dict[str, deque[Any]] = {}
        self._waiters: dict[str, asyncio.Future[Any]] = {}

    async def send(self, key: str, value: Any, *, mode: str | None = None, step: int = 0,
                   timeout: float | None = None) -> None:
        if not self._out:  # the values of one loop iteration are delivered together
            self._loop.call_soon(self._deliver)
        self._out.append((key, value))

    def _deliver(self) -> None:
        out, self._out = self._out, []
        for key, value in out:
            waiter = self._waiters.pop(key, None)
            if waiter is not None:
                waiter.set_result(value)
            else:
                self._values.setdefault(key, deque()).append(value)

    async def recv(self, key: str, *, mode: str | None = None, step: int = 0,
                   timeout: float | None = None) -> Any:
        queued = self._values.get(key)
        if queued:
            return queued.popleft()
        waiter = self._loop.create_future()
        self._waiters[key] = waiter
        return await waiter


async def lanes(producer: Any, consumer: Any, keys: list[str], n: int, value: Any) -> float:
    """``n`` messages on each key, one producer and one consumer lane per key: ns per
    message."""

    async def produce(key: str) -> None:
        send = producer.send
        sleep = asyncio.sleep
        for _ in range(n):
            await send(key, value)
            await sleep(0)

    async def consume(key: str) -> None:
        recv = consumer.recv
        for _ in range(n):
            await recv(key)

    start = time.perf_counter_ns()
    await asyncio.gather(*(produce(k) for k in keys), *(consume(k) for k in keys))
    return (time.perf_counter_ns() - start) / (n * len(keys))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def measure(messages: int, repeat: int) -> dict[str, Any]:
    cluster = rvz.ClusterSpec({"a": [f"127.0.0.1:{free_port()}"],
                               "b": [f"127.0.0.1:{free_port()}"]})
    src = "/job:a/replica:0/task:0/device:CPU:0"
    dst = "/job:b/replica:0/task:0/device:CPU:0"
    keys = [str(rvz.Key(src=src, dst=dst, name=f"lane{i}", incarnation=1))
            for i in range(LANES)]
    value = np.zeros(64, np.uint8)
    null = NullNode()
    runs: dict[str, list[float]] = {"null": [], "rvz": []}
    async with rvz.Node(cluster, "a", 0, mode="send") as a, \
            rvz.Node(cluster, "b", 0, mode="send") as b:
        await lanes(a, b, keys, 10, value)  # connected, warm
        await lanes(null, null, keys, 10, value)
        for _ in range(repeat):
            runs["null"].append(await lanes(null, null, keys, messages, value))
            runs["rvz"].append(await lanes(a, b, keys, messages, value))
    null_ns = min(runs["null"])
    rvz_ns = min(runs["rvz"])
    return {"lanes": LANES, "messages_per_lane": messages, "repeat": repeat,
            "loop": rvz.loop_name(), "implementation": rvz.implementation(),
            "runs_ns_per_message": runs, "null_ns": null_ns, "rvz_ns": rvz_ns,
            "ratio": rvz_ns / null_ns, "rvz_own_ns": rvz_ns - null_ns}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=400, help="per lane and run (400)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each, alternating (5)")
    parser.add_argument("--loop", default="auto", choices=("auto", "uvloop", "asyncio"))
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    args = parser.parse_args()
    result = rvz.run(measure(args.messages, args.repeat), loop=args.loop)
    print(f"floor.py: {LANES} lanes x {args.messages} messages of 64 B, both sides in one "
          f"process, {result['loop']}, {result['implementation']} (best of {args.repeat})")
    print(f"  null node  {result['null_ns'] / 1e3:6.2f} us a message")
    print(f"  rvz        {result['rvz_ns'] / 1e3:6.2f} us a message")
    print(f"  rvz / null {result['ratio']:6.2f}x   rvz's own work: "
          f"{result['rvz_own_ns'] / 1e3:.2f} us a message (both sides)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a blocking call costs over the async one: a 64 B round trip (send, then recv of the
peer's echo) from a synchronous thread through ``rvz.blocking.BlockingNode``, against the
same round trip awaited on an ``rvz.Node``.

    python bench/blocking.py                               # send mode, uvloop
    python bench/blocking.py --mode both --loop asyncio --rounds 3000 --repeat 3

The echo is an ``rvz.Node`` in a process of its own.  This process has two clients of it:
``client/0``, an async node driven on a loop in the main thread (the async figure), and
``client/1``, a BlockingNode called from the main thread (the blocking figure), its loop in
its thread.  Each run times ``--rounds`` round trips after a warm-up and keeps their p50;
the two kinds of runs alternate, ``--repeat`` of each, so that the machine's drift hits
both.  It prints each run, the median p50 of each kind and their ratio, and the p50 of a
bare hand-off to the loop thread and back (``transport_for``, which does no I/O): the
part of the difference that is the thread hop itself (a round trip makes two calls).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import rvz
from rvz.blocking import BlockingNode

SIZE = 64
WARMUP = 300
OPTIONS: dict[str, Any] = dict(peer_timeout=60.0, linger=1.0)


def keys(client: int) -> tuple[rvz.Key, rvz.Key]:
    """(ping, pong) of one client: client/i -> echo/0, and back."""
    me = f"/job:client/replica:0/task:{client}/device:CPU:0"
    echo = "/job:echo/replica:0/task:0/device:CPU:0"
    return rvz.Key(me, echo, "ping"), rvz.Key(echo, me, "pong")


async def echo(cluster: dict[str, Any], mode: str) -> None:
    """The echo process: each client's pings back as pongs, until stdin closes."""
    async with rvz.Node(cluster, "echo", 0, mode, **OPTIONS) as node:  # type: ignore[arg-type]

        async def serve(client: int) -> None:
            ping, pong = keys(client)
            while True:
                await node.send(pong, await node.recv(ping))

        tasks = [asyncio.ensure_future(serve(i)) for i in range(2)]
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        for task in tasks:
            task.cancel()


async def async_run(node: rvz.Node, rounds: int) -> float:
    ping, pong = keys(0)
    payload = b"x" * SIZE
    clock = time.perf_counter_ns
    samples = []
    for _ in range(WARMUP + rounds):
        t = clock()
        await node.send(ping, payload)
        await node.recv(pong)
        samples.append(clock() - t)
    return statistics.median(samples[WARMUP:]) / 1e3


def blocking_run(node: BlockingNode, rounds: int) -> float:
    ping, pong = keys(1)
    payload = b"x" * SIZE
    clock = time.perf_counter_ns
    samples = []
    for _ in range(WARMUP + rounds):
        t = clock()
        node.send(ping, payload)
        node.recv(pong)
        samples.append(clock() - t)
    return statistics.median(samples[WARMUP:]) / 1e3


def hop_run(node: BlockingNode, rounds: int) -> float:
    """p50 of a call that only crosses to the loop thread and back."""
    clock = time.perf_counter_ns
    samples = []
    for _ in range(WARMUP + rounds):
        t = clock()
        node.transport_for("/job:echo/replica:0/task:0")
        samples.append(clock() - t)
    return statistics.median(samples[WARMUP:]) / 1e3


def measure(mode: str, loop_name: str, rounds: int, repeat: int) -> dict[str, Any]:
    cluster = rvz.ClusterSpec.loopback({"client": 2, "echo": 1})
    spec = {job: [cluster.address(job, i) for i in range(n)] for job, n in (("client", 2), ("echo", 1))}
    peer = subprocess.Popen([sys.executable, __file__, "_echo", json.dumps(spec), mode, loop_name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    loop = rvz.new_event_loop(loop_name)  # type: ignore[arg-type]
    runs: dict[str, list[float]] = {"async": [], "blocking": [], "hop": []}
    try:
        assert peer.stdout is not None
        if peer.stdout.readline().strip() != b"ready":
            raise RuntimeError("the echo process did not start")
        node = rvz.Node(cluster, "client", 0, mode, **OPTIONS)  # type: ignore[arg-type]
        loop.run_until_complete(node.start())
        try:
            with BlockingNode(cluster, "client", 1, mode, loop=loop_name,  # type: ignore[arg-type]
                              **OPTIONS) as blocking:
                for _ in range(repeat):  # alternating, so that drift hits both kinds
                    runs["async"].append(loop.run_until_complete(async_run(node, rounds)))
                    runs["blocking"].append(blocking_run(blocking, rounds))
                    runs["hop"].append(hop_run(blocking, rounds))
        finally:
            loop.run_until_complete(node.close())
    finally:
        loop.close()
        if peer.stdin is not None:
            peer.stdin.close()
        try:
            peer.wait(10)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
    p50 = {kind: statistics.median(values) for kind, values in runs.items()}
    return {"mode": mode, "loop": loop_name, "implementation": rvz.implementation(),
            "rounds": rounds, "repeat": repeat, "size": SIZE, "runs_p50_us": runs,
            "p50_us": p50, "ratio": p50["blocking"] / p50["async"]}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_echo":
        rvz.run(echo(json.loads(sys.argv[2]), sys.argv[3]), loop=sys.argv[4])  # type: ignore[arg-type]
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="send", choices=("send", "recv", "both"))
    parser.add_argument("--loop", default="uvloop", choices=("uvloop", "asyncio"))
    parser.add_argument("--rounds", type=int, default=3000, help="round trips a run (3000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each kind (3)")
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    args = parser.parse_args()
    results = []
    for mode in (("send", "recv") if args.mode == "both" else (args.mode,)):
        result = measure(mode, args.loop, args.rounds, args.repeat)
        results.append(result)
        runs = result["runs_p50_us"]
        print(f"blocking.py: {SIZE} B round trip, mode {mode}, {args.loop}, "
              f"{rvz.implementation()}, {args.rounds} a run, {args.repeat} alternating runs")
        for kind in ("async", "blocking", "hop"):
            each = " ".join(f"{v:7.1f}" for v in runs[kind])
            print(f"  {kind:8s} p50 {result['p50_us'][kind]:7.1f} us   (runs: {each})")
        print(f"  blocking / async: {result['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

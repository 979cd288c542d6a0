"""What a blocking call costs over the async one: a 64 B round trip (send, then recv of the
peer's echo) from a synchronous thread through ``rvz.blocking.BlockingNode``, against the
same round trip awaited on an ``rvz.Node``.

    python bench/blocking.py                               # send mode, uvloop
    python bench/blocking.py --mode both --loop asyncio --rounds 3000 --repeat 3
    python bench/blocking.py --hammer 10                   # 8 threads, 10 s: lost, duplicated

The echo is an ``rvz.Node`` in a process of its own.  This process has two clients of it:
``client/0``, an async node driven on a loop in the main thread (the async figure), and
``client/1``, a BlockingNode called from the main thread (the blocking figure), its loop in
its thread.  Each run times ``--rounds`` round trips after a warm-up and keeps their p50;
the two kinds of runs alternate, ``--repeat`` of each, so that the machine's drift hits
both.  It prints each run, the median p50 of each kind and their ratio, the p50 of a
BlockingNode call that does no I/O (``transport_for``: the hand-off to the loop thread and
back), and the p50 of the bare hand-off under it: ``call_soon_threadsafe`` of a lock's
release to a loop of the same kind in a thread, and the wait on that lock.  A round trip
makes two calls, so the async p50 plus two bare hand-offs is the floor of a blocking round
trip made of two calls; it is printed with its ratio to the async p50.

``--hammer SECONDS`` runs instead the check of many callers: ``--threads`` threads each send
on a key of their own and on a shared one through one BlockingNode, and receive both
through another, for that long.  It prints the calls a second, and the values lost,
duplicated and corrupted (each must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

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


def bare_run(loop: asyncio.AbstractEventLoop, rounds: int) -> float:
    """p50 of the bare hand-off: a lock released by a callback on ``loop`` (in a thread)."""
    clock = time.perf_counter_ns
    samples = []
    for _ in range(WARMUP + rounds):
        t = clock()
        done = threading.Lock()
        done.acquire()
        loop.call_soon_threadsafe(done.release)
        done.acquire()
        samples.append(clock() - t)
    return statistics.median(samples[WARMUP:]) / 1e3


def measure(mode: str, loop_name: str, rounds: int, repeat: int) -> dict[str, Any]:
    cluster = rvz.ClusterSpec.loopback({"client": 2, "echo": 1})
    spec = {job: [cluster.address(job, i) for i in range(n)] for job, n in (("client", 2), ("echo", 1))}
    peer = subprocess.Popen([sys.executable, __file__, "_echo", json.dumps(spec), mode, loop_name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    loop = rvz.new_event_loop(loop_name)  # type: ignore[arg-type]
    bare = rvz.new_event_loop(loop_name)  # type: ignore[arg-type]
    bare_thread = threading.Thread(target=bare.run_forever, daemon=True)
    bare_thread.start()
    runs: dict[str, list[float]] = {"async": [], "blocking": [], "hop": [], "bare": []}
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
                    runs["bare"].append(bare_run(bare, rounds))
        finally:
            loop.run_until_complete(node.close())
    finally:
        loop.close()
        bare.call_soon_threadsafe(bare.stop)
        bare_thread.join()
        bare.close()
        if peer.stdin is not None:
            peer.stdin.close()
        try:
            peer.wait(10)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
    p50 = {kind: statistics.median(values) for kind, values in runs.items()}
    floor = p50["async"] + 2 * p50["bare"]
    return {"mode": mode, "loop": loop_name, "implementation": rvz.implementation(),
            "rounds": rounds, "repeat": repeat, "size": SIZE, "runs_p50_us": runs,
            "p50_us": p50, "ratio": p50["blocking"] / p50["async"], "floor_us": floor,
            "floor_ratio": floor / p50["async"]}


def hammer(mode: str, loop_name: str, seconds: float, threads: int) -> dict[str, Any]:
    """``threads`` callers for ``seconds``: calls a second, values lost, duplicated, corrupted."""
    cluster = rvz.ClusterSpec.loopback({"worker": 1, "ps": 1})
    src, dst = "/job:worker/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:0/device:CPU:0"
    shared = rvz.Key(src, dst, "shared")
    corrupt: list[int] = [0] * threads
    sent, got = [0] * threads, [Counter() for _ in range(threads)]

    def value(thread: int, n: int) -> Any:
        return np.full(16, thread * 1_000_000 + n, dtype=np.int64)

    with BlockingNode(cluster, "worker", 0, mode, loop=loop_name, **OPTIONS) as w, \
            BlockingNode(cluster, "ps", 0, mode, loop=loop_name, **OPTIONS) as p:  # type: ignore[arg-type]
        end = time.monotonic() + seconds

        def run(i: int) -> None:
            own, n = rvz.Key(src, dst, f"own{i}"), 0
            while time.monotonic() < end:
                w.send(own, value(i, n), timeout=30.0)
                w.send(shared, value(i, n), timeout=30.0)
                sent[i] = n = n + 1  # (an error from here on shows as a value lost)
                back = p.recv(own, timeout=30.0)
                corrupt[i] += not (isinstance(back, np.ndarray) and (back == value(i, n - 1)).all())
                other = p.recv(shared, timeout=30.0)
                if isinstance(other, np.ndarray) and other.shape == (16,) and (other == other[0]).all():
                    got[i][int(other[0])] += 1
                else:
                    corrupt[i] += 1

        start = time.monotonic()
        workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        elapsed = time.monotonic() - start
    received = sum(got, Counter())
    expected = Counter(t * 1_000_000 + n for t in range(threads) for n in range(sent[t]))
    return {"mode": mode, "loop": loop_name, "implementation": rvz.implementation(),
            "threads": threads, "seconds": elapsed, "calls_per_s": 4 * sum(sent) / elapsed,
            "lost": sum((expected - received).values()),
            "duplicated": sum((received - expected).values()), "corrupted": sum(corrupt)}


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
    parser.add_argument("--hammer", type=float, metavar="SECONDS",
                        help="run the many-threads check for SECONDS instead")
    parser.add_argument("--threads", type=int, default=8, help="callers of --hammer (8)")
    args = parser.parse_args()
    results = []
    if args.hammer is not None:
        for mode in (("send", "recv") if args.mode == "both" else (args.mode,)):
            result = hammer(mode, args.loop, args.hammer, args.threads)
            results.append(result)
            print(f"blocking.py --hammer: {result['threads']} threads, {result['seconds']:.1f} s, "
                  f"mode {mode}, {args.loop}, {rvz.implementation()}: "
                  f"{result['calls_per_s']:,.0f} calls/s, lost {result['lost']}, duplicated "
                  f"{result['duplicated']}, corrupted {result['corrupted']}")
        return _write(args.json, results, all(r["lost"] == r["duplicated"] == r["corrupted"] == 0
                                              for r in results))
    for mode in (("send", "recv") if args.mode == "both" else (args.mode,)):
        result = measure(mode, args.loop, args.rounds, args.repeat)
        results.append(result)
        runs = result["runs_p50_us"]
        print(f"blocking.py: {SIZE} B round trip, mode {mode}, {args.loop}, "
              f"{rvz.implementation()}, {args.rounds} a run, {args.repeat} alternating runs")
        for kind in ("async", "blocking", "hop", "bare"):
            each = " ".join(f"{v:7.1f}" for v in runs[kind])
            print(f"  {kind:8s} p50 {result['p50_us'][kind]:7.1f} us   (runs: {each})")
        print(f"  blocking / async: {result['ratio']:.2f}x   floor, async + 2 bare: "
              f"{result['floor_us']:.1f} us ({result['floor_ratio']:.2f}x)")
    return _write(args.json, results, True)


def _write(path: str | None, results: list[dict[str, Any]], ok: bool) -> int:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

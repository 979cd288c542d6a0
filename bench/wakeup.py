"""What a microsecond of work on a ping-pong's path costs in wall time on this machine.

    python bench/wakeup.py                                      # the table
    python bench/wakeup.py --work 0,3 --rounds 2000 --repeat 2 --json F

``rvz-bench pingpong`` compares rvz's 64 B round trip with a uvloop streams echo.  On a
machine where a round trip costs the two processes' work plus a fixed price for the
kernel (two writes, two reads, two wake-ups), W microseconds more of work on each side add
2W to the round trip.  This script measures what they add here: the same echo (two
processes, uvloop streams, TCP_NODELAY on loopback) with each side spinning W us between
a message's arrival and its reply, the levels alternating, each level's p50 the median of
``--repeat`` runs.  The slope it prints, wall time added per microsecond of work added, is
1.0 where the kernel's price is fixed; above 1.0 the price of a wake-up grows with the
time the other side spent asleep (a virtual CPU that halts longer wakes more slowly), and
every instruction rvz adds to a round trip costs more than its own time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import rvz

SIZE = 64
WARMUP = 200


def spin(ns: int) -> None:
    """Busy-wait ``ns`` nanoseconds (the stand-in for a library's work on the path)."""
    if ns:
        end = time.perf_counter_ns() + ns
        while time.perf_counter_ns() < end:
            pass


async def echo(listener: socket.socket, work_ns: int) -> None:
    """Serve one connection: each message back after ``work_ns`` of work, until EOF."""
    done = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                data = await reader.readexactly(SIZE)
                spin(work_ns)
                writer.write(data)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            done.set_result(None)

    server = await asyncio.start_server(serve, sock=listener)
    try:
        await asyncio.wait_for(done, 120.0)
    finally:
        server.close()


async def ping(port: int, work_ns: int, rounds: int) -> list[int]:
    """Round trips of ``SIZE`` bytes with ``work_ns`` of work before each send (ns each)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10.0)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = b"x" * SIZE
    clock = time.perf_counter_ns
    samples = []
    try:
        for _ in range(WARMUP + rounds):
            t = clock()
            spin(work_ns)
            writer.write(payload)
            await asyncio.wait_for(reader.readexactly(SIZE), 10.0)
            samples.append(clock() - t)
    finally:
        writer.close()
    return samples[WARMUP:]


def one_run(work_us: float, rounds: int, loop: str) -> float:
    """One echo process and one pinging one (this): the p50 round trip in us."""
    work_ns = int(work_us * 1000)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # the echo: a fresh loop in the child, nothing of the parent's running
        code = 0
        try:
            rvz.run(echo(listener, work_ns), loop=loop)
        except BaseException:
            code = 1
        os._exit(code)
    listener.close()
    try:
        samples = rvz.run(ping(port, work_ns, rounds), loop=loop)
    finally:
        _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"the echo process failed (wait status {status})")
    return statistics.median(samples) / 1e3


def measure(levels: list[float], rounds: int, repeat: int, loop: str) -> dict[str, Any]:
    runs: dict[str, list[float]] = {str(w): [] for w in levels}
    for _ in range(repeat):  # levels alternate, so drift of the machine hits them all
        for w in levels:
            runs[str(w)].append(one_run(w, rounds, loop))
    p50 = {w: statistics.median(r) for w, r in runs.items()}
    base = levels[0]
    slopes = {str(w): (p50[str(w)] - p50[str(base)]) / (2 * (w - base))
              for w in levels[1:] if w != base}
    return {"rounds": rounds, "repeat": repeat, "loop": loop, "size": SIZE,
            "runs_p50_us": runs, "p50_us": p50, "slope": slopes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="0,2,4",
                        help="us of work on each side, the first the base (0,2,4)")
    parser.add_argument("--rounds", type=int, default=10000, help="round trips a run (10000)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each level (5)")
    parser.add_argument("--loop", default="uvloop", choices=("uvloop", "asyncio"))
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    args = parser.parse_args()
    levels = [float(w) for w in args.work.split(",")]
    if len(levels) < 2 or len(set(levels)) != len(levels) or min(levels) < 0:
        parser.error("--work takes two or more distinct levels >= 0, the base first")
    result = measure(levels, args.rounds, args.repeat, args.loop)
    print(f"wakeup.py: {SIZE} B echo, two processes, {args.loop}, {args.rounds} round trips "
          f"a run, median of {args.repeat} runs a level")
    base = str(levels[0])
    for w in levels:
        line = f"  work {w:4.1f} us a side  p50 {result['p50_us'][str(w)]:7.1f} us"
        if str(w) != base:
            line += f"  +{result['p50_us'][str(w)] - result['p50_us'][base]:5.1f} us for " \
                    f"{2 * (w - levels[0]):.1f} us of work: {result['slope'][str(w)]:.2f}x"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A 64 B round trip's instructions, rvz against the echo, both sides in one process.

    python bench/roundtrip.py                     # instructions per round trip (callgrind)
    python bench/roundtrip.py --wall              # ns per round trip instead (median of 5)
    python bench/roundtrip.py --rounds 2000 --json F

``rvz-bench pingpong`` times round trips between two processes, and on a machine whose
wake-ups cost tens of microseconds its ratio says more about the scheduler than about rvz.
This probe counts what the two ends execute instead: each variant runs both of its ends on
one loop over loopback TCP, once with ``R`` round trips and once with ``3R``, under
callgrind; the difference over ``2R`` is the instructions of one round trip, both ends,
start-up and warm-up cancelled out.  What the kernel does for the system calls is not
counted (callgrind sees user space only); the variants make the same system calls a round
trip, one write and one read on each side, so what differs is Python and rvz.

* ``echo``: the asyncio streams echo of ``rvz-bench pingpong``: ``write`` then
  ``readexactly`` on one side, ``readexactly`` then ``write`` on the other.
* ``rvz-sent``: Recv-Driven, the recv of a value already sent (``rvz-bench pingpong``'s
  "value already sent" row): node *a* sent every value first, node *b* times each
  ``await b.recv(key)``, one REQUEST and the DATA that answers it.
* ``rvz-recv`` / ``rvz-send``: ``rvz-bench pingpong``'s rows: *b* sends on one key and *a*
  echoes on another, Recv-Driven or Send-Driven.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

import rvz

VARIANTS = ("echo", "rvz-sent", "rvz-recv", "rvz-send")
SIZE = 64
WARMUP = 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def echo(rounds: int) -> None:
    frame = bytes(SIZE)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                writer.write(await reader.readexactly(SIZE))
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(WARMUP + rounds):
        writer.write(frame)
        await reader.readexactly(SIZE)
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()


async def rvz_rounds(variant: str, rounds: int, timeout: float | None) -> None:
    cluster = rvz.ClusterSpec({"a": [f"127.0.0.1:{free_port()}"],
                               "b": [f"127.0.0.1:{free_port()}"]})
    job = {"a": "/job:a/replica:0/task:0/device:CPU:0", "b": "/job:b/replica:0/task:0/device:CPU:0"}

    def key(src: str, dst: str, name: str) -> str:
        return str(rvz.Key(src=job[src], dst=job[dst], name=name, incarnation=1))

    value = np.zeros(SIZE, np.uint8)
    total = WARMUP + rounds
    mode = "send" if variant == "rvz-send" else "recv"
    async with rvz.Node(cluster, "a", 0, mode=mode) as a, \
            rvz.Node(cluster, "b", 0, mode=mode) as b:
        if variant == "rvz-sent":
            held = key("a", "b", "held")
            for _ in range(total):
                await a.send(held, value)
            for _ in range(total):
                await b.recv(held, timeout=timeout)
            return
        ping, pong = key("b", "a", "ping"), key("a", "b", "pong")

        async def echoing() -> None:
            for _ in range(total):
                await a.send(pong, await a.recv(ping, timeout=timeout))

        task = asyncio.ensure_future(echoing())
        for _ in range(total):
            await b.send(ping, value)
            await b.recv(pong, timeout=timeout)
        await task


def run_once(variant: str, rounds: int, args: argparse.Namespace) -> int:
    """ns of one run, start-up included (``wall`` cancels it out as callgrind's counts do)."""
    body = echo(rounds) if variant == "echo" else rvz_rounds(variant, rounds, args.timeout)
    start = time.perf_counter_ns()
    rvz.run(body, loop=args.loop)
    return time.perf_counter_ns() - start


def wall(variant: str, rounds: int, args: argparse.Namespace) -> float:
    """ns of one round trip: a run of 3R rounds minus one of R, over 2R."""
    return (run_once(variant, 3 * rounds, args) - run_once(variant, rounds, args)) / (2 * rounds)


def instructions(variant: str, rounds: int, args: argparse.Namespace) -> float:
    """Instructions of one round trip: callgrind's total at 3R rounds minus at R, over 2R."""
    totals = []
    for n in (rounds, 3 * rounds):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "cg.out")
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")
            subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                            sys.executable, __file__, "--one", variant, "--rounds", str(n),
                            "--loop", args.loop]
                           + ([] if args.timeout is None else ["--timeout", str(args.timeout)]),
                           env=env, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            totals.append(callgrind_total(out))
    return (totals[1] - totals[0]) / (2 * rounds)


def callgrind_total(path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith("totals:") or line.startswith("summary:"):
                return int(line.split()[1])
    raise RuntimeError(f"no total in callgrind's output {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)} (all)")
    parser.add_argument("--rounds", type=int, default=2000, help="R: round trips a run (2000)")
    parser.add_argument("--loop", default="uvloop", choices=("uvloop", "asyncio"))
    parser.add_argument("--timeout", type=float, metavar="S",
                        help="each rvz recv with this timeout (none, as rvz-bench pingpong)")
    parser.add_argument("--wall", action="store_true",
                        help="ns per round trip, median of 5 alternating runs, not instructions")
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # a counted run
    args = parser.parse_args()
    if args.one:
        run_once(args.one, args.rounds, args)
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}")
    if not args.wall and shutil.which("valgrind") is None:
        print("roundtrip.py: valgrind is not installed (apt install valgrind), or use --wall",
              file=sys.stderr)
        return 2
    figures: dict[str, Any] = {}
    if args.wall:
        runs: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(5):
            for v in variants:
                runs[v].append(wall(v, args.rounds, args))
        figures = {v: sorted(r)[2] for v, r in runs.items()}
        unit = "ns"
    else:
        figures = {v: instructions(v, args.rounds, args) for v in variants}
        unit = "instructions"
    print(f"roundtrip.py: a {SIZE} B round trip, both ends in one process, {args.loop}, "
          f"{rvz.implementation()}, recv timeout {args.timeout}; {unit} per round trip")
    base = figures.get("echo")
    for v in variants:
        rel = f"   {figures[v] / base:5.2f}x echo" if base else ""
        print(f"  {v:10s} {figures[v]:10.0f}{rel}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"unit": unit, "loop": args.loop, "rounds": args.rounds, "timeout": args.timeout,
                       "implementation": rvz.implementation(), "figures": figures}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

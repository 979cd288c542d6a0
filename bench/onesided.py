"""Throughput and latency of the one-sided shm transport against TCP, two processes.

    .venv/bin/python bench/onesided.py                      # 4 MiB and 64 MiB, 64 B ping-pong
    .venv/bin/python bench/onesided.py --sizes 1M,16M --mode recv --transports tcp,shm

For every transport (same run, alternating, so both see the same machine state) it starts a
producer process (worker/0) and a consumer process (ps/0) on loopback:

* throughput: the producer sends ``--count`` tensors of each size on one key (after
  ``--warmup``); the consumer times the receipt of the measured ones; bytes / time.
* ping-pong: the worker sends 64 bytes on one key, the ps echoes them on another;
  the worker reports the round-trip p50 and p99 over ``--pings`` rounds.

Figures are noisy on a small machine: compare the ratio printed at the end, measured in the
same run, rather than absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

import rvz

WORKER = "/job:worker/replica:0/task:0/device:CPU:0"
PS = "/job:ps/replica:0/task:0/device:CPU:0"
NODE = dict(heartbeat=0.5, peer_timeout=20.0, connect_timeout=20.0, linger=5.0)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("IB")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 and size % (1 << 20) == 0 else f"{size} B"


free_ports = rvz.cluster.free_ports


def measured(args: argparse.Namespace, size: int) -> int:
    """Tensors timed per size: a long enough run that one pool growth (about 50 ms to map and
    fill a 64 MiB chunk on a small VM) cannot dominate it."""
    return args.count or max(40, (3 << 29) // size)


def warmup(args: argparse.Namespace, size: int) -> int:
    """Enough tensors that the consumer's pool reached its steady size before timing
    (registering a 64 MiB chunk takes tens of ms: it happens once, not per tensor)."""
    return max(args.warmup, -(-(160 << 20) // size))


async def role_main(args: argparse.Namespace) -> dict[str, Any]:
    cluster = rvz.ClusterSpec({"worker": [f"127.0.0.1:{args.ports[0]}"],
                               "ps": [f"127.0.0.1:{args.ports[1]}"]})
    out: dict[str, Any] = {}
    async with rvz.Node(cluster, args.role, 0, args.mode, transport=args.transport, **NODE) as node:
        go = rvz.Key(PS, WORKER, "go", 1)
        if args.role == "worker":
            for size in args.sizes:
                value = np.ones(size // 4, np.float32)
                key = rvz.Key(WORKER, PS, f"t{size}", 1)
                await node.recv(go, timeout=120)  # the consumer is ready for this size
                for _ in range(warmup(args, size)):
                    await node.send(key, value)
                await node.recv(go, timeout=120)  # the consumer took the warm-up: measure
                for _ in range(measured(args, size)):
                    await node.send(key, value)
            ping = np.zeros(64, np.uint8)
            a, b = rvz.Key(WORKER, PS, "ping", 1), rvz.Key(PS, WORKER, "pong", 1)
            rtts = []
            for i in range(args.warmup * 10 + args.pings):
                t0 = time.perf_counter()
                await node.send(a, ping)
                await node.recv(b, timeout=30)
                if i >= args.warmup * 10:
                    rtts.append(time.perf_counter() - t0)
            rtts.sort()
            out["ping_p50_us"] = statistics.median(rtts) * 1e6
            out["ping_p99_us"] = rtts[int(len(rtts) * 0.99) - 1] * 1e6
            out["transport"] = node.transport_for(PS)
        else:
            for size in args.sizes:
                key = rvz.Key(WORKER, PS, f"t{size}", 1)
                await node.send(go, b"go")
                for _ in range(warmup(args, size)):
                    await node.recv(key, timeout=60)
                # Timed from the go to the last tensor: nothing is in flight before the go.
                t0 = time.perf_counter()
                await node.send(go, b"go")
                for _ in range(measured(args, size)):
                    value = await node.recv(key, timeout=60)
                    assert value.nbytes == size // 4 * 4
                elapsed = time.perf_counter() - t0
                out[f"gbps_{size}"] = size * measured(args, size) / elapsed / 1e9
            a, b = rvz.Key(WORKER, PS, "ping", 1), rvz.Key(PS, WORKER, "pong", 1)
            for _ in range(args.warmup * 10 + args.pings):
                await node.send(b, await node.recv(a, timeout=30))
            out["transport"] = node.transport_for(WORKER)
    return out


def run_pair(args: argparse.Namespace, transport: str) -> dict[str, Any]:
    ports = free_ports(2)
    common = [sys.executable, os.path.abspath(__file__), "--transport", transport, "--mode", args.mode,
              "--ports", f"{ports[0]},{ports[1]}", "--sizes", ",".join(map(str, args.sizes)),
              "--count", str(args.count), "--warmup", str(args.warmup), "--pings", str(args.pings)]
    procs = [subprocess.Popen(common + ["--role", role], stdout=subprocess.PIPE, text=True)
             for role in ("ps", "worker")]
    result: dict[str, Any] = {}
    try:
        for proc in procs:
            stdout, _ = proc.communicate(timeout=args.timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"{transport} benchmark process failed ({proc.returncode})")
            result.update(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transports", default="tcp,shm")
    parser.add_argument("--sizes", default="4M,64M")
    parser.add_argument("--mode", default="send", choices=["send", "recv"])
    parser.add_argument("--count", type=int, default=0,
                        help="measured tensors per size (default: 1.5 GiB worth, at least 40)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--pings", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2, help="alternate the transports this often")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--transport", help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = [parse_size(s) for s in str(args.sizes).split(",")]
    if args.role:
        args.ports = [int(p) for p in args.ports.split(",")]
        print(json.dumps(rvz.run(role_main(args))), flush=True)
        return 0
    transports = args.transports.split(",")
    results: dict[str, list[dict[str, Any]]] = {t: [] for t in transports}
    for _ in range(args.rounds):
        for t in transports:
            results[t].append(run_pair(args, t))
    best: dict[str, dict[str, float]] = {}
    print(f"rvz {rvz.implementation()} hot paths, loop {rvz.new_event_loop().__class__.__module__}, "
          f"mode={args.mode}, {args.count or '1.5 GiB of'} tensors per size, best of {args.rounds} rounds")
    for t, runs in results.items():
        b: dict[str, float] = {}
        for size in args.sizes:
            b[f"gbps_{size}"] = max(r[f"gbps_{size}"] for r in runs)
        b["ping_p50_us"] = min(r["ping_p50_us"] for r in runs)
        b["ping_p99_us"] = min(r["ping_p99_us"] for r in runs)
        best[t] = b
        figures = "  ".join(f"{label(size)}: {b[f'gbps_{size}']:.2f} GB/s" for size in args.sizes)
        used = {r["transport"] for r in runs}
        print(f"{t:>5} (used {','.join(sorted(used))}): {figures}  ping-pong 64 B p50 "
              f"{b['ping_p50_us']:.1f} us (p99 {b['ping_p99_us']:.1f} us)")
    if "tcp" in best:
        for t in transports:
            if t == "tcp":
                continue
            ratios = "  ".join(f"{label(size)} x{best[t][f'gbps_{size}'] / best['tcp'][f'gbps_{size}']:.2f}"
                               for size in args.sizes)
            print(f"{t} / tcp throughput: {ratios}; ping p50 {best[t]['ping_p50_us']:.1f} vs "
                  f"{best['tcp']['ping_p50_us']:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

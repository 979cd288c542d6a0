"""The worker side of rvz-bench: one process that runs one side of every measurement.

The parent (``rvz.bench.cli``) never measures anything itself: it starts two workers (two
processes, so producer and consumer never share an interpreter or an event loop) and sends
each of them JSON commands, one per line:

* ``{"op": "prepare", "case": {...}}``: get ready for a case and answer the address the
  peer should use (a listening socket for the baselines, a free port for an rvz node);
* ``{"op": "run", "case": {...}, "addrs": {"a": ..., "b": ...}}``: run this side and answer
  its figures;
* ``{"op": "clock"}``: answer ``time.monotonic_ns()`` (for the rendezvous schedule);
* ``{"op": "quit"}``.

Side ``a`` is the producer (stream, rendezvous) or the echoing side (pingpong); side ``b``
is the consumer or the pinging side, which takes the measurements.

A case's ``impl`` says what moves the bytes: ``rvz`` (its ``pattern``: ``lanes``, ``batch``,
``one`` in flight, ``hold`` the previous array), or a baseline: ``socket``, ``streams``,
``zmq`` (pyzmq, imported only when a case asks for it), ``memcpy`` (side ``b`` copies an
array of the case's size into another, the cost of one copy per message).

The protocol runs over the process's stdin and its *original* stdout; file descriptor 1 is
pointed at stderr at start-up, so a stray ``print`` in the library cannot corrupt it.
"""

from __future__ import annotations

import asyncio
import cProfile
import functools
import importlib
import json
import math
import os
import platform
import random
import resource
import select
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import IO, Any

import numpy as np

import rvz
from rvz.poll import BusyPoll

A_JOB = "a"
B_JOB = "b"
# Baselines frame each message with this header: payload length and a "last message" flag.
FRAME = struct.Struct("<II")
CONNECT_TIMEOUT = 30.0
ROUND_TIMEOUT = 10.0      # socket baselines: longest wait for one frame, or for the end
REQUEST_BYTES = 64        # a socket baseline's request (rendezvous replica, request/reply stream)


def device(job: str) -> str:
    return f"/job:{job}/replica:0/task:0/device:CPU:0"


def lane_key(name: str, lane: int, iteration: int = 0) -> str:
    """The key string of one lane (``a`` produces, ``b`` consumes)."""
    return str(rvz.Key(src=device(A_JOB), dst=device(B_JOB), name=f"{name}{lane}",
                       iter=iteration, incarnation=1))


def back_key(name: str, lane: int) -> str:
    """A key from ``b`` to ``a`` (the pong of pingpong)."""
    return str(rvz.Key(src=device(B_JOB), dst=device(A_JOB), name=f"{name}{lane}", incarnation=1))


# -- memory -----------------------------------------------------------------------------------

def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes() -> int:
    value = _status_bytes("VmRSS")
    if value is None:  # not Linux: the high-water mark is the best we have
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return value


def peak_rss_bytes() -> int:
    value = _status_bytes("VmHWM")
    if value is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return value


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if this kernel cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def syscall_counts() -> tuple[int, int] | None:
    """(read-like, write-like) system calls of this process so far (Linux /proc/self/io)."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["syscr"]), int(fields["syscw"])
    except (OSError, KeyError, ValueError):
        return None


class MemoryProbe:
    """Idle RSS before a run and the RSS high-water mark during it."""

    def __init__(self) -> None:
        self.idle = 0
        self.reset = False

    def start(self) -> None:
        self.reset = reset_peak_rss()
        self.idle = rss_bytes()

    def result(self) -> dict[str, Any]:
        peak = peak_rss_bytes()
        return {"idle_rss": self.idle, "peak_rss": peak, "peak_above_idle": peak - self.idle,
                "peak_was_reset": self.reset}


# -- plans: how many messages, or for how long ------------------------------------------------

class Plan:
    """Message counts of one lane: ``warmup`` first, then ``iters`` or ``duration`` seconds.

    The last message of a lane carries a flag (first payload byte 1, or the baseline frame's
    flag), so the receiving side needs no count and ``--duration`` works the same way.
    """

    def __init__(self, case: dict[str, Any], lanes: int) -> None:
        self.lanes = lanes
        self.warmup = max(1, math.ceil(int(case["warmup"]) / lanes))
        iters = case.get("iters")
        self.iters = None if iters is None else max(1, math.ceil(int(iters) / lanes))
        duration = case.get("duration")
        self.duration = None if duration is None else float(duration)
        # --duration still measures a few messages of a large size on a slow machine
        self.min_messages = int(case.get("min_messages", 10))

    @property
    def warmup_total(self) -> int:
        return self.warmup * self.lanes


def payloads(size: int) -> tuple[np.ndarray, np.ndarray]:
    """An ordinary message and the last one of a lane (first byte set)."""
    body = np.zeros(size, np.uint8)
    last = np.zeros(size, np.uint8)
    last[0] = 1
    return body, last


async def produce(plan: Plan, send_one: Callable[[Any], Awaitable[None]], body: Any,
                  last: Any, check_every: int,
                  pause: Callable[[float], Awaitable[None]] | None = None) -> int:
    """Send one lane's messages through ``send_one``, then ``await pause(0)`` after each one
    if given; returns how many were sent. (The pause is a parameter, not a wrapper around
    ``send_one``: a coroutine per message of the harness's own would be counted as rvz's.)"""
    async def run(count: int, value: Any) -> None:
        for _ in range(count):
            await send_one(value)
            if pause is not None:
                await pause(0)

    await run(plan.warmup, body)
    sent = plan.warmup
    if plan.iters is not None:
        await run(plan.iters - 1, body)
        sent += plan.iters - 1
    else:
        assert plan.duration is not None
        deadline = time.perf_counter() + plan.duration
        measured = 0
        while time.perf_counter() < deadline or measured < plan.min_messages:
            await run(check_every, body)
            measured += check_every
        sent += measured
    await run(1, last)
    return sent + 1


def produce_sync(plan: Plan, send_one: Callable[[Any], Any], body: Any, last: Any,
                 check_every: int) -> int:
    """``produce`` for a blocking ``send_one``, in a plain loop (no coroutine per message)."""
    for _ in range(plan.warmup):
        send_one(body)
    sent = plan.warmup
    if plan.iters is not None:
        for _ in range(plan.iters - 1):
            send_one(body)
        sent += plan.iters - 1
    else:
        assert plan.duration is not None
        deadline = time.perf_counter() + plan.duration
        measured = 0
        while time.perf_counter() < deadline or measured < plan.min_messages:
            for _ in range(check_every):
                send_one(body)
            measured += check_every
        sent += measured
    send_one(last)
    return sent + 1


def stream_figures(count: int, size: int, start: int | None, end: int | None) -> dict[str, Any]:
    seconds = (end - start) / 1e9 if start is not None and end is not None else 0.0
    return {"messages": count, "bytes": count * size, "seconds": seconds,
            "msgs_per_s": count / seconds if seconds > 0 else 0.0,
            "gbytes_per_s": count * size / seconds / 1e9 if seconds > 0 else 0.0}


def check_every(size: int) -> int:
    """How many messages between two clock reads in --duration mode."""
    return max(1, min(256, (1 << 20) // max(size, 1)))


def memcpy_stream(case: dict[str, Any], role: str) -> dict[str, Any]:
    """The memcpy baseline: side ``b`` copies a resident array of ``size`` bytes into another
    resident one (``np.copyto``), as many times as a stream case moves messages; side ``a``
    has nothing to do.  What a one-sided transport costs at least: its writer copies once."""
    if role == "a":
        return {}
    size = int(case["size"])
    plan = Plan(case, 1)
    src = np.ones(size, np.uint8)
    dst = np.zeros(size, np.uint8)
    for _ in range(plan.warmup):
        np.copyto(dst, src)
    clock = time.perf_counter_ns
    count = 0
    start = clock()
    if plan.iters is not None:
        for _ in range(plan.iters):
            np.copyto(dst, src)
        count = plan.iters
    else:
        assert plan.duration is not None
        deadline = start + int(plan.duration * 1e9)
        while clock() < deadline or count < plan.min_messages:
            np.copyto(dst, src)
            count += 1
    return stream_figures(count, size, start, clock())


# -- rvz ----------------------------------------------------------------------------------------

DONE_KEY = str(rvz.Key(src=device(B_JOB), dst=device(A_JOB), name="done", incarnation=1))


async def finish(node: rvz.Node, role: str) -> None:
    """End of a case: ``b`` says it has everything, ``a`` waits for that before closing.

    Without it the producer may close while its last messages are still in the kernel's
    buffers; rvz's close (at the time of writing) can then reset the connection and the
    consumer loses them (see bench/README.md).
    """
    if role == "a":
        await node.recv(DONE_KEY, timeout=60.0)
    else:
        await node.send(DONE_KEY, b"done")


def make_node(case: dict[str, Any], addrs: dict[str, str], job: str) -> rvz.Node:
    cluster = rvz.ClusterSpec({A_JOB: [addrs["a"]], B_JOB: [addrs["b"]]})
    options = dict(case.get("node_options") or {})
    if case.get("busy_poll"):
        options["busy_poll"] = case["busy_poll"]
    return rvz.Node(cluster, job, 0, mode=case["mode"], transport=case["transport"], **options)


async def rvz_stream(case: dict[str, Any], addrs: dict[str, str], role: str) -> dict[str, Any]:
    size = int(case["size"])
    lanes = int(case["concurrency"])
    plan = Plan(case, lanes)
    keys = [lane_key("s", lane) for lane in range(lanes)]
    probe = MemoryProbe()
    result: dict[str, Any] = {}
    into = case.get("into")  # None, "numpy" or "torch": the consumer receives into= buffers
    # torch is imported only for these rows: it costs the worker a second and its RSS.
    torch: Any = importlib.import_module("torch") if into == "torch" else None
    async with make_node(case, addrs, A_JOB if role == "a" else B_JOB) as node:
        if role == "a":
            body, last = payloads(size)
            if torch is not None:  # the producer sends torch tensors (as DLPack, in place)
                body, last = torch.from_numpy(body), torch.from_numpy(last)
            send = node.send
            yield_each = bool(case.get("producer_yield", True))
            sleep = asyncio.sleep

            async def lane_a(key: str) -> int:
                # Each lane is one operation in flight; an application task yields between
                # steps (``pause``), and this is where the library may coalesce.
                return await produce(plan, functools.partial(send, key), body, last,
                                     check_every(size), sleep if yield_each else None)

            counts = await asyncio.gather(*(lane_a(k) for k in keys))
            result["sent"] = sum(counts)
            await finish(node, role)
        else:
            recv = node.recv
            received = 0
            warm = plan.warmup_total
            start: int | None = None
            end: int | None = None
            hold = bool(case.get("hold_previous", False))
            buffers = {key: into_buffer(size, torch) for key in keys} if into else {}
            probe.start()  # (after the buffers were written once: they are part of idle)

            async def lane_b(key: str) -> None:
                nonlocal received, start, end
                receive = functools.partial(recv, into=buffers[key]) if into else recv
                while True:
                    # hold: the previous array stays alive until this await returns, as in
                    # an application's ``v = await node.recv(k)`` loop
                    value = await receive(key)
                    received += 1
                    if received == warm:
                        start = time.perf_counter_ns()
                    if value[0]:
                        break
                    if not hold:
                        del value  # do not keep a tensor alive while waiting for the next
                end = time.perf_counter_ns()

            await asyncio.gather(*(lane_b(k) for k in keys))
            result.update(stream_figures(received - warm, size, start, end))
            result["memory"] = probe.result()
            await finish(node, role)
    return result


def into_buffer(size: int, torch: Any) -> Any:
    """A consumer's preallocated buffer, written once so that its pages are resident."""
    if torch is not None:
        return torch.zeros(size, dtype=torch.uint8)
    return np.zeros(size, np.uint8)


async def rvz_batch_stream(case: dict[str, Any], addrs: dict[str, str], role: str) -> dict[str, Any]:
    """The batch API: each ``send_many`` / ``recv_many`` call moves one message per lane key."""
    size = int(case["size"])
    batch = int(case["batch"])
    plan = Plan(case, batch)  # per-key counts: one call = one message on every key
    keys = [lane_key("b", lane) for lane in range(batch)]
    result: dict[str, Any] = {}
    async with make_node(case, addrs, A_JOB if role == "a" else B_JOB) as node:
        batch_node: Any = node  # typed loosely: the batch API is newer than some builds
        if role == "a":
            body, last = payloads(size)
            send_many = batch_node.send_many
            sleep = asyncio.sleep

            # an application task yields between steps, as the lanes do
            result["sent"] = batch * await produce(
                plan, send_many, [(k, body) for k in keys], [(k, last) for k in keys],
                max(1, check_every(size) // batch), sleep)
            await finish(node, role)
        else:
            recv_many = batch_node.recv_many
            probe = MemoryProbe()
            received = 0
            warm = plan.warmup_total
            start: int | None = None
            probe.start()
            while True:
                values = await recv_many(keys)
                if len(values) != batch:
                    raise RuntimeError(f"recv_many of {batch} keys returned {len(values)} values")
                received += batch
                if received == warm:
                    start = time.perf_counter_ns()
                if values[0][0]:  # the producer's last call flags every key
                    break
                del values
            end = time.perf_counter_ns()
            result.update(stream_figures(received - warm, size, start, end))
            result["memory"] = probe.result()
            await finish(node, role)
    return result


# Round trips of the "value already sent" row when a run is timed (--duration), not counted.
ALREADY_SENT_ROUNDS = 2000


async def rvz_already_sent(case: dict[str, Any], addrs: dict[str, str],
                           role: str) -> dict[str, Any]:
    """Recv-Driven, the recv of a value its producer sent before: side *a* sends every value
    first (each kept in its table), then says so; side *b* times each ``recv``, one request
    and its answer.  (No claim_timeout: nothing is pushed to *b* unasked.)"""
    plan = Plan(case, 1)
    count = plan.warmup_total + (plan.iters or ALREADY_SENT_ROUNDS)
    held, ready = lane_key("held", 0), lane_key("ready", 0)
    result: dict[str, Any] = {}
    async with make_node(case, addrs, A_JOB if role == "a" else B_JOB) as node:
        if role == "a":
            body, last = payloads(int(case["size"]))
            for _ in range(count - 1):
                await node.send(held, body)
            await node.send(held, last)
            await node.send(ready, b"", mode="send")
            await finish(node, role)
        else:
            await node.recv(ready, mode="send", timeout=60.0)
            samples: list[int] = []
            clock = time.perf_counter_ns
            recv = node.recv
            while True:
                t = clock()
                value = await recv(held)
                samples.append(clock() - t)
                if value[0]:
                    break
            result["samples_ns"] = samples[plan.warmup_total:]
            await finish(node, role)
    return result


async def rvz_pingpong(case: dict[str, Any], addrs: dict[str, str], role: str) -> dict[str, Any]:
    if case.get("pattern") == "already-sent":
        return await rvz_already_sent(case, addrs, role)
    size = int(case["size"])
    lanes = int(case["concurrency"])
    plan = Plan(case, lanes)
    result: dict[str, Any] = {}
    async with make_node(case, addrs, A_JOB if role == "a" else B_JOB) as node:
        send = node.send
        recv = node.recv
        if role == "a":
            async def echo(lane: int) -> None:
                ping, pong = back_key("ping", lane), lane_key("pong", lane)
                while True:
                    value = await recv(ping)
                    await send(pong, value)
                    if value[0]:
                        return

            await asyncio.gather(*(echo(lane) for lane in range(lanes)))
            await finish(node, role)
            result["spins"] = _spins(node)
        else:
            samples: list[int] = []
            clock = time.perf_counter_ns

            async def pinger(lane: int) -> None:
                ping, pong = back_key("ping", lane), lane_key("pong", lane)

                async def one(value: Any) -> None:
                    t = clock()
                    await send(ping, value)
                    await recv(pong)
                    samples.append(clock() - t)
                await produce(plan, one, body, last, 16)

            body, last = payloads(size)
            await asyncio.gather(*(pinger(lane) for lane in range(lanes)))
            result["samples_ns"] = samples[plan.warmup_total:]
            result["spins"] = _spins(node)
            await finish(node, role)
    return result


def _spins(node: rvz.Node) -> int | None:
    """How many loop passes busy polling kept awake (None: it was off)."""
    polled = node.stats()["busy_poll"]
    return None if polled is None else int(polled["spins"])


async def wait_until(t_ns: int) -> None:
    """Sleep until monotonic time ``t_ns``: coarse sleep, then yield to the loop until it.

    The last stretch keeps the loop turning (``sleep(0)``) instead of spinning in Python,
    so this side still answers the peer's frames while it waits.
    """
    sleep = asyncio.sleep
    clock = time.monotonic_ns
    while True:
        left = t_ns - clock()
        if left <= 0:
            return
        if left > 1_500_000:
            await sleep((left - 1_000_000) / 1e9)
        else:
            await sleep(0)


def rendezvous_delays(case: dict[str, Any]) -> list[tuple[int, int]]:
    """Per round: (producer delay, consumer delay) in ns after the round's start.

    Both workers draw the same sequence from the same seed.
    """
    rounds = int(case["rounds"])
    gap = int(case["gap_ns"])
    order = case["order"]
    if order == "producer-first":
        return [(0, gap)] * rounds
    if order == "consumer-first":
        return [(gap, 0)] * rounds
    rng = random.Random(int(case["seed"]))
    spread = int(case["spread_ns"])
    return [(rng.randrange(spread), rng.randrange(spread)) for _ in range(rounds)]


async def rvz_rendezvous(case: dict[str, Any], addrs: dict[str, str], role: str) -> dict[str, Any]:
    """Timed rounds, one key each; round ``i`` runs in mode ``modes[i % len(modes)]``.

    Interleaving the modes round by round (per-call ``mode=``) puts them in the same
    conditions: the same connections, and the same bursts of noise from the rest of the
    machine.
    """
    # Timestamps are time.monotonic_ns(): CLOCK_MONOTONIC is one clock for every process on
    # a Linux host, so the producer's send times and the consumer's recv times can be
    # compared directly.  Across two hosts they cannot: the parent then estimates each
    # worker's offset over the control channel (control.clock_offset) and shifts the
    # schedule; that estimate is off by up to half the control round trip (plus any
    # asymmetry of the path), which the two-host latencies carry.
    #
    # On one host, consumer-first rounds also measure the kernel, not only rvz.  Both workers
    # tend to share one CPU (a socket wake-up places the woken task on the waker's CPU), so
    # the consumer's recv completes once the producer lets it run.  A Recv-Driven REQUEST
    # wakes the producer at the consumer's call; the scheduler then lets the consumer preempt
    # it as soon as the value is written.  A Send-Driven producer wakes from its own timer and
    # keeps the CPU until it next sleeps (tens of microseconds).  The consumer's read of a
    # pushed value also sends a TCP ACK (handled inside that read on loopback), where the
    # answer to its own request is acknowledged later.  On two hosts neither applies.
    size = int(case["size"])
    delays = rendezvous_delays(case)
    modes = list(case["modes"])
    period = int(case["period_ns"])
    t0 = int(case["t0_ns"])
    keys = [lane_key("rdv", 0, i) for i in range(len(delays))]
    body = np.zeros(size, np.uint8)
    clock = time.monotonic_ns
    async with make_node(dict(case, mode=modes[0]), addrs, A_JOB if role == "a" else B_JOB) as node:
        if role == "a":
            send = node.send
            sends: list[int] = []
            for i, (mine, _) in enumerate(delays):
                await wait_until(t0 + i * period + mine)
                t = clock()
                await send(keys[i], body, mode=modes[i % len(modes)])
                sends.append(t)
            await finish(node, role)
            return {"send_ns": sends}
        recv = node.recv
        calls: list[int] = []
        done: list[int] = []
        for i, (_, mine) in enumerate(delays):
            await wait_until(t0 + i * period + mine)
            t = clock()
            await recv(keys[i], mode=modes[i % len(modes)])
            done.append(clock())
            calls.append(t)
        await finish(node, role)
        return {"recv_ns": calls, "done_ns": done}


# -- baselines: blocking sockets ----------------------------------------------------------------

def _nodelay(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    n = view.nbytes
    got = sock.recv_into(view, n, socket.MSG_WAITALL)
    while got < n:
        if got == 0:
            raise ConnectionError("peer closed the baseline connection")
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("peer closed the baseline connection")
        got += k


def _frames(size: int) -> tuple[bytearray, bytearray]:
    body = bytearray(FRAME.size + size)
    FRAME.pack_into(body, 0, size, 0)
    last = bytearray(body)
    FRAME.pack_into(last, 0, size, 1)
    return body, last


def _socket_connect(addr: str) -> socket.socket:
    host, port = rvz.cluster.split_address(addr)
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    sock.settimeout(None)
    _nodelay(sock)
    return sock


def _socket_accept(listener: socket.socket) -> socket.socket:
    listener.settimeout(CONNECT_TIMEOUT)
    conn, _ = listener.accept()
    conn.settimeout(None)
    _nodelay(conn)
    return conn


def _end_sending(sock: socket.socket) -> None:
    """Tell the consumer the producer is done, and wait until it has read everything (it
    closes then): closing at once could reset the connection under its last bytes."""
    sock.settimeout(ROUND_TIMEOUT)
    sock.shutdown(socket.SHUT_WR)
    # Until its end: requests still out (the request/reply baseline's other lanes) come
    # first, and closing with them unread would reset the connection too.
    while sock.recv(1 << 12):
        pass


def socket_stream(case: dict[str, Any], addrs: dict[str, str], role: str,
                  listener: socket.socket | None) -> dict[str, Any]:
    """Blocking sockets: ``sendall`` of each framed message, ``recv_into`` one buffer.

    With ``reply`` (the Recv-Driven rows' second baseline) the consumer asks for each
    message with a REQUEST_BYTES-byte request and the producer sends it when asked: the
    request/reply pattern itself, with nothing of rvz.  ``concurrency`` requests are out at
    a time, as rvz's Recv-Driven lanes each keep one: the consumer asks again for every
    message it reads.
    """
    size = int(case["size"])
    plan = Plan(case, 1)
    reply = bool(case.get("reply"))
    if role == "a":
        assert listener is not None
        sock = _socket_accept(listener)
        try:
            body, last = _frames(size)
            sendall = sock.sendall
            request = memoryview(bytearray(REQUEST_BYTES))

            async def one(frame: Any) -> None:
                if reply:
                    _recv_exactly(sock, request)
                sendall(frame)
            sent = _run_sync(produce(plan, one, body, last, check_every(size)))
            _end_sending(sock)
            return {"sent": sent}
        finally:
            sock.close()
    sock = _socket_connect(addrs["a"])
    try:
        probe = MemoryProbe()
        probe.start()
        frame = bytearray(FRAME.size + size)
        view = memoryview(frame)
        flag = FRAME.size - 4
        received = 0
        start = None
        warm = plan.warmup
        ask = bytes(REQUEST_BYTES)
        if reply:
            sock.sendall(ask * max(1, int(case.get("concurrency", 1))))  # each lane's first
        while True:
            _recv_exactly(sock, view)
            received += 1
            if received == warm:
                start = time.perf_counter_ns()
            if frame[flag]:
                break
            if reply:
                sock.sendall(ask)  # the lane that read it asks for its next
        end = time.perf_counter_ns()
        result = stream_figures(received - warm, size, start, end)
        result["memory"] = probe.result()
        return result
    finally:
        sock.close()


def socket_pingpong(case: dict[str, Any], addrs: dict[str, str], role: str,
                    listener: socket.socket | None) -> dict[str, Any]:
    size = int(case["size"])
    plan = Plan(case, 1)
    inbound = bytearray(FRAME.size + size)
    view = memoryview(inbound)
    flag = FRAME.size - 4
    if role == "a":
        assert listener is not None
        sock = _socket_accept(listener)
        try:
            while True:
                _recv_exactly(sock, view)
                sock.sendall(inbound)
                if inbound[flag]:
                    return {}
        finally:
            sock.close()
    sock = _socket_connect(addrs["a"])
    try:
        samples: list[int] = []
        clock = time.perf_counter_ns
        sendall = sock.sendall
        body, last = _frames(size)

        async def one(frame: Any) -> None:
            t = clock()
            sendall(frame)
            _recv_exactly(sock, view)
            samples.append(clock() - t)
        _run_sync(produce(plan, one, body, last, 16))
        return {"samples_ns": samples[plan.warmup:]}
    finally:
        sock.close()


class _Inbox:
    """A non-blocking socket whose inbound bytes are counted in frames of one length.

    The rendezvous replica only needs to know how many whole frames have arrived, so the
    bytes themselves land in one scratch buffer and are dropped.
    """

    def __init__(self, sock: socket.socket, frame_len: int) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.frame_len = frame_len
        self.got = 0        # bytes received
        self.taken = 0      # frames handed out by ``take``
        self.closed = False  # the peer shut its side down
        self.scratch = bytearray(1 << 16)
        self.readable = select.poll()
        self.readable.register(sock, select.POLLIN)
        self.writable = select.poll()
        self.writable.register(sock, select.POLLOUT)

    def poll(self, timeout_ms: float) -> None:
        """Wait up to ``timeout_ms`` for bytes (0: only look) and read what is there."""
        if not self.readable.poll(timeout_ms):
            return
        while True:
            try:
                n = self.sock.recv_into(self.scratch)
            except BlockingIOError:
                return
            if n == 0:  # the peer is done; frames before its end still count
                self.closed = True
                self.readable.unregister(self.sock)
                return
            self.got += n

    def until(self, t_ns: int) -> None:
        """Wait as ``wait_until`` does (a coarse sleep, then polls that do not block),
        reading whatever arrives meanwhile, as an event loop would."""
        clock = time.monotonic_ns
        while True:
            left = t_ns - clock()
            if left <= 0:
                return
            self.poll((left - 1_000_000) / 1e6 if left > 1_500_000 else 0)

    def take(self) -> None:
        """Wait for the next whole frame (bounded: a lost peer must not hang the run)."""
        end = time.monotonic() + ROUND_TIMEOUT
        while self.got // self.frame_len <= self.taken:
            if self.closed:
                raise ConnectionError("peer closed the baseline connection")
            if time.monotonic() > end:
                raise TimeoutError(f"no frame from the peer within {ROUND_TIMEOUT}s")
            self.poll(100)
        self.taken += 1

    def send(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        sent = self.sock.send(view)
        end = time.monotonic() + ROUND_TIMEOUT
        while sent < len(view):  # only a large frame with a full socket buffer gets here
            if time.monotonic() > end:
                raise TimeoutError(f"the peer read nothing for {ROUND_TIMEOUT}s")
            self.writable.poll(100)
            self.poll(0)  # keep reading, so neither side waits on the other's buffer
            try:
                sent += self.sock.send(view[sent:])
            except BlockingIOError:
                pass


def socket_rendezvous(case: dict[str, Any], addrs: dict[str, str], role: str,
                      listener: socket.socket | None) -> dict[str, Any]:
    """The rendezvous rounds of ``rvz_rendezvous`` on a plain TCP socket, without rvz.

    Same schedule, same rounds, and per round the bytes of its mode: Send-Driven is a push
    (the producer writes the value at its call; the consumer's call takes it once it is
    there); Recv-Driven is a request and its reply (the consumer writes a request at its
    call; the producer writes the value at its call, or when the request comes if that is
    later).  Both sides wait as the rvz workers do, reading what arrives meanwhile.  What
    this measures is the host's share of each pattern's latency: the kernel and the
    scheduler, with nothing of rvz's.
    """
    size = int(case["size"])
    delays = rendezvous_delays(case)
    modes = list(case["modes"])
    period = int(case["period_ns"])
    t0 = int(case["t0_ns"])
    clock = time.monotonic_ns
    value, _ = _frames(size)
    request, _ = _frames(REQUEST_BYTES)
    if role == "a":
        assert listener is not None
        sock = _socket_accept(listener)
        try:
            inbox = _Inbox(sock, len(request))
            sends: list[int] = []
            for i, (mine, _) in enumerate(delays):
                inbox.until(t0 + i * period + mine)
                t = clock()
                if modes[i % len(modes)] == "recv":
                    inbox.take()  # the consumer's request (already here if it called first)
                inbox.send(value)
                sends.append(t)
            _end_sending(sock)
            return {"send_ns": sends}
        finally:
            sock.close()
    sock = _socket_connect(addrs["a"])
    try:
        inbox = _Inbox(sock, len(value))
        calls: list[int] = []
        done: list[int] = []
        for i, (_, mine) in enumerate(delays):
            inbox.until(t0 + i * period + mine)
            t = clock()
            if modes[i % len(modes)] == "recv":
                inbox.send(request)
            inbox.take()
            done.append(clock())
            calls.append(t)
        return {"recv_ns": calls, "done_ns": done}
    finally:
        sock.close()


def _run_sync(coro: Awaitable[Any]) -> Any:
    """Drive a coroutine that never suspends (the blocking baselines reuse ``produce``)."""
    gen = coro.__await__()
    try:
        next(gen)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("a blocking baseline suspended")


# -- baselines: asyncio / uvloop streams --------------------------------------------------------

async def _streams_pair(addrs: dict[str, str], role: str, listener: socket.socket | None,
                        limit: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Any]:
    if role == "a":
        assert listener is not None
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = loop.create_future()

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if not accepted.done():
                accepted.set_result((reader, writer))

        listener.setblocking(False)
        server = await asyncio.start_server(on_client, sock=listener, limit=limit)
        reader, writer = await asyncio.wait_for(accepted, CONNECT_TIMEOUT)
        return reader, writer, server
    host, port = rvz.cluster.split_address(addrs["a"])
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=limit),
                                            CONNECT_TIMEOUT)
    return reader, writer, None


async def _streams_close(writer: asyncio.StreamWriter, server: Any) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass
    if server is not None:
        server.close()


async def streams_stream(case: dict[str, Any], addrs: dict[str, str], role: str,
                         listener: socket.socket | None) -> dict[str, Any]:
    """Raw asyncio/uvloop streams: one ``write`` per framed message, ``readexactly``."""
    size = int(case["size"])
    plan = Plan(case, 1)
    reader, writer, server = await _streams_pair(addrs, role, listener, 1 << 16)
    try:
        if role == "a":
            body, last = (bytes(f) for f in _frames(size))
            write = writer.write
            drain = writer.drain

            async def one(frame: Any) -> None:
                write(frame)
                await drain()
            sent = await produce(plan, one, body, last, check_every(size))
            await reader.read(1)  # the consumer closes when it has everything
            return {"sent": sent}
        probe = MemoryProbe()
        probe.start()
        n = FRAME.size + size
        flag = FRAME.size - 4
        readexactly = reader.readexactly
        received = 0
        start = None
        warm = plan.warmup
        while True:
            frame = await readexactly(n)
            received += 1
            if received == warm:
                start = time.perf_counter_ns()
            if frame[flag]:
                break
            del frame
        end = time.perf_counter_ns()
        result = stream_figures(received - warm, size, start, end)
        result["memory"] = probe.result()
        return result
    finally:
        await _streams_close(writer, server)


def busy_poll(case: dict[str, Any]) -> BusyPoll | None:
    """What an rvz node with the case's ``busy_poll`` uses (None: off), for a baseline that
    is to skip the same sleeps."""
    budget = float(case.get("busy_poll") or 0.0)
    return BusyPoll(asyncio.get_running_loop(), budget) if budget > 0 else None


async def streams_pingpong(case: dict[str, Any], addrs: dict[str, str], role: str,
                           listener: socket.socket | None) -> dict[str, Any]:
    size = int(case["size"])
    plan = Plan(case, 1)
    n = FRAME.size + size
    flag = FRAME.size - 4
    reader, writer, server = await _streams_pair(addrs, role, listener, 1 << 16)
    # Polling as the rvz nodes do when asked (--busy-poll): begin and end inline, as rvz's
    # recv does, not a coroutine around the read that rvz does not pay.
    poll = busy_poll(case)
    try:
        if role == "a":
            while True:
                if poll is not None:
                    poll.begin()
                frame = await reader.readexactly(n)
                if poll is not None:
                    poll.end()
                writer.write(frame)
                if frame[flag]:
                    await writer.drain()
                    await reader.read(1)
                    return {"spins": None if poll is None else poll.spins}
        samples: list[int] = []
        clock = time.perf_counter_ns
        body, last = (bytes(f) for f in _frames(size))

        async def one(frame: Any) -> None:
            t = clock()
            writer.write(frame)
            if poll is not None:
                poll.begin()
            await reader.readexactly(n)
            if poll is not None:
                poll.end()
            samples.append(clock() - t)
        await produce(plan, one, body, last, 16)
        return {"samples_ns": samples[plan.warmup:],
                "spins": None if poll is None else poll.spins}
    finally:
        await _streams_close(writer, server)


# -- baselines: pyzmq ----------------------------------------------------------------------------

# pyzmq sends and receives larger messages without copying them (as its docs advise for
# large messages); small ones are cheaper to copy.
ZMQ_COPY_LIMIT = 64 << 10
# Queue depth in messages: zmq's default (1000) for small messages, else about 64 MiB,
# the bytes rvz's push window lets into flight.
ZMQ_QUEUE_BYTES = 64 << 20


def zmq_available() -> str | None:
    """None if pyzmq imports here, else why not (the parent skips its baselines)."""
    if os.environ.get("RVZ_BENCH_NO_PYZMQ", "") not in ("", "0"):
        return "RVZ_BENCH_NO_PYZMQ is set"
    try:
        import zmq  # noqa: F401
    except ImportError as exc:
        return f"pyzmq does not import ({exc}); pip install 'rvz[compare]'"
    return None


def _zmq_socket(ctx: Any, kind: int, size: int, ipv6: bool) -> Any:
    import zmq

    sock = ctx.socket(kind)
    hwm = max(2, min(1000, ZMQ_QUEUE_BYTES // size))
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, int(CONNECT_TIMEOUT * 1000))  # deliver what was sent
    sock.setsockopt(zmq.RECONNECT_IVL, 10)  # the peer may bind a moment after we connect
    # No send/recv timeouts: they cost pyzmq a third of its small-message rate.  A worker
    # stuck on a dead peer is stopped by the parent's deadline, like the socket baseline.
    sock.setsockopt(zmq.IPV6, int(ipv6))
    return sock


def _zmq_payloads(size: int, copy: bool) -> tuple[Any, Any]:
    """bytes for copied messages (pyzmq's fast path), arrays for zero-copy ones."""
    body, last = payloads(size)
    return (body.tobytes(), last.tobytes()) if copy else (body, last)


def _zmq_endpoint(addr: str) -> str:
    host, port = rvz.cluster.split_address(addr)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def zmq_stream(case: dict[str, Any], addrs: dict[str, str], role: str) -> dict[str, Any]:
    """pyzmq PUSH/PULL: ``send`` in a tight loop on ``a``, ``recv`` in a tight loop on ``b``."""
    import zmq

    size = int(case["size"])
    plan = Plan(case, 1)
    copy = size <= ZMQ_COPY_LIMIT
    ipv6 = ":" in rvz.cluster.split_address(addrs["a"])[0]
    ctx = zmq.Context()
    try:
        if role == "a":
            sock = _zmq_socket(ctx, zmq.PUSH, size, ipv6)
            sock.bind(_zmq_endpoint(addrs["a"]))
            body, last = _zmq_payloads(size, copy)
            send = sock.send
            if copy:
                sent = produce_sync(plan, send, body, last, check_every(size))
            else:
                sent = produce_sync(plan, lambda v: send(v, copy=False), body, last,
                                    check_every(size))
            sock.close()  # lingers until the queued messages are out
            return {"sent": sent}
        sock = _zmq_socket(ctx, zmq.PULL, size, ipv6)
        sock.connect(_zmq_endpoint(addrs["a"]))
        probe = MemoryProbe()
        probe.start()
        recv = sock.recv
        received = 0
        start = None
        warm = plan.warmup
        if copy:  # bytes: pyzmq's fastest path for small messages
            while True:
                msg = recv()
                received += 1
                if received == warm:
                    start = time.perf_counter_ns()
                if msg[0]:
                    break
        else:  # a zmq Frame, its buffer not copied
            while True:
                frame = recv(copy=False)
                received += 1
                if received == warm:
                    start = time.perf_counter_ns()
                if frame.buffer[0]:
                    break
                del frame
        end = time.perf_counter_ns()
        sock.close(0)
        result = stream_figures(received - warm, size, start, end)
        result["memory"] = probe.result()
        return result
    finally:
        ctx.destroy(0)


def zmq_pingpong(case: dict[str, Any], addrs: dict[str, str], role: str) -> dict[str, Any]:
    """pyzmq REQ/REP: ``b`` sends and waits for the echo, ``a`` echoes what it receives."""
    import zmq

    size = int(case["size"])
    plan = Plan(case, 1)
    copy = size <= ZMQ_COPY_LIMIT
    ctx = zmq.Context()
    ipv6 = ":" in rvz.cluster.split_address(addrs["a"])[0]
    try:
        if role == "a":
            sock = _zmq_socket(ctx, zmq.REP, size, ipv6)
            sock.bind(_zmq_endpoint(addrs["a"]))
            recv, send = sock.recv, sock.send
            while True:
                msg = recv(copy=copy)
                send(msg, copy=copy)
                if (msg[0] if copy else msg.buffer[0]):
                    sock.close()
                    return {}
        sock = _zmq_socket(ctx, zmq.REQ, size, ipv6)
        sock.connect(_zmq_endpoint(addrs["a"]))
        samples: list[int] = []
        clock = time.perf_counter_ns
        send, recv = sock.send, sock.recv
        body, last = _zmq_payloads(size, copy)

        def one(value: Any) -> None:
            t = clock()
            send(value, copy=copy)
            recv(copy=copy)
            samples.append(clock() - t)
        produce_sync(plan, one, body, last, 16)
        sock.close(0)
        return {"samples_ns": samples[plan.warmup:]}
    finally:
        ctx.destroy(0)


# -- the worker process -------------------------------------------------------------------------

def versions() -> dict[str, str]:
    out = {"rvz": rvz.__version__, "python": platform.python_version(), "numpy": np.__version__}
    for name in ("uvloop", "msgpack", "Cython", "zmq"):
        try:
            module = __import__(name)
            out[name] = str(getattr(module, "__version__", getattr(module, "version", "?")))
        except ImportError:
            out[name] = "not installed"
    out["pyzmq"] = out.pop("zmq")
    return out


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"hostname": socket.gethostname(), "platform": platform.platform(),
                            "machine": platform.machine(), "cpus": os.cpu_count()}
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["memory_bytes"] = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return info


def calibrate(rounds: int = 5) -> dict[str, float]:
    """How fast this machine is at what rvz's figures are made of, best of ``rounds``.

    Ratios against same-run baselines cancel most of a machine's speed, not all of it: a
    small message costs rvz interpreter steps and a few syscalls where pyzmq spends mostly
    C, and a large one costs memory copies.  These three figures, printed with every run,
    tell whether two runs' ratios came from machines alike: interpreter time per loop step
    (``x = x + i``), one ``getppid()`` (a syscall with its Python call around it), and a
    64 MiB copy between resident arrays (GB/s counts bytes read plus bytes written).
    """
    clock = time.perf_counter_ns

    def best(run: Callable[[], int]) -> float:
        return float(min(run() for _ in range(rounds)))

    def loop() -> int:
        x, t = 0, clock()
        for i in range(100_000):
            x = x + i
        return (clock() - t) // 100_000

    getppid = os.getppid

    def syscalls() -> int:
        t = clock()
        for _ in range(20_000):
            getppid()
        return (clock() - t) // 20_000

    src = np.ones(64 << 20, np.uint8)
    dst = np.ones_like(src)

    def copy() -> int:
        t = clock()
        np.copyto(dst, src)
        return clock() - t

    copy_ns = best(copy)
    return {"python_step_ns": best(loop), "syscall_ns": best(syscalls),
            "copy_gb_per_s": 2 * src.nbytes / copy_ns}


def free_addr(host: str) -> str:
    """A free TCP port on ``host`` for an rvz node to listen on."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Worker:
    """Runs the commands the parent sends; state lives from ``prepare`` to ``run``."""

    def __init__(self) -> None:
        self.listener: socket.socket | None = None

    def prepare(self, case: dict[str, Any]) -> dict[str, Any]:
        self._drop_listener()
        host = case["bind_host"]
        if case["impl"] == "rvz":
            return {"addr": free_addr(host)}
        if case["impl"] == "zmq":  # side a binds this port when the case runs
            return {"addr": free_addr(host) if case["role"] == "a" else None}
        if case["role"] == "b":
            return {"addr": None}
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(4)
        self.listener = listener
        port = listener.getsockname()[1]
        return {"addr": f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"}

    def _drop_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def run(self, case: dict[str, Any], addrs: dict[str, str]) -> dict[str, Any]:
        profile_path: str | None = case.get("profile")
        profiler = cProfile.Profile() if profile_path else None
        if profiler is not None:
            profiler.enable()
        io_before = syscall_counts()
        cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        try:
            result = self._run(case, addrs)
            cpu = resource.getrusage(resource.RUSAGE_SELF)
            io_after = syscall_counts()
            # The whole case (setup and warm-up included): a diagnostic, not a figure.
            result["process"] = {
                "user_s": cpu.ru_utime - cpu_before.ru_utime,
                "system_s": cpu.ru_stime - cpu_before.ru_stime,
                "voluntary_switches": cpu.ru_nvcsw - cpu_before.ru_nvcsw,
                "minor_faults": cpu.ru_minflt - cpu_before.ru_minflt,
                "read_syscalls": io_after[0] - io_before[0] if io_after and io_before else None,
                "write_syscalls": io_after[1] - io_before[1] if io_after and io_before else None,
            }
            return result
        finally:
            if profiler is not None and profile_path:
                profiler.disable()
                profiler.dump_stats(profile_path)
            self._drop_listener()

    def _run(self, case: dict[str, Any], addrs: dict[str, str]) -> dict[str, Any]:
        kind, impl, role = case["kind"], case["impl"], case["role"]
        listener = self.listener
        if impl == "socket":
            body = {"stream": socket_stream, "pingpong": socket_pingpong,
                    "rendezvous": socket_rendezvous}[kind]
            return dict(body(case, addrs, role, listener))
        if impl == "streams":
            sbody = {"stream": streams_stream, "pingpong": streams_pingpong}[kind]
            return self._on_loop(case, sbody(case, addrs, role, listener))
        if impl == "memcpy":
            return memcpy_stream(case, role)
        if impl == "zmq":
            why = zmq_available()
            if why:
                raise RuntimeError(f"pyzmq baseline asked for, but {why}")
            zbody = {"stream": zmq_stream, "pingpong": zmq_pingpong}[kind]
            return dict(zbody(case, addrs, role))
        if kind == "stream" and case.get("pattern") == "batch":
            return self._on_loop(case, rvz_batch_stream(case, addrs, role))
        rbody = {"stream": rvz_stream, "pingpong": rvz_pingpong, "rendezvous": rvz_rendezvous}[kind]
        return self._on_loop(case, rbody(case, addrs, role))

    def _on_loop(self, case: dict[str, Any], coro: Any) -> dict[str, Any]:
        wanted = case["loop"]

        async def checked() -> dict[str, Any]:
            actual = rvz.loop_name()
            if actual != wanted:
                raise RuntimeError(f"asked for the {wanted} loop but {actual} runs")
            out: dict[str, Any] = await coro
            return out

        try:
            return rvz.run(checked(), loop=wanted)
        finally:
            coro.close()  # harmless once it ran; frees it if the loop could not start


def _watch_parent(parent: int) -> None:
    """Exit if the parent went away (even SIGKILLed) while a case was running."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)


def serve(rfile: IO[bytes], wfile: IO[bytes]) -> int:
    def reply(message: dict[str, Any]) -> None:
        wfile.write(json.dumps(message).encode() + b"\n")
        wfile.flush()

    reply({"event": "hello", "pid": os.getpid(), "implementation": rvz.implementation(),
           "env_no_extensions": os.environ.get("RVZ_NO_EXTENSIONS", ""),
           "versions": versions(), "machine": machine(), "pyzmq_missing": zmq_available(),
           "batch_api": hasattr(rvz.Node, "send_many") and hasattr(rvz.Node, "recv_many")})
    worker = Worker()
    for line in rfile:
        try:
            command = json.loads(line)
            op = command.get("op")
            if op == "quit":
                reply({"ok": True})
                return 0
            if op == "clock":
                reply({"ok": True, "t": time.monotonic_ns()})
            elif op == "prepare":
                reply({"ok": True, **worker.prepare(command["case"])})
            elif op == "run":
                reply({"ok": True, "result": worker.run(command["case"], command["addrs"])})
            else:
                reply({"ok": False, "error": f"unknown command {op!r}"})
        except Exception as exc:
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()})
    return 0


def main() -> int:
    """Entry point of ``python -m rvz.bench _worker``."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, not into the protocol
    sys.stdout = sys.stderr
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    return serve(sys.stdin.buffer, out)

"""Network and process faults between two nodes: every one ends in a bounded, clear outcome.

A fault proxy (tests/faultproxy.py) sits on both directions between worker:0 and ps:0; it
delays, stalls, cuts the stream mid-frame, resets, or corrupts bytes while a value crosses.
The outcome is either the value, intact, or ``PeerLost`` / ``ProtocolError`` /
``TimeoutError`` within the operation's timeout; afterwards, once the fault is cleared,
a fresh value crosses again.  Then a real peer process is frozen (SIGSTOP) or killed
(SIGKILL) in the middle of a stream, in both modes.

The streaming peer runs this file as a script: ``python -m tests.test_faults peer ...``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

import rvz

from .faultproxy import FaultProxy
from .procs import ready_process

pytestmark = pytest.mark.timeout(60)

MODES = ["recv", "send"]
WORKER = "/job:worker/replica:0/task:0/device:CPU:0"
PS = "/job:ps/replica:0/task:0/device:CPU:0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Quick heartbeats so a silent peer is lost within about a second.
SETTINGS: dict[str, Any] = dict(heartbeat=0.05, peer_timeout=1.0, linger=0.5, connect_timeout=6.0,
                                claim_timeout=0.3)
OUTCOMES = (rvz.PeerLost, rvz.ProtocolError, TimeoutError)
BOUND = 8.0   # the timeout of every operation under a fault


def key(name: str) -> rvz.Key:
    return rvz.Key(src=WORKER, dst=PS, name=name)


def value(i: int) -> np.ndarray:
    return np.arange(i, i + 250_000, dtype=np.float32)   # 1 MB: many reads, frames cut anywhere


@asynccontextmanager
async def proxied(mode: str) -> Any:
    """worker:0 and ps:0, each reaching the other only through a fault proxy."""
    pw, pp = rvz.cluster.free_ports(2)
    to_worker = await FaultProxy.start(pw)
    to_ps = await FaultProxy.start(pp)
    try:
        w_spec = rvz.ClusterSpec({"worker": [f"127.0.0.1:{pw}"], "ps": [to_ps.address]})
        p_spec = rvz.ClusterSpec({"worker": [to_worker.address], "ps": [f"127.0.0.1:{pp}"]})
        async with rvz.Node(w_spec, "worker", 0, mode, **SETTINGS) as w, \
                rvz.Node(p_spec, "ps", 0, mode, **SETTINGS) as p:
            yield w, p, (to_worker, to_ps)
    finally:
        await to_worker.close()
        await to_ps.close()


async def exchange(w: rvz.Node, p: rvz.Node, name: str, i: int) -> Any:
    """Send one value and receive it, both bounded; the value, or the error either raised."""
    async def send() -> None:
        await w.send(key(name), value(i), timeout=BOUND)

    try:
        results = await asyncio.wait_for(
            asyncio.gather(send(), p.recv(key(name), timeout=BOUND), return_exceptions=True),
            BOUND + 4)
    except asyncio.TimeoutError:
        raise AssertionError(f"{name}: an operation outlived its own timeout of {BOUND}s") from None
    for r in results:
        if isinstance(r, BaseException):
            return r
    return results[1]


def check_outcome(got: Any, i: int, what: str) -> str:
    """The value intact, or one of the clear errors; anything else fails the test."""
    if isinstance(got, BaseException):
        assert isinstance(got, OUTCOMES), f"{what}: unexpected {got!r}"
        return type(got).__name__
    assert isinstance(got, np.ndarray) and np.array_equal(got, value(i)), f"{what}: wrong value"
    return "delivered"


async def recovers(w: rvz.Node, p: rvz.Node, what: str) -> None:
    """Once the fault is gone a fresh value crosses (the nodes reconnect as needed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3 * BOUND
    attempt = 0
    while True:
        attempt += 1
        got = await exchange(w, p, f"{what}-after{attempt}", 100 + attempt)
        if not isinstance(got, BaseException):
            check_outcome(got, 100 + attempt, what)
            return
        assert isinstance(got, OUTCOMES), f"{what}: after the fault: {got!r}"
        assert loop.time() < deadline, f"{what}: no value crossed after the fault: {got!r}"


# -- faults on the wire ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_delay_only_slows_delivery(run: Any, mode: str) -> None:
    async def main() -> None:
        async with proxied(mode) as (w, p, proxies):
            assert check_outcome(await exchange(w, p, "warm", 0), 0, "warm-up") == "delivered"
            for proxy in proxies:
                proxy.faults.delay = 0.02
            for i in range(3):
                assert check_outcome(await exchange(w, p, "slow", i), i, "delay") == "delivered"

    run(main(), timeout=50)


@pytest.mark.parametrize("mode", MODES)
def test_stall_loses_the_peer_within_peer_timeout(run: Any, mode: str) -> None:
    async def main() -> None:
        async with proxied(mode) as (w, p, proxies):
            await exchange(w, p, "warm", 0)
            for proxy in proxies:
                proxy.set_stall(True)
            got = await exchange(w, p, "stalled", 1)
            assert isinstance(got, (rvz.PeerLost, TimeoutError)), f"stall: {got!r}"
            for proxy in proxies:
                proxy.set_stall(False)
            await recovers(w, p, "stall")

    run(main(), timeout=55)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", ["cut", "reset", "corrupt"])
def test_cut_reset_and_corruption_end_clearly(run: Any, mode: str, fault: str) -> None:
    async def main() -> None:
        async with proxied(mode) as (w, p, proxies):
            await exchange(w, p, "warm", 0)
            if fault == "cut":      # the next 5000 bytes either way, then both sides closed
                for proxy in proxies:
                    proxy.faults.cut_after = 5000
            elif fault == "corrupt":  # the first byte of the next read: a frame header
                for proxy in proxies:
                    proxy.faults.corrupt_next = True
            else:
                asyncio.get_running_loop().call_later(0.002, lambda: [x.reset() for x in proxies])
            check_outcome(await exchange(w, p, fault, 1), 1, fault)
            for proxy in proxies:
                proxy.faults.cut_after = None
                proxy.faults.corrupt_next = False
            await recovers(w, p, fault)

    run(main(), timeout=55)


# -- a peer process frozen or killed mid-stream -------------------------------------------------


async def peer_main(spec: dict[str, Any], role: str, mode: str) -> None:
    """The subprocess: a producer that streams values 0, 1, 2... on one key until killed,
    or a consumer that receives them."""
    job = "worker" if role == "producer" else "ps"
    async with rvz.Node(spec, job, 0, mode, heartbeat=0.05, peer_timeout=5.0, linger=0.2) as node:
        print("ready", flush=True)
        i = 0
        while True:
            if role == "producer":
                await node.send(key("stream"), value(i))
            else:
                got = await node.recv(key("stream"))
                assert got[0] == i
            i += 1


def peer_process(spec: rvz.ClusterSpec, role: str, mode: str) -> Any:
    return ready_process([sys.executable, "-m", "tests.test_faults", "peer",
                          json.dumps(spec.as_dict()), role, mode],
                         cwd=ROOT, stdin=subprocess.DEVNULL)



@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL"])
def test_producer_frozen_or_killed_mid_stream(run: Any, mode: str, sig: str) -> None:
    spec = rvz.ClusterSpec.loopback({"worker": 1, "ps": 1})

    async def main(proc: subprocess.Popen[bytes]) -> None:
        async with rvz.Node(spec, "ps", 0, mode, **SETTINGS) as p:
            for i in range(20):   # the stream flows
                got = await p.recv(key("stream"), timeout=BOUND)
                assert got[0] == i
            os.kill(proc.pid, getattr(signal, sig))
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(OUTCOMES):
                i = 20
                while True:   # values already on their way may still arrive, in order
                    got = await p.recv(key("stream"), timeout=BOUND)
                    assert got[0] == i
                    i += 1
                    assert loop.time() - start < 2 * BOUND, "values kept coming from a dead peer"

    with peer_process(spec, "producer", mode) as proc:
        run(main(proc), timeout=40)


@pytest.mark.parametrize("mode", MODES)
def test_a_producer_frozen_past_peer_timeout_loses_no_value_when_it_resumes(
        run: Any, mode: str) -> None:
    """The producer is frozen until the consumer gives it up (its recv fails with PeerLost),
    then resumes: the value it sent into the connection the consumer had closed, before it
    saw that, is sent again, and the stream goes on with no value missing or doubled."""
    spec = rvz.ClusterSpec.loopback({"worker": 1, "ps": 1})

    async def main(proc: subprocess.Popen[bytes]) -> None:
        async with rvz.Node(spec, "ps", 0, mode, **SETTINGS) as p:
            i = 0
            for _ in range(2):   # two freezes
                for _ in range(10):   # the stream flows
                    got = await p.recv(key("stream"), timeout=BOUND)
                    assert got[0] == i
                    i += 1
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    with pytest.raises(rvz.PeerLost):
                        while True:   # values already on their way arrive, in order
                            got = await p.recv(key("stream"), timeout=BOUND)
                            assert got[0] == i
                            i += 1
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
            for _ in range(30):   # every value after the freezes, none missing or twice
                got = await p.recv(key("stream"), timeout=BOUND)
                assert got[0] == i, (got[0], i)
                i += 1

    with peer_process(spec, "producer", mode) as proc:
        run(main(proc), timeout=50)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL"])
def test_consumer_frozen_or_killed_mid_stream(run: Any, mode: str, sig: str) -> None:
    spec = rvz.ClusterSpec.loopback({"worker": 1, "ps": 1})

    async def main(proc: subprocess.Popen[bytes]) -> None:
        w = await rvz.Node(spec, "worker", 0, mode, **{**SETTINGS, "push_window": 4 << 20,
                                                        "hold_limit": 4 << 20}).start()
        try:
            for i in range(20):
                await w.send(key("stream"), value(i), timeout=BOUND)
            os.kill(proc.pid, getattr(signal, sig))
            # The window (send) or the hold limit (recv) fills: a send waits, then fails clearly
            # (PeerLost once the peer is lost, or its own timeout while the value is held).
            with pytest.raises(OUTCOMES):
                for i in range(20, 2000):
                    await w.send(key("stream"), value(i), timeout=2.0)
        finally:
            await asyncio.wait_for(w.close(), BOUND)   # close is bounded too

    with peer_process(spec, "consumer", mode) as proc:
        run(main(proc), timeout=40)


if __name__ == "__main__" and sys.argv[1:2] == ["peer"]:
    rvz.run(peer_main(json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]))


@pytest.mark.parametrize("mode", MODES)
def test_traffic_counters_never_go_down_across_a_reconnect(run: Any, mode: str) -> None:
    """stats()' bytes and messages per peer are totals: a closed connection's stay counted."""
    fields = ("bytes_in", "bytes_out", "messages_in", "messages_out")

    def traffic(node: rvz.Node, peer: str) -> tuple[int, ...]:
        counts = node.stats()["peers"][peer]
        return tuple(int(counts[f]) for f in fields)  # type: ignore[literal-required]

    async def main() -> None:
        async with proxied(mode) as (w, p, proxies):
            for i in range(3):  # 1 MB each
                check_outcome(await exchange(w, p, "before", i), i, "before")
            before = traffic(w, "/job:ps/replica:0/task:0"), traffic(p, "/job:worker/replica:0/task:0")
            assert all(before[0]) and all(before[1]), before
            for proxy in proxies:
                proxy.reset()
            await recovers(w, p, "reset")  # one value or two on new connections: 3 MB less
            after = traffic(w, "/job:ps/replica:0/task:0"), traffic(p, "/job:worker/replica:0/task:0")
            for was, now in zip(before, after, strict=True):
                assert all(n > b for n, b in zip(now, was, strict=True)), (before, after)

    run(main(), timeout=55)

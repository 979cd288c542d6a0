"""Three hosts in network namespaces: traffic over real (veth) interfaces, one link rate-limited.

Each run makes four namespaces with unique names: three hosts and a switch (a bridge) that
joins their veth links, on a private 10.231.N.0/24 subnet that exists only inside them.
The link of host 3 goes through ``tc ... tbf``.  ps:0 runs on host 1, worker:0 on host 2 and
worker:1 on host 3, each as a subprocess under ``ip netns exec``.  The test checks that values
cross (also over the slow link) and that one node's step clean-up reaches all three hosts.
There are no timed assertions: only that everything completes within a generous bound.

Skipped, with the reason printed, where namespaces cannot be made (not root, no ``ip``,
a container without the rights or without bridges).  Namespaces and processes are always
removed in ``finally``.  The nodes run this file as a script (``python -m tests.test_netns``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import rvz

pytestmark = pytest.mark.timeout(90)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 7000
BOUND = 60.0   # generous: the slow link moves a few MB


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=15)


@contextmanager
def three_hosts() -> Iterator[list[tuple[str, str]]]:
    """``[(namespace, address)]`` of three hosts; skips the test if they cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("no `ip` or `tc` binary")
    tag = f"{os.getpid() % 100000}{random.randrange(1000)}"
    subnet = f"10.231.{random.randrange(1, 250)}"
    switch = f"rvz{tag}sw"
    hosts = [f"rvz{tag}h{i}" for i in (1, 2, 3)]
    made: list[str] = []
    try:
        try:
            for ns in [switch, *hosts]:
                sh("ip", "netns", "add", ns)
                made.append(ns)
            sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", switch, "link", "set", "br0", "up")
            for i, ns in enumerate(hosts, 1):
                sh("ip", "link", "add", "name", "eth0", "netns", ns, "type", "veth",
                   "peer", "name", f"port{i}", "netns", switch)
                sh("ip", "-n", switch, "link", "set", f"port{i}", "master", "br0", "up")
                sh("ip", "-n", ns, "addr", "add", f"{subnet}.{i}/24", "dev", "eth0")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            # host 3's link: 20 Mbit/s both ways (its egress and the switch port's egress)
            for ns, dev in ((hosts[2], "eth0"), (switch, "port3")):
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                   "rate", "20mbit", "burst", "32kb", "latency", "400ms")
        except (subprocess.SubprocessError, OSError) as exc:
            err = getattr(exc, "stderr", b"") or b""
            print(f"namespaces unavailable: {exc} {err.decode(errors='replace').strip()}")
            pytest.skip(f"cannot make network namespaces here: {exc} "
                        f"{err.decode(errors='replace').strip()}")
        yield [(ns, f"{subnet}.{i}") for i, ns in enumerate(hosts, 1)]
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=15)


# -- the nodes (subprocesses) ---------------------------------------------------------------


def dev(job: str, task: int) -> str:
    return f"/job:{job}/replica:0/task:{task}/device:CPU:0"


PS, W0, W1 = dev("ps", 0), dev("worker", 0), dev("worker", 1)


def payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 30, n, dtype=np.int64)


async def node_main(spec: dict[str, Any], job: str, task: int) -> dict[str, Any]:
    me = dev(job, task)
    out: dict[str, Any] = {"node": me}
    settings = dict(heartbeat=0.2, peer_timeout=20.0, connect_timeout=30.0, linger=5.0)
    async with rvz.Node(spec, job, task, "send", **settings) as node:
        out["transport"] = "tcp"
        step = node.step(7)
        if me == PS:
            # values cross: 1 MB from worker:0, 4 MB from worker:1 over the rate-limited link
            a = await node.recv(rvz.Key(src=W0, dst=PS, name="a"), timeout=BOUND)
            b = await node.recv(rvz.Key(src=W1, dst=PS, name="b"), timeout=BOUND)
            out["crossed"] = bool(np.array_equal(a, payload(125_000, 1))
                                  and np.array_equal(b, payload(500_000, 2)))
            # step 7: everyone has taken part; both workers wait on something never sent
            await step.recv(rvz.Key(src=W0, dst=PS, name="s"), timeout=BOUND)
            await step.recv(rvz.Key(src=W1, dst=PS, name="s"), timeout=BOUND)
            await node.recv(rvz.Key(src=W0, dst=PS, name="armed"), timeout=BOUND)
            await node.recv(rvz.Key(src=W1, dst=PS, name="armed"), timeout=BOUND)
            pending = asyncio.ensure_future(step.recv(rvz.Key(src=W0, dst=PS, name="never"),
                                                      timeout=BOUND))
            await asyncio.sleep(0)
            await step.cleanup("step 7 is over")
            out["cleanup"] = await outcome(pending)
        else:
            await node.send(rvz.Key(src=me, dst=PS, name="a" if task == 0 else "b"),
                            payload(125_000, 1) if task == 0 else payload(500_000, 2))
            await step.send(rvz.Key(src=me, dst=PS, name="s"), np.ones(1000))
            other = W1 if task == 0 else W0
            await step.send(rvz.Key(src=me, dst=other, name="s"), np.ones(10))
            await step.recv(rvz.Key(src=other, dst=me, name="s"), timeout=BOUND)
            pending = asyncio.ensure_future(step.recv(rvz.Key(src=other, dst=me, name="never"),
                                                      timeout=BOUND))
            await asyncio.sleep(0)
            await node.send(rvz.Key(src=me, dst=PS, name="armed"), b"1")
            out["cleanup"] = await outcome(pending)
        # let the peers finish too before this node leaves
        for peer in (PS, W0, W1):
            if peer != me:
                await node.send(rvz.Key(src=me, dst=peer, name="done"), b"1")
        for peer in (PS, W0, W1):
            if peer != me:
                await node.recv(rvz.Key(src=peer, dst=me, name="done"), timeout=BOUND)
    return out


async def outcome(task: asyncio.Future[Any]) -> str:
    try:
        await task
    except rvz.Aborted as exc:
        return "aborted: " + ("step 7 is over" if "step 7 is over" in str(exc) else str(exc))
    except BaseException as exc:
        return f"unexpected {exc!r}"
    return "unexpected: a value"


# -- the test -------------------------------------------------------------------------------


def test_three_hosts_values_cross_cleanup_reaches_all_and_a_slow_link_delivers() -> None:
    with three_hosts() as hosts:
        spec = {"ps": [f"{hosts[0][1]}:{PORT}"],
                "worker": [f"{hosts[1][1]}:{PORT}", f"{hosts[2][1]}:{PORT}"]}
        roles = [("ps", 0), ("worker", 0), ("worker", 1)]
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for (ns, _), (job, task) in zip(hosts, roles, strict=True):
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.test_netns", "node",
                     json.dumps(spec), job, str(task)],
                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            outputs = [proc.communicate(timeout=BOUND + 15) for proc in procs]
            for proc, (_, err), (job, task) in zip(procs, outputs, roles, strict=True):
                assert proc.returncode == 0, f"{job}:{task}: {err.decode()[-3000:]}"
            results = [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outputs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=10)
        ps, w0, w1 = results
        assert ps["crossed"], ps   # including 4 MB over the 20 Mbit/s link
        for r in results:          # ps:0 cleaned up step 7; all three hosts saw it
            assert r["cleanup"] == "aborted: step 7 is over", r


if __name__ == "__main__" and sys.argv[1:2] == ["node"]:
    result = rvz.run(node_main(json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])))
    print(json.dumps(result), flush=True)

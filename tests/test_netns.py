"""Three hosts in network namespaces: traffic over real (veth) interfaces, one link rate-limited.

Each run makes four namespaces with unique names: three hosts and a switch (a bridge) that
joins their veth links, on a private subnet that exists only inside them (examples/netns.py).
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
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import rvz
from examples import netns

pytestmark = pytest.mark.timeout(90)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 7000
BOUND = 60.0   # generous: the slow link moves a few MB


@contextmanager
def three_hosts() -> Iterator[list[tuple[str, str]]]:
    """``[(namespace, address)]`` of three hosts, host 3's link at 20 Mbit/s both ways;
    skips the test if they cannot be made."""
    try:
        with netns.hosts(["h1", "h2", "h3"], slow={"h3": "20mbit"}, burst="32kb",
                         latency="400ms") as made:
            yield [(host.netns, host.address) for host in made.values()]
    except netns.NamespacesUnavailable as exc:
        print(f"namespaces unavailable: {exc}")
        pytest.skip(str(exc))


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

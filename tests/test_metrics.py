"""rvz.metrics: the Prometheus collector of ``Node.stats()``, in a registry and served over HTTP.

Scrapes go over HTTP from a worker thread (``asyncio.to_thread``), as a Prometheus server's
would, while the nodes run on the test's loop; what they show is compared field by field with
``stats()`` read on the loop around the scrape (``scrape_still``).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rvz
from rvz.types import NodeStats

from .conftest import FAST, PS, WORKER, eventually, key, pair, pending
from .procs import run_python

pytest.importorskip("prometheus_client", reason="rvz.metrics needs prometheus_client, which the "
                    "'metrics' extra installs: pip install -e '.[metrics]'")

from prometheus_client import CollectorRegistry, Gauge, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from rvz import metrics  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# What docs/metrics.md promises for the peer's gauges and the steps' sums: metric -> field.
PEER_FIELDS = {
    "rvz_peer_push_window_bytes": "window", "rvz_peer_push_credit_bytes": "credit",
    "rvz_peer_owed_credit_bytes": "owed", "rvz_peer_unreturned_bytes": "unreturned",
    "rvz_peer_arriving_bytes": "arriving", "rvz_peer_queued_pushes": "queued_pushes",
    "rvz_peer_parked_requests": "parked_requests", "rvz_peer_deferred_answers": "deferred_answers",
    "rvz_peer_outstanding_requests": "outstanding_requests",
    "rvz_peer_held_back_requests": "held_back_requests", "rvz_peer_held_values": "held_values",
}
STEP_SUMS = {"rvz_queued_values": "queued_values", "rvz_queued_keys": "queued_keys",
             "rvz_waiting_recvs": "waiting_recvs", "rvz_waiting_keys": "waiting_keys"}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def of_node(samples: Samples, node: str) -> Samples:
    return {k: v for k, v in samples.items() if ("node", node) in k[1]}


async def get(url: str) -> str:
    """The body at ``url``, fetched on a worker thread."""
    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=10) as response:
            return str(response.read().decode())

    return await asyncio.to_thread(fetch)


async def scrape_still(url: str, nodes: Iterable[rvz.Node]) -> tuple[Samples, str, list[NodeStats]]:
    """A scrape during which no node's stats changed (heartbeats and credit move them), with
    those stats: the two can then be compared exactly."""
    nodes = list(nodes)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:
        before = [node.stats() for node in nodes]
        text = await get(url)
        after = [node.stats() for node in nodes]
        if before == after:
            return parse(text), text, after
        assert loop.time() < deadline, "the nodes' stats never held still through a scrape"


def check_node(samples: Samples, stats: NodeStats) -> None:
    """Every sample of the node is the field of ``stats`` that docs/metrics.md maps it to."""
    node = stats["node"]
    assert value(samples, "rvz_up", node=node) == 1
    for state in metrics.NODE_STATES:
        assert value(samples, "rvz_node_state", node=node, state=state) == (state == stats["state"])
    assert value(samples, "rvz_node_info", node=node, address=stats["address"], mode=stats["mode"],
                 transport=stats["transport"], implementation=rvz.implementation()) == 1
    assert value(samples, "rvz_held_values", node=node) == stats["held"]["values"]
    assert value(samples, "rvz_held_bytes", node=node) == stats["held"]["bytes"]
    for role in ("producer", "consumer"):
        assert value(samples, "rvz_waits_total", node=node, role=role) == stats["waits"][role]
    assert set(stats["errors"]) == {"protocol", "auth", "timeout", "reset", "peer_lost"}
    for kind, count in stats["errors"].items():
        assert value(samples, "rvz_errors_total", node=node, type=kind) == count
    assert value(samples, "rvz_active_steps", node=node) == len(stats["steps"])
    for name, field in STEP_SUMS.items():
        total = sum(step[field] for step in stats["steps"].values())  # type: ignore[literal-required]
        assert value(samples, name, node=node) == total, name
    assert value(samples, "rvz_dead_steps", node=node) == stats["dead_steps"]
    assert value(samples, "rvz_unidentified_connections", node=node) == stats["unidentified"]
    pool = stats["recv_pool"]
    assert pool is not None
    free = sum(f for _, f, _ in pool.values())
    assert value(samples, "rvz_recv_pool_blocks", node=node, state="free") == free
    assert value(samples, "rvz_recv_pool_blocks", node=node, state="in_use") == \
        sum(b for b, _, _ in pool.values()) - free
    assert value(samples, "rvz_recv_pool_bytes", node=node, state="in_use") == \
        sum(size * (b - f) for size, (b, f, _) in pool.items())
    assert value(samples, "rvz_recv_pool_target_blocks", node=node) == sum(t for _, _, t in pool.values())
    assert not [k for k in samples if k[0].startswith("rvz_busy_poll")]  # off in these nodes
    for peer, ps in stats["peers"].items():
        labels = {"node": node, "peer": peer}
        for state in metrics.PEER_STATES:
            assert value(samples, "rvz_peer_state", **labels, state=state) == (state == ps["state"])
        assert value(samples, "rvz_peer_info", **labels, transport=str(ps["transport"]),
                     mode=str(ps["mode"]), incarnation=str(ps["incarnation"])) == 1
        for direction in ("in", "out"):
            assert value(samples, "rvz_peer_bytes_total", **labels, direction=direction) == \
                ps[f"bytes_{direction}"]  # type: ignore[literal-required]
            assert value(samples, "rvz_peer_messages_total", **labels, direction=direction) == \
                ps[f"messages_{direction}"]  # type: ignore[literal-required]
        for name, field in PEER_FIELDS.items():
            assert value(samples, name, **labels) == ps[field], name  # type: ignore[literal-required]
        assert value(samples, "rvz_peer_credit_stalls_total", **labels) == ps["credit_stalls"]


@pytest.mark.parametrize("mode", ["recv", "send"])
async def test_a_scrape_shows_each_stat_of_two_nodes(cluster: rvz.ClusterSpec, mode: str) -> None:
    """Values both ways, one large (the receive pool), one left unreceived and a recv left
    waiting: each sample of both nodes, served from one registry, equals its stats field."""
    n = 6
    settings: dict[str, Any] = {"heartbeat": 0.5, "claim_timeout": None}
    async with pair(cluster, mode, **settings) as (w, p):
        back = {"src": PS, "dst": WORKER}
        for i in range(n):
            _, got = await asyncio.gather(w.send(key(f"a{i}"), np.arange(16)), p.recv(key(f"a{i}")))
            assert np.array_equal(got, np.arange(16))
            _, got = await asyncio.gather(p.send(key(f"b{i}", **back), b"xyz"), w.recv(key(f"b{i}", **back)))
            assert got == b"xyz"
        _, big = await asyncio.gather(w.send(key("big"), np.ones(1 << 18)), p.recv(key("big")))
        await w.send(key("left"), np.arange(8))  # Recv-Driven: held at w; Send-Driven: queued at p
        waiting = await pending(p.recv(key("missing"), timeout=20))
        if mode == "recv":
            await eventually(lambda: w.stats()["peers"][p.name]["parked_requests"] == 1,
                             "w parked p's request for the missing key")
        else:
            await eventually(lambda: sum(s["queued_values"] for s in p.stats()["steps"].values()) == 1,
                             "the pushed value queued at p")

        with metrics.serve(w) as server:
            assert metrics.register(p, server.registry) is metrics.register(p, server.registry)
            samples, text, (ws, ps) = await scrape_still(server.url, [w, p])
            check_node(samples, ws)
            check_node(samples, ps)
            assert text.count("# TYPE rvz_up gauge") == 1  # one family for both nodes
            out = {"node": w.name, "peer": p.name}
            into = {"node": p.name, "peer": w.name}
            assert value(samples, "rvz_peer_state", **out, state="connected") == 1
            # Every byte w wrote, p read, and the other way round.
            for direction, other in (("out", "in"), ("in", "out")):
                assert value(samples, "rvz_peer_bytes_total", **out, direction=direction) == \
                    value(samples, "rvz_peer_bytes_total", **into, direction=other), direction
            assert value(samples, "rvz_peer_messages_total", **out, direction="out") >= n + 2
            assert value(samples, "rvz_peer_bytes_total", **out, direction="out") >= n * 128 + (1 << 21)
            assert value(samples, "rvz_peer_messages_total", **into, direction="out") >= n
            assert value(samples, "rvz_waiting_recvs", node=p.name) == 1
            assert value(samples, "rvz_recv_pool_blocks", node=p.name, state="in_use") >= 1  # `big`
            if mode == "recv":
                assert value(samples, "rvz_held_values", node=w.name) == 1
                assert value(samples, "rvz_held_bytes", node=w.name) == 64
                assert value(samples, "rvz_peer_held_values", **out) == 1
                assert value(samples, "rvz_peer_parked_requests", **out) == 1
                assert value(samples, "rvz_peer_outstanding_requests", **into) == 1
            else:
                assert value(samples, "rvz_queued_values", node=p.name) == 1
                assert value(samples, "rvz_peer_push_credit_bytes", **out) < \
                    value(samples, "rvz_peer_push_window_bytes", **out)
            assert metrics.unregister(p, server.registry)
            assert not metrics.unregister(p, server.registry)
            samples = parse(await get(server.url))
            assert not of_node(samples, p.name) and value(samples, "rvz_up", node=w.name) == 1
        del big
        waiting.cancel()


async def test_serving_stops_cleanly(cluster: rvz.ClusterSpec) -> None:
    """close() stops the thread, frees the port and unregisters the node; twice is harmless."""
    async with pair(cluster) as (w, _):
        server = metrics.serve(w, timeout=1.0)
        port, registry = server.port, server.registry
        assert port > 0 and server.address == "127.0.0.1"
        assert server.url == f"http://127.0.0.1:{port}/metrics"
        assert value(parse(await get(server.url)), "rvz_up", node=w.name) == 1
        name = f"rvz-metrics:{port}"
        assert any(t.name == name for t in threading.enumerate())
        await asyncio.to_thread(server.close)
        assert server.closed and "closed" in repr(server)
        assert not any(t.name == name for t in threading.enumerate())
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert not metrics.unregister(w, registry) and generate_latest(registry) == b""
        server.close()
        with pytest.raises(urllib.error.URLError):
            await get(server.url)


async def test_serving_on_ipv6_loopback(cluster: rvz.ClusterSpec) -> None:
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    async with pair(cluster) as (w, _):
        with metrics.serve(w, addr="::1") as server:
            assert server.url == f"http://[::1]:{server.port}/metrics"
            assert value(parse(await get(server.url)), "rvz_up", node=w.name) == 1


async def test_a_scrape_on_the_nodes_own_thread_reads_it_there(cluster: rvz.ClusterSpec) -> None:
    """An application serving metrics from the node's loop (generate_latest in a coroutine)
    does not wait for the loop it blocks: the node is read directly."""
    registry = CollectorRegistry()
    async with pair(cluster) as (w, p):
        await asyncio.gather(w.send(key(), b"x"), p.recv(key()))  # (peers connect on first use)
        collector = metrics.register(w, registry)
        assert metrics.register(p, registry, timeout=0.5) is collector
        assert collector.nodes == [w, p]
        samples = parse(generate_latest(registry).decode())
        assert value(samples, "rvz_up", node=w.name) == value(samples, "rvz_up", node=p.name) == 1
        assert value(samples, "rvz_peer_state", node=w.name, peer=p.name, state="connected") == 1
        assert metrics.unregister(w, registry) and metrics.unregister(p, registry)
        assert generate_latest(registry) == b""  # the collector left with the last node
        assert metrics.register(w, registry) is not collector
        assert metrics.unregister(w, registry)


async def test_closed_and_unstarted_nodes_show_up_0(cluster: rvz.ClusterSpec) -> None:
    """A node never started has no loop to read on: ``rvz_up 0`` alone.  A closed one says
    so in ``rvz_node_state`` and shows nothing of its peers and tables."""
    idle = rvz.Node(cluster, "ps", 0, **FAST)
    async with rvz.Node(cluster, "worker", 0, **FAST) as w:
        with metrics.serve(w) as server:
            metrics.register(idle, server.registry)
            samples = parse(await get(server.url))
            assert value(samples, "rvz_up", node=w.name) == 1
            assert of_node(samples, idle.name) == {("rvz_up", frozenset({("node", idle.name)})): 0}
            await w.close()
            samples = of_node(parse(await get(server.url)), w.name)
            assert value(samples, "rvz_up", node=w.name) == 0
            assert value(samples, "rvz_node_state", node=w.name, state="closed") == 1
            assert {name for name, _ in samples} == {"rvz_up", "rvz_node_state", "rvz_node_info"}


@pytest.mark.loop_timeout(40)
async def test_a_node_on_another_thread_is_read_on_its_loop_or_shows_up_0(
        cluster: rvz.ClusterSpec) -> None:
    """A node whose loop runs on another thread is read there; while that loop is blocked
    the scrape gives up after the timeout, and once it is stopped or closed at once."""
    other = rvz.new_event_loop(rvz.loop_name())  # type: ignore[arg-type]
    runner = threading.Thread(target=other.run_forever, name="other-loop")
    runner.start()
    node = rvz.Node(cluster, "worker", 0, **FAST)
    release = threading.Event()
    try:
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(node.start(), other))
        with metrics.serve(node, timeout=0.3) as server:
            samples = parse(await get(server.url))
            assert value(samples, "rvz_up", node=node.name) == 1
            assert value(samples, "rvz_node_state", node=node.name, state="running") == 1

            other.call_soon_threadsafe(release.wait, 20)  # the loop is busy: no answer
            loop = asyncio.get_running_loop()
            began = loop.time()
            samples = parse(await get(server.url))
            assert samples == {("rvz_up", frozenset({("node", node.name)})): 0}
            assert loop.time() - began < 5
            release.set()
            assert value(parse(await get(server.url)), "rvz_up", node=node.name) == 1

            other.call_soon_threadsafe(other.stop)
            await asyncio.to_thread(runner.join, 10)
            assert not runner.is_alive()
            samples = parse(await get(server.url))
            assert samples == {("rvz_up", frozenset({("node", node.name)})): 0}

            await asyncio.to_thread(other.run_until_complete, node.close())
            other.close()
            samples = parse(await get(server.url))
            assert samples == {("rvz_up", frozenset({("node", node.name)})): 0}
    finally:
        release.set()
        if not other.is_closed():
            if runner.is_alive():
                other.call_soon_threadsafe(other.stop)
                await asyncio.to_thread(runner.join, 10)
            if node.state != "closed":
                await asyncio.to_thread(other.run_until_complete, node.close())
            other.close()


async def test_register_refuses_a_clash_and_a_bad_timeout(cluster: rvz.ClusterSpec) -> None:
    registry = CollectorRegistry()
    Gauge("rvz_up", "another exporter's", registry=registry)
    node = rvz.Node(cluster, "worker", 0, **FAST)
    for _ in range(2):  # a refused collector is not kept for the registry
        with pytest.raises(ValueError, match="rvz_up"):
            metrics.register(node, registry)
    fresh = CollectorRegistry()
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            metrics.register(node, fresh, timeout=bad)
    assert not metrics.unregister(node, fresh)
    assert metrics.register(node, fresh).nodes == [node] and metrics.unregister(node, fresh)


@pytest.mark.process
def test_rvz_imports_without_prometheus_client_and_metrics_names_the_extra() -> None:
    code = ("import sys\n"
            "import rvz\n"
            "assert 'prometheus_client' not in sys.modules, 'import rvz loaded prometheus_client'\n"
            "sys.modules['prometheus_client'] = None  # as if it were not installed\n"
            "try:\n"
            "    import rvz.metrics\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    done = run_python(["-c", code], cwd=str(ROOT), timeout=60)
    assert done.returncode == 0, done.stderr
    assert "pip install 'rvz[metrics]'" in done.stdout, done.stdout

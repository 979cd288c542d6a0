"""Prometheus metrics of rvz nodes: a collector that reads ``Node.stats()`` when scraped, and a
small HTTP server for it (the optional extra ``metrics``; docs/metrics.md names each metric).

``register(node, registry)`` adds a node to the registry's collector (one per registry, so that
several nodes share each metric family); ``serve(node, port)`` also serves a registry over HTTP.
A scrape runs on the scraper's thread and reads each node's stats on the node's own event loop,
for at most ``timeout`` seconds; a node that cannot be read then shows ``rvz_up 0`` alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import socket
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

try:
    from prometheus_client.exposition import MetricsHandler
    from prometheus_client.metrics_core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        InfoMetricFamily,
        Metric,
    )
    from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry
except ImportError as exc:  # the extra is not installed
    raise ImportError("rvz.metrics needs prometheus_client, which the optional extra 'metrics' "
                      "installs: pip install 'rvz[metrics]'") from exc

if TYPE_CHECKING:
    from .node import Node
    from .types import NodeStats, PeerStats

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 2.0
"""Seconds a scrape waits for a node's event loop to read its stats."""

NODE_STATES = ("new", "running", "closing", "closed")
"""The values of ``rvz_node_state``'s label ``state``: a node's life cycle."""
PEER_STATES = ("connected", "dialling", "idle")
"""The values of ``rvz_peer_state``'s label ``state``: a peer's connection."""

# (PeerStats field, metric name, help): the peer's gauges, each labelled node and peer.
_PEER_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("window", "rvz_peer_push_window_bytes",
     "Send-Driven push window agreed with the peer (payload bytes plus 64 per message)."),
    ("credit", "rvz_peer_push_credit_bytes",
     "Push window bytes the peer granted this node that it has not spent yet."),
    ("owed", "rvz_peer_owed_credit_bytes",
     "Credit for the peer's pushes that this node's recvs took, not returned to it yet."),
    ("unreturned", "rvz_peer_unreturned_bytes",
     "Window bytes the peer pushed to this node that were not credited back yet."),
    ("arriving", "rvz_peer_arriving_bytes",
     "Window bytes of the peer's pushes whose payload is still arriving."),
    ("queued_pushes", "rvz_peer_queued_pushes",
     "This node's pushes to the peer waiting for a link, credit or the socket."),
    ("parked_requests", "rvz_peer_parked_requests",
     "The peer's Recv-Driven requests parked here until their value is sent."),
    ("deferred_answers", "rvz_peer_deferred_answers",
     "Answers to the peer waiting because its connection's unsent output passed answer_backlog."),
    ("outstanding_requests", "rvz_peer_outstanding_requests",
     "This node's Recv-Driven requests to the peer not answered yet."),
    ("held_back_requests", "rvz_peer_held_back_requests",
     "Of the outstanding requests, those kept here for room under the peer's max_parked."),
    ("held_values", "rvz_peer_held_values",
     "Recv-Driven values held here for the peer, not asked for yet."),
)

# (StepStats field, metric name, help): summed over the steps (a step is no label: its
# numbers grow without bound, and each would be a new series).
_STEP_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("queued_values", "rvz_queued_values", "Values in this node's tables that no recv took yet."),
    ("queued_keys", "rvz_queued_keys", "Keys with queued values, over the steps."),
    ("waiting_recvs", "rvz_waiting_recvs", "Recvs on this node waiting for their value."),
    ("waiting_keys", "rvz_waiting_keys", "Keys with waiting recvs, over the steps."),
)


class _Families:
    """One scrape's metric families, filled node by node."""

    def __init__(self) -> None:
        node, peer = ["node"], ["node", "peer"]
        self.up = GaugeMetricFamily(
            "rvz_up", "1 when the node's stats were read and it is running; 0 when it is not "
            "running, its event loop is gone or did not answer within the scrape's timeout.",
            labels=node)
        self.state = GaugeMetricFamily("rvz_node_state", "1 for the node's life-cycle state.",
                                       labels=["node", "state"])
        self.info = InfoMetricFamily("rvz_node", "The node's address, mode, transport and hot paths.",
                                     labels=node)
        self.held_values = GaugeMetricFamily(
            "rvz_held_values", "Recv-Driven values held for remote consumers.", labels=node)
        self.held_bytes = GaugeMetricFamily(
            "rvz_held_bytes", "Payload bytes of the values held for remote consumers.",
            labels=node, unit="bytes")
        self.waits = CounterMetricFamily(
            "rvz_waits", "How often a send (role producer: for window credit or hold_limit) or a "
            "recv (role consumer: for its value) had to wait.", labels=["node", "role"])
        self.errors = CounterMetricFamily(
            "rvz_errors", "Connections ended by a protocol violation, a refused handshake, a "
            "timeout or a reset (type), and peers lost (type peer_lost).", labels=["node", "type"])
        self.active_steps = GaugeMetricFamily(
            "rvz_active_steps", "Steps whose table holds a value or a waiting recv.", labels=node)
        self.steps = [(field, GaugeMetricFamily(name, text, labels=node))
                      for field, name, text in _STEP_GAUGES]
        self.dead_steps = GaugeMetricFamily(
            "rvz_dead_steps", "Steps cleaned up and remembered, whose late traffic is refused.",
            labels=node)
        self.unidentified = GaugeMetricFamily(
            "rvz_unidentified_connections",
            "Accepted connections that have not completed their handshake.", labels=node)
        self.pool_blocks = GaugeMetricFamily(
            "rvz_recv_pool_blocks", "Blocks of the receive pool, free or in use by an array.",
            labels=["node", "state"])
        self.pool_bytes = GaugeMetricFamily(
            "rvz_recv_pool_bytes", "Bytes of the receive pool's blocks, free or in use.",
            labels=["node", "state"], unit="bytes")
        self.pool_target = GaugeMetricFamily(
            "rvz_recv_pool_target_blocks", "Blocks the receive pool aims to keep for recent sizes.",
            labels=node)
        self.poll_budget = GaugeMetricFamily(
            "rvz_busy_poll_budget_seconds", "The busy_poll budget (absent when busy polling is off).",
            labels=node, unit="seconds")
        self.poll_spins = CounterMetricFamily(
            "rvz_busy_poll_spins", "Event loop passes busy polling kept awake.", labels=node)
        self.peer_state = GaugeMetricFamily(
            "rvz_peer_state", "1 for the state of the node's connection to the peer.",
            labels=["node", "peer", "state"])
        self.peer_info = InfoMetricFamily(
            "rvz_peer", "The peer's transport, mode and incarnation, as this node knows them.",
            labels=peer)
        self.peer_bytes = CounterMetricFamily(
            "rvz_peer_bytes", "Bytes over the live connections to the peer (reset with them).",
            labels=["node", "peer", "direction"], unit="bytes")
        self.peer_messages = CounterMetricFamily(
            "rvz_peer_messages", "Frames (values and control) over the live connections to the "
            "peer (reset with them).", labels=["node", "peer", "direction"])
        self.peer_credit_stalls = CounterMetricFamily(
            "rvz_peer_credit_stalls", "Pushes to the peer that waited for its credit (its push "
            "window full of values it had not taken).", labels=peer)
        self.peer_gauges = [(field, GaugeMetricFamily(name, text, labels=peer,
                                                      unit="bytes" if name.endswith("_bytes") else ""))
                            for field, name, text in _PEER_GAUGES]

    def all(self) -> list[Metric]:
        return [self.up, self.state, self.info, self.held_values, self.held_bytes, self.waits,
                self.errors, self.active_steps, *(f for _, f in self.steps), self.dead_steps,
                self.unidentified,
                self.pool_blocks, self.pool_bytes, self.pool_target, self.poll_budget,
                self.poll_spins, self.peer_state, self.peer_info, self.peer_bytes,
                self.peer_messages, self.peer_credit_stalls, *(f for _, f in self.peer_gauges)]

    def add(self, name: str, stats: NodeStats | None) -> None:
        """The samples of the node called ``name``; ``stats`` is None when it was not read."""
        if stats is None:
            self.up.add_metric([name], 0)
            return
        state = stats["state"]
        self.up.add_metric([name], 1 if state == "running" else 0)
        for one in NODE_STATES:
            self.state.add_metric([name, one], 1 if one == state else 0)
        self.info.add_metric([name], {"address": stats["address"], "mode": stats["mode"],
                                      "transport": stats["transport"],
                                      "implementation": stats["implementation"]})
        if state == "closed":
            return  # its connections and tables are gone: nothing else to graph
        self.held_values.add_metric([name], stats["held"]["values"])
        self.held_bytes.add_metric([name], stats["held"]["bytes"])
        for role in ("producer", "consumer"):
            self.waits.add_metric([name, role], stats["waits"][role])
        for kind, count in stats["errors"].items():
            self.errors.add_metric([name, kind], count)
        steps = stats["steps"].values()
        self.active_steps.add_metric([name], len(steps))
        for field, family in self.steps:
            family.add_metric([name], sum(step[field] for step in steps))  # type: ignore[literal-required]
        self.dead_steps.add_metric([name], stats["dead_steps"])
        self.unidentified.add_metric([name], stats["unidentified"])
        pool = stats["recv_pool"]
        if pool is not None:
            self._pool(name, pool)
        poll = stats["busy_poll"]
        if poll is not None:
            self.poll_budget.add_metric([name], poll["budget"])
            self.poll_spins.add_metric([name], poll["spins"])
        for peer_name, peer in stats["peers"].items():
            self._peer([name, peer_name], peer)

    def _pool(self, name: str, pool: dict[int, tuple[int, int, int]]) -> None:
        blocks = free = in_use_bytes = free_bytes = target = 0
        for size, (count, idle, aim) in pool.items():
            blocks += count
            free += idle
            in_use_bytes += size * (count - idle)
            free_bytes += size * idle
            target += aim
        self.pool_blocks.add_metric([name, "free"], free)
        self.pool_blocks.add_metric([name, "in_use"], blocks - free)
        self.pool_bytes.add_metric([name, "free"], free_bytes)
        self.pool_bytes.add_metric([name, "in_use"], in_use_bytes)
        self.pool_target.add_metric([name], target)

    def _peer(self, labels: list[str], peer: PeerStats) -> None:
        for one in PEER_STATES:
            self.peer_state.add_metric([*labels, one], 1 if one == peer["state"] else 0)
        incarnation = peer["incarnation"]
        self.peer_info.add_metric(labels, {
            "transport": peer["transport"] or "", "mode": peer["mode"] or "",
            "incarnation": "" if incarnation is None else str(incarnation)})
        self.peer_bytes.add_metric([*labels, "in"], peer["bytes_in"])
        self.peer_bytes.add_metric([*labels, "out"], peer["bytes_out"])
        self.peer_messages.add_metric([*labels, "in"], peer["messages_in"])
        self.peer_messages.add_metric([*labels, "out"], peer["messages_out"])
        self.peer_credit_stalls.add_metric(labels, peer["credit_stalls"])
        for field, family in self.peer_gauges:
            family.add_metric(labels, peer[field])  # type: ignore[literal-required]


def _fill(future: concurrent.futures.Future[NodeStats], node: Node) -> None:
    """On the node's loop: read its stats into ``future``, unless the scrape gave up."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(node.stats())
    except Exception as exc:
        future.set_exception(exc)


def _read_stats(nodes: Iterable[tuple[Node, float]]) -> list[NodeStats | None]:
    """Each node's ``stats()``, read on its own event loop, or None where the node never
    started, its loop is closed or stopped, or it did not answer within its timeout.

    The reads are asked of every loop first, then waited for; the caller's thread may be any
    thread (on a node's own loop thread, that node is read directly)."""
    try:
        here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    now = time.monotonic()
    out: list[NodeStats | None] = []
    asked: list[tuple[int, Node, concurrent.futures.Future[NodeStats], float]] = []
    for node, timeout in nodes:
        out.append(None)
        loop = node._loop
        if loop is None or loop.is_closed():
            continue
        if loop is here:  # a scrape from the node's own thread cannot wait for its loop
            try:
                out[-1] = node.stats()
            except Exception:
                log.exception("rvz.metrics: stats() of %s failed", node.name)
            continue
        if not loop.is_running():
            continue
        future: concurrent.futures.Future[NodeStats] = concurrent.futures.Future()
        try:
            loop.call_soon_threadsafe(_fill, future, node)
        except RuntimeError:  # the loop closed since is_closed() was asked
            continue
        asked.append((len(out) - 1, node, future, now + timeout))
    for index, node, future, deadline in asked:
        try:
            out[index] = future.result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            future.cancel()
        except Exception:
            log.exception("rvz.metrics: stats() of %s failed", node.name)
    return out


def _checked(timeout: float) -> float:
    if not 0 < timeout < math.inf:  # (NaN fails this too)
        raise ValueError(f"timeout must be a finite positive number of seconds, not {timeout!r}")
    return float(timeout)


class NodeCollector(Collector):
    """A Prometheus collector of the nodes added to it: each scrape reads their ``stats()``.

    A registry needs one for all its nodes (the metric families are shared, labelled
    ``node``); ``register`` keeps one per registry.  Thread-safe: nodes may be added and
    removed while another thread scrapes."""

    def __init__(self, nodes: Iterable[Node] = (), *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._lock = threading.Lock()
        self._nodes: dict[int, tuple[Node, float]] = {}
        for node in nodes:
            self.add(node, timeout=timeout)

    def add(self, node: Node, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Export ``node``; a scrape waits at most ``timeout`` seconds for its event loop.
        Adding a node again only sets its timeout.  The node is referred to until removed."""
        timeout = _checked(timeout)
        with self._lock:
            self._nodes[id(node)] = (node, timeout)

    def remove(self, node: Node) -> bool:
        """Stop exporting ``node``; False if it was not exported here."""
        with self._lock:
            return self._nodes.pop(id(node), None) is not None

    @property
    def nodes(self) -> list[Node]:
        """The nodes exported, in the order they were added."""
        with self._lock:
            return [node for node, _ in self._nodes.values()]

    def describe(self) -> Iterable[Metric]:
        """Every family ``collect`` may yield, without samples: a registry checks their
        names against its other collectors' without scraping the nodes."""
        return _Families().all()

    def collect(self) -> Iterator[Metric]:
        """The families that have samples, from each node's stats read now."""
        with self._lock:
            entries = list(self._nodes.values())
        families = _Families()
        for (node, _), stats in zip(entries, _read_stats(entries), strict=True):
            families.add(node.name, stats)
        return iter([family for family in families.all() if family.samples])


# The collector ``register`` made for each registry.
_collectors: weakref.WeakKeyDictionary[CollectorRegistry, NodeCollector] = weakref.WeakKeyDictionary()
_collectors_lock = threading.Lock()


def register(node: Node, registry: CollectorRegistry | None = None, *,
             timeout: float = DEFAULT_TIMEOUT) -> NodeCollector:
    """Export ``node`` in ``registry`` (prometheus_client's default ``REGISTRY`` if None).

    Returns the registry's ``NodeCollector``, shared by every node registered there (made and
    registered with the first); ``unregister`` removes the node again.  A scrape waits at most
    ``timeout`` seconds for the node's event loop.  Raises prometheus_client's
    ``ValueError`` if another collector of the registry already has an ``rvz_`` metric name."""
    registry = REGISTRY if registry is None else registry
    timeout = _checked(timeout)  # before the registry gets a collector
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = NodeCollector()
            registry.register(collector)
            _collectors[registry] = collector
        collector.add(node, timeout=timeout)
    return collector


def unregister(node: Node, registry: CollectorRegistry | None = None) -> bool:
    """Stop exporting ``node`` in ``registry`` (the default ``REGISTRY`` if None); the
    registry's collector leaves it with its last node.  False if the node was not there."""
    registry = REGISTRY if registry is None else registry
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None or not collector.remove(node):
            return False
        if not collector.nodes:
            registry.unregister(collector)
            del _collectors[registry]
    return True


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a request still running at close() is not waited for


class _Server6(_Server):
    address_family = socket.AF_INET6


# How often the server's thread looks whether close() was called: close() waits that long.
_POLL_INTERVAL = 0.1
# Seconds a client may take to send its request before its connection is dropped.
_REQUEST_TIMEOUT = 30.0


class MetricsServer:
    """An HTTP server of a registry's metrics on its own thread (``serve`` starts one).

    ``close()`` (or leaving ``with``) stops it and unregisters the node ``serve`` registered.
    """

    def __init__(self, registry: CollectorRegistry, addr: str, port: int,
                 node: Node | None = None) -> None:
        handler = type("RvzMetricsHandler", (MetricsHandler.factory(registry),),
                       {"timeout": _REQUEST_TIMEOUT})
        server_class = _Server6 if ":" in addr else _Server
        self._httpd = server_class((addr, port), handler)
        self._node = node
        self._lock = threading.Lock()
        self._closed = False
        self.registry = registry
        """The registry served."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(_POLL_INTERVAL,),
                                        name=f"rvz-metrics:{self.port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """The address the server is bound to."""
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        """The port the server is bound to (the one the system chose, for ``port=0``)."""
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """Where a scraper finds the metrics."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving, close the listening socket and unregister the node; waits at most
        ``timeout`` seconds for the server's thread (it looks every 0.1 s). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._httpd.shutdown()  # serve_forever, running since __init__, leaves within _POLL_INTERVAL
        self._httpd.server_close()
        self._thread.join(timeout)
        if self._node is not None:
            unregister(self._node, self.registry)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<rvz.metrics.MetricsServer {self.url}{' closed' if self._closed else ''}>"


def serve(node: Node, port: int = 0, addr: str = "127.0.0.1", *,
          registry: CollectorRegistry | None = None,
          timeout: float = DEFAULT_TIMEOUT) -> MetricsServer:
    """Export ``node`` and serve its metrics over HTTP at ``addr``:``port`` on a thread of
    their own (``port=0``: one the system picks; ``MetricsServer.port`` tells it).

    ``registry`` is a new one unless given (then it is served whole, and ``node`` is
    registered in it); more nodes join with ``register(other, server.registry)``.  A scrape
    waits at most ``timeout`` seconds for a node's event loop.  Call from any thread; bind
    errors (``OSError``) are raised here."""
    registry = CollectorRegistry() if registry is None else registry
    register(node, registry, timeout=timeout)
    try:
        return MetricsServer(registry, addr, port, node)
    except BaseException:
        unregister(node, registry)
        raise


__all__ = ["DEFAULT_TIMEOUT", "NODE_STATES", "PEER_STATES", "MetricsServer", "NodeCollector", "register",
           "serve", "unregister"]

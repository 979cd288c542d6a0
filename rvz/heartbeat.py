"""The heartbeat: at every ``heartbeat`` seconds, fail connections that are silent, slow or
never finished their handshake, ping idle ones, push held values nobody claimed, drop empty
and idle steps, and say repeated events in one line.

``Heartbeat`` is a part of ``rvz.node.Node`` (a base class); each job is a method of its own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from . import _impl
from .errors import ProtocolError
from .nodestate import NodeState

log = logging.getLogger("rvz.node")
_codec = _impl.codec

# Seconds over which a repeated event (a refused connection) is said in one line.
REPEAT_INTERVAL = 10.0


class Repeats:
    """One log line per ``REPEAT_INTERVAL`` for an event that may repeat many times a second.

    The first occurrence is logged as it happens, with its detail; those that follow within
    the interval are counted, and ``flush`` (at each heartbeat) says how many in one line
    with the first of them, at the highest level among them."""

    def __init__(self) -> None:
        self.began: dict[str, float] = {}               # kind -> when its interval began
        self.counted: dict[str, list[Any]] = {}         # kind -> [count, level, first text]

    def log(self, kind: str, level: int, text: str) -> None:
        if kind not in self.began:
            self.began[kind] = time.monotonic()
            log.log(level, "%s", text)
            return
        entry = self.counted.get(kind)
        if entry is None:
            self.counted[kind] = [1, level, text]
        else:
            entry[0] += 1
            entry[1] = max(entry[1], level)

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        for kind, began in list(self.began.items()):
            if not force and now - began < REPEAT_INTERVAL:
                continue
            entry = self.counted.pop(kind, None)
            if entry is None:
                del self.began[kind]  # a quiet interval: the next one is logged at once
                continue
            count, level, text = entry
            log.log(level, "%d more like this in the last %.0fs, the first: %s", count,
                    now - began, text)
            self.began[kind] = now


def _log_unclaimed_failure(done: asyncio.Future[None]) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.warning("an unclaimed value could not be pushed: %s", done.exception())


def _release_held(core: Any, peer: Any, nbytes: int, done: asyncio.Future[None]) -> None:
    """A held value pushed to its consumer left the push queue (``Heartbeat._push_oldest``)."""
    core.holding.released_held(peer, nbytes)

def _observe(future: asyncio.Future[Any]) -> None:
    """Mark a finished future's exception as seen (its failure is reported elsewhere)."""
    if not future.cancelled():
        future.exception()


class Heartbeat(NodeState):
    """The node's periodic jobs (see the module docstring)."""

    def _tick(self) -> None:
        """Heartbeat: its jobs, then the next one."""
        if self._forked_from is not None:
            return  # a forked child's copy of the parent's heartbeat (_disown)
        assert self._loop is not None
        now = self._loop.time()
        self._check_connections(now)
        self._sweep_claims(now)
        self._sweep_steps(now)
        for peer in self._core.peers.values():
            if peer.owed > 0:  # a batch below a quarter window still goes back when idle
                self._core.credit.flush_credit_now(peer)
        self._repeats.flush()
        self._tick_handle = self._loop.call_later(self.heartbeat, self._tick)

    def _check_connections(self, now: float) -> None:
        """Fail the connections that did not complete their handshake in time, went silent
        for ``peer_timeout`` or trickle a payload below ``min_rate``; ping the idle ones."""
        limit = max(1, round(self.peer_timeout / self.heartbeat))
        for conn in list(self._conns):
            if conn.closed:
                continue
            if not conn.ready and now - conn.opened > self.hello_timeout:
                conn.fail(ProtocolError(f"no handshake within {self.hello_timeout}s "
                                        "(hello_timeout)"))
                continue
            received = conn.decoder.bytes_in
            if received == conn.seen_in:
                conn.idle_ticks += 1
                conn.read_stalled()
                if conn.idle_ticks >= limit:
                    name = conn.peer.name if conn.peer is not None else "peer"
                    conn.fail(TimeoutError(f"{name} sent nothing for {self.peer_timeout}s "
                                           "(no heartbeat)"))
                    continue
            else:
                conn.seen_in = received
                conn.idle_ticks = 0
            if self.min_rate and conn.payload_too_slow(self.heartbeat, self.peer_timeout,
                                                       self.min_rate):
                conn.fail(ProtocolError(f"a payload from {conn.peer_name()} has taken over "
                                        f"{self.peer_timeout}s and comes at less than "
                                        f"{self.min_rate} bytes/s (min_rate)"))
                continue
            if conn.ready and conn.bytes_out == conn.seen_out:
                conn.write_frame(_codec.encode_ping())
            conn.seen_out = conn.bytes_out

    def _sweep_claims(self, now: float) -> None:
        """Push the held values nobody claimed in time; forget claims past ``claim_timeout``."""
        holding = self._core.holding
        if holding.claims:
            self._push_unclaimed(now)
        if holding.asked and self.claim_timeout is not None:
            holding.forget_asked(now - self.claim_timeout)

    def _sweep_steps(self, now: float) -> None:
        """Drop empty tables, expire idle steps, forget the oldest retired ones."""
        steps = self._core.steps
        for step in steps.empty_steps():
            self._core.drop_table(step)
        if self.step_idle is not None:
            self._expire_idle_steps(now)
        steps.retire()

    def _expire_idle_steps(self, now: float) -> None:
        """Drop the tables of steps nothing touched for ``step_idle`` seconds (a peer that
        opened steps and never cleaned them up cannot keep them forever)."""
        assert self.step_idle is not None
        expired = more = values_lost = recvs_failed = 0
        level = logging.INFO
        for step, table in self._core.steps.idle_steps(now, self.step_idle):
            message = f"step {step} expired after {self.step_idle}s without activity"
            keys, values, _, recvs = table.counts()
            # What it held is lost (values never received, recvs that now fail): worth
            # a warning, not the INFO line of a step that only kept its table.
            this = logging.WARNING if values or recvs else logging.INFO
            expired += 1
            if expired == 1:  # the first with its detail, the others in one line
                log.log(this, "%s: %s; dropped %d value(s) of %d key(s), failed %d recv(s)",
                        self.name, message, values, keys, recvs)
            else:
                more += 1
                values_lost += values
                recvs_failed += recvs
                level = max(level, this)
            self._drop_table(step, message, None)
        if more:
            log.log(level, "%s: %d more step(s) expired after %ss without activity; dropped "
                    "%d value(s), failed %d recv(s)", self.name, more, self.step_idle,
                    values_lost, recvs_failed)

    def _push_held(self) -> list[Any]:
        """At close: push every Recv-Driven value still held to its consumer."""
        dones = []
        for step, table, route in self._held_keys():
            # No caller awaits these: close() counts the failed ones, and asyncio must not
            # log each as an exception never retrieved.
            dones += self._push_oldest(table, step, route, table.queued(route.text), _observe)
        self._core.holding.drop_claims()
        return dones

    def _held_keys(self) -> list[tuple[int, Any, Any]]:
        """``(step, table, route)`` of every key with Recv-Driven values held here for a
        remote consumer."""
        core = self._core
        held = []
        for step, table in core.steps.tables.items():
            for key in table.queued_keys():
                route = core.routes.route(key)
                if route.from_me and route.peer is not None:
                    held.append((step, table, route))
        return held

    def _push_oldest(self, table: Any, step: int, route: Any, count: int,
                     on_done: Callable[[asyncio.Future[None]], None]) -> list[asyncio.Future[None]]:
        """Push the ``count`` oldest values of ``route``'s key held in ``table`` to its
        consumer; they wait for credit like any push, and ``on_done`` sees how each ends."""
        core = self._core
        dones = []
        for _ in range(count):
            value, code, shape, nbytes = _codec.describe(table.take(route.text))
            done = core.credit.queue_push(core.future(), route.peer, step, route, value, code, shape, nbytes)
            # It counts against hold_limit until it leaves the queue (written, taken by a
            # request, or failed).  Released here, a consumer that took none of them let the
            # sends behind hold hold_limit again every claim_timeout: the queue grew
            # without bound.
            done.add_done_callback(functools.partial(_release_held, core, route.peer, nbytes))
            done.add_done_callback(on_done)
            dones.append(done)
        return dones

    def _push_unclaimed(self, now: float) -> None:
        """Push the held values whose claims came due (``Holding.due_claims``), oldest first."""
        core = self._core
        for step, key, count in core.holding.due_claims(now, core.routes.route):
            route = core.routes.route(key)
            log.info("%s: pushing %d unclaimed value(s) of %s to %s after %ss", self.name,
                     count, key, route.peer.name, self.claim_timeout)
            self._push_oldest(core.steps.tables[step], step, route, count, _log_unclaimed_failure)

"""A node of a cluster: routes keys, runs both remote modes, and owns the peers.

Where a key is matched: ``Node._table(step)`` returns the step's ``Table``; local values,
values pushed by producers (Send-Driven) and answers to our requests (Recv-Driven) all land
there with ``put`` and leave with ``take`` / ``take_or_wait``.

Recv-Driven (``mode="recv"``): ``send`` keeps the value in the producer's table; the
consumer's ``recv`` sends REQUEST {step, key, request id}; the producer parks it as a
waiter in its table, so it is answered as soon as the value is there.

Send-Driven (``mode="send"``): ``send`` pushes the value to the consumer at once (within
the push window the consumer granted); the consumer's table keeps it; ``recv`` waits
locally and sends nothing.

When the two sides disagree on a key's mode nothing is lost and nothing hangs:

* producer pushes, consumer requests: ``recv`` looks in its local table first, a push
  satisfies the waiter, and the now surplus request is cancelled (if the producer answered it
  first, the extra value is queued locally for the next ``recv``);
* producer holds, consumer waits locally: a consumer whose own default is Send-Driven
  still asks a node whose default (from its HELLO) is Recv-Driven; for a per-call override
  nobody can know of, a held value nobody requested within ``claim_timeout`` seconds is
  pushed to its consumer.
FIFO order per key holds within one mode; across modes on one key it is not guaranteed.

Everything this node sends a peer (pushes, requests, answers, credit) goes on one
connection, ``Peer.link``: one ordered stream per direction, coalesced per loop iteration
(a one-sided channel keeps its answers on the request's connection, see ``_answer``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from . import _impl
from .cluster import ClusterSpec, split_address
from .connection import Connection
from .errors import (
    Aborted,
    KeyFormatError,
    NodeClosed,
    PeerLost,
    ProtocolError,
    RemoteError,
    RvzError,
    TransportError,
    WrongEndpoint,
)

log = logging.getLogger("rvz")

_codec = _impl.codec
_keys = _impl.keys
_table = _impl.table
Table = _table.Table
EMPTY = _table.EMPTY
wait_value = _table.wait_value
describe = _codec.describe

MODES = ("recv", "send")
TRANSPORTS = ("tcp", "shm", "verbs", "auto")  # all but tcp: rvz.onesided
_ROUTE_CACHE_MAX = 1 << 16
_DEVICES_MAX = 4096
_DEAD_STEPS_MAX = 1 << 16

TaskId = tuple  # (job, task)


def _nbytes(value: Any) -> int:
    n = getattr(value, "nbytes", None)
    return len(value) if n is None else int(n)


# What one message costs in the push window beyond its payload: it bounds the count of tiny
# (or empty) messages in flight, not only their bytes.  Both ends use the same figure.
MESSAGE_COST = 64


def _log_unclaimed_failure(done: asyncio.Future[None]) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.warning("rvz: an unclaimed value could not be pushed: %s", done.exception())


class Route:
    """What the node needs to know of a key, computed once per key string."""

    __slots__ = ("text", "wire", "src", "dst")

    def __init__(self, text: str, src: TaskId, dst: TaskId) -> None:
        self.text = text
        self.wire = text.encode("utf-8")
        self.src = src
        self.dst = dst


class Peer:
    """Another node: its connections, the push window it granted us, and what we owe it."""

    def __init__(self, node: Node, task_id: TaskId, address: str) -> None:
        self.node = node
        self.id = task_id
        self.name = f"/job:{task_id[0]}/replica:0/task:{task_id[1]}"
        self.address = address
        self.out: Connection | None = None          # the connection we dialled
        self.dialling: asyncio.Future[Connection] | None = None
        self.inbound: set[Connection] = set()       # connections it dialled to us
        self.incarnation: int | None = None
        self.mode = ""                              # its default mode, from its HELLO
        # The connection our requests and pushes use: the first ready one either side
        # dialled, so both directions share one socket (an answer and the next request leave
        # in one write).  It only changes when it dies, which keeps pushes in order.
        self.link: Connection | None = None
        self.credit = node.push_window              # bytes we may still push to it
        self.asked = False                          # we asked it for credit it holds back
        # Pushes waiting for the link, credit or the socket, in call order:
        # (done future, step, route, value, dtype code, shape, nbytes).
        self.queue: deque[tuple[Any, ...]] = deque()
        self.owed = 0                               # bytes of its values we consumed, to return
        self.owed_scheduled = False
        self.owe_now = False                        # it asked: return credit at the next consumption

    def live_connections(self) -> list[Connection]:
        conns = [c for c in self.inbound if not c.closed]
        if self.out is not None and not self.out.closed:
            conns.append(self.out)
        return conns

    def __repr__(self) -> str:
        return f"<Peer {self.name} at {self.address}>"


class Request:
    """A Recv-Driven request we sent and that has not been answered yet."""

    __slots__ = ("id", "peer", "step", "key", "conn")

    def __init__(self, request_id: int, peer: Peer, step: int, key: str) -> None:
        self.id = request_id
        self.peer = peer
        self.step = step
        self.key = key
        self.conn: Connection | None = None  # where it went: a CANCEL must follow it there


class RemoteWaiter:
    """A remote consumer's request parked in our table, shaped like a future for ``Table``."""

    __slots__ = ("node", "conn", "step", "request_id", "route", "_done")

    def __init__(self, node: Node, conn: Connection, step: int, request_id: int, route: Route) -> None:
        self.node = node
        self.conn = conn
        self.step = step
        self.request_id = request_id
        self.route = route
        self._done = False

    def done(self) -> bool:
        return self._done or self.conn.closed

    def cancel(self) -> None:
        self._done = True

    def set_result(self, value: Any) -> None:
        self._done = True
        self.conn.parked.pop(self.request_id, None)
        self.node._answer(self.conn, self.step, self.request_id, self.route, value)

    def set_exception(self, exc: BaseException) -> None:
        self._done = True
        self.conn.parked.pop(self.request_id, None)
        code = "aborted" if isinstance(exc, Aborted) else type(exc).__name__
        self.conn.write_frame(_codec.encode_error(self.request_id, self.step, self.route.text,
                                                  code, str(exc)))


class Node:
    """One task of a cluster: ``async with Node(cluster, job, task, mode) as node``.

    ``connect_timeout`` bounds dialling a peer that is not up yet (retried with backoff);
    a peer that sends nothing (not even its ``heartbeat`` pings) for ``peer_timeout`` seconds
    is lost.  ``push_window`` bytes may be pushed to one consumer before it consumes them;
    ``hold_limit`` bytes of Recv-Driven values may wait for their consumers before ``send``
    waits.  ``linger`` bounds how long ``close()`` keeps serving held values.
    Up to ``recv_pool`` bytes of memory for large received arrays are kept and used again once
    every array on a block is gone (0: allocate each array anew).
    """

    def __init__(self, cluster: ClusterSpec | dict[str, Any], job: str, task: int,
                 mode: str = "recv", *, transport: str = "tcp", host: str | None = None,
                 connect_timeout: float = 10.0, heartbeat: float = 1.0,
                 peer_timeout: float = 10.0, linger: float = 5.0,
                 push_window: int = 64 << 20, hold_limit: int = 256 << 20,
                 claim_timeout: float | None = 2.0, incarnation: int | None = None,
                 max_payload: int = _codec.DEFAULT_MAX_PAYLOAD, recv_pool: int = 64 << 20,
                 onesided: dict[str, Any] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be 'recv' or 'send', not {mode!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        if heartbeat <= 0 or peer_timeout <= heartbeat:
            raise ValueError("need 0 < heartbeat < peer_timeout")
        self.cluster = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
        self.job = job
        self.task = int(task)
        self.id: TaskId = (job, self.task)
        self.name = f"/job:{job}/replica:0/task:{self.task}"
        self.address = self.cluster.address(job, self.task)
        self.mode = mode
        self.transport = transport
        self._host = host
        self.connect_timeout = connect_timeout
        self.heartbeat = heartbeat
        self.peer_timeout = peer_timeout
        self.linger = linger
        self.push_window = push_window
        self.hold_limit = hold_limit
        self.claim_timeout = claim_timeout
        self.max_payload = max_payload
        # Memory for large received arrays, reused once the caller dropped them (0: none).
        self._recv_pool = _impl.recvpool.RecvPool(recv_pool) if recv_pool > 0 else None
        self.incarnation = incarnation if incarnation is not None else int.from_bytes(os.urandom(8), "little")
        self._state = "new"
        self._close_cause: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tick_handle: asyncio.TimerHandle | None = None
        self._peers: dict[TaskId, Peer] = {}
        self._conns: set[Connection] = set()
        self._routes: dict[str, Route] = {}
        self._devices: dict[str, TaskId] = {}
        self._tables: dict[int, Any] = {}
        self._dead_steps: dict[int, str] = {}
        self._step_peers: dict[int, set[Peer]] = {}
        self._request_ids = itertools.count(1)
        self._requests: dict[int, Request] = {}
        self._outstanding: dict[tuple[int, str], deque[int]] = {}
        self._held_bytes = 0          # Recv-Driven values waiting for remote consumers
        self._held_count = 0
        self._hold_waiters: deque[asyncio.Future[None]] = deque()
        self._claims: deque[tuple[float, int, str]] = deque()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._deliveries: set[asyncio.Task[Any]] = set()  # the tasks close() must wait for
        # One-sided transports (rvz.onesided): options, and the hub start() opens for them.
        self._onesided_options = onesided
        self._onesided: Any = None

    # -- life cycle ---------------------------------------------------------------------------

    def _set_state(self, new: str) -> None:
        allowed = {"new": ("running", "closed"), "running": ("closing", "closed"),
                   "closing": ("closed",), "closed": ()}
        if new not in allowed[self._state]:
            raise RvzError(f"node {self.name}: cannot go from {self._state} to {new}")
        self._state = new

    async def start(self) -> Node:
        """Listen on this task's address and start the heartbeat."""
        self._loop = asyncio.get_running_loop()
        host, port = split_address(self.address)
        if self._host is not None:
            host = self._host
        if self.transport != "tcp" and self._onesided is None:
            from .onesided.hub import Hub  # TransportError here names what is missing
            self._onesided = Hub(self, self._onesided_options)
        try:
            self._server = await self._loop.create_server(
                lambda: Connection(self, outbound=False, max_payload=self.max_payload),
                host, port, reuse_address=True)
        except BaseException:
            if self._onesided is not None:  # its completion queues are on this loop
                self._onesided.close()
                self._onesided = None
            raise
        self._set_state("running")
        self._tick_handle = self._loop.call_later(self.heartbeat, self._tick)
        return self

    async def __aenter__(self) -> Node:
        return await self.start()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None and not isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            self.abort(exc)
        else:
            await self.close()

    @property
    def state(self) -> str:
        return self._state

    def _check_running(self, key: str | None = None) -> None:
        if self._state != "running":
            where = f" (key {key})" if key else ""
            err: RvzError
            if self._state == "closed" and self._close_cause is not None:
                # abort()/close() promise that every later operation fails with Aborted.
                err = Aborted(f"node {self.name} is closed: {self._close_cause}{where}")
            else:
                err = RvzError(f"node {self.name} is {self._state}{where}")
            raise err from self._close_cause

    def transport_for(self, peer: str | TaskId) -> str:
        """The transport used toward ``peer`` (a device name or ``(job, task)``).

        With ``transport="auto"`` it is ``"auto"`` until a connection to the peer agreed on
        one (``"shm"``, ``"verbs"`` or ``"tcp"``); the choice is also logged.
        """
        task_id = _keys.parse_device(peer) if isinstance(peer, str) else tuple(peer)
        self.cluster.address(*task_id)
        if self._onesided is not None:
            return str(self._onesided.transport_for(task_id))
        return self.transport

    def hello_fields(self) -> dict[str, Any]:
        return {"v": _codec.VERSION, "job": self.job, "task": self.task,
                "inc": self.incarnation, "order": sys.byteorder, "mode": self.mode}

    async def close(self) -> None:
        """Graceful close: deliver what was sent, then say BYE and close.

        Pushes already accepted are flushed; Recv-Driven values still held for remote
        consumers keep being served until fetched or until ``linger`` seconds passed.
        """
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        if self._state == "closing":
            while self._state != "closed":
                await asyncio.sleep(0.01)
            return
        self._set_state("closing")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.linger
        # Not every background task: a dial retrying toward a dead peer would hold the close
        # for the whole linger although it delivers nothing.
        while loop.time() < deadline and (self._held_count or self._deliveries or any(
                p.queue for p in self._peers.values()) or (
                self._onesided is not None and self._onesided.busy())):
            await asyncio.sleep(min(0.005, max(0.0, deadline - loop.time())))
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            if not conn.closed and conn.ready:
                self._flush_credit_now(conn.peer)
                conn.write_frame(_codec.encode_bye())
            conn.flush()
        for conn in list(self._conns):
            if not conn.closed:
                try:
                    await asyncio.wait_for(conn.drain(), max(0.05, deadline - loop.time()))
                except (asyncio.TimeoutError, RvzError):
                    pass
                conn.close()
        # conn.close() only half-closes: wait until each peer has read everything and closed
        # its side (a silent peer for at most peer_timeout), then cut what is left.
        handshake = loop.time() + self.peer_timeout
        while any(c.closed_here and not c.closed for c in self._conns) and loop.time() < handshake:
            await asyncio.sleep(0.005)
        cause = NodeClosed(f"node {self.name} was closed")
        for conn in list(self._conns):
            if not conn.closed:
                conn.fail(cause)
        self._finish(cause)
        # Give the transports one iteration to run their close callbacks.
        await asyncio.sleep(0)

    def abort(self, exc: BaseException | None = None) -> None:
        """Close at once: every pending and later operation fails with ``Aborted``."""
        if self._state == "closed":
            return
        cause = exc if exc is not None else NodeClosed(f"node {self.name} was aborted")
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.fail(cause)
        self._finish(cause)

    def _finish(self, cause: BaseException) -> None:
        self._close_cause = cause
        self._state = "closed"
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        message = f"node {self.name} closed"
        for step in list(self._tables):
            self._drop_table(step, message, cause)
        for peer in self._peers.values():
            self._fail_queued_pushes(peer, lambda key: self._closed_error(cause))
        for waiter in self._hold_waiters:
            if not waiter.done():
                waiter.set_exception(self._closed_error(cause))
        self._hold_waiters.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._onesided is not None:
            self._onesided.close()  # pool blocks under live arrays stay until those die

    def _closed_error(self, cause: BaseException) -> Aborted:
        err = Aborted(f"node {self.name} closed: {cause}")
        err.__cause__ = cause
        return err

    # -- keys and tables ---------------------------------------------------------------------

    def _route(self, key: Any) -> Route:
        text = key if isinstance(key, str) else str(key)
        route = self._routes.get(text)
        if route is None:
            # Keys change every step (frame:iter), devices do not: those are parsed once.
            parsed = _keys.as_key(key)
            canonical = str(parsed)
            route = Route(canonical, self._task_of(parsed.src, canonical),
                          self._task_of(parsed.dst, canonical))
            if len(self._routes) >= _ROUTE_CACHE_MAX:
                self._routes.clear()
            self._routes[text] = route
        return route

    def _task_of(self, device: str, key: str) -> TaskId:
        """``(job, task)`` of a device name, checked against the cluster once per device."""
        task_id = self._devices.get(device)
        if task_id is None:
            task_id = _keys.parse_device(device)
            try:  # here, before a recv queues its waiter: not a KeyError from deep inside
                self.cluster.address(*task_id)
            except KeyError:
                raise WrongEndpoint(f"key {key} names /job:{task_id[0]}/task:{task_id[1]}, "
                                    f"which is not in the cluster {self.cluster!r}") from None
            if len(self._devices) >= _DEVICES_MAX:
                self._devices.clear()
            self._devices[device] = task_id
        return task_id

    def _own_route(self, key: Any, op: str) -> Route:
        """The route of a key this node may ``send`` (its src) or ``recv`` (its dst) now."""
        route = self._route(key)
        end, role = (route.src, "source") if op == "send" else (route.dst, "destination")
        if end != self.id:
            raise WrongEndpoint(f"cannot {op} key {route.text} on {self.name}: its {role} is "
                                f"/job:{end[0]}/task:{end[1]}")
        if self._state != "running":
            self._check_running(route.text)
        return route

    def _peer(self, task_id: TaskId) -> Peer:
        peer = self._peers.get(task_id)
        if peer is None:
            peer = Peer(self, task_id, self.cluster.address(*task_id))
            self._peers[task_id] = peer
        return peer

    def _table(self, step: int) -> Any:
        table = self._tables.get(step)
        if table is None:
            dead = self._dead_steps.get(step)
            if dead is not None:
                err = Aborted(dead)
                raise err
            table = self._tables[step] = Table()
        return table

    def _joined(self, step: int, peer: Peer) -> None:
        peers = self._step_peers.get(step)
        if peers is None:
            self._step_peers[step] = {peer}
        elif peer not in peers:
            peers.add(peer)

    # -- send ----------------------------------------------------------------------------------

    async def send(self, key: Any, value: Any, *, mode: str | None = None, step: int = 0,
                   timeout: float | None = None) -> None:
        """Send ``value`` (a numpy array or bytes) on ``key``; the key's src must be this node.

        Returns once the value is queued: locally, in our table for the consumer to fetch
        (Recv-Driven), or on the wire (Send-Driven).  Waits only for backpressure.
        """
        route = self._own_route(key, "send")
        value, code, shape, nbytes = describe(value)
        table = self._table(step)
        if route.dst == self.id:
            table.put(route.text, value)
            return
        peer = self._peer(route.dst)
        self._joined(step, peer)
        if mode is None:
            mode = self.mode
        elif mode not in MODES:
            raise ValueError(f"mode must be 'recv' or 'send', not {mode!r}")
        if mode == "send" and not table.waiting(route.text):
            await self._push(peer, step, route, value, code, shape, nbytes, timeout)
            return
        # Recv-Driven (or a consumer already asked for it): a parked request takes it now.
        # Else wait for room under hold_limit *before* queuing it, so that a send that times
        # out or is cancelled did not send (one value alone may exceed the limit).
        if self._held_count and self._held_bytes + nbytes > self.hold_limit:
            assert self._loop is not None
            end = None if timeout is None else self._loop.time() + timeout
            while (self._held_count and self._held_bytes + nbytes > self.hold_limit
                   and not table.waiting(route.text)):
                left = None if end is None else max(0.0, end - self._loop.time())
                try:
                    await self._wait(self._hold_waiters, left, "hold limit")
                except TimeoutError:
                    raise TimeoutError(f"send of {route.text} to {peer.name} timed out after "
                                       f"{timeout}s (hold limit: values not yet fetched)") from None
        if table.put(route.text, value):
            return
        self._held_bytes += nbytes
        self._held_count += 1
        if self.claim_timeout is not None:
            assert self._loop is not None
            self._claims.append((self._loop.time() + self.claim_timeout, step, route.text))

    async def _push(self, peer: Peer, step: int, route: Route, value: Any, code: int,
                    shape: tuple[int, ...], nbytes: int, timeout: float | None) -> None:
        """Send-Driven: write the value to its consumer, in call order per peer.

        The fast path writes at once.  Otherwise the push joins the peer's queue, which
        ``_pump`` drains in order, synchronously, whenever the connection, the consumer's
        credit or the socket allows: many queued pushes then leave in one write.
        """
        conn = peer.link
        cost = nbytes + MESSAGE_COST
        if (not peer.queue and conn is not None and conn.ready and not conn.closed
                and not conn.paused and (peer.credit >= cost or peer.credit >= self.push_window)):
            peer.credit -= cost
            conn.write_value(step, 0, route.wire, value, code, shape, nbytes)
            return
        done = self._queue_push(peer, step, route, value, code, shape, nbytes)
        if done.done():
            return done.result()
        try:
            if timeout is None:
                await done
            else:
                await asyncio.wait_for(done, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"send of {route.text} to {peer.name} timed out after {timeout}s "
                               "(connection, push window or socket)") from None
        # A cancelled or timed-out push is cancelled in the queue too: _pump skips it.

    def _queue_push(self, peer: Peer, step: int, route: Route, value: Any, code: int,
                    shape: tuple[int, ...], nbytes: int) -> asyncio.Future[None]:
        assert self._loop is not None
        done: asyncio.Future[None] = self._loop.create_future()
        peer.queue.append((done, step, route, value, code, shape, nbytes))
        self._pump(peer)
        return done

    def _pump(self, peer: Peer) -> None:
        """Write queued pushes while the link, credit and socket allow; else arrange a wake-up."""
        queue = peer.queue
        while queue:
            done, step, route, value, code, shape, nbytes = queue[0]
            if done.done():  # cancelled or timed out before it went out
                queue.popleft()
                continue
            conn = peer.link
            if conn is None or conn.closed or not conn.ready:
                self._start_link(peer)  # _link_ready pumps again
                return
            if conn.paused:
                conn.on_resume = self._pump_later  # resume_writing pumps again
                return
            cost = nbytes + MESSAGE_COST
            if not (peer.credit >= cost or peer.credit >= self.push_window):
                if not peer.asked:  # the consumer may be holding back a batch: ask for it
                    peer.asked = True
                    conn.write_frame(_codec.encode_credit(0))
                return  # _on_credit pumps again
            queue.popleft()
            peer.credit -= cost
            conn.write_value(step, 0, route.wire, value, code, shape, nbytes)
            done.set_result(None)

    def _pump_later(self, conn: Connection) -> None:
        if conn.peer is not None:
            self._pump(conn.peer)

    def _start_link(self, peer: Peer) -> None:
        """Make sure a connection to ``peer`` is on its way (without waiting for it)."""
        if peer.dialling is None or peer.dialling.done():
            self._spawn(self._link(peer))

    def _loop_call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon(fn, *args)

    async def _wait(self, waiters: deque[asyncio.Future[None]], timeout: float | None,
                    what: str) -> None:
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            if timeout is None:
                await waiter
            else:
                await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what}: timed out after {timeout}s") from None
        finally:
            try:
                waiters.remove(waiter)
            except ValueError:
                pass

    def _answer(self, conn: Connection, step: int, request_id: int, route: Route, value: Any) -> None:
        """Send ``value`` as the answer to a Recv-Driven request.

        Over TCP the answer goes on our link to the consumer, like everything else we send
        it: one ordered stream per direction, and an answer leaves in the same write as our
        own next request.  A one-sided channel keeps it on the request's connection, whose
        channel holds the destination the consumer offered.
        """
        value, code, shape, nbytes = describe(value)
        peer = conn.peer
        if peer is not None:
            peer.credit -= nbytes + MESSAGE_COST  # answers are asked for: they never wait for credit
            link = peer.link
            if (conn.dataplane is None and link is not None and link is not conn and link.ready
                    and not link.closed and link.dataplane is None):
                conn = link
        conn.write_value(step, request_id, route.wire, value, code, shape, nbytes)

    def _released_held(self, nbytes: int) -> None:
        self._held_bytes -= nbytes
        self._held_count -= 1
        if self._hold_waiters and self._held_bytes <= self.hold_limit:
            for waiter in self._hold_waiters:
                if not waiter.done():
                    waiter.set_result(None)

    # -- recv ----------------------------------------------------------------------------------

    async def recv(self, key: Any, *, mode: str | None = None, step: int = 0,
                   timeout: float | None = None) -> Any:
        """Receive the next value of ``key`` (FIFO); the key's dst must be this node.

        ``timeout`` raises ``TimeoutError``; cancelling the awaiting task cancels just this
        recv.  Remote failures raise ``PeerLost`` or ``Aborted`` with the original cause.
        """
        route = self._own_route(key, "recv")
        table = self._table(step)
        value = table.take(route.text)
        if value is not EMPTY:
            if route.src != self.id:
                self._consumed(route.src, value)
            return value
        assert self._loop is not None
        waiter = self._loop.create_future()
        table.take_or_wait(route.text, waiter)
        if route.src == self.id:
            return await wait_value(table, route.text, waiter, self._loop, timeout,
                                    f"recv of {route.text}")
        peer = self._peer(route.src)
        self._joined(step, peer)
        if mode is None:
            # A node that holds its values (Recv-Driven by default) is asked for them even by
            # a Send-Driven consumer: default modes that disagree still cost no claim_timeout.
            mode = "recv" if self.mode == "recv" or peer.mode == "recv" else "send"
        elif mode not in MODES:
            table.remove_waiter(route.text, waiter)
            raise ValueError(f"mode must be 'recv' or 'send', not {mode!r}")
        if mode == "recv":
            self._request(peer, step, route)
        elif not peer.live_connections():
            self._spawn(self._link(peer, route.text))  # to notice if it is gone
        try:
            return await wait_value(table, route.text, waiter, self._loop, timeout,
                                    f"recv of {route.text} from {peer.name}")
        except asyncio.CancelledError:
            # wait_value gave the delivered value back: to the queue, where it is unconsumed
            # again (its credit is returned when it is taken), or to the next waiter, which
            # consumed it (the credit already counted stands).  A queue and waiters never
            # coexist, so a non-empty queue means the former.
            if (waiter.done() and not waiter.cancelled() and waiter.exception() is None
                    and table.queued(route.text)):
                peer.owed -= _nbytes(waiter.result()) + MESSAGE_COST
            raise
        finally:
            self._rebalance(step, route.text, table)

    def _request(self, peer: Peer, step: int, route: Route) -> None:
        request_id = next(self._request_ids)
        request = self._requests[request_id] = Request(request_id, peer, step, route.text)
        pending = self._outstanding.get((step, route.text))
        if pending is None:
            self._outstanding[(step, route.text)] = deque((request_id,))
        else:
            pending.append(request_id)
        conn = peer.link
        if conn is not None and conn.ready and not conn.closed:
            self._send_request(conn, request, route.wire)
        else:
            self._spawn(self._send_when_linked(request, route.wire))

    def _send_request(self, conn: Connection, request: Request, wire: bytes) -> None:
        request.conn = conn
        if conn.dataplane is not None:  # one-sided: offer the destination first
            conn.dataplane.on_request(request.step, request.id, request.key)
        conn.write_frame(_codec.encode_request(request.step, request.id, wire))

    async def _send_when_linked(self, request: Request, wire: bytes) -> None:
        conn = await self._link(request.peer, request.key)
        if request.id in self._requests:  # not cancelled while we dialled
            self._send_request(conn, request, wire)

    def _rebalance(self, step: int, key: str, table: Any) -> None:
        """Cancel requests that no local waiter needs any more (newest first)."""
        pending = self._outstanding.get((step, key))
        if pending is None:
            return
        surplus = len(pending) - (table.waiting(key) if not table.aborted else 0)
        while surplus > 0 and pending:
            request = self._requests.pop(pending.pop(), None)
            surplus -= 1
            if request is not None:
                conn = request.conn
                if conn is not None and not conn.closed:
                    conn.write_frame(_codec.encode_cancel(request.id))
        if not pending:
            del self._outstanding[(step, key)]

    def _consumed(self, src: TaskId, value: Any) -> None:
        """A value from ``src`` left our table: grant that producer the space again."""
        peer = self._peers.get(src)
        if peer is None:
            return
        peer.owed += _nbytes(value) + MESSAGE_COST
        # Credit goes back in batches of a quarter window (one frame per many messages),
        # or at once when the producer said it is waiting for it.
        if (peer.owe_now or peer.owed >= self.push_window >> 2) and not peer.owed_scheduled:
            peer.owed_scheduled = True
            self._loop_call_soon(self._flush_credit, peer)

    def _flush_credit(self, peer: Peer) -> None:
        peer.owed_scheduled = False
        self._flush_credit_now(peer)

    def _flush_credit_now(self, peer: Peer | None) -> None:
        if peer is None or peer.owed <= 0:
            return
        conns = peer.live_connections()
        if conns:
            peer.owe_now = False
            if conns[0].dataplane is not None:  # one-sided: with the data, one wake-up less
                conns[0].dataplane.send_credit(peer.owed)
            else:
                conns[0].write_frame(_codec.encode_credit(peer.owed))
            peer.owed = 0

    # -- connections ---------------------------------------------------------------------------

    async def _link(self, peer: Peer, key: str | None = None) -> Connection:
        """The connection our traffic to ``peer`` uses, dialled on first use (with retry/backoff)."""
        conn = peer.link
        if conn is not None and not conn.closed and conn.ready:
            return conn
        for conn in peer.live_connections():
            if conn.ready:
                self._link_ready(peer, conn)
                return conn
        if self._state == "closed":
            raise self._closed_error(self._close_cause or NodeClosed(self.name))
        if peer.dialling is None or peer.dialling.done():
            assert self._loop is not None
            peer.dialling = self._loop.create_future()
            self._spawn(self._dial(peer, peer.dialling))
        dialling = peer.dialling
        try:
            return await asyncio.shield(dialling)
        except PeerLost as exc:
            if key is None:
                raise
            err = PeerLost(f"{exc} (key {key})")
            raise err from exc.__cause__

    async def _dial(self, peer: Peer, result: asyncio.Future[Connection]) -> None:
        assert self._loop is not None
        host, port = split_address(peer.address)
        deadline = self._loop.time() + self.connect_timeout
        delay = 0.01
        last: BaseException | None = None
        while True:
            try:
                _, conn = await asyncio.wait_for(self._loop.create_connection(
                    lambda: Connection(self, outbound=True, peer=peer, max_payload=self.max_payload),
                    host, port), max(0.01, deadline - self._loop.time()))
                if not conn.ready:  # HELLO may already have arrived
                    if conn.closed:  # ... and failed it (e.g. no common transport)
                        raise conn.lost_error()
                    hello = self._loop.create_future()
                    conn.hello_waiter = hello
                    await asyncio.wait_for(hello, max(0.01, deadline - self._loop.time()))
                peer.out = conn
                if peer.link is None or peer.link.closed:
                    self._link_ready(peer, conn)
                if not result.done():
                    result.set_result(conn)
                return
            except (OSError, asyncio.TimeoutError, RvzError) as exc:
                last = exc
            remaining = deadline - self._loop.time()
            if self._state == "closed" or remaining <= 0:
                break
            if isinstance(last, TransportError) or isinstance(last.__cause__, TransportError):
                break  # the pair cannot agree on a transport: retrying will not change that
            await asyncio.sleep(min(delay, remaining))  # the last try is at the deadline
            delay = min(delay * 2, 0.5)
        err = PeerLost(f"could not connect to {peer.name} at {peer.address} within "
                       f"{self.connect_timeout}s: {last!r}")
        err.__cause__ = last
        if not result.done():
            result.set_exception(err)
            result.exception()  # retrieved: waiters get it through the shield
        self._peer_lost(peer, err)

    def _link_ready(self, peer: Peer, conn: Connection) -> None:
        peer.link = conn
        if peer.queue:
            self._loop_call_soon(self._pump, peer)

    def _on_connection_made(self, conn: Connection) -> None:
        self._conns.add(conn)

    def _on_connection_lost(self, conn: Connection) -> None:
        self._conns.discard(conn)
        waiter = conn.hello_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(conn.lost_error())
        peer = conn.peer
        if peer is None:
            return
        if peer.out is conn:
            peer.out = None
        if peer.link is conn:
            peer.link = None
        peer.inbound.discard(conn)
        for parked in conn.parked.values():
            parked.cancel()
        conn.parked.clear()
        if self._state == "closed" or conn.closed_here or isinstance(conn.close_reason, PeerLost):
            return  # our own close, or the loss was already handled by _peer_lost
        if conn.bye_received:
            if not peer.live_connections():
                err = PeerLost(f"peer {peer.name} closed")
                err.__cause__ = NodeClosed(f"{peer.name} said goodbye")
                self._peer_lost(peer, err)
        elif conn.ready:
            err = PeerLost(f"lost the connection to {peer.name} at {peer.address}: "
                           f"{conn.close_reason}")
            err.__cause__ = conn.close_reason
            self._peer_lost(peer, err)

    def _peer_lost(self, peer: Peer, err: PeerLost, keep: Connection | None = None) -> None:
        """Fail everything that waits on ``peer``; the next operation dials it again.

        ``keep`` is a fresh connection from the peer's new incarnation, which survives; then
        only what depended on the old process fails: requests it held (and the recvs behind
        them).  Recvs and pushes issued since may be served by the new process.
        """
        graceful = isinstance(err.__cause__, NodeClosed)
        log.log(logging.INFO if graceful else logging.WARNING, "rvz %s: %s", self.name, err)
        for conn in peer.live_connections():
            if conn is not keep:
                conn.fail(err)
        if peer.out is not keep:
            peer.out = None
        peer.inbound = {c for c in peer.inbound if c is keep}
        if peer.link is not keep:
            peer.link = None
        peer.credit = self.push_window
        peer.asked = False
        peer.owed = 0
        peer.owe_now = False

        def lost(key: str) -> PeerLost:
            exc = PeerLost(f"{err} (key {key})")
            exc.__cause__ = err.__cause__
            return exc

        stale: set[tuple[int, str]] = set()  # (step, key) of requests the old process held
        for request_id, request in list(self._requests.items()):
            if request.peer is peer and (keep is None or request.conn not in (None, keep)):
                stale.add((request.step, request.key))
                del self._requests[request_id]
                pending = self._outstanding.get((request.step, request.key))
                if pending is not None:
                    try:
                        pending.remove(request_id)
                    except ValueError:
                        pass
                    if not pending:
                        del self._outstanding[(request.step, request.key)]
        for step, table in self._tables.items():
            for key in table.keys_waiting():
                if self._route(key).src == peer.id and (keep is None or (step, key) in stale):
                    table.fail_waiters(key, lambda key=key: lost(key))
        if keep is None:
            self._fail_queued_pushes(peer, lost)

    def _fail_queued_pushes(self, peer: Peer, error: Callable[[str], BaseException]) -> None:
        queue = peer.queue
        peer.queue = deque()
        for item in queue:
            done, route = item[0], item[2]
            if not done.done():
                done.set_exception(error(route.text))

    def _spawn(self, coro: Awaitable[Any], delivery: bool = False) -> None:
        """Run ``coro`` in the background; ``delivery`` if it carries a value that close()
        must let finish (dials and requests of our own need not hold up a close)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        if delivery:
            self._deliveries.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._deliveries.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if not isinstance(exc, RvzError):
                log.error("rvz %s: background task failed", self.name, exc_info=exc)

    def _tick(self) -> None:
        """Heartbeat: ping idle connections, drop silent ones, push unclaimed values,
        return credit held back in a batch."""
        assert self._loop is not None
        limit = max(1, round(self.peer_timeout / self.heartbeat))
        for conn in list(self._conns):
            if conn.closed:
                continue
            received = conn.decoder.bytes_in
            if received == conn.seen_in:
                conn.idle_ticks += 1
                if conn.idle_ticks >= limit:
                    name = conn.peer.name if conn.peer is not None else "peer"
                    conn.fail(TimeoutError(f"{name} sent nothing for {self.peer_timeout}s "
                                           "(no heartbeat)"))
                    continue
            else:
                conn.seen_in = received
                conn.idle_ticks = 0
            if conn.ready and conn.bytes_out == conn.seen_out:
                conn.write_frame(_codec.encode_ping())
            conn.seen_out = conn.bytes_out
        if self._claims:
            self._push_unclaimed(self._loop.time())
        for peer in self._peers.values():
            if peer.owed > 0:  # a batch below a quarter window still goes back when idle
                self._flush_credit_now(peer)
        self._tick_handle = self._loop.call_later(self.heartbeat, self._tick)

    def _push_unclaimed(self, now: float) -> None:
        claims = self._claims
        while claims and claims[0][0] <= now:
            _, step, key = claims.popleft()
            table = self._tables.get(step)
            if table is None or table.aborted or not table.queued(key):
                continue
            value = table.take(key)
            self._released_held(_nbytes(value))
            route = self._route(key)
            value, code, shape, nbytes = describe(value)
            peer = self._peer(route.dst)
            log.info("rvz %s: pushing unclaimed %s to %s after %ss", self.name, key, peer.name,
                     self.claim_timeout)
            done = self._queue_push(peer, step, route, value, code, shape, nbytes)
            done.add_done_callback(_log_unclaimed_failure)

    # -- frames from peers ---------------------------------------------------------------------

    def _dispatch(self, conn: Connection, events: list[tuple[Any, ...]]) -> None:
        for event in events:
            kind = event[0]
            try:
                if kind == _codec.DATA:
                    self._on_data(conn, event[1], event[2], event[3], event[4])
                elif kind == _codec.REQUEST:
                    self._on_request(conn, event[1], event[2], event[3])
                elif kind == _codec.CREDIT:
                    self._on_credit(conn, event[1])
                elif kind == _codec.CANCEL:
                    parked = conn.parked.pop(event[1], None)
                    if parked is not None:
                        parked.cancel()
                        table = self._tables.get(parked.step)
                        if table is not None:
                            table.remove_waiter(parked.route.text, parked)
                elif kind == _codec.HELLO:
                    self._on_hello(conn, event[1])
                elif kind == _codec.ERROR:
                    self._on_error(conn, event[1])
                elif kind == _codec.ABORT_STEP:
                    name = self._peer_name(conn)
                    text = event[2] if name in event[2] else f"{event[2]} (aborted by {name})"
                    self._abort_step(event[1], text, RemoteError(event[2], name), origin=conn.peer)
                elif kind == _codec.BYE:
                    conn.bye_received = True
            except (ProtocolError, TransportError) as exc:
                conn.fail(exc)
                return
            except (KeyFormatError, WrongEndpoint) as exc:
                # A key from the wire that does not parse or route is the peer's protocol
                # violation: close that connection only, never raise into the event loop.
                err = ProtocolError(f"{self._peer_name(conn)} sent a key we cannot route: {exc}")
                err.__cause__ = exc
                conn.fail(err)
                return

    def _peer_name(self, conn: Connection) -> str:
        return conn.peer.name if conn.peer is not None else "an unidentified peer"

    def _on_hello(self, conn: Connection, fields: dict[str, Any]) -> None:
        try:
            version = fields["v"]
            task_id = (str(fields["job"]), int(fields["task"]))
            incarnation = int(fields["inc"])
            order = fields.get("order", "little")
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"HELLO is missing fields: {fields!r}") from None
        if version != _codec.VERSION:
            raise ProtocolError(f"peer speaks protocol version {version}, we speak {_codec.VERSION}")
        if order != sys.byteorder:
            raise ProtocolError(f"peer is {order}-endian, this node is {sys.byteorder}-endian")
        if conn.outbound:
            assert conn.peer is not None
            if conn.peer.id != task_id:
                raise ProtocolError(f"dialled {conn.peer.name} at {conn.peer.address} but "
                                    f"/job:{task_id[0]}/task:{task_id[1]} answered")
            peer = conn.peer
        else:
            try:
                peer = self._peer(task_id)
            except KeyError:
                raise ProtocolError(f"/job:{task_id[0]}/task:{task_id[1]} is not in our cluster") from None
            conn.peer = peer
            peer.inbound.add(conn)
        if self._onesided is not None:  # agree on the transport; TransportError fails conn
            self._onesided.on_hello(conn, fields)
        if peer.incarnation is not None and peer.incarnation != incarnation:
            err = PeerLost(f"peer {peer.name} restarted (new incarnation)")
            err.__cause__ = ConnectionResetError(f"{peer.name} restarted")
            self._peer_lost(peer, err, keep=conn)
        peer.incarnation = incarnation
        peer.mode = str(fields.get("mode", ""))
        conn.ready = True
        waiter = conn.hello_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if peer.mode == "recv" and self.mode == "send":
            self._ask_holder(peer)

    def _ask_holder(self, peer: Peer) -> None:
        """Request what we already wait for from a peer we just learned holds its values."""
        for step, table in list(self._tables.items()):
            for key in table.keys_waiting():
                route = self._route(key)
                if route.src == peer.id:
                    missing = table.waiting(key) - len(self._outstanding.get((step, key), ()))
                    for _ in range(missing):
                        self._request(peer, step, route)

    def _on_data(self, conn: Connection, step: int, request_id: int, key: str, value: Any) -> None:
        peer = conn.peer
        assert peer is not None
        if request_id:
            request = self._requests.pop(request_id, None)
            if request is not None:
                pending = self._outstanding.get((step, key))
                if pending is not None:
                    try:
                        pending.remove(request_id)
                    except ValueError:
                        pass
                    if not pending:
                        del self._outstanding[(step, key)]
        route = self._route(key)
        if route.dst != self.id or route.src != peer.id:
            raise ProtocolError(f"{peer.name} sent key {key} to {self.name}; the key routes from "
                                f"/job:{route.src[0]}/task:{route.src[1]} to "
                                f"/job:{route.dst[0]}/task:{route.dst[1]} (cluster specs differ?)")
        table = self._tables.get(step)
        if table is None:
            if step in self._dead_steps:
                self._consumed(peer.id, value)  # dropped: the step is gone
                return
            table = self._tables[step] = Table()
        self._joined(step, peer)
        if table.put(key, value):
            self._consumed(peer.id, value)

    def _on_request(self, conn: Connection, step: int, request_id: int, key: str) -> None:
        route = self._route(key)
        if route.src != self.id:
            conn.write_frame(_codec.encode_error(
                request_id, step, key, "WrongEndpoint",
                f"{self.name} cannot answer a request for key {key}: its source is "
                f"/job:{route.src[0]}/task:{route.src[1]}"))
            return
        dead = self._dead_steps.get(step)
        if dead is not None or self._state == "closed":
            conn.write_frame(_codec.encode_error(request_id, step, key, "aborted",
                                                 dead or f"node {self.name} closed"))
            return
        table = self._table(step)
        assert conn.peer is not None
        self._joined(step, conn.peer)
        waiter = RemoteWaiter(self, conn, step, request_id, route)
        value = table.take_or_wait(key, waiter)
        if value is EMPTY:
            conn.parked[request_id] = waiter
        else:
            self._released_held(_nbytes(value))
            self._answer(conn, step, request_id, route, value)

    def _on_credit(self, conn: Connection, nbytes: int) -> None:
        peer = conn.peer
        if peer is None:
            return
        if nbytes == 0:  # the producer waits for credit we hold back in a batch
            peer.owe_now = True
            self._flush_credit_now(peer)
            return
        peer.credit = min(peer.credit + nbytes, self.push_window)
        peer.asked = False
        if peer.queue:
            self._pump(peer)

    def _on_error(self, conn: Connection, fields: dict[str, Any]) -> None:
        request_id = fields.get("req", 0)
        if not isinstance(request_id, int):  # int("x") would raise into the event loop
            raise ProtocolError(f"{self._peer_name(conn)} sent an ERROR frame whose request id "
                                f"is not a number: {fields!r}")
        request = self._requests.get(request_id)
        if request is None or request.peer is not conn.peer:
            return  # a stray answer, or about a request we did not send to this peer
        del self._requests[request_id]
        pending = self._outstanding.get((request.step, request.key))
        if pending is not None and request.id in pending:
            pending.remove(request.id)
        peer_name = self._peer_name(conn)
        message = str(fields.get("msg", ""))
        code = str(fields.get("code", ""))
        cause = RemoteError(message, peer_name, code)
        table = self._tables.get(request.step)
        if table is None:
            return
        cls: type[RvzError] = {"aborted": Aborted, "WrongEndpoint": WrongEndpoint}.get(code, RemoteError)

        def error() -> RvzError:
            exc = cls(f"{peer_name} could not answer key {request.key}: {message}")
            exc.__cause__ = cause
            return exc

        table.fail_waiters(request.key, error)

    # -- steps ---------------------------------------------------------------------------------

    def step(self, step_id: int) -> Step:
        """A view of this node bound to one step id."""
        return Step(self, step_id)

    async def cleanup_step(self, step_id: int, message: str | None = None) -> None:
        """Abort ``step_id`` here and on every node that took part in it."""
        text = message or f"step {step_id} was cleaned up by {self.name}"
        if step_id not in self._dead_steps:
            # A Send-Driven consumer waits for this step's keys without telling us, so every
            # peer we are connected to may be waiting on it: tell them all, not only the
            # peers we saw in this step (a receiver that never heard of it just records it).
            for peer in self._peers.values():
                if peer.live_connections():
                    self._joined(step_id, peer)
        self._abort_step(step_id, text, None, origin=None)
        for conn in list(self._conns):
            conn.flush()
        await asyncio.sleep(0)

    def _abort_step(self, step: int, message: str, cause: BaseException | None,
                    origin: Peer | None) -> None:
        if step in self._dead_steps:
            return
        if len(self._dead_steps) >= _DEAD_STEPS_MAX:
            del self._dead_steps[next(iter(self._dead_steps))]
        self._dead_steps[step] = message
        self._drop_table(step, message, cause)
        for key in [k for k in self._outstanding if k[0] == step]:
            for request_id in self._outstanding.pop(key):
                self._requests.pop(request_id, None)
        for peer in self._step_peers.pop(step, ()):
            if peer is origin:
                continue
            for conn in peer.live_connections()[:1]:
                conn.write_frame(_codec.encode_abort_step(step, message))

    def _drop_table(self, step: int, message: str, cause: BaseException | None) -> None:
        table = self._tables.pop(step, None)
        if table is None:
            return
        for key, value in table.abort(message, cause):
            route = self._route(key)
            if route.src == self.id and route.dst != self.id:
                self._released_held(_nbytes(value))
            elif route.src != self.id:
                self._consumed(route.src, value)


class Step:
    """``node.step(42)``: send and recv scoped to one step, and its clean-up."""

    def __init__(self, node: Node, step_id: int) -> None:
        self.node = node
        self.id = step_id

    async def send(self, key: Any, value: Any, *, mode: str | None = None,
                   timeout: float | None = None) -> None:
        await self.node.send(key, value, mode=mode, step=self.id, timeout=timeout)

    async def recv(self, key: Any, *, mode: str | None = None, timeout: float | None = None) -> Any:
        return await self.node.recv(key, mode=mode, step=self.id, timeout=timeout)

    async def cleanup(self, message: str | None = None) -> None:
        await self.node.cleanup_step(self.id, message)

    def __repr__(self) -> str:
        return f"<Step {self.id} of {self.node.name}>"

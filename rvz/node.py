"""A node of a cluster: the public API and the life cycle (options, start, close, steps,
the batch calls, stats), the heartbeat, and what the engine hands up.

The per-message work lives in the protocol engine (``rvz._fast.engine``): ``Core`` matches
keys in its per-step tables (``Core.table(step)``), runs both remote modes and counts
credit; ``Wire`` frames and coalesces what one connection sends.  This module is the shell
around it: everything that awaits, times out or spans several peers.  Connections,
dialling and links are ``rvz.links.Links``, a base class of ``Node``; the handshake's
verdicts are ``rvz.handshake``.  ``send`` and ``recv``, which every message passes through,
are compiled in ``Node``'s other base class (``rvz._fast.calls``) and hand their slow paths
back to this one.

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
  pushed to its consumer (``claim_timeout`` after the last request for its key, if any).
FIFO order per key holds within one mode; across modes on one key it is not guaranteed.

Everything this node sends a peer (pushes, requests, answers, credit) goes on one
connection, ``Peer.link``: one ordered stream per direction, coalesced per loop iteration
(a one-sided channel keeps its answers on the request's connection, see ``Core.answer``).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import os
import ssl as _ssl
import time
import warnings
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from threading import get_ident
from typing import TYPE_CHECKING, Any, Literal

from . import _impl
from .cluster import ClusterSpec, split_address
from .cluster import from_env as _cluster_from_env
from .connection import Connection
from .errors import (
    Aborted,
    AuthError,
    ConfigError,
    NodeClosed,
    PeerLost,
    ProtocolError,
    RemoteError,
    RvzError,
    TransportError,
    WrongEndpoint,
)
from .handshake import Handshake
from .links import Links
from .options import MIN_RATE, Options
from .poll import BusyPoll
from .runner import wait_for
from .types import KeyLike, Mode, NodeStats, PeerStats, SendValue, StepStats, TransportName, Value

log = logging.getLogger(__name__)

_codec = _impl.codec
_keys = _impl.keys
_table = _impl.table
_engine = _impl.engine
if TYPE_CHECKING:  # the annotated source; at run time, the variant _impl loaded
    from typing_extensions import Unpack

    from ._fast.calls import NodeCalls as _NodeCalls
    from .types import NodeOptions
else:
    _NodeCalls = _impl.calls.NodeCalls
EMPTY = _table.EMPTY
_seconds = _table.seconds  # a duration as a message says it
nbytes_of = _engine.nbytes_of

# A peer needs one or two connections (each side may dial); a few more cover reconnects
# whose old connection is not known dead yet.  More is a peer holding sockets open.
_MAX_INBOUND_PER_PEER = 8
_ABORT_TEXT_MAX = 1024  # characters of a peer's step clean-up message that are kept

TaskId = tuple  # (job, task)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def certificate_names(job: str, task: int) -> set[str]:
    """The names a TLS certificate may give a task with ``tls_identity``: as a CN or a DNS
    or URI subject alternative name, ``/job:worker/task:2`` or ``worker-2``."""
    return {f"/job:{job}/task:{task}", f"{job}-{task}"}


def _certificate_names(cert: dict[str, Any]) -> list[str]:
    """The CNs of a certificate's subject and its DNS and URI alternative names, as
    ``ssl.SSLSocket.getpeercert()`` decodes them."""
    names = [value for rdn in cert.get("subject", ()) for name, value in rdn
             if name == "commonName"]
    names += [value for kind, value in cert.get("subjectAltName", ()) if kind in ("DNS", "URI")]
    return names


# Seconds over which a repeated event (a refused connection) is said in one line.
REPEAT_INTERVAL = 10.0


class _Repeats:
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
    """A held value pushed to its consumer left the push queue (``Node._push_oldest``)."""
    core.holding.released_held(peer, nbytes)


def _close_server(creating: asyncio.Future[Any]) -> None:
    """A server a cancelled or failed ``start()`` made after all: close it."""
    if not creating.cancelled() and creating.exception() is None:
        creating.result().close()


def _observe(future: asyncio.Future[Any]) -> None:
    """Mark a finished future's exception as seen (its failure is reported elsewhere)."""
    if not future.cancelled():
        future.exception()


class _Inherited:
    """A connection's transport in a child forked from the process that made it: the socket
    and the event loop's registration of it are the parent's, so nothing is written to the
    socket, and it is neither closed nor unwatched through the inherited loop (unwatching
    would unwatch it for the parent too).  The child's copy of the descriptor closes with
    the child."""

    def is_closing(self) -> bool:
        return True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def can_write_eof(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Callable[..., None]:
        return _ignore


def _ignore(*args: Any, **kwargs: Any) -> None:
    pass


# The nodes started in this process and not yet closed, for a forked child to disown.
_started: weakref.WeakSet[Node] = weakref.WeakSet()


def _disown_after_fork() -> None:
    """``os.register_at_fork(after_in_child=)``: the child's copies of running nodes are
    the parent's nodes, not its own (``Node._disown``)."""
    for node in list(_started):
        node._disown()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disown_after_fork)


class _EngineHost:
    """The node as its engine's host (``rvz._fast.host.Host``): the engine's calls upward,
    bound to the node's methods that answer them."""

    __slots__ = ("check_running", "start_link", "request_when_linked", "on_hello", "on_auth",
                 "on_error", "on_abort_step")

    def __init__(self, node: Node) -> None:
        self.check_running = node._check_running
        self.start_link = node._start_link
        self.request_when_linked = node._request_when_linked
        self.on_hello = node._on_hello
        self.on_auth = node._on_auth
        self.on_error = node._on_error
        self.on_abort_step = node._on_abort_step


if TYPE_CHECKING:
    from ._fast.host import Host

    def _checked_host(node: Node) -> Host:
        return _EngineHost(node)  # mypy holds _EngineHost to the Host protocol


class Node(_NodeCalls, Links):
    """One task of a cluster: ``async with Node(cluster, job, task, mode) as node``.

    ``connect_timeout`` bounds dialling a peer that is not up yet (retried with backoff);
    a peer that sends nothing (not even its ``heartbeat`` pings) for ``peer_timeout`` seconds
    is lost.  ``push_window`` bytes may be pushed to one consumer before it consumes them;
    ``hold_limit`` bytes of Recv-Driven values may wait for their consumers before ``send``
    waits (both count 64 bytes more per message); of the values held for consumers that are
    not connected (lost), ``lost_hold_limit`` bytes (default: ``hold_limit``) do not count
    for the sends to the others, so one lost consumer does not stall the live ones.
    ``linger`` bounds how long ``close()`` keeps serving held values.
    Up to ``recv_pool`` bytes of memory for large received arrays are kept and used again once
    every array on a block is gone (0: allocate each array anew).
    ``busy_poll`` > 0 keeps the event loop polling instead of sleeping while a recv waits on
    a peer, for up to that many seconds after the last such recv began: a CPU spins, and a
    small round trip no longer pays the wake-up of an idle one (see ``rvz.poll``).
    A large payload that has been arriving for more than ``peer_timeout`` must keep up
    ``min_rate`` bytes/s on average, or its connection is closed (0: no such bound).
    """

    def __init__(self, cluster: ClusterSpec | dict[str, Any], job: str, task: int,
                 mode: Mode = "recv", *, transport: TransportName = "tcp", host: str | None = None,
                 connect_timeout: float = 10.0, heartbeat: float = 1.0,
                 peer_timeout: float = 10.0, linger: float = 5.0,
                 push_window: int = 64 << 20, hold_limit: int = 256 << 20,
                 lost_hold_limit: int | None = None, claim_timeout: float | None = 2.0,
                 incarnation: int | None = None,
                 max_payload: int = _codec.DEFAULT_MAX_PAYLOAD, recv_pool: int = 256 << 20,
                 onesided: dict[str, Any] | None = None, secret: str | bytes | None = None,
                 ssl: _ssl.SSLContext | tuple[_ssl.SSLContext, _ssl.SSLContext] | None = None,
                 max_parked: int = 65536, max_steps: int = 65536, step_idle: float | None = 600.0,
                 hello_timeout: float = 10.0, max_unidentified: int = 64,
                 answer_backlog: int = 32 << 20, busy_poll: float = 0.0,
                 min_rate: int = MIN_RATE, tls_identity: bool = False) -> None:
        o = Options(mode=mode, transport=transport, host=host, connect_timeout=connect_timeout,
                    heartbeat=heartbeat, peer_timeout=peer_timeout, linger=linger,
                    push_window=push_window, hold_limit=hold_limit,
                    lost_hold_limit=lost_hold_limit, claim_timeout=claim_timeout,
                    incarnation=incarnation, max_payload=max_payload, recv_pool=recv_pool,
                    onesided=onesided, secret=secret, ssl=ssl, max_parked=max_parked,
                    max_steps=max_steps, step_idle=step_idle, hello_timeout=hello_timeout,
                    max_unidentified=max_unidentified, answer_backlog=answer_backlog,
                    busy_poll=busy_poll, min_rate=min_rate, tls_identity=tls_identity)
        index = _keys.as_index(task)
        if index is None:  # "0", 0.0 and True too
            raise ConfigError(f"task must be an int, not {task!r}")
        self.cluster = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
        self.job = job
        self.task = index
        self.id: TaskId = (job, self.task)
        self.name = f"/job:{job}/replica:0/task:{self.task}"
        self.address = self.cluster.address(job, self.task)
        self._take_options(o)
        self._poll = None  # the BusyPoll of the running loop (start), if busy_poll
        # Memory for large received arrays, reused once the caller dropped them (0: none).
        self._recv_pool = _impl.recvpool.RecvPool(recv_pool) if recv_pool > 0 else None
        self.incarnation = (o.incarnation if o.incarnation is not None
                            else int.from_bytes(os.urandom(8), "little"))
        self._state = "new"
        self._starting = False  # a start() is under way (``start``)
        self._close_cause: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tick_handle: asyncio.TimerHandle | None = None
        # The protocol engine: tables, routes, requests, credit (see rvz/_fast/engine.py).
        self._core = _engine.Core(_EngineHost(self), self.cluster, self.id, self.name, mode, None,
                                  push_window, hold_limit, claim_timeout, max_parked,
                                  max_steps, answer_backlog, lost_hold_limit)
        self.lost_hold_limit = self._core.holding.lost_hold_limit  # (None: the core's default)
        self._conns: set[Connection] = set()
        self._dials: dict[TaskId, asyncio.Future[Connection]] = {}  # task -> the dial under way
        # Connections accepted by a TLS node and still in their TLS handshake: not in
        # ``_conns`` yet, but counted as unidentified (``_unidentified``).
        self._handshaking: set[Connection] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._deliveries: set[asyncio.Task[Any]] = set()  # the tasks close() must wait for
        # One-sided transports (rvz.onesided): options, and the hub start() opens for them.
        self._onesided_options = onesided
        self._onesided: Any = None
        self._closing_pushes: list[Any] = []
        self._repeats = _Repeats()  # events that may repeat many times a second, logged in sum
        self._said_bye = False  # close() said BYE: a connection made since says it at once
        # HELLO and AUTH: their verdicts, and the incarnations newer ones replaced.
        self._handshake = Handshake(self.id, self.incarnation, o.secret,
                                    default_window=push_window, default_parks=_impl.peers.DEFAULT_PARKS,
                                    in_cluster=self._in_cluster)
        # The pid of the process this node was started in, when this is a child forked
        # from it (``_disown``); None otherwise.
        self._forked_from: int | None = None

    def _take_options(self, o: Options) -> None:
        """Each checked option as the attribute of its name (the secret only in the
        handshake, the TLS contexts as the server's and the client's)."""
        self.mode = o.mode
        self.transport: str = o.transport  # onesided.Host declares it a str
        self._host = o.host
        self._ssl_server, self._ssl_client = o.ssl_server, o.ssl_client
        self.tls_identity = bool(o.tls_identity)
        self.max_parked = o.max_parked
        self.max_steps = o.max_steps
        self.step_idle = o.step_idle
        self.hello_timeout = o.hello_timeout
        self.max_unidentified = o.max_unidentified
        self.min_rate = o.min_rate
        self.answer_backlog = o.answer_backlog
        self.connect_timeout = o.connect_timeout
        self.heartbeat = o.heartbeat
        self.peer_timeout = o.peer_timeout
        self.linger = o.linger
        self.push_window = o.push_window
        self.hold_limit = o.hold_limit
        self.claim_timeout = o.claim_timeout
        self.max_payload = o.max_payload
        self.busy_poll = o.busy_poll

    # the engine's state, read by the one-sided hub and by tests
    @property
    def _peers(self) -> dict[TaskId, Any]:
        return self._core.peers

    @property
    def _tables(self) -> dict[int, Any]:
        return self._core.steps.tables

    @property
    def _held_bytes(self) -> int:
        return int(self._core.holding.held_bytes)

    @property
    def _held_count(self) -> int:
        return int(self._core.holding.held_count)

    @classmethod
    def from_env(cls, **options: Unpack[NodeOptions]) -> Node:
        """A node for this process's task, from ``TF_CONFIG`` or from ``RVZ_CLUSTER`` (JSON),
        ``RVZ_JOB`` and ``RVZ_TASK`` (see ``rvz.cluster.from_env``); ``options`` are the
        other ``Node`` arguments."""
        cluster, job, task = _cluster_from_env()
        return cls(cluster, job, task, **options)

    # -- life cycle ---------------------------------------------------------------------------

    def _set_state(self, new: str) -> None:
        allowed = {"new": ("running", "closed"), "running": ("closing", "closed"),
                   "closing": ("closed",), "closed": ()}
        if new not in allowed[self._state]:
            raise RvzError(f"node {self.name}: cannot go from {self._state} to {new}")
        self._state = new
        self._core.set_running(new == "running")

    async def start(self) -> Node:
        """Listen on this task's address and start the heartbeat."""
        # Before anything is bound: a second start() must leave the running node alone, and
        # a closed node cannot come back (make a new one).  A start() that failed (the port
        # was taken) left the node new: it may be tried again.
        if self._state != "new":
            raise RvzError(f"node {self.name} is {self._state}: start() runs once, on a new node"
                           + ("" if self._state == "running" else "; create a new Node"))
        if self._starting:
            raise RvzError(f"node {self.name} is already starting")
        self._starting = True
        try:
            return await self._start()
        finally:
            self._starting = False

    async def _start(self) -> Node:
        self._loop = asyncio.get_running_loop()
        self._core.attach(self._loop, get_ident())
        if self.busy_poll:
            self._poll = BusyPoll(self._loop, self.busy_poll)
        host, port = split_address(self.address)
        if self._host is not None:
            host = self._host
        if self.transport != "tcp" and self._onesided is None:
            from .onesided.hub import Hub  # TransportError here names what is missing
            self._onesided = Hub(self, self._onesided_options)
        # With TLS the server accepts plain TCP and starts TLS itself (``TlsAccept``): a
        # connection counts against max_unidentified from accept(), before its handshake.
        creating = asyncio.ensure_future(self._loop.create_server(
            self._accepted, host, port, reuse_address=True))
        try:
            # Shielded: asyncio's create_server yields once after it has bound, and a cancel
            # landing there would lose the listening server.  Cancelled, we close it instead.
            self._server = await asyncio.shield(creating)
        except BaseException as exc:
            creating.add_done_callback(_close_server)
            if self._onesided is not None:  # its completion queues are on this loop
                self._onesided.close()
                self._onesided = None
            if isinstance(exc, OSError):
                raise TransportError(f"node {self.name} cannot listen on {host}:{port}: "
                                     f"{exc.strerror or exc}") from exc
            raise
        self._set_state("running")
        _started.add(self)
        self._tick_handle = self._loop.call_later(self.heartbeat, self._tick)
        if not self._handshake.has_secret and not _is_loopback(host):
            log.warning("%s listens on %s without a secret: any process that reaches the port "
                        "can send, receive and abort steps (see docs/security.md)",
                        self.name, host)
        return self

    def __del__(self, _warn: Any = warnings.warn) -> None:
        # As asyncio does for its transports: a node dropped while running held sockets (and
        # on shm, shared memory) that only close() gives back in order.
        if getattr(self, "_state", "new") in ("running", "closing"):
            _warn(f"unclosed node {self.name} ({self.address}): use `async with rvz.Node(...)` "
                  "or await node.close()", ResourceWarning, source=self)

    def _disown(self) -> None:
        """In a child forked from the process that started this node (``os.fork`` with the
        node running): its sockets, pipes, shared memory and event-loop registrations are
        the parent's, and a write or a close here would corrupt or cut the parent's
        connections.  The child's copy is marked closed and cut loose from all of them:
        every call fails with ``RuntimeError``, ``close()``, ``abort()`` and leaving
        ``async with`` touch nothing, and the heartbeat stops."""
        if self._state not in ("running", "closing"):
            return
        self._forked_from = self._core.pid
        self._state = "closed"
        self._core.stop(forked=True)
        # The parent's transports stay referenced here: collected, a uvloop transport would
        # close its handle through the inherited loop.
        self._parents = [conn.hand_back(_Inherited()) for conn in self._conns]
        self._server = None
        self._onesided = None
        self._tasks = set()
        self._deliveries = set()

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
                err = NodeClosed(self._closed_text(self._close_cause, "is closed") + where)
            elif self._state == "new":
                err = RvzError(f"node {self.name} is not started{where}: use `async with "
                               "rvz.Node(...) as node` or `await node.start()` first")
            else:
                # close() is under way: code that catches Aborted (or NodeClosed) at shutdown
                # must catch this call too, and a batch that was waiting when it began.
                err = NodeClosed(f"node {self.name} is closing{where}")
            raise err from self._close_cause

    def _check_empty_batch(self, step: int) -> None:
        """An empty batch does nothing, but fails as any call would on a node that is not
        running or a step that was cleaned up (or an id that is no step)."""
        self._check_running()
        table = self._core.steps.table(step)
        if table.aborted:
            raise table.aborted_error("")

    def _entry(self, timeout: float | None) -> None:
        """Checks every public call makes: the calling thread and the timeout (``send`` and
        ``recv`` have the engine make them in the same call as the rest)."""
        self._core.enter(timeout)

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

    # -- introspection ------------------------------------------------------------------------

    def __repr__(self) -> str:
        peers = sum(1 for p in self._core.peers.values() if p.live_connections())
        return (f"<rvz.Node {self.name} at {self.address} {self._state} mode={self.mode} "
                f"transport={self.transport} peers={peers}>")

    def stats(self) -> NodeStats:
        """A snapshot of this node's state and counters, as plain data (see the README).

        ``peers`` maps each peer's name to its connection ``state`` (``"connected"``,
        ``"dialling"``, ``"idle"``), the ``transport`` in use, ``bytes_in``/``bytes_out``
        and ``messages_in``/``messages_out`` (values and control frames, however values
        were packed into frames) over its live connections, the push ``credit``
        it granted us, the ``owed`` credit we hold back, ``queued_pushes``, the requests it
        parked here (``parked_requests``), ours to it (``outstanding_requests``) and the
        Recv-Driven values we hold for it (``held_values``).
        ``steps`` maps each step with a table to its ``queued_values``, ``queued_keys``,
        ``waiting_recvs`` and ``waiting_keys``.  ``held`` counts the Recv-Driven values
        kept for remote consumers; ``waits`` how often a send (``producer``) or a recv
        (``consumer``) had to wait.  ``busy_poll`` (None when off) gives its ``budget`` and how
        many loop passes it kept awake (``spins``).
        """
        core = self._core
        outstanding: dict[Any, int] = {}
        for request in core.requests.by_id.values():
            outstanding[request.peer] = outstanding.get(request.peer, 0) + 1
        held = self._held_for()
        peers: dict[str, PeerStats] = {}
        for peer in core.peers.values():
            conns = peer.live_connections()
            ready = [c for c in conns if c.ready]
            state: Literal["connected", "dialling", "idle"]
            if ready:
                state = "connected"
            elif conns or self._dialling(peer):
                state = "dialling"
            else:
                state = "idle"
            peers[peer.name] = {
                "state": state,
                "transport": self.transport_for(peer.id) if ready else None,
                "incarnation": peer.incarnation,
                "mode": peer.mode or None,
                "bytes_in": sum(int(c.decoder.bytes_in) for c in conns),
                "bytes_out": sum(int(c.bytes_out) for c in conns),
                "messages_in": sum(int(c.decoder.frames) for c in conns),
                "messages_out": sum(int(c.frames_out) for c in conns),
                "credit": int(peer.credit),
                "owed": int(peer.owed),
                "unreturned": int(peer.unreturned),
                "arriving": int(peer.arriving),
                "window": int(peer.window),
                "queued_pushes": len(peer.queue),
                "parked_requests": sum(len(c.parked) for c in conns),
                "deferred_answers": sum(len(c.deferred) for c in conns),
                "outstanding_requests": outstanding.get(peer, 0),
                "held_back_requests": sum(1 for r in peer.held_back
                                          if core.requests.by_id.get(r.id) is r),
                "held_values": held.get(peer, 0),
            }
        steps: dict[int, StepStats] = {}
        for step, table in core.steps.tables.items():
            keys_queued, queued, keys_waiting, waiting = table.counts()
            if not (keys_queued or keys_waiting):
                continue  # a table that holds nothing is as good as gone (Steps.empty_steps)
            steps[step] = {"queued_values": queued, "queued_keys": keys_queued,
                           "waiting_recvs": waiting, "waiting_keys": keys_waiting}
        return {
            "node": self.name, "address": self.address, "state": self._state,
            "mode": self.mode, "transport": self.transport,
            "implementation": _impl.implementation(),
            "peers": peers, "steps": steps,
            "held": {"values": int(core.holding.held_count), "bytes": int(core.holding.held_bytes)},
            "waits": {"producer": int(core.waits_producer), "consumer": int(core.waits_consumer)},
            "dead_steps": len(core.steps.dead_steps),
            "unidentified": self._unidentified(),
            "recv_pool": self._recv_pool.stats() if self._recv_pool is not None else None,
            "busy_poll": ({"budget": self.busy_poll, "spins": self._poll.spins}
                          if self._poll is not None else None),
        }

    # -- close ----------------------------------------------------------------------------------

    async def close(self) -> None:
        """Graceful close: deliver what was sent, then say BYE and close.

        Pushes already accepted are flushed, and Recv-Driven values still held for remote
        consumers are pushed to them (their recvs find them in their own tables), in both
        cases for at most ``linger`` seconds.  What cannot be delivered by then is dropped
        and counted in one log line.  A close() that is cancelled (an ``asyncio.wait_for``
        around it timed out, say) closes the rest at once, as ``abort()`` does.
        """
        if self._forked_from is not None:
            return  # the parent's node: nothing of it is this child's to close (_disown)
        self._entry(None)  # from another thread it raises RuntimeError and changes nothing
        if self._state in ("new", "closed"):
            self._state = "closed"
            self._core.stop()
            return
        if self._state == "closing":
            while self._state != "closed":
                await asyncio.sleep(0.01)
            return
        self._set_state("closing")
        try:
            await self._close_gracefully()
        except BaseException as exc:
            # Left half-closed, the node would keep its server, its heartbeats and its
            # connections, and every later close() (``async with``'s own) would wait forever.
            why = ("close() was cancelled" if isinstance(exc, asyncio.CancelledError)
                   else f"close() failed: {exc!r}")
            self.abort(NodeClosed(f"node {self.name}: {why}"))
            raise

    async def _close_gracefully(self) -> None:
        core = self._core
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.linger
        self._closing_pushes = self._push_held()
        # Not every background task: a dial retrying toward a dead peer would hold the close
        # for the whole linger although it delivers nothing.
        while loop.time() < deadline and (core.holding.held_count or self._deliveries or any(
                p.queue for p in core.peers.values()) or (
                self._onesided is not None and self._onesided.busy())):
            await asyncio.sleep(min(0.005, max(0.0, deadline - loop.time())))
            if self._state == "closed":
                return  # abort() was called meanwhile: it closed everything
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            if not conn.closed and conn.ready:
                core.credit.flush_credit_now(conn.peer)
        # BYE on every open connection, those still in their handshake too.  Ours is not
        # complete until we read the peer's HELLO, but the peer completes its own when it
        # reads ours (sent at connection_made), and from then on it takes an end without BYE
        # for a lost peer: it fails every connection to us, among them the one still
        # carrying the values pushed above.  BYE after our HELLO is always in order; a peer
        # whose own handshake is not complete either (it waits for our AUTH) refuses it as a
        # protocol error, on a connection it never counted ready: that fails nothing else.
        self._said_bye = True
        for conn in list(self._conns):
            if not conn.closed:
                self._say_bye(conn)
        for conn in list(self._conns):
            if not conn.closed:
                try:
                    await wait_for(conn.drain(), max(0.05, deadline - loop.time()))
                except (asyncio.TimeoutError, RvzError):
                    pass
                conn.close()
        # conn.close() only half-closes: wait until each peer has read everything and closed
        # its side (a silent peer for at most peer_timeout), then cut what is left.
        handshake = loop.time() + self.peer_timeout
        while any(c.closed_here and not c.closed for c in self._conns) and loop.time() < handshake:
            await asyncio.sleep(0.005)
        if self._state == "closed":
            return  # aborted while the peers read to the end
        cause = NodeClosed(f"node {self.name} was closed")
        for conn in list(self._conns):
            if not conn.closed:
                conn.fail(cause)
        # Counted once: still queued now, or pushed at close and already failed.
        undelivered = sum(len(p.queue) for p in core.peers.values()) + sum(
            1 for d in self._closing_pushes
            if d.done() and not d.cancelled() and d.exception() is not None)
        self._finish(cause)
        if undelivered:
            log.warning("%s: closed after a linger of %ss with %d values undelivered",
                        self.name, self.linger, undelivered)
        # Give the transports one iteration to run their close callbacks.
        await asyncio.sleep(0)

    def _say_bye(self, conn: Connection) -> None:
        """Write BYE as ``conn``'s last frame.  Nothing may follow it: the peer's decoder
        takes any frame after BYE as a protocol error, and fails every connection to us.
        A dial, a request or a credit finishing while close() drains would write one, so
        the connection counts as closed here from now on (its writes are dropped)."""
        conn.say_bye()

    def abort(self, exc: BaseException | None = None) -> None:
        """Close at once: every pending and later operation fails with ``NodeClosed`` (an
        ``Aborted``) whose ``__cause__`` is ``exc``.  From another thread, schedule it on
        the node's loop (``loop.call_soon_threadsafe(node.abort)``)."""
        if self._forked_from is not None:
            return  # the parent's node (_disown)
        self._entry(None)
        if self._state == "closed":
            return
        cause = exc if exc is not None else NodeClosed(f"node {self.name} was aborted")
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.fail(cause)
        self._finish(cause)

    def _finish(self, cause: BaseException) -> None:
        _started.discard(self)
        core = self._core
        self._close_cause = cause
        self._state = "closed"
        core.stop()
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        self._repeats.flush(force=True)
        message = f"node {self.name} closed"
        for step in list(core.steps.tables):
            self._drop_table(step, message, cause, NodeClosed)
        for peer in core.peers.values():
            self._fail_queued_pushes(peer, lambda key: self._closed_error(cause))
        for waiter in core.holding.hold_waiters:
            if not waiter.done():
                waiter.set_exception(self._closed_error(cause))
        core.holding.hold_waiters.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._onesided is not None:
            self._onesided.close()  # pool blocks under live arrays stay until those die

    def _closed_error(self, cause: BaseException) -> NodeClosed:
        err = NodeClosed(self._closed_text(cause, "closed"))
        err.__cause__ = cause
        return err

    def _closed_text(self, cause: BaseException, how: str) -> str:
        """Why this node is closed: the node once, then the cause (ours names it already)."""
        text = str(cause)
        prefix = f"node {self.name}"
        return text if text.startswith(prefix) else f"{prefix} {how}: {text}"

    # -- send ----------------------------------------------------------------------------------

    # send and recv, the per-message calls, are compiled (rvz/_fast/calls.py); named here so
    # that they are documented as Node's own.
    send = _NodeCalls.send
    recv = _NodeCalls.recv

    async def send_many(self, items: Iterable[tuple[KeyLike, SendValue]], *,
                        mode: Mode | None = None, step: int = 0, timeout: float | None = None) -> None:
        """Send several ``(key, value)`` pairs in order, as ``send`` would one by one.

        Every key is checked first (``WrongEndpoint`` before anything is sent).  Pushes to
        one consumer leave in one write.  If the call times out or is cancelled while one
        item waits for backpressure, the items before it were sent and the rest were not.
        """
        self._entry(timeout)
        batch = list(items)
        core = self._core
        core.check_routes([item[0] for item in batch], True)
        if not batch:
            self._check_empty_batch(step)
            return
        assert self._loop is not None
        end = None if timeout is None or self._loop is None else self._loop.time() + timeout
        start = 0
        while True:
            blocked = core.send_many(batch, mode, step, start)
            if blocked is None:
                return
            index, pending = blocked
            left = None if end is None else max(0.0, end - self._loop.time())
            await self._send_wait(pending, step, left, timeout)
            start = index + 1

    async def _send_wait(self, pending: Any, step: int, timeout: float | None,
                         total: float | None = None) -> None:
        """The rest of a send that could not complete at once (see ``Core.send``)."""
        said = timeout if total is None else total
        if isinstance(pending, tuple):  # Recv-Driven: wait for room under hold_limit
            route, value, nbytes, peer = pending
            core = self._core
            assert self._loop is not None
            end = None if timeout is None else self._loop.time() + timeout
            mine = core.holding.reserve_hold(peer, nbytes)
            try:
                # The step's table is looked up again after every wait: an empty one is
                # dropped at a heartbeat, and the request of the consumer that then asks
                # parks in the new one (kept, the old one hid it, and took the value where
                # no recv looks: both sides waited for ever).
                while core.hold_full(core.steps.table(step), route, nbytes, mine):
                    left = None if end is None else max(0.0, end - self._loop.time())
                    try:
                        if peer.unconnected():
                            # Room comes when consumers fetch.  Ours is dialled, as a
                            # Send-Driven recv's producer is, so that one gone (or never
                            # up) fails the send with PeerLost within connect_timeout
                            # instead of leaving it waiting for ever; a lost connection
                            # wakes us to look again (``_peer_lost``).
                            await wait_for(self._link(peer, route.text), left)
                            continue
                        await self._wait(core.holding.hold_waiters, left, "hold limit")
                    except (TimeoutError, asyncio.TimeoutError):
                        raise TimeoutError(f"send of {route.text} to {peer.name} timed out "
                                           f"after {_seconds(said)}s (hold limit: values not yet "
                                           f"fetched{self._held_summary()})") from None
            except BaseException:
                core.holding.wake_holders()  # the sends behind it look again (once ``finally`` ran)
                raise
            finally:
                core.holding.unreserve_hold(peer, mine)
            core.hold(core.steps.table(step), step, route, value, nbytes)
            return
        # A Send-Driven push waiting in its peer's queue (for the link, credit or socket).
        # A cancelled or timed-out push is cancelled, and leaves the queue at once.
        done = pending
        if done.done():
            return done.result()
        try:
            if timeout is None:
                await done
            else:
                await wait_for(done, timeout)
        except BaseException as exc:
            # Left in the queue behind a push that still waits (a send without a timeout,
            # say), each abandoned push would keep its value there until that one went:
            # a producer retrying on a timeout grew the queue by one value a try.
            dropped = self._core.credit.drop_push(done) if done.cancelled() else None
            if not isinstance(exc, asyncio.TimeoutError):
                raise
            what = (f"send of {dropped[1][2].text} to {dropped[0].name}"
                    if dropped is not None else "send")
            raise TimeoutError(f"{what} timed out after {_seconds(said)}s "
                               "(connection, push window or socket)") from None

    def _held_for(self) -> dict[Any, int]:
        """How many Recv-Driven values this node holds for each remote consumer."""
        held: dict[Any, int] = {}
        for _, table, route in self._held_keys():
            held[route.peer] = held.get(route.peer, 0) + table.queued(route.text)
        return held

    def _held_summary(self) -> str:
        """``"; held for <peer> (<state>): <n> values, ..."``, the three holding most: who
        fills hold_limit, when a send times out waiting for room (a consumer that is gone
        keeps its values held for its next incarnation, and they count).  From each
        consumer's count of what it holds against hold_limit, not from a walk of every key
        held: each send that times out says it (100k keys held took each 0.2-0.5 s)."""
        held = sorted(((peer, peer.held_count) for peer in self._core.peers.values()
                       if peer.held_count > 0), key=lambda item: -item[1])
        if not held:
            return ""
        parts = [f"{peer.name} ({'not connected' if peer.unconnected() else 'connected'}): "
                 f"{count} values" for peer, count in held[:3]]
        more = f" and {len(held) - 3} more consumers" if len(held) > 3 else ""
        return "; held for " + ", ".join(parts) + more

    async def _wait(self, waiters: deque[asyncio.Future[None]], timeout: float | None,
                    what: str) -> None:
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            if timeout is None:
                await waiter
            else:
                await wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what}: timed out after {_seconds(timeout)}s") from None
        finally:
            try:
                waiters.remove(waiter)
            except ValueError:
                pass

    # -- recv ----------------------------------------------------------------------------------

    async def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None, step: int = 0,
                        timeout: float | None = None) -> list[Value]:
        """Receive the next value of each key, in the order of ``keys`` (a key may repeat).

        All or nothing: on a timeout, a cancellation or an error, every value the batch had
        already taken goes back to the head of its key's queue, in order, and nothing is
        lost.  Every key is checked first (``WrongEndpoint`` before anything is taken).
        Recv-Driven, one request frame goes to each producer for all of its keys.
        """
        self._entry(timeout)
        core = self._core
        routes = core.check_routes(list(keys), False)
        if not routes:
            self._check_empty_batch(step)
            return []
        got = core.take_many(routes, step)
        if type(got) is list:
            return got
        return await self._recv_many_wait(got, routes, mode, step, timeout)

    async def _recv_many_wait(self, batch: Any, routes: list[Any], mode: str | None, step: int,
                              timeout: float | None) -> list[Any]:
        core = self._core
        loop = self._loop
        assert loop is not None
        waiting = batch.wait()
        try:
            asks, dial = core.ask_many(waiting, routes, mode, step)
        except BaseException:
            self._undo_batch(batch)
            raise
        for peer, text in dial.items():  # one link task a producer, not one a key
            self._spawn(self._link(peer, text))  # to notice if it is gone
        for peer, requests in asks.items():
            if not core.requests.send_asks(peer, requests):
                self._request_when_linked(requests)
        poll = self._poll
        if poll is not None and any(routes[i].peer is not None for i in waiting):
            poll.begin()
        else:
            poll = None
        try:
            return await _table.wait_batch(batch, loop, timeout, self._unconsume,
                                           functools.partial(self._batch_where, step))
        finally:
            if poll is not None:
                poll.end()
            if asks and not loop.is_closed():  # (closed: see NodeCalls.recv)
                table = batch.table
                for text in {routes[i].text for i in waiting}:
                    core.requests.rebalance(step, text, table)

    def _batch_where(self, step: int, keys: list[str]) -> str:
        """What a recv_many's timeout adds to name where it waited: the step and the
        producers of the keys still missing."""
        routes = [self._core.routes.route(key) for key in keys]
        peers = sorted({route.peer.name for route in routes if route.peer is not None})
        shown = ", ".join(peers[:3]) + (f" and {len(peers) - 3} more" if len(peers) > 3 else "")
        return (f" in step {step}" if step else "") + (f" from {shown}" if peers else "")

    def _undo_batch(self, batch: Any) -> None:
        """Give a batch's values back, oldest first, before it ever waited."""
        if not batch.future.done():
            batch.future.cancel()
        self._unconsume(batch.restore())

    def _unconsume(self, pairs: list[tuple[str, Any]]) -> None:
        """Values from peers went back to their queues: their consumption is undone."""
        core = self._core
        for key, value in pairs:
            route = core.routes.route(key)
            if route.peer is not None:
                core.unconsumed(route.src, value)

    # -- background tasks and the heartbeat ------------------------------------------------------

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
                log.error("%s: background task failed", self.name, exc_info=exc)

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
                conn.fail(ProtocolError(f"a payload from {self._peer_name(conn)} has taken over "
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

    # -- frames the engine hands up ------------------------------------------------------------

    def _in_cluster(self, task_id: TaskId) -> bool:
        try:
            self.cluster.address(*task_id)
        except KeyError:
            return False
        return True

    def _peer_name(self, conn: Connection) -> str:
        return conn.peer.name if conn.peer is not None else "an unidentified peer"

    def _on_hello(self, conn: Connection, fields: dict[str, Any]) -> None:
        """The peer's HELLO: accepted now, or answered with our AUTH (rvz.handshake)."""
        self._handshake.hello_on(self._core, conn, fields, self._accept_peer)

    def _on_auth(self, conn: Connection, fields: dict[str, Any]) -> None:
        """The peer's proof that it holds the secret, bound to this connection's nonces."""
        self._handshake.auth_on(conn, fields, self._accept_peer)

    def _accept_peer(self, conn: Connection) -> None:
        """The handshake is complete: bind the connection to its peer and open it."""
        hello = conn.hello
        incarnation, window = hello.incarnation, min(hello.window, self.push_window)
        peer = conn.peer
        self._check_certificate(conn, peer)
        self._handshake.check_replaced(
            peer.id, incarnation, peer.incarnation,
            any(c.ready and not c.bye_received for c in peer.live_connections()))
        if not conn.outbound:
            if len([c for c in peer.inbound if not c.closed]) >= _MAX_INBOUND_PER_PEER:
                raise ProtocolError(f"{peer.name} opened more than {_MAX_INBOUND_PER_PEER} "
                                    "connections")
            peer.inbound.add(conn)
        if self._onesided is not None:  # agree on the transport; TransportError fails conn
            self._onesided.on_hello(conn, hello.fields)
        if peer.incarnation != incarnation:
            self._replace_incarnation(peer, conn, incarnation, window)
        else:
            self._core.credit.resync(peer, conn, window)
        self._core.accepted(peer, conn, incarnation, hello.parks, hello.mode)
        if peer.link is None or peer.link.closed:
            # The first ready connection either side dialled carries our traffic: a push
            # to a consumer that dialled us need not wait for a dial of our own.
            self._link_ready(peer, conn)
        waiter = conn.hello_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if peer.mode == "recv" and self.mode == "send":
            self._ask_holder(peer)

    def _check_certificate(self, conn: Connection, peer: Any) -> None:
        """With ``tls_identity``, the peer's certificate must name the task it claims: its
        subject's CN or one of its DNS or URI subject alternative names is
        ``/job:<job>/task:<task>`` or ``<job>-<task>`` (``certificate_names``)."""
        if not self.tls_identity:
            return
        transport = getattr(conn, "transport", None)
        cert = transport.get_extra_info("peercert") if transport is not None else None
        wanted = certificate_names(*peer.id)
        names = _certificate_names(cert) if cert else []
        if not wanted.intersection(names):
            raise AuthError(f"{peer.name}'s TLS certificate does not name it (tls_identity): "
                            f"it names {sorted(names)[:8]}, not one of {sorted(wanted)}")

    def _replace_incarnation(self, peer: Any, conn: Connection, incarnation: int,
                             window: int) -> None:
        """``peer`` is a new process (``incarnation``), or a replaced one taken back: fail
        what depended on the one it replaces and drop everything kept for that one."""
        old = peer.incarnation
        if old is not None:
            self._handshake.replaced(peer.id, old)
            err = PeerLost(f"peer {peer.name} restarted (new incarnation)")
            err.__cause__ = ConnectionResetError(f"{peer.name} restarted")
            self._peer_lost(peer, err, keep=conn)
            self._core.steps.forget_dead_of(peer.id, old)
            self._drop_values_of(peer, old)
        self._core.new_incarnation(peer, window)  # nothing of the old process counts

    def _drop_values_of(self, peer: Any, incarnation: int) -> None:
        """Drop the values ``peer``'s replaced processes pushed here that nobody took.

        Called as its new incarnation is accepted, before any frame of that one is read, so
        every value from that task still queued came from a process that is gone.  Kept,
        a peer restarting again and again while nobody receives made the node hold up to a
        push window per incarnation, for ever.  Their steps' tables, empty now, go at the
        next heartbeats.  (A recv of such a value fails or times out as for any value a
        crashed process never sent.)"""
        core = self._core
        count = nbytes = 0
        for table in list(core.steps.tables.values()):
            for key in table.queued_keys():
                if core.routes.route(key).src != peer.id:
                    continue
                for _ in range(table.queued(key)):
                    nbytes += nbytes_of(table.take(key))
                    count += 1
        if count:
            self._repeats.log("replaced-values", logging.WARNING,
                              f"{self.name}: dropped {count} value(s) ({nbytes} bytes) that "
                              f"{peer.name} incarnation {incarnation:#x} pushed and nobody "
                              "received: a newer incarnation replaced it")

    def _ask_holder(self, peer: Any) -> None:
        """Request what we already wait for from a peer we just learned holds its values."""
        core = self._core
        for step, table in list(core.steps.tables.items()):
            for key in table.keys_waiting():
                route = core.routes.route(key)
                if route.src == peer.id:
                    core.ask_stuck(peer, step, route, table)

    def _on_error(self, conn: Connection, fields: dict[str, Any]) -> None:
        core = self._core
        if not conn.ready or (conn.outbound and fields.get("code") == "auth"):
            # A refused handshake says ERROR: before it is complete here, or after, when the
            # listener refused us (without a secret each side takes the other's HELLO as it
            # comes, so a dialler may already have taken the connection).
            if fields.get("code") == "auth":
                raise AuthError(f"{self._peer_name(conn)} refused this node: "
                                f"{str(fields.get('msg', ''))[:500]}")
            raise ProtocolError(f"{self._peer_name(conn)} sent an ERROR frame before "
                                "completing its handshake")
        request_id = fields.get("req", 0)
        if not isinstance(request_id, int):  # int("x") would raise into the event loop
            raise ProtocolError(f"{self._peer_name(conn)} sent an ERROR frame whose request id "
                                f"is not a number: {fields!r}")
        if request_id == 0 and fields.get("code") == "protocol":
            # It closes this connection for something we sent: not a broken link.  What it
            # did not acknowledge is not sent again (it would be refused again).
            core.credit.drop_unacked(conn.peer)
            conn.close_because(ProtocolError(f"{self._peer_name(conn)} closed the connection: "
                                             f"{str(fields.get('msg', ''))[:500]}"))
            return
        core.requests.asked_no_more(conn.peer, request_id)
        request = core.requests.by_id.get(request_id)
        if request is None:
            # One we cancelled: the producer dropped it (code "cancelled") or failed it
            # first; nothing of it follows.  Else a stray answer.
            core.requests.settled(conn.peer, request_id)
            return
        if request.peer is not conn.peer:
            return  # about a request we did not send to this peer
        core.requests.drop(request_id)
        peer_name = self._peer_name(conn)
        message = str(fields.get("msg", ""))
        code = str(fields.get("code", ""))
        cause = RemoteError(message, peer_name, code)
        table = core.steps.tables.get(request.step)
        if table is None:
            return
        cls: type[RvzError] = {"aborted": Aborted, "WrongEndpoint": WrongEndpoint}.get(code, RemoteError)

        def error() -> RvzError:
            # An abort leads with its step and who cleaned it up, as a Send-Driven recv's
            # does (cleanup_step); other failures lead with the producer that could not answer.
            exc = cls(f"{message} (key {request.key})" if cls is Aborted
                      else f"{peer_name} could not answer key {request.key}: {message}")
            exc.__cause__ = cause
            return exc

        table.fail_waiters(request.key, error)

    def _on_abort_step(self, conn: Connection, step: int, message: str) -> None:
        name = self._peer_name(conn)
        if step == 0:  # no node sends it (cleanup_step(0) is refused): a broken peer
            raise ProtocolError(f"{name} tried to abort step 0, the step of plain send/recv")
        # Kept for every dead step (up to Steps.dead_max of them): a peer's text is cut to a
        # length that names a reason, not one that fills memory.
        message = message[:_ABORT_TEXT_MAX]
        # Said once: a message relayed from node to node already names who started it.
        incarnation = conn.peer.incarnation if conn.peer is not None else None
        text = (message if " by /job:" in message
                else f"{message} (by {name}, incarnation {incarnation:#x})")
        self._abort_step(step, text, RemoteError(message, name), origin=conn.peer)

    # -- steps ---------------------------------------------------------------------------------

    def step(self, step_id: int) -> Step:
        """A view of this node bound to one step id."""
        return Step(self, step_id)

    def new_step(self) -> Step:
        """A step with a fresh random 64-bit id (never 0, none in use or dead here).

        A counter starts again at 1 when its process restarts, and the ids its earlier
        incarnation cleaned up stay dead on the other nodes; 64 random bits do not collide
        across restarts (TensorFlow names its steps the same way)."""
        core = self._core
        while True:
            step_id = int.from_bytes(os.urandom(8), "little")
            if step_id and step_id not in core.steps.tables and step_id not in core.steps.dead_steps:
                return Step(self, step_id)

    async def cleanup_step(self, step_id: int, message: str | None = None) -> None:
        """Abort ``step_id`` here and on every node that took part in it.

        Every pending and later send and recv of that step fails with ``Aborted``: a step
        id is dead for good once cleaned up, on every node it reached, so give each step
        its own id (a counter).  Step 0, where plain ``send``/``recv`` run, cannot be
        cleaned up (``ValueError``): it would break them for good.
        """
        if _impl.steps.step_id(step_id) == 0:
            raise ValueError("step 0 is the step of plain send/recv and cannot be cleaned up; "
                             "run work that may need a clean-up under node.step(n), n > 0")
        self._entry(None)
        self._check_running()  # (a closed node's steps are all gone: nothing to clean up)
        core = self._core
        # The step and who cleaned it up lead every message, a custom one too: code that
        # catches Aborted across many steps must be able to tell which one failed.
        text = f"step {step_id} was cleaned up by {self.name} (incarnation {self.incarnation:#x})"
        if message:
            text = f"{text}: {message}"
        if step_id not in core.steps.dead_steps:
            # A Send-Driven consumer waits for this step's keys without telling us, so every
            # peer we are connected to may be waiting on it: tell them all, not only the
            # peers we saw in this step (a receiver that never heard of it just records it).
            for peer in core.peers.values():
                if peer.live_connections():
                    core.steps.joined(step_id, peer)
        self._abort_step(step_id, text, None, origin=None)
        for conn in list(self._conns):
            conn.flush()
        await asyncio.sleep(0)

    def _abort_step(self, step: int, message: str, cause: BaseException | None,
                    origin: Any) -> None:
        core = self._core
        peers = core.steps.kill(step, message)
        if peers is None:
            return  # dead already
        self._drop_table(step, message, cause)
        core.steps.note_owner(step, peers, origin)
        for peer in core.peers.values():
            if peer.queue:  # Send-Driven sends of the step still waiting for credit or a link
                self._fail_queued_pushes(
                    peer, lambda key: _table.aborted_error(message, cause, key), step)
        core.requests.drop_outstanding(step)
        for peer in peers:
            peer.left_step(step)
            if peer is origin:
                continue
            for conn in peer.live_connections()[:1]:
                conn.write_frame(_codec.encode_abort_step(step, message))

    def _drop_table(self, step: int, message: str, cause: BaseException | None,
                    kind: type[Aborted] = Aborted) -> None:
        core = self._core
        table = core.drop_table(step)
        if table is None:
            return
        for key, value in table.abort(message, cause, kind):
            route = core.routes.route(key)
            if route.src == self.id and route.dst != self.id:
                core.holding.released_held(route.peer, nbytes_of(value))
            elif route.src != self.id:
                core.consumed(route.src, value)


class Step:
    """``node.step(42)``: send and recv scoped to one step, and its clean-up."""

    def __init__(self, node: Node, step_id: int) -> None:
        self.node = node
        self.id = _impl.steps.step_id(step_id)  # a bad id fails here, not at the first call

    async def send(self, key: KeyLike, value: SendValue, *, mode: Mode | None = None,
                   timeout: float | None = None) -> None:
        """``node.send`` on this step."""
        await self.node.send(key, value, mode=mode, step=self.id, timeout=timeout)

    async def recv(self, key: KeyLike, *, mode: Mode | None = None,
                   timeout: float | None = None) -> Value:
        """``node.recv`` on this step."""
        return await self.node.recv(key, mode=mode, step=self.id, timeout=timeout)

    async def send_many(self, items: Iterable[tuple[KeyLike, SendValue]], *,
                        mode: Mode | None = None, timeout: float | None = None) -> None:
        """``node.send_many`` on this step."""
        await self.node.send_many(items, mode=mode, step=self.id, timeout=timeout)

    async def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None,
                        timeout: float | None = None) -> list[Value]:
        """``node.recv_many`` on this step."""
        return await self.node.recv_many(keys, mode=mode, step=self.id, timeout=timeout)

    async def cleanup(self, message: str | None = None) -> None:
        """Abort this step here and on every node that took part in it."""
        await self.node.cleanup_step(self.id, message)

    def __repr__(self) -> str:
        return f"<Step {self.id} of {self.node.name}>"

"""A node of a cluster: the public API and the life cycle (options, start, close, steps,
the batch calls, stats).

The per-message work lives in the protocol engine (``rvz._fast.engine``): ``Core`` matches
keys in its per-step tables, runs both remote modes and counts credit through its parts;
``Wire`` frames and coalesces what one connection sends.  The node is the shell around it:
everything that awaits, times out or spans several peers, in parts that are its base
classes (``rvz.nodestate`` lists them): connections and dialling (``rvz.links``), what the
engine hands up (``rvz.peering``; the handshake's verdicts are ``rvz.handshake``), the
heartbeat (``rvz.heartbeat``), calls that must wait (``rvz.waiting``) and close
(``rvz.closing``).  ``send`` and ``recv``, which every message passes through, are
compiled in ``Node``'s first base class (``rvz._fast.calls``).

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
import ipaddress
import logging
import os
import ssl as _ssl
import warnings
from collections.abc import Awaitable, Callable, Iterable, Sequence
from threading import get_ident
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from . import _impl
from .closing import Closing
from .cluster import ClusterSpec, split_address
from .cluster import from_env as _cluster_from_env
from .connection import Connection
from .errors import (
    Aborted,
    ConfigError,
    NodeClosed,
    RvzError,
    TransportError,
)
from .handshake import Handshake
from .heartbeat import Heartbeat, Repeats
from .links import ERROR_KINDS, Links
from .nodestate import TaskId, started
from .options import MIN_RATE, Options
from .peering import Peering
from .poll import BusyPoll
from .types import KeyLike, Mode, NodeStats, PeerStats, SendValue, StepStats, TransportName, Value
from .waiting import Waiting

log = logging.getLogger(__name__)

_codec = _impl.codec
_keys = _impl.keys
_table = _impl.table
_engine = _impl.engine
_batches = _impl.batches
_NO_TRAFFIC = (0, 0, 0, 0)
_Buffer = TypeVar("_Buffer")  # an into= buffer: recv returns the caller's own object
if TYPE_CHECKING:  # the annotated source; at run time, the variant _impl loaded
    from typing_extensions import Unpack

    from ._fast.calls import NodeCalls as _NodeCalls
    from .types import NodeOptions
else:
    _NodeCalls = _impl.calls.NodeCalls
EMPTY = _table.EMPTY
_seconds = _table.seconds  # a duration as a message says it
nbytes_of = _engine.nbytes_of



def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _close_server(creating: asyncio.Future[Any]) -> None:
    """A server a cancelled or failed ``start()`` made after all: close it."""
    if not creating.cancelled() and creating.exception() is None:
        creating.result().close()


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


def _disown_after_fork() -> None:
    """``os.register_at_fork(after_in_child=)``: the child's copies of running nodes are
    the parent's nodes, not its own (``Node._disown``)."""
    for node in list(started):
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


class Node(_NodeCalls, Links, Peering, Heartbeat, Waiting, Closing):
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
    every array on a block is gone, and small received arrays (below 64 KiB) are kept, up to
    an eighth of that (8 MiB at most), and written over with a new value once nothing refers
    to them (0: allocate each array anew).
    ``busy_poll`` > 0 keeps the event loop polling instead of sleeping while a recv waits on
    a peer, for up to that many seconds after the last such recv began: a CPU spins, and a
    small round trip no longer pays the wake-up of an idle one (see ``rvz.poll``).
    A large payload that has been arriving for more than ``peer_timeout`` must keep up
    ``min_rate`` bytes/s on average, or its connection is closed (0: no such bound).
    Over ``shm`` and ``verbs`` a received array is the memory the peer wrote it into, lent
    until the array dies; ``shm_copy`` copies it out first, so that a peer writing where it
    should not cannot change it (docs/security.md).
    """

    def __init__(self, cluster: ClusterSpec | dict[str, Any], job: str, task: int,
                 mode: Mode = "recv", *, transport: TransportName = "tcp", host: str | None = None,
                 connect_timeout: float = 10.0, heartbeat: float = 1.0,
                 peer_timeout: float = 10.0, linger: float = 5.0,
                 push_window: int = 64 << 20, hold_limit: int = 256 << 20,
                 lost_hold_limit: int | None = None, claim_timeout: float | None = 2.0,
                 incarnation: int | None = None,
                 max_payload: int = _codec.DEFAULT_MAX_PAYLOAD, recv_pool: int = 256 << 20,
                 onesided: dict[str, Any] | None = None, shm_copy: bool = False,
                 secret: str | bytes | None = None,
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
                    onesided=onesided, shm_copy=shm_copy, secret=secret, ssl=ssl, max_parked=max_parked,
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
        self._errors = dict.fromkeys(ERROR_KINDS, 0)  # connections ended badly, lost peers
        self._closed_traffic = {}  # so that stats() counts a peer's traffic over reconnects
        self._repeats = Repeats()  # events that may repeat many times a second, logged in sum
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
        self.shm_copy = o.shm_copy

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
            if not creating.done():
                # Cancelled while it binds: wait for the bind (quick) and close what it
                # made, so that nothing listens once this start() has returned and the
                # next one finds the port free.  A second cancel stops the wait.
                try:
                    await asyncio.wait([creating])
                except asyncio.CancelledError:
                    pass
            if creating.done():
                _close_server(creating)
            else:
                creating.add_done_callback(_close_server)
            if self._onesided is not None:  # its completion queues are on this loop
                self._onesided.close()
                self._onesided = None
            if isinstance(exc, OSError):
                raise TransportError(f"node {self.name} cannot listen on {host}:{port}: "
                                     f"{exc.strerror or exc}") from exc
            raise
        self._set_state("running")
        started.add(self)
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
        were packed into frames) over all its connections so far, the push ``credit``
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
            closed = self._closed_traffic.get(peer, _NO_TRAFFIC)
            peers[peer.name] = {
                "state": state,
                "transport": self.transport_for(peer.id) if ready else None,
                "incarnation": peer.incarnation,
                "mode": peer.mode or None,
                "bytes_in": closed[0] + sum(int(c.decoder.bytes_in) for c in conns),
                "bytes_out": closed[1] + sum(int(c.bytes_out) for c in conns),
                "messages_in": closed[2] + sum(int(c.decoder.frames) for c in conns),
                "messages_out": closed[3] + sum(int(c.frames_out) for c in conns),
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
                "credit_stalls": int(peer.credit_stalls),
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
            "into": {"landed_bytes": core.into.landed, "copied_bytes": core.into.copied},
            "dead_steps": len(core.steps.dead_steps),
            "errors": dict(self._errors),
            "unidentified": self._unidentified(),
            "recv_pool": self._recv_pool.stats() if self._recv_pool is not None else None,
            "busy_poll": ({"budget": self.busy_poll, "spins": self._poll.spins}
                          if self._poll is not None else None),
        }

    # -- send ----------------------------------------------------------------------------------

    # send and recv, the per-message calls, are compiled (rvz/_fast/calls.py); named here so
    # that they are documented as Node's own.
    send = _NodeCalls.send
    if TYPE_CHECKING:  # what recv returns depends on into= (a buffer comes back as it went)
        @overload
        async def recv(self, key: KeyLike, *, mode: Mode | None = None, step: int = 0,
                       timeout: float | None = None, into: None = None) -> Value: ...
        @overload
        async def recv(self, key: KeyLike, *, mode: Mode | None = None, step: int = 0,
                       timeout: float | None = None, into: _Buffer) -> _Buffer: ...
        async def recv(self, key: KeyLike, *, mode: Mode | None = None, step: int = 0,
                       timeout: float | None = None, into: Any = None) -> Any:
            return await _NodeCalls.recv(self, key, mode=mode, step=step, timeout=timeout,
                                         into=into)
    else:
        recv = _NodeCalls.recv

    async def send_many(self, items: Iterable[tuple[KeyLike, SendValue]], *,
                        mode: Mode | None = None, step: int = 0, timeout: float | None = None) -> None:
        """Send several ``(key, value)`` pairs in order, as ``send`` would one by one.

        Every key and every value is checked first (``WrongEndpoint``, or ``TypeError`` for
        a value ``send`` would refuse, before anything is sent).  Pushes to one consumer
        leave in one write.  If the call times out or is cancelled while one item waits for
        backpressure, the items before it were sent and the rest were not.
        """
        self._entry(timeout)
        batch = list(items)
        core = self._core
        keys = [item[0] for item in batch]
        _batches.check_routes(core, keys, True)
        if not batch:
            self._check_empty_batch(step)
            return
        values = _batches.described(batch)
        assert self._loop is not None
        end = None if timeout is None or self._loop is None else self._loop.time() + timeout
        start = 0
        while True:
            blocked = _batches.send_many(core, keys, values, mode, step, start)
            if blocked is None:
                return
            index, pending = blocked
            left = None if end is None else max(0.0, end - self._loop.time())
            await self._send_wait(pending, step, left, timeout)
            start = index + 1

    # -- recv ----------------------------------------------------------------------------------

    @overload
    async def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None, step: int = 0,
                        timeout: float | None = None, into: None = None) -> list[Value]: ...
    @overload
    async def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None, step: int = 0,
                        timeout: float | None = None,
                        into: Sequence[Any | None]) -> list[Any]: ...
    async def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None, step: int = 0,
                        timeout: float | None = None,
                        into: Sequence[Any | None] | None = None) -> list[Any]:
        """Receive the next value of each key, in the order of ``keys`` (a key may repeat).

        All or nothing: on a timeout, a cancellation or an error, every value the batch had
        already taken goes back to the head of its key's queue, in order, and nothing is
        lost.  Every key is checked first (``WrongEndpoint`` before anything is taken).
        Recv-Driven, one request frame goes to each producer for all of its keys.

        ``into``: one buffer per key (None: a new value), as ``recv``'s; each value is
        copied into its buffer, and a value that fits none fails the whole batch.
        """
        self._entry(timeout)
        core = self._core
        routes = _batches.check_routes(core, list(keys), False)
        if into is not None:
            return await self._recv_many_into(routes, into, mode, step, timeout)
        if not routes:
            self._check_empty_batch(step)
            return []
        got = _batches.take_many(core, routes, step)
        if type(got) is list:
            return got
        return await self._recv_many_wait(got, routes, mode, step, timeout)

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
                core.credit.consumed_from(route.peer, nbytes_of(value))


class Step:
    """``node.step(42)``: send and recv scoped to one step, and its clean-up."""

    def __init__(self, node: Node, step_id: int) -> None:
        self.node = node
        self.id = _impl.steps.step_id(step_id)  # a bad id fails here, not at the first call

    async def send(self, key: KeyLike, value: SendValue, *, mode: Mode | None = None,
                   timeout: float | None = None) -> None:
        """``node.send`` on this step."""
        await self.node.send(key, value, mode=mode, step=self.id, timeout=timeout)

    @overload
    async def recv(self, key: KeyLike, *, mode: Mode | None = None,
                   timeout: float | None = None, into: None = None) -> Value: ...
    @overload
    async def recv(self, key: KeyLike, *, mode: Mode | None = None,
                   timeout: float | None = None, into: _Buffer) -> _Buffer: ...
    async def recv(self, key: KeyLike, *, mode: Mode | None = None,
                   timeout: float | None = None, into: Any = None) -> Any:
        """``node.recv`` on this step."""
        return await self.node.recv(key, mode=mode, step=self.id, timeout=timeout, into=into)

    async def send_many(self, items: Iterable[tuple[KeyLike, SendValue]], *,
                        mode: Mode | None = None, timeout: float | None = None) -> None:
        """``node.send_many`` on this step."""
        await self.node.send_many(items, mode=mode, step=self.id, timeout=timeout)

    @overload
    async def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None,
                        timeout: float | None = None, into: None = None) -> list[Value]: ...
    @overload
    async def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None,
                        timeout: float | None = None,
                        into: Sequence[Any | None]) -> list[Any]: ...
    async def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None,
                        timeout: float | None = None,
                        into: Sequence[Any | None] | None = None) -> list[Any]:
        """``node.recv_many`` on this step."""
        return await self.node.recv_many(keys, mode=mode, step=self.id, timeout=timeout,
                                         into=into)

    async def cleanup(self, message: str | None = None) -> None:
        """Abort this step here and on every node that took part in it."""
        await self.node.cleanup_step(self.id, message)

    def __repr__(self) -> str:
        return f"<Step {self.id} of {self.node.name}>"

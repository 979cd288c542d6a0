"""The one-sided engine: Send-Driven and Recv-Driven over any provider.

One ``Engine`` per provider and node owns the registered pool and the completion queues
(each watched by the event loop with ``add_reader`` and drained by its own handler);
one ``Channel`` per TCP connection that negotiated the provider carries the protocol.
Control messages (slot grants, destinations, metadata updates) travel as ONESIDED frames on
that TCP connection, in order with its REQUEST/CANCEL/ERROR frames; payloads travel
one-sided.  Everything a channel delivers enters the node exactly like a TCP DATA frame:
``Wire.deliver([(DATA, step, request_id, key, value, seq)])``, ``seq`` being the number
the producer gave the value (see ``layout.SLOT_HDR``).

A channel is made of parts, each owning its state in a module of its own: ``regions`` (the
memory the peer may write), ``grants`` (the slots granted to it), ``destinations`` (those
offered for our requests, with ``buffers``: a recv's ``into=`` buffer offered as one),
``delivery`` (what arrives), ``outbound`` (what we write) and
``control`` (the peer's control messages); ``layout`` holds the bytes they exchange.

Isolation: the memory a peer may write is a *region per peer*, carved only into that peer's
slots (``PeerRegions.arena``) and destinations (``PeerRegions.dest_arena``); the consumer's
own pool (``Engine.pool``), which holds copied and assembled values, is never described to
any peer (a recv's ``into=`` buffer is offered to one peer, over verbs, only while its request
is out: ``buffers``).  A completed write is handed to the application in place, as an array over the
slot or destination, which stays taken until that array dies (``Delivery``): a peer that
keeps writing where it was never granted could change it.  ``Node(shm_copy=True)`` copies
every value out of the peer's region into the pool first, so a peer can never touch an
array it already delivered.  Regions left empty are unregistered and the peer is told to
unmap them (``unmap``).

Send-Driven (``request_id == 0``): the consumer grants the producer *slots* per key
(``want`` -> ``slots``); the producer caches them per (peer, key) and writes header and
tensor into one slot with the slot's id as the immediate.  The consumer's completion
handler hands the slot to the table as an array (or a copy of it) and grants a fresh slot
of the same size: slots are the credits, so a producer never overruns; a slot lent as an
array counts against the budget until the array dies.  Values without a slot
wait in the producer's per-key queue, in order.  The memory registered for a channel's
slots (``PeerRegions.arena``, its chunks rounded to a page) never exceeds ``slot_budget``: a
``want`` that does not fit waits until slots come back (empty regions are then unregistered
to make room), and slots of keys idle for ``slot_idle`` seconds (or wanted elsewhere) are revoked
(``revoke`` -> ``rel``).  A value larger than the consumer's budget (advertised in HELLO)
goes in pieces through slots that fit it, and the consumer assembles it.

Recv-Driven (``request_id != 0``): before its REQUEST the consumer sends ``dest``: the
address of a destination array it allocated from its pool for the dtype/shape it saw last
on that key.  The producer writes the tensor straight into it.  When dtype or shape differ
(or the consumer knew nothing yet) the producer answers ``meta``; the consumer reallocates
and sends ``dest`` again (a re-ask).  A key's values, pushes and answers alike, wait in one
queue behind the first that cannot go yet (for slots, or for that re-ask), so FIFO order per
key holds even when a recv asks for a key whose pushes are still under way.

Small values (header + key + payload within one provider message) go as an inline
message, in order with the writes of the same endpoint.  The values of a key whose first
value was a push of at most ``tcp_max`` bytes (shm: 256 KiB; verbs: none) or an answer
of at most ``answer_tcp_max`` (shm: 64 KiB; at least one provider message; the consumer
offers no destination for a key it learned nothing of here) do not come here at all: they
stay on the TCP connection, compiled and coalesced (``Wire.goes_onesided`` in the engine).

Failures never escape into the event loop: a failed completion, an unreachable peer file,
a malformed control message or an exhausted pool fails the channel with
``TransportError``; its TCP connection is aborted, which fails every operation waiting on
that peer with ``PeerLost`` (whose ``__cause__`` is the ``TransportError``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING, Any, Protocol

from .. import _impl
from ..errors import ProtocolError, TransportError
from .control import ControlIn
from .delivery import Delivery
from .destinations import Destinations
from .grants import SlotGrants
from .outbound import Outbound
from .pool import Pool
from .provider import FAILED, RECV_MSG, RECV_WRITE, SEND_DONE, Provider
from .regions import PeerRegions, Target

if TYPE_CHECKING:
    from collections import deque

    from ..connection import Connection

log = logging.getLogger(__name__)

_codec = _impl.codec
_META_MAX = 1 << 16


class Host(Protocol):
    """What the one-sided transports read of the node that owns them (rvz.node.Node)."""

    name: str
    transport: str
    peer_timeout: float
    max_payload: int
    shm_copy: bool

    @property
    def _peers(self) -> dict[Any, Any]: ...


class Options:
    """Tunables of the one-sided transports (``Node(..., onesided={...})``)."""

    KNOWN = {"chunk_size", "pool_limit", "cqs", "max_slots", "slot_budget", "inline_max",
             "tcp_max", "pipe_size", "device", "port", "gid_index", "recv_depth", "send_depth",
             "grant_timeout", "slot_idle"}

    def __init__(self, values: dict[str, Any] | None = None) -> None:
        values = dict(values or {})
        unknown = set(values) - self.KNOWN
        if unknown:
            raise ValueError(f"unknown onesided option(s) {sorted(unknown)}; known: {sorted(self.KNOWN)}")
        self.chunk_size = int(values.get("chunk_size", 64 << 20))
        self.pool_limit = int(values.get("pool_limit", 16 << 30))
        self.cqs = int(values.get("cqs", 2))
        self.max_slots = int(values.get("max_slots", 8))
        self.slot_budget = int(values.get("slot_budget", 64 << 20))
        self.inline_max = values.get("inline_max")
        # The values of keys whose first push is at most this many bytes go over the TCP
        # connection (``Wire.goes_onesided``); None: the provider's ``tcp_max``; -1: none.
        self.tcp_max = values.get("tcp_max")
        if self.tcp_max is not None:
            self.tcp_max = int(self.tcp_max)
        self.pipe_size = int(values.get("pipe_size", 1 << 20))
        self.device = values.get("device")
        self.port = int(values.get("port", 1))
        self.gid_index = values.get("gid_index")
        self.recv_depth = int(values.get("recv_depth", 256))
        self.send_depth = int(values.get("send_depth", 256))
        self.grant_timeout = values.get("grant_timeout")
        self.slot_idle = float(values.get("slot_idle", 5.0))
        if self.cqs < 1 or self.max_slots < 1 or self.slot_budget < 1 or self.slot_idle <= 0:
            raise ValueError("onesided cqs, max_slots, slot_budget and slot_idle must be positive")



class Engine:
    """A provider's pool, completion queues and channels, for one node."""

    def __init__(self, node: Host, provider: Provider, options: Options) -> None:
        self.node = node
        self.provider = provider
        self.name = provider.name
        self.options = options
        self.loop: asyncio.AbstractEventLoop = asyncio.get_running_loop()
        self.pool = Pool(provider, options.chunk_size, options.pool_limit)
        self.needs_registered_source = provider.needs_registered_source
        # Node(shm_copy=True): every value written into our memory is copied out of it
        # before the application sees it, instead of being lent in place (``Delivery``).
        self.copy_out = bool(node.shm_copy)
        limit = provider.max_message
        if options.inline_max is not None:
            limit = min(limit, int(options.inline_max))
        self.inline_limit = limit
        self.tcp_max = options.tcp_max if options.tcp_max is not None else provider.tcp_max
        self.answer_tcp_max = min(self.tcp_max, max(provider.answer_tcp_max, limit))
        self.channels: dict[int, Channel] = {}
        self.meta: dict[str, tuple[int, tuple[int, ...], int]] = {}
        self._ep_ids = itertools.count(1)
        self._next_cq = 0
        self.cqs: list[Any] = []
        self.closed = False
        try:
            for _ in range(options.cqs):
                cq = provider.create_cq()
                self.cqs.append(cq)
                self.loop.add_reader(cq.fd, self._on_cq, cq)
        except BaseException:
            self.close()
            raise
        self._watchdog = self.loop.call_later(1.0, self._watch)

    # -- endpoints and channels ------------------------------------------------------------

    def endpoint(self) -> Any:
        """A new endpoint on the next completion queue (channels spread across them)."""
        cq = self.cqs[self._next_cq % len(self.cqs)]
        self._next_cq += 1
        return self.provider.create_endpoint(cq, next(self._ep_ids))

    def attach(self, conn: Connection, ep: Any, remote: dict[str, Any],
               peer_budget: Any = None) -> Channel:
        ep.connect(remote)
        channel = Channel(self, conn, ep, peer_budget)
        self.channels[ep.ep_id] = channel
        return channel

    def busy(self) -> bool:
        return any(ch.busy() for ch in self.channels.values())

    def remember(self, key: str, code: int, shape: tuple[int, ...], nbytes: int) -> None:
        """The dtype, shape and size last seen on ``key``: what the destinations offered for
        its requests are made for."""
        meta = self.meta
        if len(meta) >= _META_MAX and key not in meta:
            meta.clear()
        meta[key] = (code, shape, nbytes)

    # -- completions ------------------------------------------------------------------------

    def _on_cq(self, cq: Any) -> None:
        """The handler of one completion queue: drain it, deliver per channel."""
        try:
            completions = cq.poll()
        except Exception as exc:  # never let a provider error reach the loop
            completions = [(FAILED, 0, f"{self.name} completion queue failed: {exc!r}")]
        if not completions:
            return
        touched: dict[int, Channel] = {}
        channels = self.channels
        for c in completions:
            ep_id = c[1]
            if c[0] == FAILED and ep_id == 0:
                for every in list(channels.values()):
                    if every.ep.cq is cq:
                        every.fail(TransportError(str(c[2])))
                continue
            ch = channels.get(ep_id)
            if ch is None:
                continue  # a completion for a channel already closed
            try:
                ch.on_completion(c)
            except (TransportError, ProtocolError, ValueError, TypeError, KeyError) as exc:
                ch.fail(TransportError(f"{self.name}: bad completion from {ch.peer_name}: {exc}"))
                continue
            touched[ep_id] = ch
        for ch in touched.values():
            ch.deliver()

    def drain(self, cq: Any) -> None:
        if not self.closed:
            self._on_cq(cq)

    def _watch(self) -> None:
        now = self.loop.time()
        for ch in list(self.channels.values()):
            ch.check_deadlines(now)
        if not self.closed:
            self._watchdog = self.loop.call_later(1.0, self._watch)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if hasattr(self, "_watchdog"):
            self._watchdog.cancel()
        for ch in list(self.channels.values()):
            ch.close()
        for cq in self.cqs:
            try:
                self.loop.remove_reader(cq.fd)
            except Exception:
                pass
            cq.close()
        self.pool.close()
        self.provider.close()


class Channel:
    """The one-sided side of one TCP connection: both the producer's and the consumer's state.

    Its parts own that state: ``PeerRegions`` the memory the peer may write, ``SlotGrants``
    the slots granted to the peer, ``Destinations`` those offered for our requests,
    ``Delivery`` what arrives, ``Outbound`` what we write, ``ControlIn`` the peer's control
    messages.  The channel holds what they share: its connection, endpoint and state."""

    def __init__(self, engine: Engine, conn: Connection, ep: Any, peer_budget: Any = None) -> None:
        self.engine = engine
        self.name = engine.name
        self.conn = conn
        self.ep = ep
        self.pool = engine.pool            # ours alone: the arrays handed to the application
        options = engine.options
        self.inline_limit = engine.inline_limit
        self.tcp_max = engine.tcp_max      # read by the connection (``Wire.goes_onesided``)
        # A key first answered with a value this small stays on the connection as well: at
        # most one provider message, it would go here inline, handled in Python on both
        # sides; up to the provider's ``answer_tcp_max``, the destination the consumer offers
        # before each request costs more than the channel saves.  (-1 with tcp_max -1.)
        self.answer_tcp_max = engine.answer_tcp_max
        ep.on_error = self.fail
        self.failed: BaseException | None = None
        self.closed = False
        peer = conn.peer
        self.peer_name = peer.name if peer is not None else "peer"
        # The only memory this peer may write: its slots and destinations, nothing else.
        self._regions = PeerRegions(engine.provider, options.slot_budget, options.pool_limit)
        self._grants = SlotGrants(self, self._regions, options.slot_budget, options.max_slots,
                                  options.slot_idle)
        self._destinations = Destinations(self, self._regions)
        self._delivery = Delivery(self, self._regions, self._grants, self._destinations)
        timeout = options.grant_timeout
        self._out = Outbound(self, peer_budget,
                             float(timeout) if timeout is not None else engine.node.peer_timeout)
        # What the connection and the engine call, bound straight to the part that serves it.
        self.write_value = self._out.write_value
        self.send_credit = self._out.send_credit
        self.answered_here = self._out.answered_here
        self.on_request = self._destinations.on_request
        self.claim = self._destinations.claim
        self.deliver = self._delivery.deliver
        self.on_frames = ControlIn(self, self._out, self._grants, self._destinations).on_frames

    @property
    def stats(self) -> dict[str, int]:
        """Counts of what this side sent: ``writes`` (one-sided), ``inline`` (values
        carried in a message: a provider message, or a TCP frame for the values that stay on
        the connection, which ``tcp`` counts alone), ``meta``, ``grants``."""
        out = self._out
        tcp = self.conn.tcp_values
        return {"writes": out.writes, "inline": out.inline + tcp, "meta": out.meta,
                "grants": self._grants.count, "tcp": tcp}

    # What tests and diagnostics read of the parts, under the names the channel has always had.

    @property
    def arena(self) -> Pool:
        return self._regions.arena

    @property
    def targets(self) -> dict[int, Target]:
        return self._regions.targets

    @property
    def slot_imms(self) -> dict[str, set[int]]:
        return self._grants.slot_imms

    @property
    def wanted(self) -> dict[str, int]:
        return self._grants.wanted

    @property
    def refill(self) -> dict[str, list[int]]:
        return self._grants.refill

    @property
    def revoking(self) -> dict[str, set[int]]:
        return self._grants.revoking

    @property
    def last_use(self) -> dict[str, float]:
        return self._grants.last_use

    @property
    def asks(self) -> dict[int, tuple[int, str]]:
        return self._destinations.asks

    @property
    def remote_slots(self) -> dict[str, deque[tuple[int, int, int, int]]]:
        return self._out.remote_slots

    @property
    def out_pending(self) -> dict[str, deque[tuple[Any, ...]]]:
        return self._out.out_pending

    @property
    def inflight(self) -> dict[int, Any]:
        return self._out.inflight

    def __repr__(self) -> str:
        return f"<{self.name} channel to {self.peer_name} ep={self.ep.ep_id}>"

    # -- state ------------------------------------------------------------------------------

    def busy(self) -> bool:
        return self._out.busy()

    def fail(self, exc: BaseException) -> None:
        """The channel cannot carry data any more: abort its TCP connection."""
        if self.failed is not None or self.closed:
            return
        self.failed = exc
        log.warning("rvz %s: %s transport to %s failed: %s", self.engine.node.name, self.name,
                    self.peer_name, exc)
        self.conn.fail(exc)

    def close(self) -> None:
        """The TCP connection is gone: deliver what already arrived, then free everything."""
        if self.closed:
            return
        try:
            self.engine.drain(self.ep.cq)
        except Exception:  # pragma: no cover - delivery is best effort at close
            pass
        self.closed = True
        self.engine.channels.pop(self.ep.ep_id, None)
        self._grants.close()
        self._destinations.close()
        self._delivery.close()
        self._out.close()
        self._regions.close()
        self.ep.close()

    def check_deadlines(self, now: float) -> None:
        """The engine's watchdog (every second): grant deadlines, idle slots, empty regions."""
        if self.failed is not None or self.closed:
            return
        if self._out.grants_overdue(now):
            return
        self._grants.revoke_idle(now)
        self.unmap(self._regions.trim_idle())

    def unmap(self, rkeys: list[int]) -> None:
        """Tell the peer to unmap regions of ours we unregistered (``PeerRegions.trim``)."""
        if rkeys:
            self._control({"op": "unmap", "rk": rkeys})

    def _control(self, fields: dict[str, Any]) -> None:
        self.conn.write_frame(_codec.encode_onesided(fields))

    # -- completions ------------------------------------------------------------------------

    def on_completion(self, c: tuple[Any, ...]) -> None:
        kind = c[0]
        if kind == RECV_WRITE:
            self._delivery.on_write(c[2], c[3])
        elif kind == RECV_MSG:
            self._delivery.on_message(c[2])
        elif kind == SEND_DONE:
            self._out.sent(c[2])
        elif kind == FAILED:
            self.fail(TransportError(f"{self.name} to {self.peer_name}: {c[2]}"))

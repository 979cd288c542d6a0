"""The one-sided engine: Send-Driven and Recv-Driven over any provider.

One ``Engine`` per provider and node owns the registered pool and the completion queues
(each watched by the event loop with ``add_reader`` and drained by its own handler);
one ``Channel`` per TCP connection that negotiated the provider carries the protocol.
Control messages (slot grants, destinations, metadata updates) travel as ONESIDED frames on
that TCP connection, in order with its REQUEST/CANCEL/ERROR frames; payloads travel
one-sided.  Everything a channel delivers enters the node exactly like a TCP DATA frame:
``Wire.deliver([(DATA, step, request_id, key, value, seq)])``, ``seq`` being the number
the producer gave the value (see ``SLOT_HDR``).

Isolation: the memory a peer may write is a *region per peer*, carved only into that peer's
slots (``Channel.arena``) and destinations (``Channel.dest_arena``); the consumer's own pool
(``Engine.pool``), which holds the arrays handed to the application, is never described to
any peer.  A completed write is copied out of the peer's region into the pool before the
application sees it, so a peer can never touch an array it already delivered.  Regions left
empty are unregistered and the peer is told to unmap them (``unmap``).

Send-Driven (``request_id == 0``): the consumer grants the producer *slots* per key
(``want`` -> ``slots``); the producer caches them per (peer, key) and writes header and
tensor into one slot with the slot's id as the immediate.  The consumer's completion
handler copies the slot into the array it hands to the table and grants a fresh slot of
the same size: slots are the credits, so a producer never overruns.  Values without a slot
wait in the producer's per-key queue, in order.  The memory registered for a channel's
slots (``Channel.arena``, its chunks rounded to a page) never exceeds ``slot_budget``: a
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
import struct
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .. import _impl
from ..errors import ProtocolError, TransportError
from .pool import ALIGN, PAGE, Block, Pool, address_of, align
from .provider import FAILED, RECV_MSG, RECV_WRITE, SEND_DONE, Provider

if TYPE_CHECKING:
    from ..connection import Connection

log = logging.getLogger(__name__)

_codec = _impl.codec
DTYPES = _codec.DTYPES
payload_view = _codec.payload_view

# Slot header, written in front of the tensor in a Send-Driven slot:
#   u64 step | u64 nbytes | u8 dtype code | u8 ndim | u16 flags | u64 seq | u64 shape[ndim],
#   padded to 64.  ``seq`` is the producer's number of the value (``Wire.write_value``), by
#   which the consumer acknowledges it and drops a copy sent again after a reconnect.
SLOT_HDR = struct.Struct("<QQBBHQ")
# Inline value message: u8 kind | u8 code | u8 ndim | u8 0 | u32 key_len | u64 step |
#   u64 request_id | u64 nbytes | u64 seq | u64 shape[ndim] | key | payload
MSG_HDR = struct.Struct("<BBBBIQQQQ")
# An answer written into the destination its consumer offered is followed by its number.
SEQ_TRAILER = struct.Struct("<Q")
MSG_VALUE = 1
MSG_CREDIT = 2   # the node's push-window credit (nbytes field), with the data it frees
_SHAPES = [struct.Struct("<" + "Q" * n) for n in range(_codec.MAX_NDIM + 1)]
_WAITING = object()      # remote_dests marker: we sent META and wait for the re-ask
_IMM_MAX = (1 << 32) - 1
_REMOTE_DESTS_MAX = 1 << 16
_META_MAX = 1 << 16
_WANTED_MAX = 1 << 16      # keys waiting for slots per channel (a legit producer has fewer)
ARENA_STEP = 1 << 20       # a peer's region grows by 1 MiB, or by what a slot needs (to a page)
# Slot header flags: a whole value, the first piece of a larger one, a later piece.
WHOLE, FIRST, PIECE = 0, 1, 2

SLOT = 1
DEST = 2
ALIGN_HDR = align(SLOT_HDR.size)   # the header of a later piece (no shape)


def slot_header_size(ndim: int) -> int:
    return align(SLOT_HDR.size + 8 * ndim)


class Host(Protocol):
    """What the one-sided transports read of the node that owns them (rvz.node.Node)."""

    name: str
    transport: str
    peer_timeout: float
    max_payload: int

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


class _Target:
    """Memory of ours that the peer may write: a granted slot or a request's destination."""

    __slots__ = ("kind", "block", "key", "step", "request_id", "code", "shape", "nbytes")

    def __init__(self, kind: int, block: Block, key: str, step: int = 0, request_id: int = 0,
                 code: int = 0, shape: tuple[int, ...] = (), nbytes: int = 0) -> None:
        self.kind = kind
        self.block = block
        self.key = key
        self.step = step
        self.request_id = request_id
        self.code = code
        self.shape = shape
        self.nbytes = nbytes


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
    """The one-sided side of one TCP connection: both the producer's and the consumer's state."""

    def __init__(self, engine: Engine, conn: Connection, ep: Any, peer_budget: Any = None) -> None:
        self.engine = engine
        self.name = engine.name
        self.conn = conn
        self.ep = ep
        self.pool = engine.pool            # ours alone: the arrays handed to the application
        options = engine.options
        # The only memory this peer may write: its slots and destinations, nothing else.
        # The slots' regions count against the budget as registered, so that a slot a little
        # over a chunk's size costs its own size (to a page), not two chunks.
        self.budget = options.slot_budget
        self.arena = Pool(engine.provider, ARENA_STEP, self.budget, PAGE)
        self.dest_arena = Pool(engine.provider, ARENA_STEP, options.pool_limit, PAGE)
        self._arena_used = False
        self.max_slots = options.max_slots
        self.slot_idle = options.slot_idle
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
        # consumer side: memory the peer may write
        self._next_imm = 0
        self.targets: dict[int, _Target] = {}
        self.slot_imms: dict[str, set[int]] = {}
        self.granted = 0                               # bytes of granted slots not written yet
        self.refill: dict[str, list[int]] = {}        # key -> [count, size] to grant again
        self._refill_scheduled = False
        self.wanted: dict[str, int] = {}               # key -> slot size, waiting for budget
        self.owed: dict[str, int] = {}                 # key -> slot size, waiting on its own slots
        # key -> when its slots last moved; only keys holding granted slots (``_release_slot``)
        self.last_use: dict[str, float] = {}
        self.revoking: dict[str, set[int]] = {}        # key -> its slots asked back
        # Slots the producer filled when we asked for them back (it gave back the others):
        # their writes are on their way, so they are not asked for again (``_revoke``).
        self.filled: set[int] = set()
        self.partial: dict[str, list[Any]] = {}        # key -> a value arriving in pieces
        self.dests: dict[int, int] = {}                # request id -> imm of its destination
        self.asks: dict[int, tuple[int, str]] = {}     # request id -> (step, key)
        self.regions_sent: set[int] = set()
        self._events: list[tuple[Any, ...]] = []
        self._keys: dict[bytes, str] = {}              # key on the wire -> key (a cache)
        self._wires: dict[str, bytes] = {}
        # producer side: the peer's memory we may write
        self.remote_slots: dict[str, deque[tuple[int, int, int, int]]] = {}
        # key -> its values waiting to go, pushes and answers, in call order (``write_value``)
        self.out_pending: dict[str, deque[tuple[Any, ...]]] = {}
        self.asked: dict[str, float] = {}              # key -> deadline of our want
        self.remote_dests: dict[int, Any] = {}
        self.progress: dict[str, int] = {}             # key -> bytes of its head value written
        try:  # the slot budget the consumer advertised: larger values go in pieces
            self.peer_budget = int(peer_budget) if peer_budget is not None else 1 << 62
        except (TypeError, ValueError):
            raise TransportError(f"{self.name}: malformed slot budget {peer_budget!r} from "
                                 f"{self.peer_name}") from None
        if self.peer_budget < 1:
            raise TransportError(f"{self.name}: {self.peer_name} advertises a slot budget of "
                                 f"{self.peer_budget}")
        self.inflight: dict[int, Any] = {}             # wr_id -> what must live until done
        self._wr_ids = itertools.count(1)
        timeout = engine.options.grant_timeout
        self.grant_timeout = float(timeout) if timeout is not None else engine.node.peer_timeout
        self._stats = {"writes": 0, "inline": 0, "meta": 0, "grants": 0}

    @property
    def stats(self) -> dict[str, int]:
        """Counts of what this side sent: ``writes`` (one-sided), ``inline`` (values
        carried in a message: a provider message, or a TCP frame for the values that stay on
        the connection, which ``tcp`` counts alone), ``meta``, ``grants``."""
        out = dict(self._stats)
        tcp = self.conn.tcp_values
        out["inline"] += tcp
        out["tcp"] = tcp
        return out

    def __repr__(self) -> str:
        return f"<{self.name} channel to {self.peer_name} ep={self.ep.ep_id}>"

    # -- state ------------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.out_pending or self.inflight or self.ep.pending())

    def _error(self, key: str) -> TransportError:
        err = TransportError(f"{self.name} channel to {self.peer_name} failed (key {key}): {self.failed}")
        err.__cause__ = self.failed
        return err

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
        pool = self.pool
        for target in self.targets.values():
            self._arena_of(target).free(target.block)
        self.targets.clear()
        self.slot_imms.clear()
        self.dests.clear()
        self.asks.clear()
        for part in self.partial.values():
            pool.free(part[0])
        self.partial.clear()
        self.wanted.clear()
        self.owed.clear()
        self.last_use.clear()
        self.revoking.clear()
        self.filled.clear()
        self.progress.clear()
        for keep in self.inflight.values():
            if keep[1] is not None:
                pool.free(keep[1])
        self.inflight.clear()
        self.arena.close()
        self.dest_arena.close()
        self.out_pending.clear()
        self.remote_slots.clear()
        self.remote_dests.clear()
        self.ep.close()

    def check_deadlines(self, now: float) -> None:
        """The engine's watchdog (every second): grant deadlines, idle slots, empty regions."""
        if self.failed is not None or self.closed:
            return
        for key, deadline in self.asked.items():
            if now > deadline:
                self.fail(TransportError(
                    f"{self.name}: {self.peer_name} granted no slot for key {key} within "
                    f"{self.grant_timeout:g}s"))
                return
        idle = now - self.slot_idle
        for key, used in list(self.last_use.items()):
            if used < idle:
                self._revoke(key)
        if not self._arena_used:
            self._trim()
        self._arena_used = False

    def _trim(self) -> None:
        """Unregister the peer's regions that hold nothing; the peer unmaps them."""
        dropped = self.arena.trim() + self.dest_arena.trim()
        if dropped:
            self.regions_sent.difference_update(dropped)
            self._control({"op": "unmap", "rk": dropped})

    def _control(self, fields: dict[str, Any]) -> None:
        self.conn.write_frame(_codec.encode_onesided(fields))

    def _arena_of(self, target: _Target) -> Pool:
        return self.arena if target.kind == SLOT else self.dest_arena

    def _new_imm(self) -> int:
        imm = self._next_imm
        targets = self.targets
        while True:
            imm = imm + 1 if imm < _IMM_MAX else 1
            if imm not in targets:
                self._next_imm = imm
                return imm

    def _descs(self, blocks: list[Block]) -> list[dict[str, Any]]:
        out = []
        for block in blocks:
            region = block.region
            if region.rkey not in self.regions_sent:
                self.regions_sent.add(region.rkey)
                out.append(region.describe())
        return out

    def _inline_ok(self, key: str, shape: tuple[int, ...], nbytes: int) -> bool:
        klen = len(key) if key.isascii() else len(key.encode("utf-8"))
        return MSG_HDR.size + 8 * len(shape) + klen + nbytes <= self.inline_limit

    # -- producer: values out ------------------------------------------------------------------

    def write_value(self, step: int, request_id: int, key_wire: bytes, value: Any, code: int,
                    shape: tuple[int, ...], nbytes: int, seq: int = 0) -> None:
        """``Connection.write_value`` for this connection: push or answer one-sided; ``seq``
        is the value's number (0: none)."""
        key = self._keys.get(key_wire)
        if key is None:
            if len(self._keys) >= _META_MAX:
                self._keys.clear()
                self._wires.clear()
            key = self._keys[key_wire] = key_wire.decode("utf-8")
            self._wires[key] = key_wire
        if self.failed is not None or self.closed:
            if self.failed is None:
                raise self.conn.lost_error(key)
            raise self._error(key)
        item = (step, request_id, key, value, code, shape, nbytes, seq)
        try:
            # Behind the key's values still waiting (for slots, or for the meta round of an
            # answer), pushes and answers alike: an answer taken from the push queue must not
            # overtake the pushes of its key ahead of it, nor a push a waiting answer.
            pending = self.out_pending.get(key)
            if pending is not None:
                pending.append(item)
            elif not self._try_send(item):
                self.out_pending[key] = deque((item,))
        except TransportError as exc:
            self.fail(exc)
            raise self._error(key) from None

    def _try_send(self, item: tuple[Any, ...]) -> bool:
        """Post ``item`` (a push, or an answer when it has a request id) if it can go now."""
        return self._try_push(item) if item[1] == 0 else self._try_answer(item)

    def _try_push(self, item: tuple[Any, ...]) -> bool:
        step, _, key, value, code, shape, nbytes, _ = item
        if self._inline_ok(key, shape, nbytes):
            self._send_inline(item)
            return True
        need = slot_header_size(len(shape)) + nbytes
        if align(need) > self.peer_budget:   # (the consumer carves slots 64-byte aligned)
            return self._push_pieces(item)
        slots = self.remote_slots.get(key)
        if slots:
            if slots[0][3] >= need:
                self._write_slot(slots.popleft(), item)
                if not slots:
                    del self.remote_slots[key]
                return True
            released = [s[0] for s in slots]   # too small now: give them back, ask anew
            del self.remote_slots[key]
            self._want(key, need, released)
        elif key not in self.asked:
            self._want(key, need, [])
        return False

    def _push_pieces(self, item: tuple[Any, ...]) -> bool:
        """A value larger than the consumer's slot budget: one piece per slot, in order."""
        step, _, key, value, code, shape, nbytes, seq = item
        ndim = len(shape)
        first = slot_header_size(ndim)
        # Two slots in flight keep the copy pipelined; slots are carved 64-byte aligned.
        size = self.peer_budget // 2 // ALIGN * ALIGN
        if size < first + 4096:
            size = self.peer_budget // ALIGN * ALIGN
        if size <= first:
            raise TransportError(f"{self.name}: {self.peer_name}'s slot budget of "
                                 f"{self.peer_budget} bytes cannot hold a value of key {key}")
        done = self.progress.get(key, 0)
        slots = self.remote_slots.get(key)
        while slots and done < nbytes:
            imm, addr, rkey, room = slots.popleft()
            head_size = first if done == 0 else ALIGN_HDR
            if room <= head_size:
                continue   # a stale tiny slot: the consumer takes it back when idle
            n = min(nbytes - done, room - head_size)
            if done == 0:
                head = (SLOT_HDR.pack(step, nbytes, code, ndim, FIRST, seq)
                        + _SHAPES[ndim].pack(*shape))
            else:
                head = SLOT_HDR.pack(step, nbytes, code, 0, PIECE, seq)
            head += bytes(head_size - len(head))
            self._post_write([memoryview(head), payload_view(value)[done:done + n]],
                             addr, rkey, imm, value)
            done += n
        if slots is not None and not slots:
            del self.remote_slots[key]
        if done >= nbytes:
            self.progress.pop(key, None)
            return True
        self.progress[key] = done
        if key not in self.asked and not self.remote_slots.get(key):
            self._want(key, size, [])
        return False

    def _want(self, key: str, need: int, released: list[int]) -> None:
        self.asked[key] = self.engine.loop.time() + self.grant_timeout
        self._control({"op": "want", "k": key, "n": need, "rel": released})

    def _drain_pending(self, key: str) -> None:
        pending = self.out_pending.get(key)
        if pending is None:
            return
        while pending:
            if not self._try_send(pending[0]):
                return
            pending.popleft()
        del self.out_pending[key]

    def _write_slot(self, slot: tuple[int, int, int, int], item: tuple[Any, ...]) -> None:
        imm, addr, rkey, _ = slot
        step, _, key, value, code, shape, nbytes, seq = item
        ndim = len(shape)
        head = SLOT_HDR.pack(step, nbytes, code, ndim, WHOLE, seq) + _SHAPES[ndim].pack(*shape)
        head += bytes(slot_header_size(ndim) - len(head))
        self._post_write([memoryview(head), payload_view(value)], addr, rkey, imm, value)

    def _post_write(self, views: list[memoryview], addr: int, rkey: int, imm: int, keep: Any) -> None:
        wr_id = next(self._wr_ids)
        staged = None
        if self.engine.needs_registered_source:
            sources, staged = self._registered(views)
        else:
            sources = [(v, 0, 0) for v in views]
        self._stats["writes"] += 1
        if not self.ep.write(sources, addr, rkey, imm, wr_id):
            self.inflight[wr_id] = (keep, staged)
        elif staged is not None:
            self.pool.free(staged)

    def _registered(self, views: list[memoryview]) -> tuple[list[tuple[Any, ...]], Block | None]:
        """Sources in registered memory: as they are if they already are, else staged."""
        lookup = self.pool.lookup
        sources = []
        for v in views:
            n = v.nbytes
            if n == 0:
                continue
            addr = address_of(v)
            region = lookup(addr, n)
            if region is None:
                break
            sources.append((v, addr, region.lkey))
        else:
            return sources, None
        total = sum(v.nbytes for v in views)
        block = self.pool.alloc(total)
        off = 0
        for v in views:
            n = v.nbytes
            block.view(off, n)[:] = v
            off += n
        return [(block.view(0, total), block.addr, block.region.lkey)], block

    def _send_inline(self, item: tuple[Any, ...]) -> None:
        step, request_id, key, value, code, shape, nbytes, seq = item
        wire = self._wires.get(key)
        if wire is None:
            wire = key.encode("utf-8")
        ndim = len(shape)
        parts = [MSG_HDR.pack(MSG_VALUE, code, ndim, 0, len(wire), step, request_id, nbytes, seq),
                 _SHAPES[ndim].pack(*shape), wire]
        if nbytes:
            parts.append(payload_view(value))
        self._stats["inline"] += 1
        wr_id = next(self._wr_ids)
        if not self.ep.send(parts, wr_id):
            self.inflight[wr_id] = (None, None)

    def send_credit(self, nbytes: int) -> None:
        """The node's push-window credit for the peer, in order with our one-sided traffic."""
        if self.failed is None and not self.closed:
            try:
                self.ep.send([MSG_HDR.pack(MSG_CREDIT, 0, 0, 0, 0, 0, 0, nbytes, 0)],
                             next(self._wr_ids))
                return
            except TransportError as exc:
                self.fail(exc)
        self.conn.write_frame(_codec.encode_credit(nbytes))

    def _try_answer(self, item: tuple[Any, ...]) -> bool:
        step, request_id, key, value, code, shape, nbytes, seq = item
        dest = self.remote_dests.pop(request_id, None)
        if dest is _WAITING:
            self.remote_dests[request_id] = _WAITING
            return False
        if dest is not None:
            imm, addr, rkey, _, dcode, dshape, dnbytes = dest
            if dcode == code and dshape == shape and dnbytes == nbytes:
                self._post_write([payload_view(value), memoryview(SEQ_TRAILER.pack(seq))],
                                 addr, rkey, imm, value)
                return True
        if self._inline_ok(key, shape, nbytes):
            self._send_inline(item)   # the consumer frees the destination it had, if any
            return True
        self.remote_dests[request_id] = _WAITING
        self._stats["meta"] += 1
        self._control({"op": "meta", "r": request_id, "st": step, "k": key, "c": code,
                       "s": list(shape), "n": nbytes})
        return False

    def answered_here(self, request_id: int) -> None:
        """The connection carried the answer to ``request_id`` (its key's values go that
        way): the destination the consumer offered for it will not be written."""
        self.remote_dests.pop(request_id, None)

    # -- consumer: memory in ----------------------------------------------------------------

    def on_request(self, step: int, request_id: int, key: str) -> None:
        """Before REQUEST ``request_id`` leaves: offer a destination if we know the shape."""
        if self.failed is not None or self.closed:
            return
        self.asks[request_id] = (step, key)
        meta = self.engine.meta.get(key)
        if meta is None:
            return
        code, shape, nbytes = meta
        if self._inline_ok(key, shape, nbytes):
            return
        try:
            self._send_dest(step, request_id, key, code, shape, nbytes, False)
        except TransportError as exc:
            self.fail(exc)

    def _send_dest(self, step: int, request_id: int, key: str, code: int, shape: tuple[int, ...],
                   nbytes: int, again: bool) -> None:
        block = self.dest_arena.alloc(nbytes + SEQ_TRAILER.size)  # the answer's number follows it
        self._arena_used = True
        imm = self._new_imm()
        self.targets[imm] = _Target(DEST, block, key, step, request_id, code, shape, nbytes)
        self.dests[request_id] = imm
        self._control({"op": "dest", "r": request_id, "k": key, "i": imm, "a": block.addr,
                       "rk": block.region.rkey, "c": code, "s": list(shape), "n": nbytes,
                       "m": self._descs([block]), "re": again})

    def _drop_dest(self, request_id: int) -> None:
        imm = self.dests.pop(request_id, None)
        if imm is not None:
            target = self.targets.pop(imm, None)
            if target is not None:
                self.dest_arena.free(target.block)

    def _forget_ask(self, request_id: int) -> None:
        """Our request ``request_id`` is over (answered another way, failed or gone): its
        destination and our record of it go."""
        self._drop_dest(request_id)
        self.asks.pop(request_id, None)

    def _grant(self, key: str, size: int, count: int) -> None:
        blocks = []
        slots = []
        imms = self.slot_imms.setdefault(key, set())
        self.owed.pop(key, None)   # any grant answers the producer's want (it asks again if short)
        self.last_use[key] = self.engine.loop.time()
        self._arena_used = True
        for _ in range(count):
            block = self.arena.alloc(size)
            imm = self._new_imm()
            self.targets[imm] = _Target(SLOT, block, key)
            imms.add(imm)
            self.granted += block.size
            blocks.append(block)
            slots.append([imm, block.addr, block.region.rkey, block.size])
        self._stats["grants"] += count
        self._control({"op": "slots", "k": key, "s": slots, "m": self._descs(blocks)})

    def _flush_refill(self) -> None:
        self._refill_scheduled = False
        if self.closed or self.failed is not None:
            self.refill.clear()
            return
        refill = self.refill
        self.refill = {}
        try:
            self._serve()   # keys that wait for budget come before refills
            for key, (count, size) in refill.items():
                count = self._room(size, min(count, self.max_slots - self._have(key, size)))
                if count > 0:
                    self._grant(key, size, count)
            waiting = len(self.wanted)
            for key in refill:   # a refill the budget did not allow: its want waits its turn
                self._settle(key)
            if len(self.wanted) > waiting:
                self._serve()
        except TransportError as exc:
            self.fail(exc)

    def _have(self, key: str, size: int) -> int:
        """Slots of ``key`` granted and not filled yet that hold ``size`` bytes."""
        targets = self.targets
        return sum(1 for imm in self.slot_imms.get(key, ()) if targets[imm].block.size >= size)

    def _room(self, size: int, most: int) -> int:
        """How many more slots of ``size`` bytes the budget allows, at most ``most``.

        Regions no slot is carved from are unregistered when they stand in the way."""
        if most <= 0:
            return 0
        room = self.arena.capacity(size, most)
        if room < most and self.arena.empty_chunks():
            self._trim()
            room = self.arena.capacity(size, most)
        return room

    def _free_slot(self, imm: int, key: str) -> None:
        target = self.targets.get(imm)
        if target is None or target.kind != SLOT or target.key != key:
            return
        del self.targets[imm]
        self._release_slot(imm, key, target.block.size)
        self.arena.free(target.block)

    def _release_slot(self, imm: int, key: str, size: int) -> bool:
        """Slot ``imm`` of ``key``, already out of ``targets``, is granted no more (given
        back, or its write seen); True if it was the key's last.  A key with no slot left
        leaves ``last_use`` too: nothing of it is there to revoke, and a key used once (a
        sparse embedding id) whose last slot was written and not granted again (no room
        for the refill) would otherwise stay there for good, walked every second."""
        self.filled.discard(imm)
        self.granted -= size
        imms = self.slot_imms.get(key)
        if imms is None:
            return False
        imms.discard(imm)
        if imms:
            return False
        del self.slot_imms[key]
        self.last_use.pop(key, None)
        return True

    def _serve(self) -> None:
        """Grant the keys that wait for budget, in the order they asked."""
        wanted = self.wanted
        while wanted:
            key = next(iter(wanted))
            size = wanted[key]
            have = self._have(key, size)
            count = self._room(size, self.max_slots - have)
            if count <= 0 and have == 0:
                self._reclaim(size, key)
                return
            del wanted[key]
            if count > 0:
                self._grant(key, size, count)
            else:
                self._owe(key, size)

    def _owe(self, key: str, size: int) -> None:
        """Let the producer's want of ``key`` wait on slots we count as its own.

        The producer asks only when it holds no slot that fits, so those slots are on their way
        to it, or already filled and their writes not seen yet (a want travels on the TCP
        connection, a write's completion apart from it), to be granted again as a refill.  The
        budget may not allow that refill: then the want must not be forgotten (``_settle``)."""
        self.owed[key] = max(size, self.owed.get(key, 0))

    def _settle(self, key: str) -> None:
        """A want of ``key`` that waited on its own slots, none of which is left and no refill
        coming: it waits for budget in ``wanted``, behind the keys already there."""
        size = self.owed.get(key)
        if size is None or key in self.refill or self._have(key, size):
            return
        del self.owed[key]
        self.wanted[key] = max(size, self.wanted.get(key, 0))

    def _reclaim(self, size: int, keep: str) -> None:
        """Ask for the slots of the least recently used keys back until ``size`` would fit.

        Short by what registering a region for it would pass the budget by: slots given back
        may leave their regions partly used, so each pass that still finds no room asks for
        more (once their regions are empty, ``_room`` unregisters them)."""
        short = align(size) - (self.budget - self.arena.registered)
        for key in sorted(self.last_use, key=self.last_use.__getitem__):
            if short <= 0:
                return
            if key == keep or key in self.revoking:
                continue
            short -= sum(self.targets[imm].block.size for imm in self.slot_imms.get(key, ()))
            self._revoke(key)

    def _revoke(self, key: str) -> None:
        if key in self.revoking:
            return
        imms = self.slot_imms.get(key, set()) - self.filled
        if imms:
            self.revoking[key] = imms
            self._control({"op": "revoke", "k": key, "s": sorted(imms)})

    # -- control frames from the peer -----------------------------------------------------------

    def on_frames(self, events: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """Take our ONESIDED frames out of a batch; watch CANCEL, answers and ERROR on the way."""
        out = []
        for event in events:
            kind = event[0]
            if kind == _codec.ONESIDED:
                if self.failed is None and not self.closed:
                    try:
                        self._on_control(event[1])
                    except (TransportError, ValueError, TypeError, KeyError, IndexError) as exc:
                        self.fail(self._control_error(exc))
                continue
            if kind == _codec.CANCEL:
                request_id = event[1]
                if request_id in self.conn.parked:
                    # Parked, it was not answered and never will be: the consumer frees the
                    # destination it offered, and forgets the request either way (without
                    # this, every cancelled request it offered none for stayed in its asks).
                    dest = self.remote_dests.pop(request_id, None)
                    if dest is not _WAITING:
                        self._control({"op": "gone", "r": request_id})
            elif kind == _codec.DATA and event[2]:
                # An answer that came over TCP (its key's values go that way): the
                # destination offered for it will not be written.
                self._forget_ask(event[2])
            elif kind == _codec.ERROR:
                try:
                    request_id = int(event[1].get("req", 0))
                except (TypeError, ValueError, AttributeError):
                    request_id = 0
                self._forget_ask(request_id)
            out.append(event)
        return out

    def _control_error(self, exc: BaseException) -> BaseException:
        """Why a control message from the peer fails this channel.  A memory region it offered
        that is gone from its process (closed as it resets this very connection: the offer
        was still on the way) makes that a reset, after which the pair connects again and
        nothing is lost; anything else is the peer's fault."""
        if isinstance(exc.__cause__, FileNotFoundError):
            return ConnectionResetError(f"{self.name}: {self.peer_name} closed a memory region "
                                        f"it offered: {exc}")
        return TransportError(f"{self.name}: bad control message from {self.peer_name}: {exc!r}")

    def _on_control(self, f: dict[str, Any]) -> None:
        op = f["op"]
        if op == "slots":
            key = str(f["k"])
            for desc in f.get("m", ()):
                self.ep.add_region(desc)
            self.asked.pop(key, None)
            slots = self.remote_slots.get(key)
            if slots is None:
                slots = self.remote_slots[key] = deque()
            for imm, addr, rkey, size in f["s"]:
                slots.append((int(imm), int(addr), int(rkey), int(size)))
            self._drain_pending(key)
            if key not in self.out_pending and self.remote_slots.get(key) == deque():
                del self.remote_slots[key]
        elif op == "revoke":   # the consumer wants unused slots of a key back
            key = str(f["k"])
            slots = self.remote_slots.get(key)
            asked = {int(imm) for imm in f["s"]}
            released: list[tuple[int, int, int, int]] = []
            if slots:
                keep: deque[tuple[int, int, int, int]] = deque()
                for slot in slots:
                    (released if slot[0] in asked else keep).append(slot)
                if keep:
                    self.remote_slots[key] = keep
                else:
                    del self.remote_slots[key]
            self._control({"op": "rel", "k": key, "s": [s[0] for s in released]})
            if key in self.out_pending and not self.remote_slots.get(key) and key not in self.asked:
                self._drain_pending(key)   # still needed: ask again, behind the others
        elif op == "rel":   # slots given back (the answer to revoke)
            key = str(f["k"])
            for imm in f["s"]:
                self._free_slot(int(imm), key)
            # Those it kept it had filled before it read the revoke (a grant and a revoke
            # travel in order): asked again, it would give nothing back again.
            for imm in self.revoking.pop(key, ()):
                if imm in self.targets:
                    self.filled.add(imm)
            self._settle(key)
            self._serve()
        elif op == "unmap":   # regions of the consumer that hold nothing of ours any more
            for rkey in f["rk"]:
                self.ep.remove_region(int(rkey))
        elif op == "dest":
            request_id = int(f["r"])
            for desc in f.get("m", ()):
                self.ep.add_region(desc)
            self.remote_dests[request_id] = (int(f["i"]), int(f["a"]), int(f["rk"]), int(f["n"]),
                                             int(f["c"]), tuple(int(d) for d in f["s"]), int(f["n"]))
            if len(self.remote_dests) > _REMOTE_DESTS_MAX:
                self._evict_dests()
            if f.get("re"):
                self._drain_pending(str(f["k"]))
        elif op == "want":
            key = str(f["k"])
            self.owed.pop(key, None)   # a want comes only after the last was answered
            for imm in f.get("rel", ()):
                self._free_slot(int(imm), key)
            size = int(f["n"])
            if size <= 0 or align(size) > self.budget:
                raise TransportError(f"slot of {size} bytes asked for key {key}: the slot budget "
                                     f"is {self.budget} bytes (larger values come in pieces)")
            # Slots already granted (maybe still on their way) or about to be re-granted count
            # against max_slots: the producer asks when it runs dry, which races our refills.
            have = self._have(key, size)
            refill = self.refill.get(key)
            if refill is not None and refill[1] >= size:
                have += refill[0]
            count = self._room(size, self.max_slots - have)
            if count > 0 and not self.wanted:
                self._grant(key, size, count)
            elif key not in self.wanted and len(self.wanted) + len(self.owed) >= _WANTED_MAX:
                # Owed keys wait too (``_settle`` moves them to ``wanted``): one bound for both.
                raise TransportError(f"more than {_WANTED_MAX} keys wait for slots")
            elif have == 0:   # no room now: wait, in order, for slots to come back
                self.wanted[key] = max(size, self.wanted.get(key, 0))
                self._serve()
            else:
                self._owe(key, size)
        elif op == "meta":
            request_id = int(f["r"])
            if request_id not in self.asks:
                return   # not a request of ours (or one already answered or cancelled)
            self._drop_dest(request_id)
            key = str(f["k"])
            step = int(f["st"])
            code = int(f["c"])
            shape = tuple(int(d) for d in f["s"])
            nbytes = int(f["n"])
            self._check_meta(key, code, shape, nbytes)
            self._remember(key, code, shape, nbytes)
            self.asks[request_id] = (step, key)
            self._send_dest(step, request_id, key, code, shape, nbytes, True)
        elif op == "gone":
            request_id = int(f["r"])
            self._forget_ask(request_id)
        else:
            raise ValueError(f"unknown operation {op!r}")

    def _evict_dests(self) -> None:
        # Entries of requests that were answered with ERROR are never claimed; drop the oldest.
        for request_id in list(self.remote_dests)[: _REMOTE_DESTS_MAX // 4]:
            if self.remote_dests[request_id] is not _WAITING:
                del self.remote_dests[request_id]

    def _check_meta(self, key: str, code: int, shape: tuple[int, ...], nbytes: int) -> None:
        if code >= len(DTYPES) or len(shape) > _codec.MAX_NDIM:
            raise TransportError(f"bad dtype code {code} or {len(shape)} dims for key {key}")
        dtype = DTYPES[code]
        if dtype is None:
            expected = nbytes
        else:
            expected = dtype.itemsize
            for dim in shape:
                expected *= dim
        if expected != nbytes or nbytes > self.engine.node.max_payload:
            raise TransportError(f"key {key}: {nbytes} bytes do not match dtype {dtype} and shape "
                                 f"{shape} or exceed the payload limit")

    def _remember(self, key: str, code: int, shape: tuple[int, ...], nbytes: int) -> None:
        meta = self.engine.meta
        if len(meta) >= _META_MAX and key not in meta:
            meta.clear()
        meta[key] = (code, shape, nbytes)

    # -- completions ------------------------------------------------------------------------

    def on_completion(self, c: tuple[Any, ...]) -> None:
        kind = c[0]
        if kind == RECV_WRITE:
            self._on_write(c[2], c[3])
        elif kind == RECV_MSG:
            self._on_message(c[2])
        elif kind == SEND_DONE:
            keep = self.inflight.pop(c[2], None)
            if keep is not None and keep[1] is not None:
                self.pool.free(keep[1])
        elif kind == FAILED:
            self.fail(TransportError(f"{self.name} to {self.peer_name}: {c[2]}"))

    def _on_write(self, imm: int, nbytes: int) -> None:
        target = self.targets.pop(imm, None)
        if target is None:
            raise TransportError(f"write with unknown immediate {imm}")
        block = target.block
        key = target.key
        if target.kind == SLOT:
            if not self._release_slot(imm, key, block.size):
                self.last_use[key] = self.engine.loop.time()  # (its refill's grant sets it)
            self._schedule_refill(key, block.size)
            try:
                event = self._on_slot(block, key, nbytes)
            finally:
                self.arena.free(block)   # copied out (or refused): the slot's memory is free
            if event is None:
                return
        else:
            try:
                if nbytes != target.nbytes + SEQ_TRAILER.size:
                    raise TransportError(f"write of {nbytes} bytes into a destination of "
                                         f"{target.nbytes} for key {key}")
                request_id = target.request_id
                self.dests.pop(request_id, None)
                self.asks.pop(request_id, None)
                code, shape, size = target.code, target.shape, target.nbytes
                (seq,) = SEQ_TRAILER.unpack_from(block.view(size, SEQ_TRAILER.size))
                event = (target.step, request_id, code, shape, size,
                         self._copy_out(block, 0, code, shape, size), seq)
            finally:
                self.dest_arena.free(block)
        step, request_id, code, shape, size, value, seq = event
        self._remember(key, code, shape, size)
        self._events.append((_codec.DATA, step, request_id, key, value, seq))

    def _schedule_refill(self, key: str, size: int) -> None:
        refill = self.refill.get(key)
        if refill is None:
            self.refill[key] = [1, size]
        else:
            refill[0] += 1
            refill[1] = max(refill[1], size)
        if not self._refill_scheduled:
            self._refill_scheduled = True
            self.engine.loop.call_soon(self._flush_refill)

    def _on_slot(self, block: Block, key: str, nbytes: int) -> tuple[Any, ...] | None:
        """A filled slot: the whole value, or one piece of a larger one (then ``None``
        until its last piece)."""
        view = block.view()
        if nbytes > block.size:
            raise TransportError(f"write of {nbytes} bytes into a slot of {block.size}")
        step, size, code, ndim, flags, seq = SLOT_HDR.unpack_from(view, 0)
        if ndim > _codec.MAX_NDIM or flags > PIECE:
            raise TransportError(f"slot of key {key} holds {ndim} dims, flags {flags}")
        shape = _SHAPES[ndim].unpack_from(view, SLOT_HDR.size)
        start = slot_header_size(ndim)
        part = self.partial.get(key)
        if flags == PIECE:
            if part is None or ndim != 0 or (step, code, size) != (part[1], part[2], part[4]):
                raise TransportError(f"a piece of key {key} that continues no value")
        elif part is not None:
            raise TransportError(f"key {key}: a new value before the last piece of the previous one")
        if flags != PIECE:
            self._check_meta(key, code, shape, size)
        if flags == WHOLE:
            if nbytes != start + size:
                raise TransportError(f"write of {nbytes} bytes into a slot of {block.size} "
                                     f"does not match its header ({size} bytes)")
            return step, 0, code, shape, size, self._copy_out(block, start, code, shape, size), seq
        n = nbytes - start
        done = 0 if part is None else part[5]
        if n <= 0 or done + n > size or (flags == FIRST and n >= size):
            raise TransportError(f"a piece of {n} bytes of key {key} at {done} of {size}")
        if part is None:
            whole = self.pool.alloc(size)
            part = self.partial[key] = [whole, step, code, shape, size, 0, seq]
        whole = part[0]
        whole.view(done, n)[:] = block.view(start, n)
        part[5] = done + n
        if part[5] < size:
            return None
        del self.partial[key]
        _, step, code, shape, size, _, seq = part
        return step, 0, code, shape, size, self._value(whole, code, shape, size), seq

    def _copy_out(self, block: Block, start: int, code: int, shape: tuple[int, ...],
                  nbytes: int) -> Any:
        """The value a peer wrote into its region, moved into memory only we can reach."""
        dtype = DTYPES[code]
        if dtype is None:
            return bytes(block.view(start, nbytes))
        if nbytes == 0:
            return np.empty(shape, dtype)
        mine = self.pool.alloc(nbytes)
        mine.view(0, nbytes)[:] = block.view(start, nbytes)
        return self.pool.array(mine, dtype, shape)

    def _value(self, block: Block, code: int, shape: tuple[int, ...], nbytes: int) -> Any:
        """An array over a block of our pool (``bytes`` are copied out of it)."""
        dtype = DTYPES[code]
        if dtype is None:
            data = bytes(block.view(0, nbytes))
            self.pool.free(block)
            return data
        return self.pool.array(block, dtype, shape)

    def _on_message(self, data: bytes) -> None:
        kind, code, ndim, _, klen, step, request_id, nbytes, seq = MSG_HDR.unpack_from(data, 0)
        if kind == MSG_CREDIT:
            self._events.append((_codec.CREDIT, nbytes))
            return
        if kind != MSG_VALUE or ndim > _codec.MAX_NDIM:
            raise TransportError(f"unknown message kind {kind} or {ndim} dims")
        shape = _SHAPES[ndim].unpack_from(data, MSG_HDR.size)
        kstart = MSG_HDR.size + 8 * ndim
        key = data[kstart:kstart + klen].decode("utf-8")
        self._check_meta(key, code, shape, nbytes)
        pstart = kstart + klen
        if pstart + nbytes != len(data):
            raise TransportError(f"message of {len(data)} bytes does not hold {nbytes} bytes of key {key}")
        dtype = DTYPES[code]
        value: Any
        if dtype is None:
            value = data[pstart:]
        elif nbytes == 0:
            value = np.empty(shape, dtype)
        else:  # one copy out of the message, into an array the receiver owns
            value = np.frombuffer(data, dtype, nbytes // dtype.itemsize, pstart).copy()
            if len(shape) != 1:
                value = value.reshape(shape)
        if request_id:
            self._forget_ask(request_id)
        self._remember(key, code, shape, nbytes)
        self._events.append((_codec.DATA, step, request_id, key, value, seq))

    def deliver(self) -> None:
        """Hand what the completions produced to the node, like TCP DATA frames."""
        events = self._events
        if events:
            self._events = []
            self.conn.deliver(events)

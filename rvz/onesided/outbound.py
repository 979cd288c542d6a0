"""The producer's side of a channel: values out, into the memory the consumer offered.

A key's values, pushes and answers alike, wait in one queue (``out_pending``, in call order)
behind the first that cannot go yet: a push for a slot the consumer grants (``slots``), an
answer for the destination the consumer offers again after our ``meta``.  Granted slots are
kept per key (``remote_slots``) and given back when asked (``revoke`` -> ``rel``); a value
larger than the consumer's slot budget goes in pieces.  ``inflight`` keeps what a posted write
reads until its completion.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING, Any

from .. import _impl
from ..errors import TransportError
from .layout import (
    ALIGN_HDR,
    FIRST,
    MSG_CREDIT,
    MSG_HDR,
    MSG_VALUE,
    PIECE,
    SEQ_TRAILER,
    SHAPES,
    SLOT_HDR,
    WHOLE,
    fits_inline,
    payload_view,
    slot_header_size,
)
from .pool import ALIGN, Block, address_of, align

if TYPE_CHECKING:
    from .engine import Channel

_codec = _impl.codec
_WAITING = object()        # remote_dests marker: we sent META and wait for the re-ask
_LATER = object()          # remote_dests marker: the consumer's destination follows (``later``)
_REMOTE_DESTS_MAX = 1 << 16
_KEYS_MAX = 1 << 16


class Outbound:
    """What one channel's producer writes, and the consumer's memory it may write into."""

    def __init__(self, channel: Channel, peer_budget: Any, grant_timeout: float) -> None:
        self._channel = channel
        engine = channel.engine
        self._loop = engine.loop
        self._ep = channel.ep
        self._pool = channel.pool
        self._needs_registered_source = engine.needs_registered_source
        self._inline_limit = channel.inline_limit
        self.grant_timeout = grant_timeout
        self.remote_slots: dict[str, deque[tuple[int, int, int, int]]] = {}
        # key -> its values waiting to go, pushes and answers, in call order (``write_value``)
        self.out_pending: dict[str, deque[tuple[Any, ...]]] = {}
        self._asked: dict[str, float] = {}             # key -> deadline of our want
        self._remote_dests: dict[int, Any] = {}
        self._progress: dict[str, int] = {}            # key -> bytes of its head value written
        self.inflight: dict[int, Any] = {}             # wr_id -> what must live until done
        self._wr_ids = itertools.count(1)
        self._keys: dict[bytes, str] = {}              # key on the wire -> key (a cache)
        self._wires: dict[str, bytes] = {}
        self.writes = self.inline = self.meta = 0      # what we sent, for the stats
        try:  # the slot budget the consumer advertised: larger values go in pieces
            self.peer_budget = int(peer_budget) if peer_budget is not None else 1 << 62
        except (TypeError, ValueError):
            raise TransportError(f"{channel.name}: malformed slot budget {peer_budget!r} from "
                                 f"{channel.peer_name}") from None
        if self.peer_budget < 1:
            raise TransportError(f"{channel.name}: {channel.peer_name} advertises a slot budget "
                                 f"of {self.peer_budget}")

    def busy(self) -> bool:
        return bool(self.out_pending or self.inflight or self._ep.pending())

    def _error(self, key: str) -> TransportError:
        channel = self._channel
        err = TransportError(f"{channel.name} channel to {channel.peer_name} failed (key {key}): "
                             f"{channel.failed}")
        err.__cause__ = channel.failed
        return err

    # -- values out ----------------------------------------------------------------------------

    def write_value(self, step: int, request_id: int, key_wire: bytes, value: Any, code: int,
                    shape: tuple[int, ...], nbytes: int, seq: int = 0) -> None:
        """``Connection.write_value`` for this connection: push or answer one-sided; ``seq``
        is the value's number (0: none)."""
        key = self._keys.get(key_wire)
        if key is None:
            if len(self._keys) >= _KEYS_MAX:
                self._keys.clear()
                self._wires.clear()
            key = self._keys[key_wire] = key_wire.decode("utf-8")
            self._wires[key] = key_wire
        channel = self._channel
        if channel.failed is not None or channel.closed:
            if channel.failed is None:
                raise channel.conn.lost_error(key)
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
            channel.fail(exc)
            raise self._error(key) from None

    def _try_send(self, item: tuple[Any, ...]) -> bool:
        """Post ``item`` (a push, or an answer when it has a request id) if it can go now."""
        return self._try_push(item) if item[1] == 0 else self._try_answer(item)

    def _try_push(self, item: tuple[Any, ...]) -> bool:
        step, _, key, value, code, shape, nbytes, _ = item
        if fits_inline(key, shape, nbytes, self._inline_limit):
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
        elif key not in self._asked:
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
            raise TransportError(f"{self._channel.name}: {self._channel.peer_name}'s slot budget "
                                 f"of {self.peer_budget} bytes cannot hold a value of key {key}")
        done = self._progress.get(key, 0)
        slots = self.remote_slots.get(key)
        while slots and done < nbytes:
            imm, addr, rkey, room = slots.popleft()
            head_size = first if done == 0 else ALIGN_HDR
            if room <= head_size:
                continue   # a stale tiny slot: the consumer takes it back when idle
            n = min(nbytes - done, room - head_size)
            if done == 0:
                head = (SLOT_HDR.pack(step, nbytes, code, ndim, FIRST, seq)
                        + SHAPES[ndim].pack(*shape))
            else:
                head = SLOT_HDR.pack(step, nbytes, code, 0, PIECE, seq)
            head += bytes(head_size - len(head))
            self._post_write([memoryview(head), payload_view(value)[done:done + n]],
                             addr, rkey, imm, value)
            done += n
        if slots is not None and not slots:
            del self.remote_slots[key]
        if done >= nbytes:
            self._progress.pop(key, None)
            return True
        self._progress[key] = done
        if key not in self._asked and not self.remote_slots.get(key):
            self._want(key, size, [])
        return False

    def _want(self, key: str, need: int, released: list[int]) -> None:
        self._asked[key] = self._loop.time() + self.grant_timeout
        self._channel._control({"op": "want", "k": key, "n": need, "rel": released})

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
        head = SLOT_HDR.pack(step, nbytes, code, ndim, WHOLE, seq) + SHAPES[ndim].pack(*shape)
        head += bytes(slot_header_size(ndim) - len(head))
        self._post_write([memoryview(head), payload_view(value)], addr, rkey, imm, value)

    def _post_write(self, views: list[memoryview], addr: int, rkey: int, imm: int, keep: Any) -> None:
        wr_id = next(self._wr_ids)
        staged = None
        if self._needs_registered_source:
            sources, staged = self._registered(views)
        else:
            sources = [(v, 0, 0) for v in views]
        self.writes += 1
        if imm < 0:   # a plain write (no immediate): the write after it says it is done
            done = self._ep.write_plain(sources, addr, rkey, wr_id)
        else:
            done = self._ep.write(sources, addr, rkey, imm, wr_id)
        if not done:
            self.inflight[wr_id] = (keep, staged)
        elif staged is not None:
            self._pool.free(staged)

    def _registered(self, views: list[memoryview]) -> tuple[list[tuple[Any, ...]], Block | None]:
        """Sources in registered memory: as they are if they already are, else staged."""
        lookup = self._pool.lookup
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
        block = self._pool.alloc(total)
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
                 SHAPES[ndim].pack(*shape), wire]
        if nbytes:
            parts.append(payload_view(value))
        self.inline += 1
        wr_id = next(self._wr_ids)
        if not self._ep.send(parts, wr_id):
            self.inflight[wr_id] = (None, None)

    def sent(self, wr_id: int) -> None:
        """The completion of a posted write or message: what it read may go."""
        keep = self.inflight.pop(wr_id, None)
        if keep is not None and keep[1] is not None:
            self._pool.free(keep[1])

    def send_credit(self, nbytes: int) -> None:
        """The node's push-window credit for the peer, in order with our one-sided traffic."""
        channel = self._channel
        if channel.failed is None and not channel.closed:
            try:
                self._ep.send([MSG_HDR.pack(MSG_CREDIT, 0, 0, 0, 0, 0, 0, nbytes, 0)],
                              next(self._wr_ids))
                return
            except TransportError as exc:
                channel.fail(exc)
        channel.conn.write_frame(_codec.encode_credit(nbytes))

    # -- answers --------------------------------------------------------------------------------

    def _try_answer(self, item: tuple[Any, ...]) -> bool:
        step, request_id, key, value, code, shape, nbytes, seq = item
        dest = self._remote_dests.pop(request_id, None)
        if dest is _WAITING or dest is _LATER:
            self._remote_dests[request_id] = dest
            return False
        if dest is not None:
            imm, addr, rkey, trailer, dcode, dshape, dnbytes = dest
            if dcode == code and dshape == shape and dnbytes == nbytes:
                number = memoryview(SEQ_TRAILER.pack(seq))
                if trailer is None:
                    self._post_write([payload_view(value), number], addr, rkey, imm, value)
                else:   # a recv's buffer: the payload, then its number with the immediate
                    self._post_write([payload_view(value)], addr, rkey, -1, value)
                    self._post_write([number], trailer[0], trailer[1], imm, value)
                return True
        if fits_inline(key, shape, nbytes, self._inline_limit):
            self._send_inline(item)   # the consumer frees the destination it had, if any
            return True
        self._remote_dests[request_id] = _WAITING
        self.meta += 1
        self._channel._control({"op": "meta", "r": request_id, "st": step, "k": key, "c": code,
                                "s": list(shape), "n": nbytes})
        return False

    def answered_here(self, request_id: int) -> None:
        """The connection carried the answer to ``request_id`` (its key's values go that
        way): the destination the consumer offered for it will not be written."""
        self._remote_dests.pop(request_id, None)

    def cancelled(self, request_id: int) -> None:
        """The consumer cancelled ``request_id`` while we held it unanswered: it frees the
        destination it offered, and forgets the request either way (without this, every
        cancelled request it offered none for stayed in its asks)."""
        dest = self._remote_dests.pop(request_id, None)
        if dest is not _WAITING:
            self._channel._control({"op": "gone", "r": request_id})

    # -- control messages from the consumer -----------------------------------------------------

    def on_slots(self, f: dict[str, Any]) -> None:
        """Slots granted for a key: its waiting values go into them."""
        key = str(f["k"])
        for desc in f.get("m", ()):
            self._ep.add_region(desc)
        self._asked.pop(key, None)
        slots = self.remote_slots.get(key)
        if slots is None:
            slots = self.remote_slots[key] = deque()
        for imm, addr, rkey, size in f["s"]:
            slots.append((int(imm), int(addr), int(rkey), int(size)))
        self._drain_pending(key)
        if key not in self.out_pending and self.remote_slots.get(key) == deque():
            del self.remote_slots[key]

    def on_revoke(self, f: dict[str, Any]) -> None:
        """The consumer wants unused slots of a key back."""
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
        self._channel._control({"op": "rel", "k": key, "s": [s[0] for s in released]})
        if key in self.out_pending and not self.remote_slots.get(key) and key not in self._asked:
            self._drain_pending(key)   # still needed: ask again, behind the others

    def on_unmap(self, f: dict[str, Any]) -> None:
        """Regions of the consumer that hold nothing of ours any more."""
        for rkey in f["rk"]:
            self._ep.remove_region(int(rkey))

    def on_dest(self, f: dict[str, Any]) -> None:
        """Where to write the answer to a request; again (``re``) after our ``meta``."""
        request_id = int(f["r"])
        for desc in f.get("m", ()):
            self._ep.add_region(desc)
        trailer = f.get("t")
        if trailer is not None:   # the buffer of the consumer's recv (buffers.py)
            if not hasattr(self._ep, "write_plain"):
                raise TransportError(f"{self._channel.name} cannot write into a recv's buffer")
            trailer = (int(trailer[0]), int(trailer[1]))
        self._remote_dests[request_id] = (int(f["i"]), int(f["a"]), int(f["rk"]), trailer,
                                          int(f["c"]), tuple(int(d) for d in f["s"]), int(f["n"]))
        if len(self._remote_dests) > _REMOTE_DESTS_MAX:
            self._evict_dests()
        if f.get("re"):
            self._drain_pending(str(f["k"]))

    def on_later(self, f: dict[str, Any]) -> None:
        """The destination of a request that follows comes after it: its answer waits."""
        self._remote_dests[int(f["r"])] = _LATER
        if len(self._remote_dests) > _REMOTE_DESTS_MAX:
            self._evict_dests()

    def _evict_dests(self) -> None:
        # Entries of requests that were answered with ERROR are never claimed; drop the oldest.
        for request_id in list(self._remote_dests)[: _REMOTE_DESTS_MAX // 4]:
            if self._remote_dests[request_id] is not _WAITING:
                del self._remote_dests[request_id]

    # -- the watchdog and the end ---------------------------------------------------------------

    def grants_overdue(self, now: float) -> bool:
        """Fail the channel if a want of ours went unanswered for ``grant_timeout``."""
        for key, deadline in self._asked.items():
            if now > deadline:
                channel = self._channel
                channel.fail(TransportError(
                    f"{channel.name}: {channel.peer_name} granted no slot for key {key} within "
                    f"{self.grant_timeout:g}s"))
                return True
        return False

    def close(self) -> None:
        self._progress.clear()
        for keep in self.inflight.values():
            if keep[1] is not None:
                self._pool.free(keep[1])
        self.inflight.clear()
        self.out_pending.clear()
        self.remote_slots.clear()
        self._remote_dests.clear()

"""What a channel receives, turned into values for the node: writes and inline messages.

A write into a slot or a destination is handed to the application in place: the array is a
view of the peer's region, and the slot or destination stays taken (``Pool.array``) until
that array and every view of it are gone; then a slot returns to the producer's budget
(``SlotGrants.returned``).  Arrays lent that way hold at most half of their region's budget
(``LEND_SHARE``); past it, and always with ``Node(shm_copy=True)``, the value is copied out
into our own pool and its memory freed at once, so the peer never reaches an array it
delivered.  A value larger than a slot arrives in pieces and is assembled here; inline
messages and ``bytes`` are copies.  Everything goes to the node like TCP DATA frames
(``deliver``), one batch per pass over a completion queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _impl
from ..errors import TransportError
from .layout import (
    DTYPES,
    FIRST,
    MSG_CREDIT,
    MSG_HDR,
    MSG_VALUE,
    PIECE,
    SEQ_TRAILER,
    SHAPES,
    SLOT_HDR,
    WHOLE,
    check_meta,
    slot_header_size,
)
from .pool import Block, Pool
from .regions import BUFFER, FENCED, SLOT, PeerRegions

if TYPE_CHECKING:
    from .destinations import Destinations
    from .engine import Channel
    from .grants import SlotGrants

_codec = _impl.codec
_MAX_NDIM = _codec.MAX_NDIM
# The share of a region's budget that arrays lent to the application may hold.  The rest is
# what the producer writes into meanwhile: at least one slot as large as any value lent,
# so an application that keeps every array it receives costs a copy per value from there
# on, never a stalled producer; a value of more than half the budget is always copied.
LEND_SHARE = 2
_LENT = 6   # the item of a write's event that says its value is the block itself


class Delivery:
    """The values one channel received and has not handed to the node yet."""

    def __init__(self, channel: Channel, regions: PeerRegions, grants: SlotGrants,
                 destinations: Destinations) -> None:
        engine = channel.engine
        self._channel = channel
        self._conn = channel.conn
        self._pool = channel.pool
        self._node = engine.node
        self._remember = engine.remember
        self._regions = regions
        self._grants = grants
        self._destinations = destinations
        self._copy = engine.copy_out     # Node(shm_copy=True): never lend a peer's memory
        self._partial: dict[str, list[Any]] = {}       # key -> a value arriving in pieces
        self._events: list[tuple[Any, ...]] = []
        # Values written into recvs' buffers among the events: (index, into= target).
        self._landed: list[tuple[int, Any]] = []

    def on_write(self, imm: int, nbytes: int) -> None:
        """The peer's write of ``nbytes`` into the target numbered ``imm`` completed."""
        target = self._regions.targets.pop(imm, None)
        if target is None:
            raise TransportError(f"write with unknown immediate {imm}")
        block = target.block
        key = target.key
        event: tuple[Any, ...] | None = None
        if target.kind == SLOT:
            self._grants.written(imm, key, block.size)
            try:
                event = self._on_slot(block, key, nbytes)
            finally:
                if event is None or not event[_LENT]:   # copied out (or refused): free at once
                    self._regions.arena.free(block)
            if event is None:
                return
        elif target.kind >= BUFFER:
            self._into_buffer(imm, target, nbytes)
            return
        else:
            try:
                if nbytes != target.nbytes + SEQ_TRAILER.size:
                    raise TransportError(f"write of {nbytes} bytes into a destination of "
                                         f"{target.nbytes} for key {key}")
                request_id = target.request_id
                self._destinations.written(request_id)
                code, shape, size = target.code, target.shape, target.nbytes
                (seq,) = SEQ_TRAILER.unpack_from(block.view(size, SEQ_TRAILER.size))
                event = (target.step, request_id, code, shape, size,
                         *self._take(self._regions.dest_arena, block, 0, code, shape, size), seq)
            finally:
                if event is None or not event[_LENT]:
                    self._regions.dest_arena.free(block)
        step, request_id, code, shape, size, value, _, seq = event
        self._remember(key, code, shape, size)
        self._events.append((_codec.DATA, step, request_id, key, value, seq))

    def _into_buffer(self, imm: int, target: Any, nbytes: int) -> None:
        """The trailer of an answer written into a recv's buffer: the payload is there."""
        arena = self._regions.dest_arena
        try:
            if target.kind == FENCED:
                # The payload went in before the fence, the completion came after it: the
                # buffer is the caller's again.  A reset makes the producer send it again.
                self._channel.fail(ConnectionResetError(
                    f"{self._channel.name}: an answer for key {target.key} was written into "
                    "a recv's buffer that had stopped waiting"))
                return
            if nbytes != SEQ_TRAILER.size:
                raise TransportError(f"write of {nbytes} bytes into the trailer of key "
                                     f"{target.key}")
            (seq,) = SEQ_TRAILER.unpack_from(target.block.view(0, SEQ_TRAILER.size))
        finally:
            arena.free(target.block)
        offer = self._destinations.written(target.request_id)
        if offer is None:
            raise TransportError(f"write into the buffer of a request settled already "
                                 f"(key {target.key})")
        key = target.key
        self._remember(key, target.code, target.shape, target.nbytes)
        self._landed.append((len(self._events), offer.target))
        self._events.append((_codec.DATA, target.step, target.request_id, key,
                             (target.code, target.shape), seq))

    def _on_slot(self, block: Block, key: str, nbytes: int) -> tuple[Any, ...] | None:
        """A filled slot: the whole value, or one piece of a larger one (then ``None``
        until its last piece); ``(step, 0, code, shape, size, value, lent, seq)``, ``lent``
        when the value is the slot itself."""
        view = block.view()
        if nbytes > block.size:
            raise TransportError(f"write of {nbytes} bytes into a slot of {block.size}")
        step, size, code, ndim, flags, seq = SLOT_HDR.unpack_from(view, 0)
        if ndim > _MAX_NDIM or flags > PIECE:
            raise TransportError(f"slot of key {key} holds {ndim} dims, flags {flags}")
        shape = SHAPES[ndim].unpack_from(view, SLOT_HDR.size)
        start = slot_header_size(ndim)
        part = self._partial.get(key)
        if flags == PIECE:
            if part is None or ndim != 0 or (step, code, size) != (part[1], part[2], part[4]):
                raise TransportError(f"a piece of key {key} that continues no value")
        elif part is not None:
            raise TransportError(f"key {key}: a new value before the last piece of the previous one")
        if flags != PIECE:
            check_meta(key, code, shape, size, self._node.max_payload)
        if flags == WHOLE:
            if nbytes != start + size:
                raise TransportError(f"write of {nbytes} bytes into a slot of {block.size} "
                                     f"does not match its header ({size} bytes)")
            return (step, 0, code, shape, size,
                    *self._take(self._regions.arena, block, start, code, shape, size), seq)
        n = nbytes - start
        done = 0 if part is None else part[5]
        if n <= 0 or done + n > size or (flags == FIRST and n >= size):
            raise TransportError(f"a piece of {n} bytes of key {key} at {done} of {size}")
        if part is None:
            whole = self._pool.alloc(size)
            part = self._partial[key] = [whole, step, code, shape, size, 0, seq]
        whole = part[0]
        whole.view(done, n)[:] = block.view(start, n)
        part[5] = done + n
        if part[5] < size:
            return None
        del self._partial[key]
        _, step, code, shape, size, _, seq = part
        return step, 0, code, shape, size, self._value(whole, code, shape, size), False, seq

    def _take(self, arena: Pool, block: Block, start: int, code: int, shape: tuple[int, ...],
              nbytes: int) -> tuple[Any, bool]:
        """The value a peer wrote into ``block`` of ``arena``, and whether it is lent: an
        array over the block itself while the arrays lent from ``arena`` leave the producer
        its share of the budget (``LEND_SHARE``), else a copy in our pool."""
        dtype = DTYPES[code]
        if (dtype is not None and nbytes and not self._copy
                and arena.lent + block.size <= arena.limit // LEND_SHARE):
            return arena.array(block, dtype, shape, start), True
        return self._copy_out(block, start, code, shape, nbytes), False

    def _copy_out(self, block: Block, start: int, code: int, shape: tuple[int, ...],
                  nbytes: int) -> Any:
        """The value a peer wrote into its region, moved into memory only we can reach."""
        dtype = DTYPES[code]
        if dtype is None:
            return bytes(block.view(start, nbytes))
        if nbytes == 0:
            return np.empty(shape, dtype)
        mine = self._pool.alloc(nbytes)
        mine.view(0, nbytes)[:] = block.view(start, nbytes)
        return self._pool.array(mine, dtype, shape)

    def _value(self, block: Block, code: int, shape: tuple[int, ...], nbytes: int) -> Any:
        """An array over a block of our pool (``bytes`` are copied out of it)."""
        dtype = DTYPES[code]
        if dtype is None:
            data = bytes(block.view(0, nbytes))
            self._pool.free(block)
            return data
        return self._pool.array(block, dtype, shape)

    def on_message(self, data: bytes) -> None:
        """An inline message: a value, or the node's push-window credit."""
        kind, code, ndim, _, klen, step, request_id, nbytes, seq = MSG_HDR.unpack_from(data, 0)
        if kind == MSG_CREDIT:
            self._events.append((_codec.CREDIT, nbytes))
            return
        if kind != MSG_VALUE or ndim > _MAX_NDIM:
            raise TransportError(f"unknown message kind {kind} or {ndim} dims")
        shape = SHAPES[ndim].unpack_from(data, MSG_HDR.size)
        kstart = MSG_HDR.size + 8 * ndim
        key = data[kstart:kstart + klen].decode("utf-8")
        check_meta(key, code, shape, nbytes, self._node.max_payload)
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
            self._destinations.forget(request_id)
        self._remember(key, code, shape, nbytes)
        self._events.append((_codec.DATA, step, request_id, key, value, seq))

    def deliver(self) -> None:
        """Hand what the completions produced to the node, like TCP DATA frames."""
        events = self._events
        if events:
            self._events = []
            if self._landed:
                self._buffers(events)
            self._conn.deliver(events)

    def _buffers(self, events: list[tuple[Any, ...]]) -> None:
        """The values written into recvs' buffers, as they go to the node now: the buffer
        itself for a recv that gets it (no value of its key ahead of it), else a copy."""
        data = _codec.DATA
        keys = [event[3] if event[0] == data else None for event in events]
        for index, into in self._landed:
            event = events[index]
            code, shape = event[4]
            first = event[3] not in keys[:index]
            events[index] = (*event[:4], into.written(code, shape, first), event[5])
        self._landed = []

    def close(self) -> None:
        for part in self._partial.values():
            self._pool.free(part[0])
        self._partial.clear()

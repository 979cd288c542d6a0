"""The asyncio shell around the sans-IO codec: one TCP connection to one peer.

This is where bytes hit the socket (``Connection._write``) and where they come off it
(``get_buffer`` / ``buffer_updated``, which the decoder serves).  Everything protocol-level
is decided by the node; this class only moves frames.

Small frames issued in one loop iteration are coalesced into one write, flushed by a
``call_soon`` callback at the end of the iteration.  A large payload is not copied into that
buffer: the pending small frames and its header are flushed, then the payload is handed to
the transport as a view of the caller's array (scatter-gather without concatenation).
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _impl
from .errors import PeerLost, ProtocolError

if TYPE_CHECKING:
    from .node import Node, Peer

_codec = _impl.codec

# A payload up to this size is copied into the coalescing buffer; above it, it is written
# as a separate view.  Copying 16 KiB costs less than a second write call.
COALESCE_MAX = 16384
# A producer that never yields to the loop still gets its frames out once this many bytes
# are pending, so the consumer can work in parallel.
FLUSH_AT = 65536
WRITE_HIGH_WATER = 8 << 20
WRITE_LOW_WATER = 2 << 20


class Connection(asyncio.BufferedProtocol):
    """One framed, bidirectional connection; ``outbound`` if this side dialled it."""

    def __init__(self, node: Node, outbound: bool, peer: Peer | None = None,
                 max_payload: int = _codec.DEFAULT_MAX_PAYLOAD) -> None:
        self.node = node
        self.outbound = outbound
        self.peer = peer                  # known from the start when dialling, else at HELLO
        self.ready = False                # HELLO received
        self.hello_waiter: asyncio.Future[None] | None = None
        self.bye_received = False
        self.closed_here = False          # we closed it gracefully: not a lost peer
        self.closed = False
        self.close_reason: BaseException | None = None
        self.decoder = _codec.Decoder(max_payload=max_payload, pool=node._recv_pool)
        self.parked: dict[int, Any] = {}  # request id -> RemoteWaiter parked in our table
        # The rvz.onesided Channel this connection negotiated at HELLO (shm, verbs): DATA
        # then goes one-sided through it, and its control frames are handed to it.
        self.dataplane: Any = None
        self.bytes_out = 0
        self.seen_in = 0                  # decoder.bytes_in at the last heartbeat tick
        self.seen_out = 0
        self.idle_ticks = 0
        self._transport: Any = None
        self._out = bytearray()
        self._flush_scheduled = False
        self._paused = False
        self._gather = False
        self.on_resume: Callable[[Connection], None] | None = None  # the node's push queue
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._loop = asyncio.get_running_loop()

    # -- asyncio protocol callbacks -------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = transport
        # uvloop's writelines is a real writev, asyncio's is one from Python 3.12 (before,
        # it joins the buffers: a copy of the payload).
        self._gather = sys.version_info >= (3, 12) or type(transport).__module__.startswith("uvloop")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)
        fields = self.node.hello_fields()
        hub = getattr(self.node, "_onesided", None)
        if hub is not None:
            fields.update(hub.offer(self))  # one-sided endpoints this connection may use
        self.write_frame(_codec.encode_hello(fields))
        self.node._on_connection_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        view: memoryview = self.decoder.get_buffer(sizehint)
        return view

    def buffer_updated(self, nbytes: int) -> None:
        try:
            events = self.decoder.buffer_updated(nbytes)
        except ProtocolError as exc:
            self.fail(exc)
            return
        if events:
            if not self.ready and len(events) > 1:
                # HELLO (always the first frame) may attach a dataplane; the frames that came
                # in the same read after it must already go through that dataplane.
                self.node._dispatch(self, events[:1])
                events = events[1:]
                if self.closed:
                    return
            if self.dataplane is not None:
                events = self.dataplane.on_frames(events)
            self.node._dispatch(self, events)

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.close_reason is None:
            if exc is not None:
                self.close_reason = exc
            elif not self.bye_received:
                self.close_reason = ConnectionResetError("connection closed by the peer without BYE")
        self._wake_drain()
        if self.dataplane is not None:
            self.dataplane.close()  # delivers what already arrived one-sided, frees the rest
        self.node._on_connection_lost(self)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drain()
        callback = self.on_resume
        if callback is not None:
            self.on_resume = None
            callback(self)

    # -- writing ----------------------------------------------------------------------------

    def write_frame(self, frame: bytes) -> None:
        """Queue a small frame; it leaves with the others of this loop iteration."""
        if self.closed:
            return
        self._out += frame
        self._queued()

    def write_value(self, step: int, request_id: int, key: bytes, value: Any, code: int,
                    shape: tuple[int, ...], nbytes: int) -> None:
        """Queue a DATA frame: header in the coalescing buffer, a large payload by reference."""
        if self.closed:
            raise self.lost_error()
        if self.dataplane is not None:  # shm / verbs: the payload goes one-sided
            self.dataplane.write_value(step, request_id, key, value, code, shape, nbytes)
            return
        header = _codec.encode_data(step, request_id, key, code, shape, nbytes)
        if nbytes <= COALESCE_MAX:
            out = self._out
            out += header
            if nbytes:
                out += _codec.payload_view(value)
            self._queued()
        elif not self.closed_here:
            # Pending small frames, this header and the payload leave in one gathered write.
            out = self._out
            out += header
            self._out = bytearray()
            self._write(out, _codec.payload_view(value))

    def _queued(self) -> None:
        """Frames were added to ``_out``: write now if enough is pending, else at the end of
        this loop iteration."""
        if len(self._out) >= FLUSH_AT:
            self._write_out()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write what is pending (the end-of-iteration callback)."""
        self._flush_scheduled = False
        self._write_out()

    def _write_out(self) -> None:
        if self._out and not self.closed:
            data = self._out
            self._out = bytearray()  # the transport may keep a reference to ``data``
            self._write(data)

    def _write(self, data: bytearray, payload: memoryview | None = None) -> None:
        """Where bytes hit the socket: ``data``, then a large ``payload`` by reference."""
        transport = self._transport
        assert transport is not None
        if self.closed_here:
            return  # after write_eof() the transport refuses writes; nothing more may go out
        self.bytes_out += len(data)
        if payload is None:
            transport.write(data)
            return
        self.bytes_out += payload.nbytes
        if self._gather:
            transport.writelines((data, payload))  # one writev: no copy, one system call
        else:
            transport.write(data)
            transport.write(payload)

    @property
    def paused(self) -> bool:
        return self._paused

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its low-water mark."""
        while self._paused and not self.closed:
            waiter = self._loop.create_future()
            self._drain_waiters.append(waiter)
            await waiter
        if self.closed:
            raise self.lost_error()

    def _wake_drain(self) -> None:
        waiters = self._drain_waiters
        self._drain_waiters = []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- closing ------------------------------------------------------------------------------

    def lost_error(self, key: str | None = None) -> PeerLost:
        name = self.peer.name if self.peer is not None else "an unidentified peer"
        where = f" (key {key})" if key else ""
        err = PeerLost(f"connection to {name} is closed{where}: {self.close_reason}")
        err.__cause__ = self.close_reason
        return err

    def close(self) -> None:
        """Flush and close after what is already queued (our side's graceful close).

        A half-close: EOF goes out after the queued bytes and we keep reading until the peer
        closes its side (``connection_lost`` follows).  Closing outright while the peer's
        pings or credits are still unread makes the kernel send RST, which throws away what
        we sent that is still in flight.
        """
        self.flush()
        self.closed_here = True
        transport = self._transport
        if transport is not None and not transport.is_closing():
            if transport.can_write_eof():
                transport.write_eof()
            else:
                transport.close()

    def fail(self, reason: BaseException) -> None:
        """Close at once: a protocol error, a heartbeat timeout, an abort."""
        if self.close_reason is None:
            self.close_reason = reason
        if self._transport is not None:
            self._transport.abort()

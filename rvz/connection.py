"""The TCP transport: the asyncio shell around one ``Wire`` of the protocol engine.

Bytes come off the socket into the buffer the wire's ``get_buffer`` offers, and
``Wire.buffer_updated`` hands every frame of a read to the engine in one call; bytes go
to the socket through ``Wire._write`` and the transport's ``write`` / ``writelines``.  Those
are compiled (``rvz._fast.engine``): a message passes no interpreted frame of this module.
What is here is the connection's life-cycle (handshake deadline, pause and resume, drain,
close), the socket's options, and the tuning of large reads (``tune_read``).
Connection life-cycle events go to the ``Owner`` (the node), which this module does not
import.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import socket
import sys
from typing import TYPE_CHECKING, Any, Protocol

from . import _impl
from .errors import ProtocolError

if TYPE_CHECKING:
    from ._fast.wire import Wire
else:
    Wire = _impl.wire.Wire  # the compiled or the pure-Python engine, as rvz._impl chose

log = logging.getLogger("rvz.node")

WRITE_HIGH_WATER = 8 << 20
WRITE_LOW_WATER = 2 << 20
# After a short read inside a large payload, SO_RCVLOWAT is raised to a LOWAT_SHARE-th of
# what is left (at most LOWAT_MAX), so the loop wakes once per that many bytes, not once
# per segment.  A share, not the whole rest, so that copying overlaps the arrival: what is
# copied after the last byte is on a request's critical path.  The cap keeps reads (the
# heartbeat's sign of life) regular on a slow link; a connection that still goes a
# heartbeat without a read stops using it.  A rest under LOWAT_SHARE * LOWAT_MIN arrives in
# a few wake-ups, cheaper than two setsockopt calls; ``Wire.tune_from`` checks that bound.
LOWAT_MIN = 256 << 10
LOWAT_MAX = 1 << 20
LOWAT_SHARE = 4


def _libc_setsockopt() -> Any:
    """The C library's ``setsockopt``, or None where it cannot be loaded.

    SO_RCVLOWAT changes twice per large payload, and uvloop's transport socket builds a
    ``socket.socket`` for every such call (a ``getsockname`` system call and an object),
    which costs more than the option itself.  The fd goes to the C call directly.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.setsockopt
    except (OSError, AttributeError):  # no C library to load symbols from (not POSIX)
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint)
    call.restype = ctypes.c_int
    return call


_SETSOCKOPT = _libc_setsockopt()
_INT_SIZE = ctypes.sizeof(ctypes.c_int)


class Owner(Protocol):
    """What a connection tells the node that owns it."""

    def connection_made(self, conn: Connection) -> None: ...

    def connection_lost(self, conn: Connection) -> None: ...


class Connection(Wire, asyncio.BufferedProtocol):
    """One framed, bidirectional TCP connection; ``outbound`` if this side dialled it."""

    def __init__(self, owner: Owner, core: Any, decoder: Any, outbound: bool,
                 peer: Any = None) -> None:
        Wire.__init__(self, core, outbound, peer, decoder)
        self.owner = owner
        self.hello_waiter: asyncio.Future[None] | None = None
        self.seen_in = 0                  # decoder.bytes_in at the last heartbeat tick
        self.seen_out = 0
        self.idle_ticks = 0
        self.on_resume: Any = None        # the engine's push queue, waiting for the socket
        self.nonce = b""                  # ours, in our HELLO (the handshake's challenge)
        self.hello: Any = None            # the peer's checked HELLO (rvz.handshake.Hello)
        self.opened = 0.0                 # loop time of connection_made (HELLO deadline)
        self.lowat_sock: Any = None       # the plain TCP socket whose SO_RCVLOWAT we tune
        self._lowat_fd = -1
        self._lowat = 1
        self._lowat_value = ctypes.c_int(1)  # the C call's argument, kept for its address
        self._drain_waiters: list[asyncio.Future[None]] = []
        # The large payload arriving as the heartbeat last saw it (``payload_too_slow``):
        # the decoder's frame count then, heartbeats since, and how much of it was left.
        self._payload_frame = -1
        self._payload_ticks = 0
        self._payload_left = 0

    # -- asyncio protocol callbacks -------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = transport
        # uvloop's writelines is a real writev, asyncio's is one from Python 3.12 (before,
        # it joins the buffers: a copy of the payload).
        self.gather = sys.version_info >= (3, 12) or type(transport).__module__.startswith("uvloop")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            if self.outbound and _connected_to_itself(sock):
                # Dialling a local port nobody listens on yet can connect the socket to
                # itself (TCP simultaneous open, when the kernel picks that very port as our
                # source port): it is no peer. Closed here, the dial tries again.
                self.close_reason = ConnectionRefusedError(
                    f"connected to itself at {sock.getsockname()}: nothing listens there yet")
                transport.abort()
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Not under TLS: what is left of a payload then says nothing of the bytes the
            # socket must hold (the TLS layer may already have buffered them).
            if transport.get_extra_info("sslcontext") is None and hasattr(socket, "SO_RCVLOWAT"):
                self.lowat_sock = sock
                self._lowat_fd = sock.fileno()
                self.tune_from = LOWAT_SHARE * LOWAT_MIN
        # Writing pauses (and held-back answers resume) below answer_backlog at the latest.
        high = min(WRITE_HIGH_WATER, self.core.answer_backlog)
        transport.set_write_buffer_limits(high=high, low=min(WRITE_LOW_WATER, high // 4))
        self.owner.connection_made(self)  # it says HELLO, unless it refuses the connection

    def tune_read(self) -> None:
        """After a read that stopped inside a payload with at least ``tune_from`` of it
        left (short, or large), or any read while tuned (see ``Wire.buffer_updated``): set
        SO_RCVLOWAT to a share of what is left of the payload arriving (1 between frames)."""
        if self.lowat_sock is not None:
            left = self.decoder.payload_left()
            part = left // LOWAT_SHARE
            self._set_lowat(min(part, LOWAT_MAX) if part >= LOWAT_MIN else 1)

    def _set_lowat(self, lowat: int) -> None:
        if lowat == self._lowat or self.closed or self.transport.is_closing():
            return  # (closing: the descriptor may be closed already, its number reused)
        self._lowat = lowat
        self.tuning = lowat != 1  # while raised, every read comes back here
        if _SETSOCKOPT is not None:
            self._lowat_value.value = lowat
            if _SETSOCKOPT(self._lowat_fd, socket.SOL_SOCKET, socket.SO_RCVLOWAT,
                           ctypes.addressof(self._lowat_value), _INT_SIZE) == 0:
                return
        else:
            try:
                self.lowat_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
                return
            except OSError:
                pass
        self._stop_tuning()  # not supported here: wake per segment

    def _stop_tuning(self) -> None:
        """From now on this connection wakes for every segment, and the engine no longer
        calls ``tune_read``."""
        self.lowat_sock = None
        self.tuning = False
        self.tune_from = _impl.wire.NEVER

    def read_stalled(self) -> None:
        """A heartbeat went by without a read.  In the middle of a payload that means a
        slow link: from now on this connection wakes for every segment."""
        if self.lowat_sock is not None and self._lowat > 1:
            self._set_lowat(1)
            self._stop_tuning()

    def payload_too_slow(self, heartbeat: float, grace: float, min_rate: float) -> bool:
        """At a heartbeat: whether the large payload arriving came slower than ``min_rate``
        bytes/s, on average since the first heartbeat that saw it, once ``grace`` seconds
        have passed.  Time is counted in heartbeats, which a busy or stalled loop of ours
        does not run: only the peer's slowness counts."""
        left = self.decoder.payload_left()
        if left == 0:
            self._payload_frame = -1
            return False
        frame = self.decoder.frames  # the same until this payload is whole
        if frame != self._payload_frame:
            self._payload_frame = frame
            self._payload_ticks = 0
            self._payload_left = left
            return False
        self._payload_ticks += 1
        late = self._payload_ticks * heartbeat - grace
        return late > 0 and self._payload_left - left < min_rate * late

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.core.arrived(self)  # a push cut short gives back what it reserved of the window
        if self.close_reason is None:
            if exc is not None:
                self.close_reason = exc
            elif not self.bye_received:
                self.close_reason = ConnectionResetError("connection closed by the peer without BYE")
        self._wake_drain()
        self.decoder.close()  # a payload cut short gives its receive-pool block back
        if self.dataplane is not None:
            self.dataplane.close()  # delivers what already arrived one-sided, frees the rest
        self.owner.connection_lost(self)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_drain()
        if self.deferred:
            self.core.answer_deferred(self)
        callback = self.on_resume
        if callback is not None:
            self.on_resume = None
            callback(self)

    def hand_back(self, stand_in: Any) -> Any:
        """In a forked child: put ``stand_in`` in place of the parent's transport, which
        this process must never touch, and return the parent's (to keep it referenced)."""
        parent, self.transport = self.transport, stand_in
        return parent

    # -- writing: Wire._write (compiled) hands bytes to self.transport --------------------

    def backlog(self) -> int:
        """Bytes written to the transport and not sent yet."""
        transport = self.transport
        return int(transport.get_write_buffer_size()) if transport is not None else 0

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its low-water mark."""
        loop = asyncio.get_running_loop()
        while self.paused and not self.closed:
            waiter = loop.create_future()
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

    def close(self) -> None:
        """Flush and close after what is already queued (our side's graceful close).

        A half-close: EOF goes out after the queued bytes and we keep reading until the peer
        closes its side (``connection_lost`` follows).  Closing outright while the peer's
        pings or credits are still unread makes the kernel send RST, which throws away what
        we sent that is still in flight.
        """
        self.flush()
        self.closed_here = True
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if transport.can_write_eof():
                try:
                    transport.write_eof()
                except OSError:  # the peer is already gone (asyncio raises ENOTCONN here)
                    transport.close()
            else:
                transport.close()

    def fail(self, reason: BaseException) -> None:
        """Close at once: a protocol error, a heartbeat timeout, an abort.

        A peer that broke the protocol after its handshake is told so first (ERROR
        "protocol", written before the socket closes, and nothing more is read): taken for
        a broken link, the close would make it connect again and send the same values
        again."""
        if isinstance(reason, ProtocolError) and self.ready and not self.closed:
            if self.closed_here:
                return  # told already, and closing
            if self.close_reason is None:
                self.close_reason = reason
            # Once per connection (``closed_here`` guards it): the operator's only sign that
            # a peer misbehaves, as the peer is not lost and nothing else fails here.
            log.warning("%s: closing the connection of %s: %s", self.core.name, self.peer.name,
                        reason)
            self.write_frame(_impl.codec.encode_error(0, 0, "", "protocol", str(reason)))
            self.flush()
            self.closed_here = True
            if self.transport is not None:
                self.transport.close()
            return
        if self.close_reason is None:
            self.close_reason = reason
        if self.transport is not None:
            self.transport.abort()


class TlsAccept(asyncio.Protocol):
    """A connection a TLS node accepted, before its TLS handshake (``Node.tls_accepted``).

    The node listens on plain TCP, so that it counts a connection as unidentified from
    accept() (``max_unidentified``) and refuses one too many before a byte is read or an
    SSL object made.  This protocol only hands the new transport to the node, in
    ``connection_made``, before the transport has read anything.
    """

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def connection_made(self, transport: Any) -> None:
        self.owner.tls_accepted(transport)


def _connected_to_itself(sock: Any) -> bool:
    try:
        return bool(sock.getsockname() == sock.getpeername())
    except OSError:  # already reset: not ours to judge here, connection_lost follows
        return False

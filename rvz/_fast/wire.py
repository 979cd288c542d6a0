"""One connection's protocol state (``Wire``): its decoder, and the coalescing write buffer
where frames are packed and where bytes reach the transport (``Wire._write``).

A stream transport (``rvz.connection.Connection``, TCP) is a ``Wire`` with the asyncio
life-cycle added: it reads into ``get_buffer`` and hands each read to ``buffer_updated``,
which decodes every frame of it and hands them to the engine in one ``dispatch`` call.
The engine is seen here only as a ``Dispatcher`` (``rvz._fast.engine.Core`` is one), so
that this module does not import it.
"""

from __future__ import annotations

from time import monotonic_ns
from typing import Any

from ..errors import AuthError, PeerLost, ProtocolError, TransportError, WrongEndpoint
from . import arrays as _arrays
from . import codec as _codec
from .codec import (
    MANY_OVERHEAD,
    MANY_PAYLOAD,
    MAX_MANY,
    MAX_NDIM,
    encode_error,
    encode_seq,
)
from .format import NUMBER
from .peers import MESSAGE_COST, UNACKED

try:  # Cython's own module; a compiled build sees the constant True
    import cython
    COMPILED = cython.compiled
except ImportError:  # pure Python without Cython installed
    COMPILED = False

describe = _arrays.describe  # a value sent before: its description, made again
append_data = _arrays.append_data  # checks ndim; a route's key length is checked once
many_begin = _arrays.many_begin
append_request = _arrays.append_request
many_entry = _arrays.many_entry
many_end = _arrays.many_end
MANY_HEAD = _arrays.MANY_HEAD_SIZE   # a DATA_MANY frame's header and metadata

# A payload up to this size is copied into the coalescing buffer; above it, it is written
# as a separate view.  Copying 16 KiB costs less than a second write call.
COALESCE_MAX = 16384
# A producer that never yields to the loop still gets its frames out once this many bytes
# are pending, so the consumer can work in parallel.
FLUSH_AT = 65536
# Large payloads written in one loop iteration wait for its end to leave in one gathered
# write (all but the first, unless the iteration before wrote a group), unless this many
# payload bytes are waiting already.  (A module attribute in both builds, for the tests: it
# is read once per gathered payload only.)
GATHER_AT = 1 << 20
# A read at least this large means large payloads: the receive pool prepares its next
# block after the loop iteration (``RecvPool.maintain``, scheduled by ``Wire.buffer_updated``).
LARGE_READ = 65536
# Pending frames up to this size go to the transport as ``bytes``, a copy of the coalescing
# buffer: uvloop writes ``bytes`` as they are, and wraps any other buffer in a memoryview
# cast first, which costs more than copying a few KiB (a 64 B ping-pong's every write).
COPY_WRITE_MAX = 4096
# A frame that leaves alone at once opens a span of this many nanoseconds in which the next
# frames of its connection wait for an end-of-iteration flush and leave together (see
# ``Wire._at_once``); a read from the peer, or the flush, closes it sooner.  Long enough
# that what a caller does between two frames of one group (an answer and its request) does
# not split it; short enough that a producer on a timer, which reads nothing between its
# sends, still sends each at once.
ALONE_NS = 1_000_000
NEVER = 1 << 62  # ``Wire.tune_from`` of a transport that does not tune its reads
# A connection with a one-sided channel remembers which way each key's values go (see
# ``Wire.goes_onesided``) for this many keys; the values of keys beyond it go one-sided.
KEY_WAYS_MAX = 1 << 14


def frame_data(out: bytearray, step: Any, request_id: Any, key: bytes, code: int, shape: tuple,
               nbytes: int, value: Any, with_payload: bool) -> None:
    """Append a DATA frame to ``out`` (arrays.pyx's C call, compiled: no argument boxed)."""
    if COMPILED:
        append_data_c(  # type: ignore[name-defined]  # noqa: F821
            out, step, request_id, key, code, shape, nbytes, value, with_payload)
    else:
        append_data(out, step, request_id, key, code, shape, nbytes, value, with_payload)


def copy_bytes(data: bytearray) -> bytes:
    """``bytes(data)`` (compiled, one C call: the type call asks for a buffer export and
    costs five times as much for a 64 B ping-pong's write)."""
    if COMPILED:
        return PyBytes_FromStringAndSize(  # type: ignore[name-defined]  # noqa: F821
            PyByteArray_AS_STRING(data), len(data))  # type: ignore[name-defined]  # noqa: F821
    return bytes(data)


def reserved(room: int) -> bytearray:
    """An empty write buffer with room for ``room`` bytes (compiled: allocated once, not
    grown by reallocs that copy it as it fills; pure Python: a plain bytearray)."""
    if COMPILED:
        return reserved_c(room)  # type: ignore[name-defined]  # noqa: F821
    return bytearray()


def emptied(data: bytearray) -> bytearray:
    """An empty write buffer in place of ``data``, whose bytes were copied (compiled:
    ``data`` itself, its room kept unless it is more than a small write needs, which an
    idle connection would hold on to; pure Python: a new bytearray)."""
    if COMPILED:
        return emptied_c(data, 2 * COPY_WRITE_MAX)  # type: ignore[name-defined]  # noqa: F821
    return bytearray()


def clock_ns() -> int:
    """Monotonic nanoseconds (``time.monotonic_ns``; compiled, ``clock_gettime`` itself)."""
    if COMPILED:
        return monotonic_ns_c()  # type: ignore[name-defined]  # noqa: F821
    return monotonic_ns()


class Dispatcher:
    """What a connection asks of the engine that owns it (``rvz._fast.engine.Core``)."""

    loop: Any  # the event loop the connection's flushes are scheduled on
    name: str  # the node's name, for what the connection logs
    answer_backlog: int  # unsent output beyond which answers wait (the writer pauses below it)
    into: Any  # the recvs waiting with an into= buffer (``rvz._fast.into.Landings``)

    def dispatch(self, conn: Wire, events: list) -> None:
        """Handle every frame decoded from one read (or one batch of completions)."""
        raise NotImplementedError

    def admit(self, conn: Wire, step: Any, request_id: Any, key: str, nbytes: Any) -> None:
        """Check a large DATA frame at its header, before its payload arrives."""
        raise NotImplementedError

    def arrived(self, conn: Wire) -> None:
        """The payload of the DATA frame admitted at its header is whole."""
        raise NotImplementedError

    def answer_deferred(self, conn: Wire) -> None:
        """The connection's output drained: write the answers held back meanwhile."""
        raise NotImplementedError


class Wire:
    """One connection's protocol state and its coalescing write buffer.

    Small frames issued in one loop iteration are coalesced into one write, flushed by a
    ``call_soon`` callback at the end of the iteration; a frame alone leaves at once, and
    schedules nothing (``_at_once`` says which).  A large payload is not copied into that
    buffer: the pending frames and its header go first, then the payload is handed to the
    transport as a view of the caller's array; alone at once, else with the others at the
    iteration's end (``_write_gathered``).
    ``_write`` hands bytes to ``transport`` (where they go to the socket); ``get_buffer`` and
    ``buffer_updated`` take them from it.  The transport subclass sets ``transport`` (and
    ``tune_from`` if it tunes its reads) and provides ``fail`` and ``tune_read``.
    """

    def __init__(self, core: Dispatcher, outbound: bool, peer: Any, decoder: Any) -> None:
        self.core = core
        self.outbound = outbound
        self.peer = peer                  # known from the start when dialling, else at HELLO
        self.decoder = decoder
        self.ready = False                # HELLO received
        self.closed = False
        self.closed_here = False          # we closed it gracefully: not a lost peer
        self.bye_received = False
        self.paused = False               # the transport's buffer is above its high-water mark
        self.close_reason: Any = None
        self.parked: dict = {}            # request id -> RemoteWaiter parked in our table
        # The rvz.onesided channel this connection negotiated at HELLO (shm, verbs): DATA then
        # goes one-sided through it, and its control frames are handed to it.
        self.dataplane: Any = None
        # With a dataplane: key -> True (its values go one-sided) or False (over this
        # connection), fixed by the key's first value (``goes_onesided``).
        self.key_ways: dict = {}
        self.key_ways_max = KEY_WAYS_MAX
        self.tcp_values = 0               # values that stayed here although a dataplane is on
        # The number the consumer gives the next value we write on this stream (0: none
        # yet, a SEQ frame says it first), and the number of the next value that arrives on
        # it (0: the peer numbers none).  A one-sided channel carries each value's number.
        self.tx_next = 0
        self.rx_seq = 0
        self.bytes_out = 0
        self.frames_out = 0
        self.data_out = 0                 # cost (payload + MESSAGE_COST) of the DATA written
        self.deferred: list = []          # answers held back while the output is backlogged
        self._out = bytearray()
        # The size of the last buffer handed to the transport whole: the next one to pack
        # DATA_MANY frames into starts with that room (``_pack``).
        self._room = 0
        self._gathered: list = []         # headers and payloads waiting for the flush, in order
        self._gathered_bytes = 0          # payload bytes in ``_gathered``
        # The DATA_MANY frame that small pushes are being packed into: where it starts in
        # ``_out`` and where it ends (it is open while it is the last thing there), its
        # step and how many values it holds.
        self._many_at = -1
        self._many_end = 0
        self._many_step: Any = None
        self._many_count = 0
        self._flush_scheduled = False
        self._hold_first = False          # the last iteration wrote more than one frame
        self._burst = 0                   # frames of this iteration (see ``_at_once``)
        self._alone_at = 0                # when a frame last left alone (see ``_at_once``)
        self.alone_ns = ALONE_NS          # that window (tests widen it)
        self._answer_queued = False       # an answer waits in ``_out`` (see ``requests_queued``)
        self._call_soon = core.loop.call_soon
        self._flush_cb = self.flush       # bound once: scheduled in every busy loop iteration
        self._read_flush_cb = self.flush_after_read
        self.transport: Any = None        # the stream transport bytes are written to
        self.gather = False               # its ``writelines`` is one gathered write (no copy)
        self.tuning = False               # the transport tunes its reads: tell it of each one
        # A read that stops inside a payload with at least this much of it left (short, or
        # large) goes to the transport's ``tune_read`` (which may raise its wake-up
        # threshold); see ``buffer_updated``.
        self.tune_from = NEVER
        # What the push whose payload arrives now reserved of its peer's window
        # (``Core.admit``); given back when it has arrived or the connection closes.
        self.arriving = 0
        if decoder is not None:
            decoder.admit = self.admit
            decoder.land = core.into.land
            decoder.stop_at_handshake = True

    # -- reading --------------------------------------------------------------------------

    # A stream transport's read callbacks (asyncio's BufferedProtocol): compiled, the loop
    # calls into the engine without an interpreted frame (ping-pong's path pays them on
    # every message).

    def get_buffer(self, sizehint: int) -> Any:
        """Where the transport reads into: the decoder's buffer, or a large payload's array."""
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` landed where ``get_buffer`` said: decode and dispatch.  After a large
        read the receive pool prepares its next block, once this loop iteration's reads are
        handled.  The transport hears of a read (``tune_read``) only while it tunes its
        reads (``tuning``), or when a read into a payload came up short (the socket had
        less than the rest of it), or a large one stopped inside a payload, with at least
        ``tune_from`` of it left: when the rest is already in the socket, as it is for a
        consumer that cannot keep up, the next read takes it whole and there is nothing to
        tune (each tuning is a system call, two per payload).  No interpreted frame runs
        for an ordinary read."""
        into_payload = self.decoder.payload_left() != 0
        self._alone_at = 0  # the peer spoke: a frame of ours may leave alone again
        self._feed(nbytes)
        if self._hold_first and not self._flush_scheduled and self.decoder.payload_left() == 0:
            # Frames go in groups here: the first of the next one will be held (``_at_once``),
            # typically an answer that a task this read woke gives before it asks for the
            # next value.  See ``flush_after_read``.  (Not after a read that stopped inside
            # a payload: a large value arrives in many, and the frame it ends wakes the task.)
            self._flush_scheduled = True
            self._call_soon(self._read_flush_cb)
        # (``self.decoder.pool`` spelled out each time: typed, so these are C reads)
        if nbytes >= LARGE_READ and self.decoder.pool is not None and not self.decoder.pool.due:
            self.decoder.pool.due = True
            # getattr: the bound method as a Python object (``.maintain`` of the typed pool
            # names its C entry, which Cython cannot hand to call_soon)
            self._call_soon(getattr(self.decoder.pool, "maintain"))  # noqa: B009
        if self.tuning or ((into_payload or nbytes >= LARGE_READ)
                           and self.decoder.payload_left() >= self.tune_from):
            self.tune_read()

    def tune_read(self) -> None:
        """The transport's (see ``buffer_updated``)."""

    def feed(self, nbytes: int) -> None:
        """``nbytes`` arrived in the decoder's buffer: decode and dispatch every frame."""
        self._feed(nbytes)

    def _feed(self, nbytes: int) -> None:
        try:
            events = self.decoder.buffer_updated(nbytes)
        except ProtocolError as exc:
            self.fail(exc)
            return
        if self.arriving != 0 and self.decoder.payload_left() == 0:
            # The push admitted at its header is whole, in ``events``: from its dispatch on
            # it counts in ``unreturned`` instead.
            self.core.arrived(self)
        while events:
            if not self.ready:
                # The handshake (HELLO, then AUTH with a secret) goes frame by frame: it says
                # who the peer is, may attach a dataplane, and the frames after it must
                # already be checked against the peer and go through that dataplane.  The
                # decoder stops after each handshake frame; more() parses the rest.
                i = 0
                n = len(events)
                while i < n and not self.ready and not self.closed:
                    self.core.dispatch(self, events[i:i + 1])
                    i += 1
                if self.closed:
                    return
                events = events[i:]
            if events:
                if self.dataplane is not None:
                    events = self.dataplane.on_frames(events)
                self.core.dispatch(self, events)
            if self.closed:
                return
            try:
                events = self.decoder.more()
            except ProtocolError as exc:
                self.fail(exc)
                return

    def deliver(self, events: list) -> None:
        """Frames that arrived another way (a one-sided channel's completions): each value
        carries its number as a sixth item, which stands in for this stream's count while
        it is dispatched."""
        stream = self.rx_seq
        try:
            for event in events:
                self.rx_seq = event[NUMBER] if len(event) > NUMBER else 0
                self.core.dispatch(self, [event])
        finally:
            self.rx_seq = stream

    # -- writing --------------------------------------------------------------------------

    def write_frame(self, frame: bytes) -> None:
        """Queue a small frame; it leaves with the others of this loop iteration."""
        if self.closed:
            return
        self._append(frame)
        self.frames_out += 1
        self._queued()

    def _append(self, frame: bytes) -> None:
        """Add a whole frame to the coalescing buffer (compiled: grown as the frames packed
        in place grow it; ``+=`` would shrink a buffer with room to spare)."""
        if COMPILED:
            append_frame_c(self._out, frame)  # type: ignore[name-defined]  # noqa: F821
        else:
            self._out += frame

    def write_request(self, step: Any, request_id: Any, key: bytes) -> None:
        """Queue a REQUEST frame, built in the coalescing buffer (``key``: a route's bytes,
        whose length was checked)."""
        if self.closed:
            return
        if COMPILED:
            append_request_c(self._out, step, request_id, key)  # type: ignore[name-defined]  # noqa: F821
        else:
            append_request(self._out, step, request_id, key)
        self.frames_out += 1
        self._queued()

    def write_value(self, step: Any, request_id: Any, key: bytes, value: Any, code: int,
                    shape: tuple, nbytes: int) -> None:
        """Queue a DATA frame: header in the coalescing buffer, a large payload by reference."""
        if self.closed:
            raise self.lost_error()
        self.frames_out += 1  # a message: a value, however it is framed
        self.data_out += nbytes + MESSAGE_COST
        # Every value is numbered and kept until acknowledged (``Credit.resend``), before it
        # goes either way: a channel that fails takes its connection with it
        # (``Channel.fail``), and the value goes again on the next one, as it would after a
        # write to a socket that broke.  Its description is made again if it is.
        peer = self.peer
        seq = peer.tx_seq + 1
        peer.tx_seq = seq
        peer.keep(step, request_id, key, value)
        if self.dataplane is not None:  # shm / verbs: the key's way (``goes_onesided``)
            if self.goes_onesided(key, request_id, nbytes):
                try:
                    self.dataplane.write_value(step, request_id, key, value, code, shape,
                                               nbytes, seq)
                except (TransportError, PeerLost):
                    if self.dataplane.failed is None and not self.dataplane.closed:
                        raise
                return
            self.tcp_values += 1
            if request_id != 0:  # the destination the consumer offered stays unused
                self.dataplane.answered_here(request_id)
        if seq != self.tx_next:
            self._append(encode_seq(seq))
        self.tx_next = seq + 1
        self._write_stream(step, request_id, key, value, code, shape, nbytes)

    def resend(self, first: int, entries: list) -> None:
        """Write values sent before, numbered from ``first``, on this connection's stream
        (a reconnect: the consumer drops those it has).  Their keys stay on the stream
        here, so a later value of one cannot overtake them through a one-sided channel."""
        self._append(encode_seq(first))
        ways = self.key_ways
        for at in range(0, len(entries), UNACKED):  # (step, request_id, key, value) each
            if self.closed:
                return
            key = entries[at + 2]
            if self.dataplane is not None and key not in ways:
                ways[key] = False
            value, code, shape, nbytes = describe(entries[at + 3])
            # Counted as written here: should this connection break too, what it carried
            # goes again (``Links._reconnect`` asks ``data_out``).
            self.data_out += nbytes + MESSAGE_COST
            self._write_stream(entries[at], entries[at + 1], key, value, code, shape, nbytes)
        self.tx_next = first + len(entries) // UNACKED

    def _write_stream(self, step: Any, request_id: Any, key: bytes, value: Any, code: int,
                      shape: tuple, nbytes: int) -> None:
        """A DATA frame (or an entry of a DATA_MANY frame) for this connection's stream."""
        if nbytes <= COALESCE_MAX:
            if request_id == 0:
                self._pack(step, key, value, code, shape, nbytes)
            else:
                frame_data(self._out, step, request_id, key, code, shape, nbytes, value, True)
                self._answer_queued = True
            self._queued()
        elif not self.closed_here:
            # The header joins the pending small frames; the payload goes by reference.
            out = self._out
            frame_data(out, step, request_id, key, code, shape, nbytes, value, False)
            self._out = bytearray()
            self._many_at = -1
            if COMPILED:  # a C call, not a module attribute and a Python one
                payload = payload_view_c(value)  # type: ignore[name-defined]  # noqa: F821
            else:
                payload = _codec.payload_view(value)
            if not self.gather:  # its writelines would copy: each payload goes by itself
                self._write(out, payload)
                return
            if self._at_once():
                # Alone (see ``_at_once``), it leaves at once, with the frames that were
                # pending: the consumer starts on it while we go on.
                self._write(out, payload)
                return
            # The others of the iteration wait for its end and leave together, in one
            # gathered write (see ``_write_out``): a system call per 256 KiB payload cost a
            # producer that cannot keep up a tenth of its time in the kernel.
            self._gathered.append(out)
            self._gathered.append(payload)
            self._gathered_bytes += nbytes
            if self._gathered_bytes >= GATHER_AT:
                self._write_out()

    def goes_onesided(self, key: bytes, request_id: Any, nbytes: int) -> bool:
        """Whether a value of ``key`` goes through the one-sided channel or this connection.

        Small values cost less here (compiled, packed with the others of the loop iteration
        into one write) than as one provider message each, handled in Python on both sides;
        large ones cost less one-sided.  The two ways are not ordered with each other at the
        consumer, so a key's first value decides for all of its values on this connection,
        pushes and answers alike (an answer taken from the push queue follows pushes of its
        key still on their way): this connection if it was a push of at most the channel's
        ``tcp_max`` bytes or an answer of at most its ``answer_tcp_max`` (shm: 64 KiB),
        else the channel (a larger answer: there the consumer offered its
        destination), which keeps each key's values in order.  Keys are remembered up to
        ``key_ways_max``; the values of keys first seen after that go one-sided, which no
        remembered key ever does unless it started so.
        """
        ways = self.key_ways
        onesided = ways.get(key)
        if onesided is None:
            if len(ways) >= self.key_ways_max:
                return True
            if request_id == 0:
                onesided = nbytes > self.dataplane.tcp_max
            else:
                onesided = nbytes > self.dataplane.answer_tcp_max
            ways[key] = onesided
        return onesided is True

    def _pack(self, step: Any, key: bytes, value: Any, code: int, shape: tuple,
              nbytes: int) -> None:
        """A small push into the coalescing buffer: into the DATA_MANY frame at its end if
        there is one of this step with room, else into a new one.  (A value alone costs no
        more in a DATA_MANY frame than in a DATA frame; consecutive ones cost 28 bytes less
        each, and their consumer decodes them into one event.)"""
        ndim = len(shape)
        if ndim > MAX_NDIM:
            raise ValueError(f"array has {ndim} dimensions; rvz carries at most {MAX_NDIM}")
        out = self._out
        if self._room != 0 and len(out) == 0:
            # A busy stream: this buffer will fill as its predecessor did.  Grown to that by
            # half at a time, it was reallocated (and copied) six times from 4 KiB to 64 KiB.
            out = self._out = reserved(self._room)
            self._room = 0
        start = self._many_at
        if (start < 0 or self._many_end != len(out) or self._many_count == MAX_MANY
                or self._many_end - start - MANY_HEAD + MANY_OVERHEAD + 8 * ndim + len(key)
                + nbytes > MANY_PAYLOAD
                or (step is not self._many_step and step != self._many_step)):
            start = self._many_at = len(out)
            self._many_step = step
            self._many_count = 0
            if COMPILED:
                many_begin_c(out, step)  # type: ignore[name-defined]  # noqa: F821
            else:
                many_begin(out, step)
        self._many_count += 1
        if COMPILED:  # arrays.pyx's C calls (cimported in engine.pxd)
            many_entry_c(out, key, code, shape, nbytes, value)  # type: ignore[name-defined]  # noqa: F821
            many_end_c(out, start, self._many_count)  # type: ignore[name-defined]  # noqa: F821
        else:
            many_entry(out, key, code, shape, nbytes, value)
            many_end(out, start, self._many_count)
        self._many_end = len(out)

    def _queued(self) -> None:
        """Frames were added: they leave now (``_at_once``), at the end of the loop iteration
        with the others of it, or earlier once FLUSH_AT bytes are pending."""
        if self._at_once() or len(self._out) >= FLUSH_AT:
            self._write_out()

    def _at_once(self) -> bool:
        """A frame was queued: whether it leaves now, alone.

        A frame leaves at once (a push or a reply waits for no loop iteration, nor for
        whatever the caller does before it next yields) unless the last iteration wrote more
        than one frame, or a frame left alone less than ``alone_ns`` ago and the peer has not
        spoken since.  Frames then come in groups (an answer and the next request of a
        Recv-Driven exchange, a burst of sends), and writing the first alone costs a second
        write here and a second wake-up at the peer, which may act on half the group
        meanwhile (an answer held there because its request is still in the second write;
        ``requests_queued`` writes such a group as soon as its request is queued): they
        leave together at the end of the iteration, from the flush this schedules.  A frame
        that leaves alone schedules nothing: the callback would find nothing to write."""
        if self._flush_scheduled:
            self._burst += 1
            return False
        now = clock_ns()
        if not self._hold_first and now - self._alone_at > self.alone_ns:
            self._alone_at = now
            self._burst = 1
            return True
        self._burst += 1  # 1 when held first, 2 after a frame that left alone
        self._flush_scheduled = True
        self._call_soon(self._flush_cb)
        return False

    def flush(self) -> None:
        """Write what is pending (the end-of-iteration callback)."""
        self._flush_scheduled = False
        self._hold_first = self._burst > 1
        self._burst = 0
        self._alone_at = 0
        self._write_out()

    def flush_after_read(self) -> None:
        """The flush a read scheduled while frames go in groups (``buffer_updated``).

        It runs right after the tasks that read woke (their callbacks were ahead of it in
        the ready queue), in the same loop pass.  When their group has already left
        (``requests_queued`` wrote an answer and its request together), it ends the group
        as the held frame's own flush would have, without the loop pass of its own that
        flush costs when a task schedules it: a poll of the kernel on every message of a
        Recv-Driven ping-pong.  What is still held (a request alone) waits for the next
        pass, as it would have: the peer's next frame may join it there."""
        if self._out or self._gathered:
            self._call_soon(self._flush_cb)
        else:
            self.flush()

    def requests_queued(self) -> None:
        """A recv that is about to wait queued its request(s).  If they follow an answer
        held back in this iteration, and nothing else did (``_burst`` counts the frames since
        the last end-of-iteration flush), the answer and the request(s) are the group the
        hold waited for: they leave now, in one write, rather than one loop iteration later
        (a Recv-Driven ping-pong's critical path).  Later groups of the same iteration (more
        tasks exchanging on this connection) still leave together at its end."""
        if self._answer_queued and self._burst <= 2:
            self._write_out()

    def _write_out(self) -> None:
        self._answer_queued = False
        if self.closed:
            return
        gathered = self._gathered
        if gathered:
            self._gathered = []
            self._gathered_bytes = 0
            if self._out:
                gathered.append(self._out)
                self._out = bytearray()
                self._many_at = -1
            self._write_gathered(gathered)
        elif self._out:
            data = self._out
            self._many_at = -1
            if len(data) <= COPY_WRITE_MAX:
                # Written as a copy: the buffer stays, with its room, for the next frames.
                small = copy_bytes(data)
                self._out = emptied(data)
                self._write(small, None)
            else:
                self._out = bytearray()  # the transport may keep a reference to ``data``
                self._room = len(data) + (len(data) >> 3)
                self._write(data, None)

    def _write(self, data: Any, payload: Any) -> None:
        """Where bytes reach the transport (and from it the socket): ``data`` (``bytes``,
        or a bytearray the transport may keep), then a large ``payload`` by reference."""
        transport = self.transport  # set before the first write (connection_made)
        if self.closed_here:
            return  # after write_eof() the transport refuses writes; nothing more may go out
        self.bytes_out += len(data)
        try:
            if payload is None:
                transport.write(data)
                return
            self.bytes_out += payload.nbytes
            if self.gather:
                transport.writelines((data, payload))  # one writev: no copy, one system call
            else:
                transport.write(data)
                transport.write(payload)
        except RuntimeError as exc:
            self._write_refused(transport, exc)

    def _write_refused(self, transport: Any, exc: RuntimeError) -> None:
        """uvloop refuses a write to a transport that is closing (aborted, or closed on the
        peer's EOF) until ``connection_lost`` comes, where asyncio drops it.  Dropped here
        too: the values it carried are kept until acknowledged and go again."""
        if not transport.is_closing():
            raise exc

    def _write_gathered(self, pieces: list) -> None:
        """Headers and large payloads of one loop iteration (see ``write_value``), then
        what was pending after them: one gathered write (``gather`` transports only)."""
        if self.closed_here:
            return
        for piece in pieces:
            self.bytes_out += len(piece) if type(piece) is bytearray else piece.nbytes
        try:
            self.transport.writelines(pieces)
        except RuntimeError as exc:
            self._write_refused(self.transport, exc)

    def backlog(self) -> int:
        """Bytes written but not yet sent (the transport's buffer)."""
        return 0

    def admit(self, step: Any, request_id: Any, key: str, nbytes: Any) -> None:
        """The decoder's check of a large DATA frame at its header (see ``Core.admit``)."""
        self.core.admit(self, step, request_id, key, nbytes)

    def fail(self, reason: BaseException) -> None:
        raise NotImplementedError  # the transport's: close at once

    def close(self) -> None:
        raise NotImplementedError  # the transport's: close after what is queued

    def peer_name(self) -> str:
        """The peer as messages name it ("an unidentified peer" before its HELLO)."""
        return self.peer.name if self.peer is not None else "an unidentified peer"

    def check_backlog(self) -> None:
        """A peer whose requests get only error replies, and that does not read them, is
        closed at ``answer_backlog`` bytes unsent: they would pile up here unbounded."""
        if self.backlog() > self.core.answer_backlog:
            raise ProtocolError(f"{self.peer.name} sends requests and does not read the replies")

    def frame_failed(self, exc: BaseException) -> None:
        """A frame of the peer's could not be handled (``Dispatcher.dispatch`` raised
        ``exc``): the connection ends, so that the peer learns why where it can."""
        if isinstance(exc, AuthError):
            if self.ready:
                self.fail(exc)
            elif self.outbound:
                # The handshake failed here, at the dialler.  Our own AUTH, queued when the
                # listener's HELLO came (often in this same read), may still be in the
                # write buffer: a reset would discard it, and the listener would see an end
                # without a word instead of a failed proof.  It leaves first.
                self.close_because(exc)
            else:
                self.refuse(exc)  # we are the listener: the dialler must learn why
            return
        if not isinstance(exc, (ProtocolError, TransportError)):
            # A peer-supplied value that breaks a conversion (task=inf, a huge shape) or a
            # key that does not route: that peer's protocol violation.
            name = self.peer_name()
            err = ProtocolError(f"{name} sent a key we cannot route: {exc}"
                                if isinstance(exc, WrongEndpoint)
                                else f"{name} sent a frame we cannot use: {exc!r}")
            err.__cause__ = exc
            exc = err
        self.fail(exc)

    def refuse(self, reason: BaseException) -> None:
        """A failed handshake, at the listener: tell the dialler why (a dialler told "auth"
        does not retry), then close after that frame."""
        self.write_frame(encode_error(0, 0, "", "auth", str(reason)))
        self.close_because(reason)

    def close_because(self, reason: BaseException) -> None:
        """Close after what we queued, for ``reason`` (unless a reason is known already):
        not a reset, which could discard it, as the peer must still get our AUTH or
        ERROR."""
        if self.close_reason is None:
            self.close_reason = reason
        if not self.closed_here:
            self.close()

    def say_bye(self) -> None:
        """Write BYE as this connection's last frame.  Nothing may follow it (the peer
        takes any frame after BYE as a protocol error), so from now on the connection
        counts as closed here and its writes are dropped."""
        self.write_frame(_codec.encode_bye())
        self.flush()
        self.closed_here = True

    def lost_error(self, key: Any = None) -> PeerLost:
        name = self.peer_name()
        where = f" (key {key})" if key else ""
        err = PeerLost(f"connection to {name} is closed{where}: {self.close_reason}")
        err.__cause__ = self.close_reason
        return err

"""The wire format: frame encoders and a sans-IO frame decoder (no asyncio here).

Every frame starts with a 16-byte header, little-endian::

    u8 version | u8 type | u16 flags (0) | u32 meta_len | u64 payload_len

followed by ``meta_len`` bytes of type-specific metadata and ``payload_len`` bytes of
payload (only DATA and DATA_MANY frames carry a payload).  DATA metadata is::

    u64 step | u64 request_id | u16 key_len | u8 dtype | u8 ndim | u64 shape[ndim] | key

``request_id`` is 0 for a Send-Driven push and the consumer's request id for a
Recv-Driven answer.  Send-Driven pushes of 16 KiB or less that follow each other in a
connection's write buffer (a ``send_many``, or the sends of one loop iteration) are packed
into a DATA_MANY frame instead, when they are of one step.  Its metadata is ``u64 step |
u32 count``, and its payload ``count`` entries, each::

    u16 key_len | u8 dtype | u8 ndim | u32 nbytes | u64 shape[ndim] | key | payload

It is bounded (MANY_PAYLOAD), so it is always read whole into the staging buffer, and it
is decoded into one event for the whole batch.  Values are numbered per peer: a SEQ frame
(``u64 seq``) gives the number of the next value on its connection, the values after it
count up from there, and the consumer's ACK (``u64 seq``) says it holds every value up to
that number.  CREDIT (``u64``) carries the running total of credit returned.  HELLO and
ERROR carry msgpack maps: they are rare, and a map lets them grow without a new version.
There is no pickle anywhere.

The decoder is fed like an ``asyncio.BufferedProtocol``: ``get_buffer()`` says where the
next bytes should land and ``buffer_updated(n)`` returns the frames they completed.  Small
frames land in a staging buffer; the payload of a large tensor lands straight in the
``np.empty`` array that will be handed to the receiver, so it is copied at most once.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np

from ..errors import ProtocolError
from . import arrays as _arrays
from . import format as _format
from .format import KEY, REQUEST_ID, STEP, VALUE

try:  # Cython's own module; a compiled build sees the constant True
    import cython
    COMPILED = cython.compiled
except ImportError:  # pure Python without Cython installed
    COMPILED = False

VERSION = _format.VERSION

HELLO = 1
DATA = _format.DATA
REQUEST = _format.REQUEST
CANCEL = 4
ERROR = 5
ABORT_STEP = 6
PING = 7
CREDIT = 8
BYE = 9
ONESIDED = 10  # control of a one-sided transport (rvz.onesided): a msgpack map
REQUESTS = 11  # several requests of one step in one frame (recv_many): decoded as REQUESTs
AUTH = 12      # the handshake's proof of the shared secret (a msgpack map), right after HELLO
DATA_MANY = _format.DATA_MANY  # 13: small Send-Driven values of one step, decoded as one event
# Exactly-once delivery across reconnects: SEQ numbers the values that follow it on a
# connection (the producer's count of values sent to that peer), ACK returns the highest
# number below which the consumer has every value.
SEQ = 14
ACK = 15

FRAME_NAMES = {HELLO: "HELLO", DATA: "DATA", REQUEST: "REQUEST", CANCEL: "CANCEL",
               ERROR: "ERROR", ABORT_STEP: "ABORT_STEP", PING: "PING", CREDIT: "CREDIT",
               BYE: "BYE", ONESIDED: "ONESIDED", REQUESTS: "REQUESTS", AUTH: "AUTH",
               DATA_MANY: "DATA_MANY", SEQ: "SEQ", ACK: "ACK"}

HEADER_SIZE = 16
MAX_NDIM = _format.MAX_NDIM
MAX_KEY = 4096           # bytes of a key on the wire
MAX_META = 65536         # bytes of any frame's metadata
# After a large payload, the next read asks for this much only: the next frame's header
# (and a DATA frame's key), not the start of the next large payload, which would otherwise
# land in the staging buffer and be copied out of it once more.
PEEK = 4096
# A larger value needs Node(max_payload=...): a header announcing a payload reserves its
# array (virtual memory) before the payload arrives.
DEFAULT_MAX_PAYLOAD = 1 << 32

_HEADER = struct.Struct("<BBHIQ")
_DATA_FIXED = struct.Struct("<QQHBB")   # 20 bytes after the header
_REQUEST_FIXED = struct.Struct("<QQH")  # 18 bytes
_U64 = struct.Struct("<Q")
_REQUESTS_FIXED = struct.Struct("<QI")  # step, count; then count x (u64 id, u16 klen, key)
_ENTRY = struct.Struct("<QH")
MAX_REQUESTS = 4096  # entries in one REQUESTS frame (its metadata is bounded by MAX_META too)
_SHAPES = [struct.Struct("<" + "Q" * n) for n in range(MAX_NDIM + 1)]
_MANY_FIXED = struct.Struct("<QI")     # step, count
_MANY_ENTRY = struct.Struct("<HBBI")   # key_len, dtype, ndim, nbytes; then shape, key, payload
# Bounds of one DATA_MANY frame: its payload (every entry, keys and values) is read whole
# into the staging buffer, and a batch larger than this goes as several frames.
MANY_PAYLOAD = 32768
MAX_MANY = 4096
MANY_OVERHEAD = _MANY_ENTRY.size  # per entry, besides its shape, key and payload
# C copies (codec.pxd types them) of what the decoder compares every frame's fields with:
# compiled, a comparison with a Python global would box the field first.
_C_HEADER = HEADER_SIZE
_C_VERSION = VERSION
_C_MAX_META = MAX_META
_C_MAX_NDIM = MAX_NDIM
_C_MAX_KEY = MAX_KEY
_C_NCODES = len(_format.DTYPES)
_C_BYTES = _format.BYTES_CODE
_C_DATA = DATA
_C_DATA_MANY = DATA_MANY
_C_HELLO = HELLO
_C_REQUEST = REQUEST
_C_REQUESTS = REQUESTS
_C_CANCEL = CANCEL
_C_CREDIT = CREDIT
_C_SEQ = SEQ
_C_ACK = ACK
_C_ENTRY = MANY_OVERHEAD
_C_MANY_PAYLOAD = MANY_PAYLOAD
_C_MAX_MANY = MAX_MANY

# The decoder's states: what the next frame may be.
_S_HELLO = 0  # only HELLO: it opens every connection
_S_OPEN = 1   # any frame but a second HELLO
_S_BYE = 2    # none: BYE was the peer's last

# dtype code 0 is a ``bytes`` value; the others are numpy dtypes, little-endian on the wire.
BYTES_CODE = _format.BYTES_CODE
DTYPES = _format.DTYPES
_CODES = _format.CODES
_append_data = _arrays.append_data
_new_array = _arrays.new_array
_block_array = _arrays.block_array
_move = _arrays.move
_U8 = np.dtype(np.uint8)
# Item size per dtype code (a byte each; 0 for bytes values): a C read when compiled.
_ITEMSIZES = bytes(0 if dt is None else dt.itemsize for dt in DTYPES)
# A 1-D length below this times an item size (16 at most) cannot overflow 64 bits.
_DIM1_LIMIT = 1 << 59
KEY_CACHE = 256  # sets of the decoder's key cache, 2 keys each (compiled): see Decoder._key
_MAX_ARRAY_BYTES = (1 << 63) - 1  # numpy's limit on itemsize times the non-zero dims
_EMPTY_LIST: list = []


def dtype_code(dtype: Any) -> int:
    """The wire code of a numpy dtype; -1 if rvz does not carry it."""
    return _CODES.get(dtype.str, -1)


describe = _arrays.describe


def payload_view(value: Any) -> memoryview:
    """A flat byte view of a described value (no copy)."""
    if isinstance(value, np.ndarray):
        if value.size == 0:
            return memoryview(b"")
        array: Any = value  # numpy's stubs do not declare the buffer protocol for 3.10
        return memoryview(array).cast("B")
    return memoryview(value)


def encode_data(step: int, request_id: int, key: bytes, code: int, shape: tuple,
                nbytes: int) -> bytes:
    """Header and metadata of a DATA frame; the payload follows it on the wire."""
    out = bytearray()
    append_data(out, step, request_id, key, code, shape, nbytes, None, False)
    return bytes(out)


def append_data(out: bytearray, step: int, request_id: int, key: bytes, code: int,
                shape: tuple, nbytes: int, value: Any, with_payload: bool) -> None:
    """Append a DATA frame to a write buffer: header and key, and the payload if asked.

    The shape and key are checked here, for any caller; the engine's own writes trust them,
    as every value it sends went through ``describe`` and every key through ``keys``."""
    if len(shape) > MAX_NDIM:
        raise ValueError(f"array has {len(shape)} dimensions; rvz carries at most {MAX_NDIM}")
    if len(key) > MAX_KEY:
        raise ValueError(f"key of {len(key)} bytes is longer than {MAX_KEY}")
    _append_data(out, step, request_id, key, code, shape, nbytes, value, with_payload)


def encode_data_many(step: int, items: list) -> bytes:
    """One DATA_MANY frame of ``items``, ``(key bytes, value)`` pairs (the engine writes
    these frames straight into its write buffer; this is for tools and tests)."""
    out = bytearray()
    _arrays.many_begin(out, step)
    for key, value in items:
        value, code, shape, nbytes = describe(value)
        if len(shape) > MAX_NDIM or len(key) > MAX_KEY:
            raise ValueError(f"value of key {key!r} does not fit a DATA_MANY entry")
        _arrays.many_entry(out, key, code, shape, nbytes, value)
    if len(out) - _arrays.MANY_HEAD_SIZE > MANY_PAYLOAD or len(items) > MAX_MANY:
        raise ValueError(f"{len(items)} values do not fit one DATA_MANY frame")
    _arrays.many_end(out, 0, len(items))
    return bytes(out)


def encode_request(step: int, request_id: int, key: bytes) -> bytes:
    klen = len(key)
    if klen > MAX_KEY:
        raise ValueError(f"key of {klen} bytes is longer than {MAX_KEY}")
    out = bytearray()
    _arrays.append_request(out, step, request_id, key)
    return bytes(out)


def encode_requests(step: int, entries: list) -> bytes:
    """One REQUESTS frame for ``entries``, a list of ``(request_id, key bytes)`` of one step."""
    parts = [b"", _REQUESTS_FIXED.pack(step, len(entries))]
    for request_id, key in entries:
        if len(key) > MAX_KEY:
            raise ValueError(f"key of {len(key)} bytes is longer than {MAX_KEY}")
        parts.append(_ENTRY.pack(request_id, len(key)))
        parts.append(key)
    meta = sum(len(p) for p in parts)
    if meta > MAX_META or len(entries) > MAX_REQUESTS:
        raise ValueError(f"{len(entries)} requests do not fit one REQUESTS frame")
    parts[0] = _HEADER.pack(VERSION, REQUESTS, 0, meta, 0)
    return b"".join(parts)


def encode_requests_split(step: int, entries: list) -> list:
    """REQUESTS frames for any number of ``entries`` (``(request_id, key bytes)``, one
    step): as many frames as the bounds on one frame's entries and metadata need, the
    entries in order."""
    frames = []
    start = 0
    meta = _REQUESTS_FIXED.size
    for i, (_, key) in enumerate(entries):
        need = _ENTRY.size + len(key)
        if i > start and (meta + need > MAX_META or i - start == MAX_REQUESTS):
            frames.append(encode_requests(step, entries[start:i]))
            start = i
            meta = _REQUESTS_FIXED.size
        meta += need
    if start < len(entries):
        frames.append(encode_requests(step, entries[start:]))
    return frames


def _u16(buf: bytearray, pos: int) -> int:
    """A little-endian u16 at ``buf[pos]`` (used compiled, as ``_u32``)."""
    return buf[pos] | buf[pos + 1] << 8


def _u32(buf: bytearray, pos: int) -> int:
    """A little-endian u32 at ``buf[pos]`` (used compiled, where indexing is a C read).

    The bytes go through unsigned 64-bit locals (see the .pxd): shifted as C ints, a top
    byte of 0x80 or more would sign-extend.
    """
    b0 = buf[pos]
    b1 = buf[pos + 1]
    b2 = buf[pos + 2]
    b3 = buf[pos + 3]
    return b0 | b1 << 8 | b2 << 16 | b3 << 24


def _u64(buf: bytearray, pos: int) -> int:
    """A little-endian u64 at ``buf[pos]``."""
    return _u32(buf, pos) | _u32(buf, pos + 4) << 32


def _encode_u64(ftype: int, n: int) -> bytes:
    return _HEADER.pack(VERSION, ftype, 0, 8, 0) + _U64.pack(n)


def encode_cancel(request_id: int) -> bytes:
    return _encode_u64(CANCEL, request_id)


def encode_credit(nbytes: int) -> bytes:
    return _encode_u64(CREDIT, nbytes)


def encode_seq(seq: int) -> bytes:
    """The next value on this connection is the producer's value number ``seq``."""
    return _encode_u64(SEQ, seq)


def encode_ack(seq: int) -> bytes:
    """The consumer holds every value numbered ``seq`` or below."""
    return _encode_u64(ACK, seq)


def encode_ping() -> bytes:
    return _HEADER.pack(VERSION, PING, 0, 0, 0)


def encode_bye() -> bytes:
    return _HEADER.pack(VERSION, BYE, 0, 0, 0)


def encode_abort_step(step: int, message: str) -> bytes:
    text = message.encode("utf-8")[: MAX_META - 8]
    return _HEADER.pack(VERSION, ABORT_STEP, 0, 8 + len(text), 0) + _U64.pack(step) + text


def _encode_map(ftype: int, fields: dict) -> bytes:
    body = msgpack.packb(fields, use_bin_type=True)
    if len(body) > MAX_META:
        raise ValueError(f"{FRAME_NAMES[ftype]} metadata of {len(body)} bytes is too long")
    return _HEADER.pack(VERSION, ftype, 0, len(body), 0) + body


def encode_hello(fields: dict) -> bytes:
    return _encode_map(HELLO, fields)


def encode_error(request_id: int, step: int, key: str, code: str, message: str) -> bytes:
    """A producer's failure to answer request ``request_id``, or (code ``"cancelled"``) its
    word that it dropped that request, parked until its CANCEL came: no answer follows."""
    return _encode_map(ERROR, {"req": request_id, "step": step, "key": key, "code": code,
                               "msg": message[:4096]})


def encode_auth(mac: bytes) -> bytes:
    """The handshake's AUTH frame: this side's HMAC over both nonces and identities."""
    return _encode_map(AUTH, {"mac": mac})


def encode_onesided(fields: dict) -> bytes:
    """A one-sided transport's control message (slot grants, destinations; see docs/rdma.md)."""
    return _encode_map(ONESIDED, fields)


def staged_value(pool: Any, code: int, shape: tuple, buf: bytearray, pos: int,
                 nbytes: int) -> Any:
    """The value whose ``nbytes`` are staged at ``pos`` of ``buf``, copied out: into an
    array the receive pool ``pool`` (None: no pool) kept and nothing refers to any more when
    it has one, else into a new array (``bytes`` for code 0)."""
    if pool is not None and code != _C_BYTES and nbytes != 0:
        return pool.arrays.take(code, shape, buf, pos, nbytes)
    if COMPILED:
        return new_array_c(code, shape, buf, pos, nbytes)  # type: ignore[name-defined]  # noqa: F821
    return _new_array(code, shape, buf, pos, nbytes)


def own_memory(pool: Any, buf: bytearray, key: str, code: int, shape: tuple, payload_len: int,
               pstart: int, avail: int) -> tuple:
    """Memory of the decoder's own for a large payload (from ``pool``, a ``RecvPool``, when
    it has a block), the ``avail`` bytes at ``pstart`` of the staging buffer ``buf`` copied
    in: ``(the view it is received into, the event's value)``; the value is None for
    ``bytes`` (made when the payload is whole)."""
    block = None
    try:
        if code == BYTES_CODE:
            arr = np.empty(payload_len, _U8)
            value = None
        else:
            if pool is not None:
                block = pool.take(payload_len)
            if block is None:
                arr = np.empty(shape, DTYPES[code])
            elif COMPILED:  # the array on the block, what came with the header in it
                arr = block_array_c(code, shape, block, buf, pstart, avail)  # type: ignore[name-defined]  # noqa: F821
            else:
                arr = _block_array(code, shape, block, buf, pstart, avail)
            value = arr
    except (MemoryError, ValueError) as exc:
        raise ProtocolError(f"DATA frame for key {key}: cannot allocate {payload_len} "
                            f"bytes: {exc!r}") from None
    if block is None:
        dest = payload_view(arr)
        if avail:
            dest[:avail] = memoryview(buf)[pstart:pstart + avail]
    else:  # the block's bytes are the array's (a memoryview of one is its start)
        dest = block if type(block) is memoryview else memoryview(block)
    return dest, value


class Decoder:
    """Turns received bytes into frame events, never copying a large payload twice.

    Events are tuples whose first item is the frame type:
    ``(HELLO, fields)``, ``(DATA, step, request_id, key, value)``,
    ``(DATA_MANY, step, keys, values)``,
    ``(REQUEST, step, request_id, key)``, ``(CANCEL, request_id)``,
    ``(ERROR, fields)``, ``(ABORT_STEP, step, message)``, ``(PING,)``,
    ``(CREDIT, nbytes)``, ``(SEQ, seq)``, ``(ACK, seq)``, ``(BYE,)``, ``(ONESIDED, fields)``,
    ``(AUTH, fields)``.  Any malformed input raises ``ProtocolError`` and the decoder stays
    failed.  The first frame must be HELLO and nothing may follow BYE.
    """

    __slots__ = ("_buf", "_view", "_head", "_size", "_start", "_end", "_direct_min", "_max_payload",
                 "_dest", "_dest_filled", "_dest_len", "_pending", "_state", "_failed",
                 "pool", "frames", "bytes_in", "_full_size", "admit", "land", "_landing",
                 "stop_at_handshake", "_peek", "_keys")

    def __init__(self, buffer_size: int = 262144, direct_min: int = 65536,
                 max_payload: int = DEFAULT_MAX_PAYLOAD, pool: Any = None) -> None:
        floor = HEADER_SIZE + MAX_META + max(direct_min, MANY_PAYLOAD)
        if buffer_size < floor:  # any staged frame fits whole
            buffer_size = floor
        # Until HELLO only a HELLO can come: a connection that never says it costs a buffer
        # of that size, not the full one (grown in _parse once HELLO is read).
        self._full_size = buffer_size
        self._size = HEADER_SIZE + MAX_META
        self._buf = bytearray(self._size)
        self._view = memoryview(self._buf)
        self._head = self._view[:PEEK]
        self._start = 0
        self._end = 0
        # A payload at least this large is received straight into its array.
        self._direct_min = direct_min
        self._max_payload = max_payload
        self._dest: Any = None
        self._dest_filled = 0
        self._dest_len = 0
        self._pending: Any = None
        self._state = _S_HELLO
        self._peek = False  # since a large payload, until a read fills PEEK: read the next header alone
        self._failed: Any = None
        self.pool = pool  # a RecvPool for large arrays, or None
        # Called with (step, request_id, key, payload_len) at a large DATA frame's header,
        # before memory is allocated for it; raises ProtocolError to refuse the frame.
        self.admit: Any = None
        # Called with (step, request_id, key, code, shape, payload_len) at a large DATA
        # frame's header, after ``admit``: the ``into=`` buffer of the recv the value will go
        # to, when it waits and the value fits it (see rvz/_fast/into.py), else None.
        self.land: Any = None
        self._landing: Any = None  # that buffer's target while the payload lands in it
        # Stop parsing after HELLO and AUTH, so the owner learns who the peer is before the
        # frames that follow are parsed (and admitted); more() goes on from there.
        self.stop_at_handshake = False
        self.frames = 0
        self.bytes_in = 0
        # The str of each key decoded lately, by a hash of its bytes: a key seen again is
        # the same str object, neither decoded nor hashed again (its hash is cached), so
        # the engine's route and table lookups find it at once.
        self._keys: list[Any] = [None] * (2 * KEY_CACHE)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._failed is not None:
            # What still arrives on a connection closing after an error lands here and is
            # never parsed (``buffer_updated`` raises): reading on lets the close complete.
            return self._view
        if self._dest is not None:
            return self._dest[self._dest_filled:]
        end = self._end
        if end == 0:
            # Every byte read so far was parsed (the usual case between two reads): the
            # same two views serve every such read, no slice made per read.
            return self._head if self._peek else self._view
        if end == self._size:
            self._compact()
            end = self._end
        if self._peek and end + PEEK < self._size:
            return self._view[end:end + PEEK]
        return self._view[end:]

    def close(self) -> None:
        """The connection is gone: the large payload being received never will be, so its
        array is dropped and a pool block under it goes back to the system."""
        dest = self._dest
        self._dest = None
        self._pending = None
        landing = self._landing
        if landing is not None:  # a recv's buffer, not ours: nothing more is written into it
            self._landing = None
            landing.decoder = None
        elif dest is not None and self.pool is not None:
            self.pool.release(dest)

    def payload_left(self) -> int:
        """Bytes still to come of the large payload being received (0 between frames)."""
        if self._dest is None:
            return 0
        return self._dest_len - self._dest_filled

    def buffer_updated(self, nbytes: int) -> list:
        if self._failed is not None:  # a failed decoder stays failed: never parse past an error
            raise ProtocolError(self._failed)
        self.bytes_in += nbytes
        if self._dest is not None:
            self._dest_filled += nbytes
            if self._dest_filled < self._dest_len:
                return _EMPTY_LIST
            event = self._pending
            if self._landing is not None:  # into a recv's buffer: the value is a view of it
                landing = self._landing
                self._landing = None
                event = (DATA, event[STEP], event[REQUEST_ID], event[KEY], landing.landed())
            elif event[VALUE] is None:  # a large bytes value was received into a uint8 array
                event = (DATA, event[STEP], event[REQUEST_ID], event[KEY], self._dest.tobytes())
            self._dest = None
            self._pending = None
            self._peek = True
            self.frames += 1
            return [event]
        self._end += nbytes
        try:
            events = self._parse()
        except ProtocolError as exc:
            self._failed = str(exc)
            raise
        if self._peek and nbytes >= PEEK and self._dest is None:
            # The read filled the peek: small frames stream in, so read as much as there is
            # again.  A shorter read (a credit, a request, the socket drained) keeps peeking:
            # on a connection that carries large payloads the next may be one, and it
            # would otherwise land in the staging buffer and be copied out once more.
            self._peek = False
        return events

    def more(self) -> list:
        """Parse what is already buffered (after a handshake frame stopped the parse)."""
        if self._failed is not None:
            raise ProtocolError(self._failed)
        if self._dest is not None or self._end == self._start:
            return _EMPTY_LIST
        try:
            return self._parse()
        except ProtocolError as exc:
            self._failed = str(exc)
            raise

    def _compact(self) -> None:
        """Move the unparsed tail to the front; the buffer holds any whole small frame."""
        start = self._start
        end = self._end
        if start == 0:
            return
        if start < end:  # one move within the buffer: no slice or temporary copy made
            if COMPILED:
                move_c(self._buf, 0, start, end - start)  # type: ignore[name-defined]  # noqa: F821
            else:
                _move(self._buf, 0, start, end - start)
        self._start = 0
        self._end = end - start

    def _fail(self, message: str) -> None:
        raise ProtocolError(message)

    def _parse(self) -> list:
        events: list[Any] = []
        handshake = False
        buf = self._buf
        view = self._view
        pos = self._start
        end = self._end
        need = _C_HEADER
        while end - pos >= _C_HEADER:
            if COMPILED:  # C reads of the little-endian fields; struct is faster in Python
                version = buf[pos]
                ftype = buf[pos + 1]
                flags = buf[pos + 2] | buf[pos + 3]
                meta_len = _u32(buf, pos + 4)
                payload_len = _u64(buf, pos + 8)
            else:
                version, ftype, flags, meta_len, payload_len = _HEADER.unpack_from(buf, pos)
            if (version != _C_VERSION or flags != 0 or meta_len > _C_MAX_META
                    or self._state != _S_OPEN):
                self._check_header(version, ftype, flags, meta_len)
            mstart = pos + _C_HEADER
            if end - mstart < meta_len:
                need = _C_HEADER + meta_len
                break
            if ftype == _C_DATA:
                # the frame's end when it was whole; else -1 (its payload is staged, or
                # received in place: see ``_direct``)
                pend = self._data(buf, mstart, meta_len, payload_len, end, events)
                if pend >= 0:
                    pos = pend
                    continue
                if payload_len < self._direct_min:
                    need = HEADER_SIZE + meta_len + payload_len
                else:
                    pos = end
                break
            if ftype == _C_DATA_MANY:
                if meta_len != 12 or payload_len > _C_MANY_PAYLOAD:
                    self._fail(f"DATA_MANY metadata must be 12 bytes, not {meta_len}"
                               if meta_len != 12 else f"DATA_MANY payload of {payload_len} "
                               f"bytes exceeds the limit of {MANY_PAYLOAD}")
                pend = mstart + 12 + payload_len
                if pend > end:
                    need = _C_HEADER + 12 + payload_len
                    break
                self._many(buf, mstart, pend, events)  # its values count as messages
                pos = pend
                continue
            if payload_len != 0:
                self._fail(f"{FRAME_NAMES.get(ftype, ftype)} frame carries a payload")
            if ftype == _C_REQUEST:
                if meta_len < 18:
                    self._fail(f"REQUEST metadata of {meta_len} bytes is too short")
                if COMPILED:
                    step = _u64(buf, mstart)
                    request_id = _u64(buf, mstart + 8)
                    klen = _u16(buf, mstart + 16)
                else:
                    step, request_id, klen = _REQUEST_FIXED.unpack_from(buf, mstart)
                if klen > _C_MAX_KEY or meta_len != 18 + klen:
                    self._fail(f"REQUEST metadata length {meta_len} does not match key length {klen}")
                events.append((REQUEST, step, request_id, self._key(buf, mstart + 18, klen)))
            elif self._control(ftype, buf, view, mstart, meta_len, events):
                handshake = self.stop_at_handshake
            self.frames += 1
            pos = mstart + meta_len
            if handshake:
                # The owner acts on a handshake frame (who the peer is, whether it proved
                # the secret) before the frames after it are even parsed: see more().
                break
        self._parsed(pos, need)
        return events

    def _data(self, buf: bytearray, mstart: int, meta_len: int, payload_len: int, end: int,
              events: list) -> int:
        """A DATA frame at ``mstart``: its event appended and its end returned when it is
        whole here; else -1."""
        if meta_len < 20:
            self._fail(f"DATA metadata of {meta_len} bytes is too short")
        if COMPILED:
            step = _u64(buf, mstart)
            request_id = _u64(buf, mstart + 8)
            klen = _u16(buf, mstart + 16)
            code = buf[mstart + 18]
            ndim = buf[mstart + 19]
        else:
            step, request_id, klen, code, ndim = _DATA_FIXED.unpack_from(buf, mstart)
        if (ndim > _C_MAX_NDIM or klen > _C_MAX_KEY or meta_len != 20 + 8 * ndim + klen
                or code >= _C_NCODES):
            self._bad_data(meta_len, klen, ndim, code)
        kstart = mstart + 20 + 8 * ndim
        key = self._key(buf, kstart, klen)
        value: Any
        shape = self._shape(buf, mstart + 20, ndim, code, key, payload_len)
        if payload_len > self._max_payload:
            self._fail(f"DATA frame for key {key}: payload of {payload_len} bytes exceeds "
                       f"the limit of {self._max_payload}")
        pstart = mstart + meta_len
        avail = end - pstart
        if payload_len <= avail:
            pend = pstart + payload_len
            # One copy out of the staging buffer into an array (or bytes) the
            # caller owns.
            value = staged_value(self.pool, code, shape, buf, pstart, payload_len)
            events.append((DATA, step, request_id, key, value))
            self.frames += 1
            return pend
        if payload_len >= self._direct_min:
            self._direct(step, request_id, key, code, shape, payload_len, pstart, avail)
        return -1

    def _parsed(self, pos: int, need: int) -> None:
        """The frames before ``pos`` were parsed, and the next needs ``need`` bytes: keep the
        rest where a read can complete it."""
        if pos == self._end:
            self._start = 0
            self._end = 0
        else:
            self._start = pos
            if pos + need > self._size:
                self._compact()
        if self._state != _S_HELLO and self._size < self._full_size and self._dest is None:
            self._grow()

    def _check_header(self, version: int, ftype: int, flags: int, meta_len: int) -> None:
        """A frame header off the common case: refuse it, or let a handshake frame by."""
        if version != _C_VERSION:
            self._fail(f"unsupported protocol version {version} (this side speaks {VERSION})")
        if flags != 0:
            self._fail(f"frame flags {flags:#x} are not defined in version {VERSION}")
        if meta_len > _C_MAX_META:
            self._fail(f"frame metadata of {meta_len} bytes exceeds the limit of {MAX_META}")
        if self._state == _S_HELLO and ftype != _C_HELLO:
            self._fail(f"first frame is {FRAME_NAMES.get(ftype, ftype)}, expected HELLO")
        if self._state == _S_BYE:
            self._fail(f"{FRAME_NAMES.get(ftype, ftype)} frame after BYE")

    def _bad_data(self, meta_len: int, klen: int, ndim: int, code: int) -> None:
        """Refuse a DATA frame whose metadata does not add up."""
        if ndim > _C_MAX_NDIM:
            self._fail(f"DATA frame has {ndim} dimensions, the limit is {MAX_NDIM}")
        if klen > _C_MAX_KEY or meta_len != 20 + 8 * ndim + klen:
            self._fail(f"DATA metadata length {meta_len} does not match key length "
                       f"{klen} and {ndim} dimensions")
        self._fail(f"DATA frame has unknown dtype code {code}")

    def _direct(self, step: Any, request_id: Any, key: str, code: int, shape: tuple,
                payload_len: int, pstart: int, avail: int) -> None:
        """A DATA frame too large to stage: the rest of its payload is received straight
        into the memory it ends in (``get_buffer``), what came with the header copied in:
        the buffer of a recv waiting for it with ``into=`` (``land``), else a new array."""
        if self.admit is not None:  # the owner agrees to the frame first (its route, its window)
            self.admit(step, request_id, key, payload_len)
        target = None
        if self.land is not None:
            target = self.land(step, request_id, key, code, shape, payload_len)
        if target is None:
            dest, value = own_memory(self.pool, self._buf, key, code, shape, payload_len, pstart,
                                     avail)
        else:
            dest = target.dest
            if avail:
                dest[:avail] = self._view[pstart:self._end]
            target.decoder = self
            target.prefix = avail
            self._landing = target
            value = None
        self._dest = dest
        self._dest_filled = avail
        self._dest_len = payload_len
        self._pending = (DATA, step, request_id, key, value)

    # -- receiving into a recv's buffer (``into=``) ----------------------------------------

    def arriving(self, step: Any, key: str) -> bool:
        """Whether a large payload of ``key`` in ``step`` is being received into memory of
        our own (a recv with ``into=`` may ``adopt`` it)."""
        pending = self._pending
        return (self._dest is not None and self._landing is None
                and pending[STEP] == step and pending[KEY] == key)

    def adopt(self, target: Any) -> bool:
        """Receive the rest of the payload ``arriving`` into ``target`` (a recv's ``into=``
        buffer, which it fits), what came already copied over.  False if it does not fit."""
        pending = self._pending
        value = pending[VALUE]
        if value is None:
            code, shape = BYTES_CODE, (self._dest_len,)
        else:
            code, shape = dtype_code(value.dtype), value.shape
        if not target.takes(code, shape, self._dest_len):
            return False
        filled = self._dest_filled
        target.dest[:filled] = self._dest[:filled]
        target.decoder = self
        target.prefix = filled
        self._landing = target
        self._dest = target.dest  # our memory goes (a pool block, back to the pool)
        self._pending = (DATA, pending[STEP], pending[REQUEST_ID], pending[KEY], None)
        return True

    def unland(self) -> None:
        """The recv the payload lands for stopped waiting for it, and its buffer is the
        caller's again: the rest goes to memory of our own, what came already copied over."""
        target = self._landing
        if target is None:
            return
        self._landing = None
        target.decoder = None
        pending = self._pending
        filled = self._dest_filled
        code, shape = target.meta
        dest, value = own_memory(self.pool, self._buf, pending[KEY], code, shape, self._dest_len,
                                 0, 0)
        dest[:filled] = self._dest[:filled]
        self._dest = dest
        self._pending = (DATA, pending[STEP], pending[REQUEST_ID], pending[KEY], value)

    def _control(self, ftype: int, buf: bytearray, view: Any, mstart: int, meta_len: int,
                 events: list) -> bool:
        """A frame without a payload, other than REQUEST: its event appended.  True for a
        handshake frame (HELLO, AUTH), on which the owner acts before the next is parsed."""
        if ftype == _C_REQUESTS:
            self._requests(buf, view, mstart, meta_len, events)
        elif (ftype == _C_CANCEL or ftype == _C_CREDIT or ftype == _C_SEQ
              or ftype == _C_ACK):
            if meta_len != 8:
                self._fail(f"{FRAME_NAMES[ftype]} metadata must be 8 bytes, not {meta_len}")
            events.append((ftype, _u64(buf, mstart) if COMPILED
                           else _U64.unpack_from(buf, mstart)[0]))
        elif ftype == PING:
            if meta_len != 0:
                self._fail("PING frame carries metadata")
            events.append((PING,))
        elif ftype == ABORT_STEP:
            if meta_len < 8:
                self._fail(f"ABORT_STEP metadata of {meta_len} bytes is too short")
            step = _U64.unpack_from(buf, mstart)[0]
            message = self._text(view, mstart + 8, meta_len - 8)
            events.append((ABORT_STEP, step, message))
        elif ftype == HELLO or ftype == ERROR:
            fields = self._map(view, mstart, meta_len, ftype)
            if ftype == HELLO:
                if self._state != _S_HELLO:
                    self._fail("second HELLO on one connection")
                self._state = _S_OPEN
            events.append((ftype, fields))
            return ftype == HELLO
        elif ftype == AUTH:
            events.append((AUTH, self._map(view, mstart, meta_len, ftype)))
            return True
        elif ftype == ONESIDED:
            events.append((ONESIDED, self._map(view, mstart, meta_len, ftype)))
        elif ftype == BYE:
            if meta_len != 0:
                self._fail("BYE frame carries metadata")
            self._state = _S_BYE
            events.append((BYE,))
        else:
            self._fail(f"unknown frame type {ftype}")
        return False

    def _grow(self) -> None:
        """HELLO was read: the full staging buffer, with the unparsed bytes moved over."""
        tail = bytes(self._view[self._start:self._end])
        self._buf = bytearray(self._full_size)
        self._view = memoryview(self._buf)
        self._head = self._view[:PEEK]
        self._size = self._full_size
        self._buf[0:len(tail)] = tail
        self._start = 0
        self._end = len(tail)

    def _requests(self, buf: bytearray, view: memoryview, start: int, length: int,
                  events: list) -> None:
        """Expand a REQUESTS frame into one REQUEST event per entry."""
        if length < 12:
            self._fail(f"REQUESTS metadata of {length} bytes is too short")
        if COMPILED:
            step = _u64(buf, start)
            count = _u32(buf, start + 8)
        else:
            step, count = _REQUESTS_FIXED.unpack_from(buf, start)
        if count > MAX_REQUESTS:
            self._fail(f"REQUESTS frame of {count} entries exceeds the limit of {MAX_REQUESTS}")
        pos = start + 12
        end = start + length
        for _n in range(count):
            if end - pos < 10:
                self._fail("REQUESTS frame ends inside an entry")
            if COMPILED:
                request_id = _u64(buf, pos)
                klen = _u16(buf, pos + 8)
            else:
                request_id, klen = _ENTRY.unpack_from(buf, pos)
            if klen > _C_MAX_KEY or end - pos - 10 < klen:
                self._fail(f"REQUESTS entry key of {klen} bytes does not fit the frame")
            events.append((REQUEST, step, request_id, self._key(buf, pos + 10, klen)))
            pos += 10 + klen
        if pos != end:
            self._fail(f"REQUESTS frame has {end - pos} bytes after its {count} entries")

    def _many(self, buf: bytearray, start: int, end: int, events: list) -> None:
        """Decode a DATA_MANY frame (metadata at ``start``, its payload ending at ``end``)
        into one ``(DATA_MANY, step, keys, values)`` event."""
        if COMPILED:
            step = _u64(buf, start)
            count = _u32(buf, start + 8)
        else:
            step, count = _MANY_FIXED.unpack_from(buf, start)
        if count > _C_MAX_MANY:
            self._fail(f"DATA_MANY frame of {count} entries exceeds the limit of {MAX_MANY}")
        keys = []
        values = []
        pos = start + 12
        for _k in range(count):
            if end - pos < _C_ENTRY:
                self._fail("DATA_MANY frame ends inside an entry")
            if COMPILED:
                klen = _u16(buf, pos)
                code = buf[pos + 2]
                ndim = buf[pos + 3]
                nbytes = _u32(buf, pos + 4)
            else:
                klen, code, ndim, nbytes = _MANY_ENTRY.unpack_from(buf, pos)
            if ndim > _C_MAX_NDIM:
                self._fail(f"DATA_MANY entry has {ndim} dimensions, the limit is {MAX_NDIM}")
            if code >= _C_NCODES:
                self._fail(f"DATA_MANY entry has unknown dtype code {code}")
            kstart = pos + _C_ENTRY + 8 * ndim
            if klen > _C_MAX_KEY or end - kstart < klen or end - kstart - klen < nbytes:
                self._fail(f"DATA_MANY entry (key of {klen} bytes, payload of {nbytes}) does "
                           "not fit the frame")
            key = self._key(buf, kstart, klen)
            # max_payload bounds each value, as a DATA frame's: checked at each entry's
            # header, before its array is made (the frame, 32 KiB at most, is already staged;
            # arrays of the entries before it go with the error). Not on the frame's total,
            # which is no value's size: values within the limit pack into a frame above it
            # (the sender does not know the limit), and refusing it would drop a peer that
            # sent nothing too large; a total within the limit needs no check, but testing
            # that would cost what this comparison costs.
            if nbytes > self._max_payload:
                self._fail(f"DATA_MANY entry for key {key}: payload of {nbytes} bytes exceeds "
                           f"the limit of {self._max_payload}")
            shape = self._shape(buf, pos + _C_ENTRY, ndim, code, key, nbytes)
            pos = kstart + klen
            values.append(staged_value(self.pool, code, shape, buf, pos, nbytes))
            keys.append(key)
            pos += nbytes
        if pos != end:
            self._fail(f"DATA_MANY frame has {end - pos} bytes after its {count} entries")
        self.frames += len(values)
        events.append((DATA_MANY, step, keys, values))

    def _shape(self, buf: bytearray, pos: int, ndim: int, code: int, key: str,
               payload_len: int) -> tuple:
        """The shape at ``pos`` of a value of dtype ``code``, checked against its payload."""
        if COMPILED and ndim == 1 and code != _C_BYTES:
            # The common tensor, checked in C: no Python int per field.
            dim0 = _u64(buf, pos)
            if dim0 >= _DIM1_LIMIT or dim0 * _ITEMSIZES[code] != payload_len:
                self._check_size(key, code, (dim0,), payload_len)
            # arrays.pyx's: the tuple of the last 1-D shape made, while the shape repeats
            return shape1_c(dim0)  # type: ignore[name-defined]  # noqa: F821
        if code == _C_BYTES:
            if ndim != 0:
                self._fail(f"bytes value for key {key} has a shape")
            return ()
        shape = _SHAPES[ndim].unpack_from(buf, pos)
        self._check_size(key, code, shape, payload_len)
        return shape

    def _check_size(self, key: str, code: int, shape: tuple, payload_len: int) -> None:
        """Fail unless ``payload_len`` bytes are exactly an array of ``shape`` (in Python
        ints: a peer's shape may overflow any C type) of dtype ``code``."""
        if code == BYTES_CODE:
            return  # a bytes value is its payload, any length
        dtype = DTYPES[code]
        expected = dtype.itemsize
        for dim in shape:
            expected *= dim
        if expected == 0:
            # np.empty refuses an empty shape whose other dims overflow its size.
            size = dtype.itemsize
            for dim in shape:
                if dim:
                    size *= dim
            if size > _MAX_ARRAY_BYTES:
                self._fail(f"DATA frame for key {key}: shape {shape} is too large")
        if expected != payload_len:
            self._fail(f"DATA frame for key {key}: payload of {payload_len} bytes does not "
                       f"match dtype {dtype} and shape {shape} ({expected} bytes)")

    def _key(self, buf: bytearray, start: int, length: int) -> str:
        # Compiled, a key seen lately is the same str object again: no decoding, its hash
        # already computed for the engine's dict lookups. The cache is 2-way set associative
        # (a set's most recent key first): direct-mapped, a quarter of 64 keys streamed in
        # turn shared a slot with another and missed every time.
        slot = 0
        if COMPILED:  # the cache's C helpers (_key_slot, _same_key) are in codec.pxd
            slot = 2 * _key_slot(buf, start, length)  # type: ignore[name-defined]  # noqa: F821
            keys = self._keys
            known = keys[slot]
            if known is not None and _same_key(known, buf, start, length):  # type: ignore[name-defined]  # noqa: F821
                return known
            other = keys[slot + 1]
            if other is not None and _same_key(other, buf, start, length):  # type: ignore[name-defined]  # noqa: F821
                keys[slot + 1] = known
                keys[slot] = other
                return other
        try:
            # Compiled, a slice of a bytearray decoded at once is read in place (no copy).
            text = buf[start:start + length].decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("key is not valid UTF-8") from None
        if COMPILED:
            self._keys[slot + 1] = self._keys[slot]
            self._keys[slot] = text
        return text

    def _text(self, view: memoryview, start: int, length: int) -> str:
        return str(view[start:start + length], "utf-8", "replace")

    def _map(self, view: memoryview, start: int, length: int, ftype: int) -> dict:
        try:
            fields = msgpack.unpackb(view[start:start + length], raw=False,
                                     max_str_len=MAX_META, max_bin_len=MAX_META,
                                     max_array_len=1024, max_map_len=1024)
        except Exception as exc:
            raise ProtocolError(f"{FRAME_NAMES[ftype]} metadata is not valid msgpack: {exc}") from None
        if not isinstance(fields, dict):
            raise ProtocolError(f"{FRAME_NAMES[ftype]} metadata is not a map")
        return fields

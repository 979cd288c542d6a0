"""The sans-IO frame codec: round trips, dtypes, chunked decoding, zero-copy, limits, fuzz.

No sockets and no event loop: the decoder is driven exactly as ``asyncio.BufferedProtocol``
drives it (``get_buffer`` then ``buffer_updated``).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterable
from typing import Any

import msgpack
import numpy as np
import pytest

import rvz
from rvz import _impl

from .conftest import key
from .hostile import DATA_FIXED, HEADER, MANY_FIXED

codec = _impl.codec
KEY = str(key("codec_key"))
KEYB = KEY.encode()
HELLO = codec.encode_hello({"v": codec.VERSION, "job": "worker", "task": 0, "inc": 7,
                            "order": "little"})


# -- helpers -----------------------------------------------------------------------------------


def feed(decoder: Any, data: bytes, chunks: Iterable[int] | None = None) -> list:
    """Feed ``data`` through get_buffer/buffer_updated, ``chunks`` bytes at a time at most."""
    view = memoryview(data)
    sizes = iter(chunks) if chunks is not None else None
    events: list = []
    pos = 0
    while pos < len(view):
        buf = decoder.get_buffer(-1)
        assert len(buf) > 0, "decoder offered an empty buffer"
        n = min(len(buf), len(view) - pos)
        if sizes is not None:
            n = min(n, next(sizes))
        buf[:n] = view[pos:pos + n]
        pos += n
        events.extend(decoder.buffer_updated(n))
    return events


def byte_by_byte() -> Iterable[int]:
    while True:
        yield 1


def random_chunks(seed: int, top: int = 5000) -> Iterable[int]:
    rng = random.Random(seed)
    while True:
        yield rng.choice((1, 2, 3, 7, 15, 16, 17, rng.randint(1, top)))


def data_frame(value: Any, step: int = 1, request_id: int = 0, k: bytes = KEYB) -> bytes:
    value, code, shape, nbytes = codec.describe(value)
    return codec.encode_data(step, request_id, k, code, shape, nbytes) + bytes(codec.payload_view(value))


def comparable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    return value


def normalize(events: list) -> list:
    """Events with arrays replaced by comparable (dtype, shape, bytes) tuples."""
    out = []
    for event in events:
        if event[0] == codec.DATA:
            out.append(event[:4] + (comparable(event[4]),))
        elif event[0] == codec.DATA_MANY:
            out.append(event[:3] + ([comparable(v) for v in event[3]],))
        else:
            out.append(event)
    return out


def raw_many(step: int, entries: list, count: int | None = None) -> bytes:
    """A DATA_MANY frame written field by field: ``entries`` of ``(key, code, shape,
    payload)``, or of raw bytes (one entry as is)."""
    body = b""
    for entry in entries:
        if isinstance(entry, bytes):
            body += entry
            continue
        k, code, shape, payload = entry
        body += (struct.pack("<HBBI", len(k), code, len(shape), len(payload))
                 + struct.pack("<" + "Q" * len(shape), *shape) + k + payload)
    count = len(entries) if count is None else count
    return header(codec.DATA_MANY, 12, len(body)) + MANY_FIXED.pack(step, count) + body


def all_ways(data: bytes, seed: int = 0) -> list:
    """Decode ``data`` whole, byte by byte, and in random chunks; all must agree."""
    whole = normalize(feed(codec.Decoder(), data))
    assert normalize(feed(codec.Decoder(), data, byte_by_byte())) == whole
    for s in range(3):
        assert normalize(feed(codec.Decoder(), data, random_chunks(seed * 10 + s))) == whole
    return whole


def header(ftype: int, meta_len: int, payload_len: int = 0, version: int = codec.VERSION,
           flags: int = 0) -> bytes:
    return HEADER.pack(version, ftype, flags, meta_len, payload_len)


def raw_data(step: int, rid: int, k: bytes, code: int, shape: tuple, payload: bytes,
             ndim: int | None = None) -> bytes:
    ndim = len(shape) if ndim is None else ndim
    meta = DATA_FIXED.pack(step, rid, len(k), code, ndim) + struct.pack(
        "<" + "Q" * len(shape), *shape) + k
    return header(codec.DATA, len(meta), len(payload)) + meta + payload


# -- round trips -------------------------------------------------------------------------------


async def test_every_frame_type_round_trips() -> None:
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    stream = b"".join([
        HELLO,
        data_frame(arr, step=5, request_id=0),
        data_frame(b"raw bytes", step=6, request_id=99),
        codec.encode_request(7, 123, KEYB),
        codec.encode_cancel(123),
        codec.encode_error(9, 7, KEY, "aborted", "step 7 is gone"),
        codec.encode_abort_step(42, "cleaned up: ünïcode"),
        codec.encode_ping(),
        codec.encode_credit(1 << 40),
        codec.encode_onesided({"grant": 3, "addr": b"\x00\x01"}),
        codec.encode_bye(),
    ])
    events = all_ways(stream)
    kinds = [e[0] for e in events]
    assert kinds == [codec.HELLO, codec.DATA, codec.DATA, codec.REQUEST, codec.CANCEL,
                     codec.ERROR, codec.ABORT_STEP, codec.PING, codec.CREDIT, codec.ONESIDED,
                     codec.BYE]
    assert events[0][1] == {"v": codec.VERSION, "job": "worker", "task": 0, "inc": 7,
                            "order": "little"}
    assert events[1][:4] == (codec.DATA, 5, 0, KEY)
    assert events[1][4] == ("array", "<i4", (3, 4), arr.tobytes())
    assert events[2] == (codec.DATA, 6, 99, KEY, b"raw bytes")
    assert events[3] == (codec.REQUEST, 7, 123, KEY)
    assert events[4] == (codec.CANCEL, 123)
    assert events[5][1] == {"req": 9, "step": 7, "key": KEY, "code": "aborted",
                            "msg": "step 7 is gone"}
    assert events[6] == (codec.ABORT_STEP, 42, "cleaned up: ünïcode")
    assert events[8] == (codec.CREDIT, 1 << 40)
    assert events[9] == (codec.ONESIDED, {"grant": 3, "addr": b"\x00\x01"})
    dec = codec.Decoder()
    feed(dec, stream)
    assert dec.frames == 11 and dec.bytes_in == len(stream)


async def test_data_many_round_trips_every_kind_of_value() -> None:
    keys = [str(key(f"m{i}")).encode() for i in range(len(DTYPE_VALUES) + 3)]
    values: list[Any] = [*DTYPE_VALUES, b"", b"raw", np.arange(7, dtype=np.int16)]
    items = list(zip(keys, values, strict=True))
    frame = codec.encode_data_many(9, items)
    # As many DATA frames carry the same bytes, plus a 36-byte header each instead of 8.
    assert len(frame) == 28 + sum(8 + 8 * np.ndim(v) + len(k) + len(bytes(codec.payload_view(
        codec.describe(v)[0]))) for k, v in items)
    events = all_ways(HELLO + frame + codec.encode_ping(), seed=4)
    assert [e[0] for e in events] == [codec.HELLO, codec.DATA_MANY, codec.PING]
    kind, step, got_keys, got = events[1]
    assert step == 9 and got_keys == [k.decode() for k in keys]
    assert got == [comparable(v) for v in values]
    arrays = feed(codec.Decoder(), HELLO + frame)[1][3]
    assert type(arrays[-3]) is bytes and arrays[-1].dtype == np.int16
    assert not np.shares_memory(arrays[0], arrays[-1])  # each value its own array


async def test_a_data_many_frame_at_its_bounds() -> None:
    k = KEYB
    per = 8 + 8 + len(k)  # entry head, one dim, key; payload below
    payload = codec.MANY_PAYLOAD - per
    full = codec.encode_data_many(1, [(k, np.zeros(payload, np.uint8))])
    assert len(full) == 28 + codec.MANY_PAYLOAD
    assert feed(codec.Decoder(), HELLO + full, random_chunks(2))[1][3][0].nbytes == payload
    with pytest.raises(ValueError):
        codec.encode_data_many(1, [(k, np.zeros(payload + 1, np.uint8))])
    many = codec.encode_data_many(2, [(b"", b"")] * codec.MAX_MANY)
    assert len(feed(codec.Decoder(), HELLO + many)[1][3]) == codec.MAX_MANY
    with pytest.raises(ValueError):
        codec.encode_data_many(2, [(b"", b"")] * (codec.MAX_MANY + 1))
    empty = feed(codec.Decoder(), HELLO + codec.encode_data_many(3, []))[1]
    assert empty == (codec.DATA_MANY, 3, [], [])


async def test_max_u64_fields_round_trip() -> None:
    top = (1 << 64) - 1
    stream = HELLO + codec.encode_request(top, top, KEYB) + data_frame(np.zeros(1), top, top)
    events = all_ways(stream)
    assert events[1] == (codec.REQUEST, top, top, KEY)
    assert events[2][1:3] == (top, top)


DTYPE_VALUES = [
    np.array([True, False, True]),
    np.arange(-5, 5, dtype=np.int8),
    np.arange(250, 256, dtype=np.uint8),
    np.arange(-3, 3, dtype=np.int16),
    np.arange(6, dtype=np.uint16) * 1000,
    np.arange(-3, 3, dtype=np.int32) * 100000,
    np.arange(6, dtype=np.uint32) * 4000000000 // 6,
    np.array([-(2 ** 63), 0, 2 ** 63 - 1], dtype=np.int64),
    np.array([0, 2 ** 64 - 1], dtype=np.uint64),
    np.array([0.5, -1.25, np.inf, 65504], dtype=np.float16),
    np.array([1.5, np.nan, -np.inf], dtype=np.float32),
    np.array([np.pi, -0.0, 1e300], dtype=np.float64),
    np.array([1 + 2j, -3.5j], dtype=np.complex64),
    np.array([1e200 + 1e-200j, np.nan * 1j], dtype=np.complex128),
    np.array(3.5),                                   # 0-d
    np.array(True),                                  # 0-d bool
    np.zeros((0,), np.float32),                      # empty
    np.zeros((3, 0, 2), np.int64),                   # empty with dims
    np.arange(2 * 3 * 4 * 5, dtype=np.float64).reshape(2, 3, 4, 5),
    np.zeros((1,) * 32, np.uint8),                   # the dimension limit
]


@pytest.mark.parametrize("value", DTYPE_VALUES, ids=lambda v: f"{v.dtype}{list(v.shape)}")
async def test_every_dtype_and_shape_round_trips(value: np.ndarray) -> None:
    events = all_ways(HELLO + data_frame(value), seed=value.size)
    (_, step, rid, k, got) = events[1]
    assert (step, rid, k) == (1, 0, KEY)
    assert got == ("array", value.dtype.str, value.shape, value.tobytes())
    arr = feed(codec.Decoder(), HELLO + data_frame(value))[1][4]
    assert arr.dtype == value.dtype and arr.shape == value.shape
    np.testing.assert_array_equal(arr, value)


@pytest.mark.parametrize("value", [b"", b"x", bytes(range(256)) * 3, bytearray(b"mutable"),
                                   memoryview(b"a view"), memoryview(bytes(range(10)))[::2]])
async def test_bytes_values_round_trip(value: Any) -> None:
    events = all_ways(HELLO + data_frame(value))
    assert events[1][4] == bytes(value)
    assert type(feed(codec.Decoder(), HELLO + data_frame(value))[1][4]) is bytes


async def test_non_contiguous_and_big_endian_input_are_sent_contiguous_little_endian() -> None:
    base = np.arange(48, dtype=np.float64).reshape(6, 8)
    for value in [base[::2, 1::3], base.T, np.asfortranarray(base), base.astype(">f8"),
                  base.astype(">i4")[::-1]]:
        sent, code, shape, nbytes = codec.describe(value)
        assert sent.flags.c_contiguous and shape == value.shape and nbytes == value.size * value.itemsize
        arr = feed(codec.Decoder(), HELLO + data_frame(value))[1][4]
        assert arr.dtype.byteorder in ("<", "=")
        np.testing.assert_array_equal(arr, value)


async def test_contiguous_input_is_not_copied() -> None:
    value = np.arange(10.0)
    assert codec.describe(value)[0] is value


@pytest.mark.parametrize("value", [np.array(["a", "b"]), np.array([b"a"]), np.array([{}, 1], dtype=object),
                                   np.zeros(2, dtype=[("a", "i4")]), np.zeros(2, "datetime64[s]"),
                                   [1, 2, 3], "text", 3.5, None])
async def test_unsupported_values_are_refused_with_type_error(value: Any) -> None:
    with pytest.raises(TypeError) as info:
        codec.describe(value)
    assert "rvz" in str(info.value)


@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble])
async def test_long_double_is_refused_naming_the_dtypes_that_go(dtype: Any) -> None:
    # numeric, but its layout is the platform's (80-bit x87 padded to 16 bytes here, a plain
    # double elsewhere): the wire has no code for it, and the error says which floats go
    value = np.zeros(2, dtype)
    if value.dtype.itemsize <= 8 * (2 if value.dtype.kind == "c" else 1):
        pytest.skip(f"{value.dtype} is an ordinary double on this platform")
    with pytest.raises(TypeError, match="float16 to float64 and complex64/complex128"):
        codec.describe(value)


# -- chunked decoding and zero copy ---------------------------------------------------------


async def test_mixed_stream_decodes_the_same_in_any_chunking() -> None:
    rng = np.random.default_rng(1)
    parts = [HELLO]
    for i in range(40):
        size = int(rng.choice([0, 1, 100, 5000, 70000, 200000]))
        parts.append(data_frame(rng.integers(0, 255, size, dtype=np.uint8), step=i, request_id=i))
        parts.append(codec.encode_request(i, i + 1, KEYB))
        parts.append(codec.encode_ping())
        if i % 7 == 0:
            parts.append(data_frame(bytes(size), step=i))
    parts.append(codec.encode_bye())
    events = all_ways(b"".join(parts), seed=3)
    assert len(events) == 1 + 40 * 3 + 6 + 1


async def test_large_payload_lands_in_the_array_the_decoder_hands_out() -> None:
    value = np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32)  # 512 KiB
    frame = data_frame(value, step=3, request_id=4)
    hdr_len = len(frame) - value.nbytes
    dec = codec.Decoder()
    assert feed(dec, HELLO) [0][0] == codec.HELLO
    # Header and the first 1000 payload bytes arrive in the staging buffer.
    assert feed(dec, frame[:hdr_len + 1000]) == []
    pos = hdr_len + 1000
    handed_out = []
    events: list = []
    while pos < len(frame):
        buf = dec.get_buffer(-1)
        # In payload state the buffer is exactly the rest of the destination array.
        assert buf.nbytes == len(frame) - pos
        handed_out.append(buf)
        n = min(buf.nbytes, 100000)
        buf[:n] = frame[pos:pos + n]
        pos += n
        events += dec.buffer_updated(n)
    assert len(events) == 1
    kind, step, rid, k, arr = events[0]
    assert (kind, step, rid, k) == (codec.DATA, 3, 4, KEY)
    np.testing.assert_array_equal(arr, value)
    # Copied at most once: every buffer the socket would have filled is the array's memory.
    for buf in handed_out:
        assert np.shares_memory(arr, np.frombuffer(buf, np.uint8))
    assert arr.flags.owndata and arr.flags.writeable
    # and the next frame goes back to the staging buffer
    assert feed(dec, codec.encode_ping()) == [(codec.PING,)]


async def test_small_payload_does_not_alias_the_staging_buffer() -> None:
    value = np.arange(100, dtype=np.int64)
    dec = codec.Decoder()
    feed(dec, HELLO)
    staging = dec.get_buffer(-1)
    (event,) = feed(dec, data_frame(value))
    arr = event[4]
    assert not np.shares_memory(arr, np.frombuffer(staging, np.uint8))
    feed(dec, data_frame(np.zeros(100, np.int64)))  # the staging buffer is reused
    np.testing.assert_array_equal(arr, value)


async def test_reads_after_whole_frames_reuse_one_buffer_object() -> None:
    """Once every byte read was parsed, the next read goes where the last one started and
    the decoder offers the same buffer object again: no view is made per read, which a
    64 B ping-pong paid on every message.  A read that ends inside a frame still gets a
    view after it; peeking (after a large payload) offers one fixed view too."""
    dec = codec.Decoder(direct_min=65536)
    feed(dec, HELLO)
    first = dec.get_buffer(-1)
    assert feed(dec, codec.encode_ping()) == [(codec.PING,)]
    assert dec.get_buffer(-1) is first
    frame = data_frame(np.arange(10, dtype=np.int64))
    first[:5] = frame[:5]
    assert dec.buffer_updated(5) == []
    rest = dec.get_buffer(-1)
    assert rest is not first and len(rest) == len(first) - 5
    rest[:len(frame) - 5] = frame[5:]
    (event,) = dec.buffer_updated(len(frame) - 5)
    np.testing.assert_array_equal(event[4], np.arange(10))
    assert dec.get_buffer(-1) is first
    feed(dec, data_frame(np.zeros(1 << 20, np.uint8)))  # a large payload: peek next
    peek = dec.get_buffer(-1)
    assert len(peek) == codec.PEEK and dec.get_buffer(-1) is peek
    assert feed(dec, codec.encode_ping()) == [(codec.PING,)]


async def test_large_bytes_value() -> None:
    value = bytes(range(256)) * 1024  # 256 KiB
    events = all_ways(HELLO + data_frame(value) + codec.encode_ping(), seed=9)
    assert events[1][4] == value and events[2] == (codec.PING,)


# -- malformed frames -------------------------------------------------------------------------

PING_WITH_META = header(codec.PING, 1) + b"x"
MALFORMED = {
    "bad-version": HELLO + header(codec.PING, 0, version=codec.VERSION + 1),
    "bad-version-first": header(codec.HELLO, 0, version=0),
    "flags": HELLO + header(codec.PING, 0, flags=1),
    "oversize-meta": HELLO + header(codec.ERROR, codec.MAX_META + 1),
    "ndim-33": HELLO + raw_data(0, 0, KEYB, 3, (1,) * 33, b"\0"),
    "key-too-long": HELLO + raw_data(0, 0, b"k" * (codec.MAX_KEY + 1), 3, (1,), b"\0"),
    "payload-shape-mismatch": HELLO + raw_data(0, 0, KEYB, 11, (4,), b"\0" * 15),
    "payload-shape-mismatch-large": HELLO + raw_data(0, 0, KEYB, 11, (100000,), b"\0" * 399996),
    "data-meta-length": HELLO + header(codec.DATA, 20 + len(KEYB) + 1)
    + DATA_FIXED.pack(0, 0, len(KEYB), 3, 0) + KEYB + b"!",
    "data-meta-short": HELLO + header(codec.DATA, 4) + b"\0" * 4,
    "unknown-dtype": HELLO + raw_data(0, 0, KEYB, 99, (1,), b"\0"),
    "bytes-with-shape": HELLO + raw_data(0, 0, KEYB, 0, (2,), b"\0\0"),
    "key-not-utf8": HELLO + raw_data(0, 0, b"\xff\xfe", 3, (1,), b"\0"),
    "unknown-type": HELLO + header(42, 0),
    "unknown-type-zero": HELLO + header(0, 0),
    "non-hello-first": codec.encode_ping() + HELLO,
    "data-first": data_frame(np.zeros(2)),
    "frame-after-bye": HELLO + codec.encode_bye() + codec.encode_ping(),
    "second-hello": HELLO + HELLO,
    "invalid-msgpack": header(codec.HELLO, 1) + b"\xc1",
    "truncated-msgpack": header(codec.HELLO, 3) + msgpack.packb({"v": 1})[:3],
    "msgpack-not-a-map": header(codec.HELLO, 2) + msgpack.packb([1]),
    "msgpack-extra-data": header(codec.HELLO, 2) + b"\x80\x80",
    "error-invalid-msgpack": HELLO + header(codec.ERROR, 2) + b"\xc1\xc1",
    "ping-with-meta": HELLO + PING_WITH_META,
    "ping-with-payload": HELLO + header(codec.PING, 0, 4) + b"\0" * 4,
    "cancel-meta-7": HELLO + header(codec.CANCEL, 7) + b"\0" * 7,
    "credit-meta-9": HELLO + header(codec.CREDIT, 9) + b"\0" * 9,
    "request-short": HELLO + header(codec.REQUEST, 10) + b"\0" * 10,
    "request-key-length": HELLO + header(codec.REQUEST, 18 + 3) + struct.pack("<QQH", 1, 1, 5) + b"abc",
    "abort-short": HELLO + header(codec.ABORT_STEP, 4) + b"\0" * 4,
    "bye-with-meta": HELLO + header(codec.BYE, 1) + b"x",
    "many-meta-13": HELLO + header(codec.DATA_MANY, 13) + b"\0" * 13,
    "many-payload-over-limit": HELLO + header(codec.DATA_MANY, 12, codec.MANY_PAYLOAD + 1)
    + MANY_FIXED.pack(0, 1),
    "many-count-over-limit": HELLO + raw_many(0, [], count=codec.MAX_MANY + 1),
    "many-count-beyond-entries": HELLO + raw_many(0, [(KEYB, 3, (1,), b"\0")], count=2),
    "many-bytes-after-entries": HELLO + raw_many(0, [(KEYB, 3, (1,), b"\0"), b"\0" * 9], count=1),
    "many-entry-cut": HELLO + raw_many(0, [b"\0" * 7], count=1),
    "many-key-beyond-frame": HELLO + raw_many(0, [struct.pack("<HBBI", 50, 3, 0, 0) + b"k"]),
    "many-payload-beyond-frame": HELLO + raw_many(
        0, [struct.pack("<HBBI", 1, 3, 1, 9) + struct.pack("<Q", 9) + b"k" + b"\0" * 8]),
    "many-ndim-33": HELLO + raw_many(0, [(KEYB, 3, (1,) * 33, b"\0")]),
    "many-unknown-dtype": HELLO + raw_many(0, [(KEYB, 99, (1,), b"\0")]),
    "many-bytes-with-shape": HELLO + raw_many(0, [(KEYB, 0, (2,), b"\0\0")]),
    "many-shape-mismatch": HELLO + raw_many(0, [(KEYB, 11, (4,), b"\0" * 15)]),
    "many-key-not-utf8": HELLO + raw_many(0, [(b"\xff\xfe", 3, (1,), b"\0")]),
    "many-key-too-long": HELLO + raw_many(0, [(b"k" * (codec.MAX_KEY + 1), 3, (1,), b"\0")]),
    "many-first": raw_many(0, [(KEYB, 3, (1,), b"\0")]),
    "zero-size-shape-overflow": HELLO + raw_data(0, 0, KEYB, 3, (2 ** 63, 0), b""),
    "zero-size-too-big": HELLO + raw_data(0, 0, KEYB, 3, (2 ** 62, 0, 2 ** 62), b""),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
async def test_malformed_frames_raise_protocol_error_and_decoder_stays_failed(name: str) -> None:
    data = MALFORMED[name]
    for chunks in (None, byte_by_byte(), random_chunks(5)):
        dec = codec.Decoder()
        with pytest.raises(rvz.ProtocolError) as info:
            feed(dec, data, chunks)
        message = str(info.value)
        assert message
        # What still arrives while its connection closes is read, never parsed.
        buf = dec.get_buffer(-1)
        assert len(buf) > 0
        with pytest.raises(rvz.ProtocolError):
            dec.buffer_updated(len(buf))
        with pytest.raises(rvz.ProtocolError):
            dec.buffer_updated(0)
        with pytest.raises(rvz.ProtocolError):  # valid bytes do not revive it
            feed(dec, codec.encode_ping())


async def test_payload_above_the_limit_is_refused() -> None:
    dec = codec.Decoder(max_payload=1000)
    with pytest.raises(rvz.ProtocolError) as info:
        feed(dec, HELLO + data_frame(np.zeros(1001, np.uint8)))
    assert "1001" in str(info.value) and KEY in str(info.value)
    ok = codec.Decoder(max_payload=1000)
    assert len(feed(ok, HELLO + data_frame(np.zeros(1000, np.uint8)))) == 2


@pytest.mark.parametrize("big", [np.zeros(1001, np.uint8), bytes(1001), np.zeros((7, 143), np.uint8)])
async def test_a_data_many_entry_above_the_limit_is_refused(big: Any) -> None:
    # max_payload bounds each value packed in a DATA_MANY frame as it bounds a DATA
    # frame's, wherever the entry is in the frame and however the frame arrives.
    over = KEYB + b"-over"
    frame = codec.encode_data_many(4, [(KEYB, np.arange(3)), (over, big), (KEYB, b"after")])
    for chunks in (None, byte_by_byte(), random_chunks(7)):
        dec = codec.Decoder(max_payload=1000)
        with pytest.raises(rvz.ProtocolError) as info:
            feed(dec, HELLO + frame, chunks)
        message = str(info.value)
        assert "DATA_MANY" in message and "1001" in message and "1000" in message
        assert over.decode() in message
        with pytest.raises(rvz.ProtocolError):  # and the decoder stays failed
            feed(dec, codec.encode_ping())


async def test_a_data_many_frame_above_the_limit_whose_values_are_within_it_is_accepted() -> None:
    # The limit is on a value, not on the frame: the sender packs values it may send
    # without knowing the consumer's limit, here three of 1000 bytes in a frame of over 3000.
    values = [np.full(1000, 1, np.uint8), bytes(1000), np.zeros((10, 25), np.float32)]
    frame = codec.encode_data_many(5, [(KEYB, v) for v in values])
    assert len(frame) > 3000
    events = feed(codec.Decoder(max_payload=1000), HELLO + frame)
    assert normalize(events[1:]) == normalize([(codec.DATA_MANY, 5, [KEY] * 3, values)])


async def test_keys_seen_again_decode_to_their_own_text() -> None:
    # The compiled decoder remembers decoded keys in 256 slots picked by a hash of their
    # bytes. 1000 distinct keys share those slots: short ones, long ones that differ in
    # their last byte only, and keys that are not ASCII; each comes three times, shuffled.
    keys = ([f"k{i:04d}" for i in range(600)]
            + [KEY[:-1] + chr(c) for c in range(33, 127)] + [f"{KEY}{i:03d}" for i in range(106)]
            + [f"ключ-{i}" for i in range(200)])
    order = keys * 3
    random.Random(5).shuffle(order)
    stream = HELLO + b"".join(data_frame(np.int32([i]), k=k.encode()) for i, k in enumerate(order))
    events = feed(codec.Decoder(), stream)[1:]
    assert [e[3] for e in events] == order
    assert [int(e[4][0]) for e in events] == list(range(len(order)))


async def test_a_1d_shape_whose_size_overflows_64_bits_is_refused() -> None:
    # (2**61 + 1) float64 is 2**64 + 8 bytes: 8 bytes once wrapped to 64 bits. A frame
    # announcing that shape with an 8-byte payload must fail, not make an array.
    code = codec.dtype_code(np.dtype("<f8"))
    frame = raw_data(1, 0, KEYB, code, (2**61 + 1,), bytes(8))
    with pytest.raises(rvz.ProtocolError, match="does not match"):
        feed(codec.Decoder(), HELLO + frame)


async def test_mismatch_error_names_key_dtype_and_shape() -> None:
    with pytest.raises(rvz.ProtocolError) as info:
        feed(codec.Decoder(), MALFORMED["payload-shape-mismatch"])
    message = str(info.value)
    assert KEY in message and "float32" in message and "(4,)" in message


async def test_encoder_limits() -> None:
    with pytest.raises(ValueError):
        codec.encode_data(0, 0, b"k" * (codec.MAX_KEY + 1), 3, (1,), 1)
    with pytest.raises(ValueError):
        codec.encode_data(0, 0, KEYB, 3, (1,) * 33, 1)
    with pytest.raises(ValueError):
        codec.encode_request(0, 0, b"k" * (codec.MAX_KEY + 1))


# -- fuzz ---------------------------------------------------------------------------------------


def _valid_stream(rng: random.Random) -> bytes:
    parts = [HELLO]
    for _ in range(rng.randint(1, 8)):
        choice = rng.randrange(7)
        if choice == 6:
            parts.append(codec.encode_data_many(rng.randint(0, 5), [
                (KEYB, np.arange(rng.randint(0, 9), dtype=np.int16)) for _ in range(rng.randint(0, 4))]))
        elif choice == 0:
            parts.append(data_frame(np.arange(rng.randint(0, 20), dtype=np.int16),
                                    step=rng.randint(0, 5), request_id=rng.randint(0, 5)))
        elif choice == 1:
            parts.append(codec.encode_request(rng.randint(0, 9), rng.randint(1, 9), KEYB))
        elif choice == 2:
            parts.append(codec.encode_error(1, 2, KEY, "aborted", "m" * rng.randint(0, 30)))
        elif choice == 3:
            parts.append(codec.encode_abort_step(rng.randint(0, 9), "gone"))
        elif choice == 4:
            parts.append(codec.encode_credit(rng.randint(0, 1 << 30)))
        else:
            parts.append(codec.encode_ping())
    if rng.random() < 0.3:
        parts.append(codec.encode_bye())
    return b"".join(parts)


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        pos = rng.randrange(len(buf)) if buf else 0
        if op == 0 and buf:
            buf[pos] = rng.randrange(256)
        elif op == 1 and buf:
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == 2:
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif buf:
            del buf[pos:pos + rng.randint(1, 8)]
    return bytes(buf)


def _decode_or_protocol_error(data: bytes, chunks: Iterable[int] | None) -> None:
    dec = codec.Decoder(max_payload=1 << 20)
    try:
        feed(dec, data, chunks)
    except rvz.ProtocolError:
        with pytest.raises(rvz.ProtocolError):  # it stays failed
            dec.buffer_updated(len(dec.get_buffer(-1)))


async def test_fuzz_random_bytes_decode_or_protocol_error() -> None:
    rng = random.Random(20240611)
    for i in range(300):
        data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
        if i % 2:
            data = HELLO + data  # get past the HELLO check too
        _decode_or_protocol_error(data, random_chunks(i))


async def test_fuzz_mutated_valid_streams_decode_or_protocol_error() -> None:
    rng = random.Random(7)
    for i in range(600):
        data = _mutate(rng, _valid_stream(rng))
        _decode_or_protocol_error(data, None if i % 3 == 0 else random_chunks(i, 64))


async def test_fuzz_header_fields_decode_or_protocol_error() -> None:
    """Valid frames whose header and DATA metadata fields take extreme values."""
    rng = random.Random(99)
    extremes = [0, 1, 2, 7, 8, 32, 33, 255, 4096, 65535, 65536, 2 ** 31, 2 ** 32 - 1]
    for i in range(600):
        shape = tuple(rng.choice([0, 1, 3, 2 ** 31, 2 ** 62, 2 ** 63, 2 ** 64 - 1])
                      for _ in range(rng.randint(0, 4)))
        code = rng.choice([0, 1, 3, 11, 14, 15, 255])
        payload = bytes(rng.choice([0, 1, 4, 12, 24]))
        frame = raw_data(rng.choice(extremes), rng.choice(extremes), KEYB, code, shape, payload)
        if rng.random() < 0.5:
            frame = bytearray(frame)
            frame[rng.randrange(len(frame))] = rng.choice([0, 1, 32, 33, 255])
            frame = bytes(frame)
        _decode_or_protocol_error(HELLO + frame, random_chunks(i, 40))


async def test_header_fields_with_high_bytes_read_exactly() -> None:
    """u32/u64 fields whose top bytes are 0x80 or more (a 3 GiB payload, a step and a
    request id near 2**64) are read as the same unsigned numbers on both implementations."""
    step, request_id = (1 << 63) + 12345, (1 << 64) - 2
    out = bytearray()
    codec.append_data(out, step, request_id, KEYB, 3, (3,), 3, b"abc", True)
    events = feed(codec.Decoder(), HELLO + bytes(out))
    assert events[1][:4] == (codec.DATA, step, request_id, KEY)
    # a header announcing 3 GiB (0xC0000000: the top byte of its low u32 is 0xC0)
    meta = DATA_FIXED.pack(1, 1, len(KEYB), 3, 1) + struct.pack("<Q", 3 << 30) + KEYB
    dec = codec.Decoder(max_payload=1 << 20)
    with pytest.raises(rvz.ProtocolError, match=f"payload of {3 << 30} bytes exceeds"):
        feed(dec, HELLO + header(codec.DATA, len(meta), 3 << 30) + meta)

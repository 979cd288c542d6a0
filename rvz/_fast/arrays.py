"""Dtype codes and the byte-level steps of the data path: packing a DATA header and building
a received array.

This file is the pure-Python implementation.  ``arrays.pyx`` beside it is the compiled twin
with the same functions, written with raw pointers and numpy's C API because these steps are
a handful of stores and one ``memcpy`` that Python's ``struct`` and ``np.frombuffer`` wrap in
a microsecond of calls.  ``rvz._impl`` picks one, like the other hot-path modules.
"""

from __future__ import annotations

import struct
import weakref
from typing import Any

import numpy as np

from .format import BYTES_CODE, DATA, DATA_MANY, DTYPES, MAX_NDIM, REQUEST, VERSION, WIRE_DTYPES
from .format import describe_other as _describe_other

# One struct per ndim packs the whole DATA header (frame header + metadata) in one call.
_DATA_HEADERS = [struct.Struct("<BBHIQQQHBB" + "Q" * n) for n in range(MAX_NDIM + 1)]
# DATA_MANY: the frame header and its metadata (step, count), then entries, each
# ``u16 klen | u8 code | u8 ndim | u32 nbytes | u64 shape[ndim] | key | payload``.
_MANY_HEAD = struct.Struct("<BBHIQQI")
MANY_HEAD_SIZE = _MANY_HEAD.size  # 28
_ENTRY_HEADS = [struct.Struct("<HBBI" + "Q" * n) for n in range(MAX_NDIM + 1)]
_PAYLOAD_LEN = struct.Struct("<Q")
# REQUEST: the frame header, then ``u64 step | u64 request_id | u16 klen | key``.
_REQUEST_HEAD = struct.Struct("<BBHIQQQH")
_COUNT = struct.Struct("<I")


# dtype -> wire code; numpy caches a dtype's hash, where ``dtype.str`` formats a new string
_CODE_OF_DTYPE = {np.dtype(s): i + 1 for i, s in enumerate(WIRE_DTYPES)}


def describe(value: Any) -> tuple:
    """``(value, dtype_code, shape, nbytes)`` of a value about to be sent.

    Arrays come back C-contiguous and in little-endian order (a copy only when the caller's
    array was not); numpy scalars as 0-d arrays; ``bytes``-like values as they are.
    """
    if type(value) is np.ndarray and value.flags.c_contiguous and value.ndim <= MAX_NDIM:
        code = _CODE_OF_DTYPE.get(value.dtype, -1)
        if code > 0:
            return value, code, value.shape, value.nbytes
    return _describe_other(value)


def append_data(out: bytearray, step: int, request_id: int, key: bytes, code: int,
                shape: tuple, nbytes: int, value: Any, with_payload: bool) -> None:
    """Append a DATA frame's header and key to ``out``, and its payload if ``with_payload``.

    The caller has checked the key's length (at most ``codec.MAX_KEY`` bytes) and the
    shape's (at most ``MAX_NDIM``: ``describe`` refuses more).
    """
    ndim = len(shape)
    out += _DATA_HEADERS[ndim].pack(VERSION, DATA, 0, 20 + 8 * ndim + len(key), nbytes,
                                    step, request_id, len(key), code, ndim, *shape)
    out += key
    if with_payload and nbytes:
        _append_payload(out, value)


def _append_payload(out: bytearray, value: Any) -> None:
    if isinstance(value, np.ndarray):
        array: Any = value  # numpy's stubs do not declare the buffer protocol for 3.10
        out += memoryview(array).cast("B")
    else:
        out += value


def append_request(out: bytearray, step: int, request_id: int, key: bytes) -> None:
    """Append a REQUEST frame for ``key`` to ``out`` (the caller checked the key's length)."""
    out += _REQUEST_HEAD.pack(VERSION, REQUEST, 0, 18 + len(key), 0, step, request_id, len(key))
    out += key


def many_begin(out: bytearray, step: int) -> None:
    """Open a DATA_MANY frame at the end of ``out``; ``many_end`` completes its header."""
    out += _MANY_HEAD.pack(VERSION, DATA_MANY, 0, 12, 0, step, 0)


def many_entry(out: bytearray, key: bytes, code: int, shape: tuple, nbytes: int,
               value: Any) -> None:
    """Append one value to the DATA_MANY frame being written (the caller checked the key's
    length, the shape's rank and the frame's bound)."""
    out += _ENTRY_HEADS[len(shape)].pack(len(key), code, len(shape), nbytes, *shape)
    out += key
    if nbytes:
        _append_payload(out, value)


def many_end(out: bytearray, start: int, count: int) -> None:
    """Complete the DATA_MANY frame opened at ``start``: its payload length and count."""
    _PAYLOAD_LEN.pack_into(out, start + 8, len(out) - start - MANY_HEAD_SIZE)
    _COUNT.pack_into(out, start + 24, count)


def block_array(code: int, shape: tuple, block: Any, src: bytearray, offset: int,
                avail: int) -> Any:
    """An array of wire ``code`` (not 0) and ``shape`` on the memory of ``block`` (a
    pooled ``bytearray``, or a ``memoryview`` of one, of exactly the array's size), which
    it keeps referenced (as its base, or through a memoryview of it: one reference either
    way, which is what the pool counts); ``src[offset:offset + avail]`` is copied to its
    start (the part of the payload that came with the header)."""
    arr = np.frombuffer(block, DTYPES[code])
    if len(shape) != 1:
        arr = arr.reshape(shape)
    if avail:
        memoryview(block)[:avail] = memoryview(src)[offset:offset + avail]
    return arr


def new_array(code: int, shape: tuple, src: bytearray, offset: int, nbytes: int) -> Any:
    """A new array (``bytes`` for code 0) holding ``src[offset:offset + nbytes]``."""
    if code == BYTES_CODE:
        return bytes(src[offset:offset + nbytes])
    dtype = DTYPES[code]
    value = np.frombuffer(src, dtype, nbytes // dtype.itemsize, offset).copy()
    if len(shape) != 1:
        value = value.reshape(shape)
    return value


def same_array(arr: Any, code: int, shape: tuple, flags: int) -> bool:
    """Whether ``arr`` is still exactly as the decoder made it for wire ``code`` and ``shape``
    (``flags`` being what ``array_flags`` read then): its dtype, shape, C strides and flags
    unchanged, and no weak reference to it, so a new value may be written into it."""
    if weakref.getweakrefcount(arr) or arr.flags.num != flags:
        return False
    dtype = DTYPES[code]
    if arr.dtype is not dtype or arr.shape != shape:
        return False
    stride = dtype.itemsize
    strides = arr.strides
    for i in range(len(shape) - 1, -1, -1):
        if strides[i] != stride:
            return False
        stride *= shape[i]
    return True


def array_flags(arr: Any) -> int:
    """numpy's flags of ``arr``, as one integer."""
    return int(arr.flags.num)


def refill(arr: Any, src: bytearray, offset: int, nbytes: int) -> None:
    """Copy ``src[offset:offset + nbytes]`` over the whole of ``arr`` (C-contiguous, of
    exactly ``nbytes`` bytes)."""
    arr.reshape(-1).view(np.uint8)[:] = np.frombuffer(src, np.uint8, nbytes, offset)


def move(buf: bytearray, dst: int, src: int, nbytes: int) -> None:
    """Move ``nbytes`` of ``buf`` from ``src`` to ``dst`` (the ranges may overlap)."""
    buf[dst:dst + nbytes] = buf[src:src + nbytes]

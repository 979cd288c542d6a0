"""Dtype codes and the byte-level steps of the data path: packing a DATA header and building
a received array.

This file is the pure-Python implementation.  ``arrays.pyx`` beside it is the compiled twin
with the same functions, written with raw pointers and numpy's C API because these steps are
a handful of stores and one ``memcpy`` that Python's ``struct`` and ``np.frombuffer`` wrap in
a microsecond of calls.  ``rvz._impl`` picks one, like the other hot-path modules.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

VERSION = 2
DATA = 2

# dtype code 0 is a ``bytes`` value; the others are numpy dtypes, little-endian on the wire.
BYTES_CODE = 0
WIRE_DTYPES = ["|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8",
               "<f2", "<f4", "<f8", "<c8", "<c16"]
DTYPES: list[Any] = [None] + [np.dtype(s) for s in WIRE_DTYPES]
CODES = {np.dtype(s).str: i + 1 for i, s in enumerate(WIRE_DTYPES)}
MAX_NDIM = 32

# One struct per ndim packs the whole DATA header (frame header + metadata) in one call.
_DATA_HEADERS = [struct.Struct("<BBHIQQQHBB" + "Q" * n) for n in range(MAX_NDIM + 1)]


def append_data(out: bytearray, step: int, request_id: int, key: bytes, code: int,
                shape: tuple, nbytes: int, value: Any, with_payload: bool) -> None:
    """Append a DATA frame's header and key to ``out``, and its payload if ``with_payload``.

    The caller has checked ``len(shape) <= MAX_NDIM`` and the key's length.
    """
    ndim = len(shape)
    out += _DATA_HEADERS[ndim].pack(VERSION, DATA, 0, 20 + 8 * ndim + len(key), nbytes,
                                    step, request_id, len(key), code, ndim, *shape)
    out += key
    if with_payload and nbytes:
        if isinstance(value, np.ndarray):
            array: Any = value  # numpy's stubs do not declare the buffer protocol for 3.10
            out += memoryview(array).cast("B")
        else:
            out += value


def new_array(code: int, shape: tuple, src: bytearray, offset: int, nbytes: int) -> Any:
    """A new array (``bytes`` for code 0) holding ``src[offset:offset + nbytes]``."""
    if code == BYTES_CODE:
        return bytes(src[offset:offset + nbytes])
    dtype = DTYPES[code]
    value = np.frombuffer(src, dtype, nbytes // dtype.itemsize, offset).copy()
    if len(shape) != 1:
        value = value.reshape(shape)
    return value

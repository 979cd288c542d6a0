"""The bytes of the one-sided protocol: slot headers, inline messages, answer trailers.

What a producer puts in front of a tensor in a slot, what an inline message holds and what
follows an answer written into a destination, as both ends pack and read them; and the check
a consumer applies to the dtype, shape and size a peer claims for a value.
"""

from __future__ import annotations

import struct

from .. import _impl
from ..errors import TransportError
from .pool import align

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
SHAPES = [struct.Struct("<" + "Q" * n) for n in range(_codec.MAX_NDIM + 1)]
# Slot header flags: a whole value, the first piece of a larger one, a later piece.
WHOLE, FIRST, PIECE = 0, 1, 2
ALIGN_HDR = align(SLOT_HDR.size)   # the header of a later piece (no shape)


def slot_header_size(ndim: int) -> int:
    return align(SLOT_HDR.size + 8 * ndim)


def fits_inline(key: str, shape: tuple[int, ...], nbytes: int, limit: int) -> bool:
    """Whether a value goes as one inline message of at most ``limit`` bytes."""
    klen = len(key) if key.isascii() else len(key.encode("utf-8"))
    return MSG_HDR.size + 8 * len(shape) + klen + nbytes <= limit


def check_meta(key: str, code: int, shape: tuple[int, ...], nbytes: int, max_payload: int) -> None:
    """Refuse a dtype, shape and size that disagree, or a value past the payload limit."""
    if code >= len(DTYPES) or len(shape) > _codec.MAX_NDIM:
        raise TransportError(f"bad dtype code {code} or {len(shape)} dims for key {key}")
    dtype = DTYPES[code]
    if dtype is None:
        expected = nbytes
    else:
        expected = dtype.itemsize
        for dim in shape:
            expected *= dim
    if expected != nbytes or nbytes > max_payload:
        raise TransportError(f"key {key}: {nbytes} bytes do not match dtype {dtype} and shape "
                             f"{shape} or exceed the payload limit")

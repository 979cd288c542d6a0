"""Constants of the wire format shared by both implementations of ``arrays``: the protocol
version, the dtypes rvz carries and their codes, and how an unusual value is described.

Plain Python (``describe_other`` is not a hot path: the common case, a C-contiguous native
array, never gets there).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

# 2: REQUESTS (several keys in one frame) was added; 3: DATA_MANY; 4: the AUTH proof names
# the side of the connection that sends it (a secret-less relay passed as either peer);
# 5: SEQ and ACK (values are numbered per peer and sent again after a reconnect)
VERSION = 5
DATA = 2       # the DATA frame's type (codec.py lists them all)
REQUEST = 3    # the REQUEST frame's type
DATA_MANY = 13  # several small Send-Driven values of one step in one frame
MAX_NDIM = 32

# The decoder hands each frame up as an event: a tuple of its kind, then its fields
# (``codec.Decoder.feed`` lists each kind's).  These name the positions.
KIND = 0
STEP = 1        # DATA, DATA_MANY, REQUEST, ABORT_STEP
FIELD = 1       # the one field of CREDIT, SEQ, ACK, CANCEL, HELLO, AUTH, ERROR, ONESIDED
REQUEST_ID = 2  # DATA (0: a push), REQUEST
KEY = 3         # DATA, REQUEST
VALUE = 4       # DATA
NUMBER = 5      # DATA delivered by a one-sided channel: the value's number (``Wire.deliver``)
KEYS = 2        # DATA_MANY
VALUES = 3      # DATA_MANY
MESSAGE = 2     # ABORT_STEP

# dtype code 0 is a ``bytes`` value; the others are numpy dtypes, little-endian on the wire.
BYTES_CODE = 0
WIRE_DTYPES = ["|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8",
               "<f2", "<f4", "<f8", "<c8", "<c16"]
DTYPES: list[Any] = [None] + [np.dtype(s) for s in WIRE_DTYPES]
CODES = {np.dtype(s).str: i + 1 for i, s in enumerate(WIRE_DTYPES)}


def describe_other(value: Any) -> tuple:
    """``describe`` for everything but a little-endian, C-contiguous array of a wire dtype
    with at most ``MAX_NDIM`` dimensions."""
    if isinstance(value, np.generic):  # a numpy scalar (say ``arr.sum()``): a 0-d array
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        # A masked array's buffer is its data without its mask: sent as an array, the mask
        # would be lost without a word. Other subclasses (matrix, memmap) are their values.
        # (An exact ndarray skips the check and so never loads numpy.ma.)
        if type(value) is not np.ndarray and isinstance(value, np.ma.MaskedArray):
            raise TypeError(f"rvz does not send masked arrays ({type(value).__module__}."
                            f"{type(value).__name__}): the mask would be lost; send "
                            "value.filled(fill_value), or the data and the mask "
                            "(np.ma.getmaskarray(value)) as two arrays")
        if value.ndim > MAX_NDIM:  # (refused here, by the call: the frame could not carry it)
            raise ValueError(f"array has {value.ndim} dimensions; rvz carries at most "
                             f"{MAX_NDIM}")
        code = CODES.get(value.dtype.str, -1)
        if code < 0:
            dtype = value.dtype
            if dtype.kind in "biufc" and dtype.byteorder == ">":
                value = value.astype(dtype.newbyteorder("<"))
                code = CODES.get(value.dtype.str, -1)
            if code < 0:
                raise TypeError(f"rvz does not send arrays of dtype {dtype} (bool, integer, "
                                "float16 to float64 and complex64/complex128 dtypes only; "
                                "nothing is pickled)")
        if not value.flags.c_contiguous:
            value = np.ascontiguousarray(value)
        return value, code, value.shape, value.nbytes
    if isinstance(value, (bytes, bytearray, memoryview)):
        if isinstance(value, memoryview):
            value = value.cast("B") if value.c_contiguous else memoryview(value.tobytes())
        return value, BYTES_CODE, (), len(value)
    array = foreign_array(value)
    if array is None:
        raise TypeError(f"rvz sends numpy arrays, bytes, or CPU tensors and arrays that export "
                        f"DLPack, __array_interface__ or the buffer protocol, not "
                        f"{_kind(value)}")
    return describe_other(array)


# DLPack's device types that are CPU memory numpy can read (``__dlpack_device__``).
_DL_CPU = 1
_DL_DEVICES = {2: "CUDA", 3: "pinned CUDA host", 4: "OpenCL", 7: "Vulkan", 8: "Metal",
               9: "VPI", 10: "ROCm", 11: "pinned ROCm host", 13: "CUDA managed",
               14: "oneAPI", 15: "WebGPU", 16: "Hexagon"}


def _kind(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def foreign_array(value: Any, use: str = "send") -> np.ndarray | None:
    """An ndarray over the memory of a tensor of another framework (torch, JAX, TensorFlow,
    CuPy on the host) or of any object that exports DLPack, ``__array_interface__`` or the
    buffer protocol: no copy.  None for an object that exports none of them; a tensor
    that cannot be used as it is raises ``TypeError`` naming why and the fix.  ``use`` says
    what for, in those messages: ``"send"``, or ``"receive into"`` (``into=``)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and not value.requires_grad and (
            value.device.type == "cpu"):
        # A torch CPU tensor's own view: the same memory DLPack gives, for a quarter of its
        # cost (a tensor numpy cannot hold goes on to DLPack, for its error).
        try:
            array: np.ndarray = value.numpy()
            return array
        except (RuntimeError, TypeError):
            pass
    if getattr(value, "requires_grad", False) is True:  # torch: its DLPack refuses it too
        raise TypeError(f"rvz does not {use} a {_kind(value)} that requires grad: {use} "
                        "value.detach(), the same memory without the autograd graph")
    kind = _kind(value)
    if hasattr(value, "__dlpack__"):
        device = value.__dlpack_device__() if hasattr(value, "__dlpack_device__") else (1, 0)
        if int(device[0]) != _DL_CPU:
            where = _DL_DEVICES.get(int(device[0]), f"type {int(device[0])}")
            raise TypeError(f"rvz can {use} CPU memory, and this {kind} is on a {where} "
                            f"device ({int(device[1])}): use a CPU copy (torch: value.cpu(); "
                            "JAX: jax.device_get(value))")
        try:
            return np.from_dlpack(value)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            # numpy has no bfloat16 (or float8): the framework must convert it.
            raise TypeError(f"rvz cannot {use} this {kind} of dtype "
                            f"{getattr(value, 'dtype', '?')}: {str(exc).rstrip('.')}; use a dtype "
                            "numpy has (torch: value.float(), or value.view(torch.int16) to "
                            "keep the bits)") from exc
    if hasattr(value, "__array_interface__"):
        return np.asarray(value)
    try:
        memoryview(value)
    except TypeError:
        return None
    return np.asarray(value)

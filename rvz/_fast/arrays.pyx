# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled twin of ``arrays.py`` (read that file for what each function promises).

Raw pointers and numpy's C API: a DATA header is a few stores into the write buffer, and a
small received array is one ``PyArray_EMPTY`` and one ``memcpy``.  The wire is little-endian;
on a big-endian host this module refuses to load and ``rvz._impl`` runs pure Python.
"""

import sys

import numpy as np

cimport numpy as cnp
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport (PyByteArray_AS_STRING, PyByteArray_FromStringAndSize,
                                PyByteArray_GET_SIZE, PyByteArray_Resize)
from cpython.memoryview cimport PyMemoryView_GET_BUFFER
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy, memmove

cdef extern from "Python.h":
    ctypedef struct PyByteArrayObject:
        Py_ssize_t ob_alloc
        char* ob_bytes
        char* ob_start
        Py_ssize_t ob_exports
    void Py_SET_SIZE(object o, Py_ssize_t size)

cdef extern from "numpy/arrayobject.h":
    ctypedef struct PyArrayObject_fields:
        void* weakreflist

cnp.import_array()

if sys.byteorder != "little":
    raise ImportError("rvz's compiled data path assumes a little-endian host")

from rvz._fast.format import (BYTES_CODE, CODES, DATA, DATA_MANY, DTYPES, MAX_NDIM, REQUEST,
                           VERSION, WIRE_DTYPES)
from rvz._fast.format import describe_other as _describe_other

# numpy type numbers of the wire codes (index = code)
cdef int[15] _TYPENUMS
_TYPENUMS[:] = [0, cnp.NPY_BOOL, cnp.NPY_INT8, cnp.NPY_UINT8, cnp.NPY_INT16, cnp.NPY_UINT16,
                cnp.NPY_INT32, cnp.NPY_UINT32, cnp.NPY_INT64, cnp.NPY_UINT64, cnp.NPY_FLOAT16,
                cnp.NPY_FLOAT32, cnp.NPY_FLOAT64, cnp.NPY_COMPLEX64, cnp.NPY_COMPLEX128]


# The dtype object of each wire code (numpy's own, the one every array of it is made with):
# a reused array must still have it.
cdef void* _DESCRS[15]
for _code in range(1, 15):
    _DESCRS[_code] = <void*>DTYPES[_code]

# A C copy of the wire's limit: compared with as a C int, not a boxed Python global.
cdef int _C_MAX_NDIM = MAX_NDIM
assert MAX_NDIM <= 32  # block_array_c's dims array

# wire code of each numpy type number (-1: not carried), for native-order arrays
cdef int[32] _CODE_OF_TYPENUM
_CODE_OF_TYPENUM[:] = [-1] * 32
for _code in range(1, 15):
    _CODE_OF_TYPENUM[_TYPENUMS[_code]] = _code


def describe(object value):
    return describe_c(value)


# The last 1-D shape made, for the sender's describe and the receiver's decoder: a stream
# carries one shape over and over, and the tuple (and, past 256 elements, its int) would
# otherwise be made and freed for every value.
cdef unsigned long long _last_dim0 = 0
cdef tuple _last_shape1 = (0,)


cdef tuple shape1_c(unsigned long long dim0):
    global _last_dim0, _last_shape1
    if dim0 != _last_dim0:
        _last_shape1 = (dim0,)
        _last_dim0 = dim0
    return _last_shape1


cdef tuple describe_c(object value):
    """describe() for compiled callers (the engine): a C call."""
    cdef cnp.ndarray arr
    cdef int typenum
    cdef int code
    if cnp.PyArray_CheckExact(value):
        arr = <cnp.ndarray>value
        typenum = cnp.PyArray_TYPE(arr)
        if (0 <= typenum < 32 and cnp.PyArray_ISNOTSWAPPED(arr)
                and cnp.PyArray_IS_C_CONTIGUOUS(arr)):
            code = _CODE_OF_TYPENUM[typenum]
            if code > 0:
                if cnp.PyArray_NDIM(arr) == 1:  # the common tensor: no attribute lookup
                    return value, code, shape1_c(cnp.PyArray_DIM(arr, 0)), cnp.PyArray_NBYTES(arr)
                if cnp.PyArray_NDIM(arr) <= _C_MAX_NDIM:  # (more: describe_other refuses it)
                    return value, code, value.shape, cnp.PyArray_NBYTES(arr)
    return _describe_other(value)


cdef inline void _put16(char* p, uint16_t v) noexcept nogil:
    memcpy(p, &v, 2)


cdef inline void _put32(char* p, uint32_t v) noexcept nogil:
    memcpy(p, &v, 4)


cdef inline void _put64(char* p, uint64_t v) noexcept nogil:
    memcpy(p, &v, 8)


# A write buffer's first allocation; it grows by half again after.
cdef Py_ssize_t MIN_ROOM = 4096


cdef char* _grow(bytearray out, Py_ssize_t add) except NULL:
    """Room for ``add`` more bytes at the end of ``out``: where they go.  CPython grows a
    bytearray by an eighth at a time, one realloc (often with a copy) every few frames of a
    loop pass's buffer; this grows it by half, from MIN_ROOM, and moves only the logical
    size while there is room."""
    cdef PyByteArrayObject* o = <PyByteArrayObject*>out
    cdef Py_ssize_t old = PyByteArray_GET_SIZE(out)
    cdef Py_ssize_t size = old + add
    cdef Py_ssize_t room
    if o.ob_exports == 0 and size + (o.ob_start - o.ob_bytes) + 1 <= o.ob_alloc:
        Py_SET_SIZE(out, size)
    else:
        room = size + (size >> 1)
        if room < MIN_ROOM:
            room = MIN_ROOM
        if PyByteArray_Resize(out, room) < 0:  # (a BufferError while exported, as CPython's)
            return NULL
        Py_SET_SIZE(out, size)
    o.ob_start[size] = 0  # a bytearray keeps a NUL after its bytes
    return o.ob_start + old


cdef bytearray reserved_c(Py_ssize_t room):
    """An empty write buffer with room for ``room`` bytes, allocated once: filled up to
    that, it is never reallocated (each realloc copies what the buffer holds)."""
    cdef bytearray out = PyByteArray_FromStringAndSize(NULL, room)
    Py_SET_SIZE(out, 0)
    (<PyByteArrayObject*>out).ob_start[0] = 0
    return out


cdef bytearray emptied_c(bytearray out, Py_ssize_t keep):
    """``out`` with its bytes dropped and its room kept, unless that room exceeds ``keep``
    bytes (a new buffer then, as while it is exported: its bytes may not change under a
    view)."""
    cdef PyByteArrayObject* o = <PyByteArrayObject*>out
    if o.ob_exports != 0 or o.ob_alloc > keep:
        return bytearray()
    o.ob_start = o.ob_bytes
    Py_SET_SIZE(out, 0)
    if o.ob_alloc != 0:
        o.ob_start[0] = 0
    return out


cdef int append_frame_c(bytearray out, bytes frame) except -1:
    """Append a whole frame to a write buffer (``Wire.write_frame``), growing it as the
    frames packed in place do: ``+=`` would shrink a buffer with room to spare."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(frame)
    memcpy(_grow(out, n), PyBytes_AS_STRING(frame), n)
    return 0


def append_data(bytearray out, uint64_t step, uint64_t request_id, bytes key, int code,
                tuple shape, Py_ssize_t nbytes, object value, bint with_payload):
    append_data_c(out, step, request_id, key, code, shape, nbytes, value, with_payload)


cdef int append_data_c(bytearray out, uint64_t step, uint64_t request_id, bytes key, int code,
                       tuple shape, Py_ssize_t nbytes, object value,
                       bint with_payload) except -1:
    """append_data() for compiled callers (the engine's write buffer): no argument boxed."""
    cdef Py_ssize_t ndim = len(shape)
    cdef Py_ssize_t klen = PyBytes_GET_SIZE(key)
    cdef Py_ssize_t meta = 20 + 8 * ndim + klen
    cdef Py_ssize_t add = 16 + meta
    cdef Py_ssize_t i
    cdef char* p
    if with_payload:
        add += nbytes
    p = _grow(out, add)
    p[0] = <char>VERSION
    p[1] = <char>DATA
    _put16(p + 2, 0)
    _put32(p + 4, <uint32_t>meta)
    _put64(p + 8, <uint64_t>nbytes)
    _put64(p + 16, step)
    _put64(p + 24, request_id)
    _put16(p + 32, <uint16_t>klen)
    p[34] = <char><uint8_t>code
    p[35] = <char><uint8_t>ndim
    for i in range(ndim):
        _put64(p + 36 + 8 * i, <uint64_t>shape[i])
    memcpy(p + 36 + 8 * ndim, PyBytes_AS_STRING(key), klen)
    if not with_payload or nbytes == 0:
        return 0
    return _copy_payload(p + 16 + meta, value, nbytes)


cdef int _copy_payload(char* p, object value, Py_ssize_t nbytes) except -1:
    cdef Py_buffer view
    if cnp.PyArray_Check(value):
        memcpy(p, cnp.PyArray_DATA(<cnp.ndarray>value), nbytes)
    elif type(value) is bytes:
        memcpy(p, PyBytes_AS_STRING(value), nbytes)
    else:
        PyObject_GetBuffer(value, &view, PyBUF_SIMPLE)
        try:
            memcpy(p, view.buf, nbytes)
        finally:
            PyBuffer_Release(&view)
    return 0


MANY_HEAD_SIZE = 28


def append_request(bytearray out, uint64_t step, uint64_t request_id, bytes key):
    append_request_c(out, step, request_id, key)


cdef int append_request_c(bytearray out, uint64_t step, uint64_t request_id,
                          bytes key) except -1:
    """append_request() for compiled callers: a REQUEST frame in a few stores."""
    cdef Py_ssize_t klen = PyBytes_GET_SIZE(key)
    cdef char* p
    p = _grow(out, 34 + klen)
    p[0] = <char>VERSION
    p[1] = <char>REQUEST
    _put16(p + 2, 0)
    _put32(p + 4, <uint32_t>(18 + klen))
    _put64(p + 8, 0)
    _put64(p + 16, step)
    _put64(p + 24, request_id)
    _put16(p + 32, <uint16_t>klen)
    memcpy(p + 34, PyBytes_AS_STRING(key), klen)
    return 0


def many_begin(bytearray out, uint64_t step):
    many_begin_c(out, step)


def many_entry(bytearray out, bytes key, int code, tuple shape, Py_ssize_t nbytes, object value):
    many_entry_c(out, key, code, shape, nbytes, value)


def many_end(bytearray out, Py_ssize_t start, Py_ssize_t count):
    many_end_c(out, start, count)


cdef int many_begin_c(bytearray out, uint64_t step) except -1:
    """many_begin() for compiled callers."""
    cdef char* p
    p = _grow(out, 28)
    p[0] = <char>VERSION
    p[1] = <char>DATA_MANY
    _put16(p + 2, 0)
    _put32(p + 4, 12)
    _put64(p + 8, 0)
    _put64(p + 16, step)
    _put32(p + 24, 0)
    return 0


cdef int many_entry_c(bytearray out, bytes key, int code, tuple shape, Py_ssize_t nbytes,
                      object value) except -1:
    """many_entry() for compiled callers."""
    cdef Py_ssize_t ndim = len(shape)
    cdef Py_ssize_t klen = PyBytes_GET_SIZE(key)
    cdef Py_ssize_t head = 8 + 8 * ndim
    cdef Py_ssize_t i
    cdef char* p
    p = _grow(out, head + klen + nbytes)
    _put16(p, <uint16_t>klen)
    p[2] = <char><uint8_t>code
    p[3] = <char><uint8_t>ndim
    _put32(p + 4, <uint32_t>nbytes)
    for i in range(ndim):
        _put64(p + 8 + 8 * i, <uint64_t>shape[i])
    memcpy(p + head, PyBytes_AS_STRING(key), klen)
    if nbytes == 0:
        return 0
    return _copy_payload(p + head + klen, value, nbytes)


cdef int many_end_c(bytearray out, Py_ssize_t start, Py_ssize_t count) except -1:
    """many_end() for compiled callers."""
    cdef char* p = PyByteArray_AS_STRING(out) + start
    _put64(p + 8, <uint64_t>(PyByteArray_GET_SIZE(out) - start - 28))
    _put32(p + 24, <uint32_t>count)
    return 0


cdef Py_ssize_t nbytes_c(object value) except -1:
    """Payload bytes of a value (the engine's nbytes_of): an array's, a bytes' length."""
    if cnp.PyArray_Check(value):
        return cnp.PyArray_NBYTES(<cnp.ndarray>value)
    if type(value) is bytes:
        return PyBytes_GET_SIZE(value)
    n = getattr(value, "nbytes", None)
    return len(value) if n is None else int(n)


def block_array(int code, tuple shape, object block, bytearray src, Py_ssize_t offset,
                Py_ssize_t avail):
    return block_array_c(code, shape, block, src, offset, avail)


cdef object block_array_c(int code, tuple shape, object block, bytearray src,
                          Py_ssize_t offset, Py_ssize_t avail):
    """block_array() for compiled callers (the decoder): an array made on the block's
    memory and one ``memcpy``, where ``np.frombuffer`` and slicing cost five Python calls."""
    cdef cnp.npy_intp[32] dims
    cdef Py_ssize_t ndim = len(shape)
    cdef Py_ssize_t i
    cdef char* data
    cdef Py_ssize_t size
    if type(block) is bytearray:
        data = PyByteArray_AS_STRING(block)
        size = PyByteArray_GET_SIZE(block)
    elif type(block) is memoryview:  # the first bytes of a larger block (see RecvPool.take)
        data = <char*>PyMemoryView_GET_BUFFER(block).buf
        size = PyMemoryView_GET_BUFFER(block).len
    else:
        raise TypeError(f"a pool block is a bytearray or a memoryview, not {type(block)}")
    for i in range(ndim):
        dims[i] = <cnp.npy_intp>shape[i]
    arr = cnp.PyArray_SimpleNewFromData(<int>ndim, dims, _TYPENUMS[code], data)  # writable
    if cnp.PyArray_NBYTES(<cnp.ndarray>arr) != size:
        raise ValueError(f"a block of {size} bytes for an array of "
                         f"{cnp.PyArray_NBYTES(<cnp.ndarray>arr)}")
    cnp.set_array_base(<cnp.ndarray>arr, block)  # the block stays referenced while arr lives
    if avail:
        memcpy(data, PyByteArray_AS_STRING(src) + offset, avail)
    return arr


def new_array(int code, tuple shape, bytearray src, Py_ssize_t offset, Py_ssize_t nbytes):
    return new_array_c(code, shape, src, offset, nbytes)


cdef object new_array_c(int code, tuple shape, bytearray src, Py_ssize_t offset,
                        Py_ssize_t nbytes):
    """new_array() for compiled callers (the decoder): a C call, no arguments boxed."""
    cdef char* base = PyByteArray_AS_STRING(src) + offset
    cdef cnp.npy_intp[32] dims
    cdef Py_ssize_t ndim = len(shape)
    cdef Py_ssize_t i
    if code == BYTES_CODE:
        return PyBytes_FromStringAndSize(base, nbytes)
    for i in range(ndim):
        dims[i] = <cnp.npy_intp>shape[i]
    arr = cnp.PyArray_EMPTY(<int>ndim, dims, _TYPENUMS[code], 0)
    if nbytes:
        memcpy(cnp.PyArray_DATA(<cnp.ndarray>arr), base, nbytes)
    return arr


def same_array(object arr, int code, tuple shape, int flags):
    return same_array_c(arr, code, shape, flags)


cdef bint same_array_c(object arr, int code, tuple shape, int flags):
    """same_array() for compiled callers (the array pool): a few C comparisons."""
    cdef cnp.ndarray a = <cnp.ndarray>arr
    cdef Py_ssize_t ndim = len(shape)
    cdef Py_ssize_t i
    cdef cnp.npy_intp stride
    if ((<PyArrayObject_fields*><void*>arr).weakreflist != NULL or cnp.PyArray_FLAGS(a) != flags
            or cnp.PyArray_NDIM(a) != ndim or <void*>cnp.PyArray_DESCR(a) != _DESCRS[code]):
        return False
    stride = cnp.PyArray_ITEMSIZE(a)
    for i in range(ndim - 1, -1, -1):
        if cnp.PyArray_DIM(a, i) != <cnp.npy_intp>shape[i] or cnp.PyArray_STRIDE(a, i) != stride:
            return False
        stride *= cnp.PyArray_DIM(a, i)
    return True


def array_flags(object arr):
    return cnp.PyArray_FLAGS(<cnp.ndarray>arr)


def refill(object arr, bytearray src, Py_ssize_t offset, Py_ssize_t nbytes):
    refill_c(arr, src, offset, nbytes)


cdef int refill_c(object arr, bytearray src, Py_ssize_t offset, Py_ssize_t nbytes) except -1:
    """refill() for compiled callers: one ``memcpy``."""
    memcpy(cnp.PyArray_DATA(<cnp.ndarray>arr), PyByteArray_AS_STRING(src) + offset, nbytes)
    return 0


def move(bytearray buf, Py_ssize_t dst, Py_ssize_t src, Py_ssize_t nbytes):
    move_c(buf, dst, src, nbytes)


cdef int move_c(bytearray buf, Py_ssize_t dst, Py_ssize_t src, Py_ssize_t nbytes) except -1:
    """move() for compiled callers: one ``memmove`` within the buffer."""
    cdef char* p = PyByteArray_AS_STRING(buf)
    memmove(p + dst, p + src, nbytes)
    return 0

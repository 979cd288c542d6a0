cimport cython
from cpython.bytearray cimport PyByteArray_AS_STRING
from libc.string cimport memcmp

from rvz._fast.arrays cimport block_array_c, move_c, new_array_c, shape1_c
from rvz._fast.recvpool cimport RecvPool

cdef extern from "Python.h":
    bint PyUnicode_IS_COMPACT_ASCII(object)
    Py_ssize_t PyUnicode_GET_LENGTH(object)
    void *PyUnicode_DATA(object)

cdef bint COMPILED
cdef bytes _ITEMSIZES
cdef unsigned long long _DIM1_LIMIT
cdef Py_ssize_t KEY_CACHE
cdef Py_ssize_t _C_HEADER, _C_VERSION, _C_MAX_META, _C_MAX_NDIM, _C_MAX_KEY, _C_NCODES, _C_BYTES
cdef Py_ssize_t _C_DATA, _C_DATA_MANY, _C_HELLO, _C_ENTRY, _C_MANY_PAYLOAD, _C_MAX_MANY
cdef Py_ssize_t _C_REQUEST, _C_REQUESTS, _C_CANCEL, _C_CREDIT, _C_SEQ, _C_ACK
cdef int _S_HELLO, _S_OPEN, _S_BYE


cdef inline Py_ssize_t _key_slot(bytearray buf, Py_ssize_t start, Py_ssize_t length) noexcept:
    """A slot of the decoder's key cache for the key at buf[start:start + length]: a hash
    of its length and its last 16 bytes (keys of one program differ mostly at the end)."""
    cdef const unsigned char *p = <const unsigned char *>PyByteArray_AS_STRING(buf) + start
    cdef unsigned long long h = <unsigned long long>length * 0x9E3779B97F4A7C15ULL
    cdef Py_ssize_t i = length - 16 if length > 16 else 0
    while i < length:
        h = (h ^ p[i]) * 0x100000001B3ULL
        i += 1
    return <Py_ssize_t>((h ^ (h >> 29)) & <unsigned long long>(KEY_CACHE - 1))


cdef inline bint _same_key(str known, bytearray buf, Py_ssize_t start, Py_ssize_t length) noexcept:
    """Whether ``known`` (a cached key) is the text of buf[start:start + length] (ASCII
    keys only: for those, the str's bytes are the UTF-8 bytes)."""
    return (PyUnicode_IS_COMPACT_ASCII(known) and PyUnicode_GET_LENGTH(known) == length
            and memcmp(PyUnicode_DATA(known), PyByteArray_AS_STRING(buf) + start, length) == 0)

cdef Py_ssize_t _u16(bytearray buf, Py_ssize_t pos)
@cython.locals(b0="unsigned long long", b1="unsigned long long", b2="unsigned long long",
               b3="unsigned long long")
cdef unsigned long long _u32(bytearray buf, Py_ssize_t pos)
cdef unsigned long long _u64(bytearray buf, Py_ssize_t pos)
cpdef bytes encode_data(unsigned long long step, unsigned long long request_id, bytes key,
                        int code, tuple shape, unsigned long long nbytes)
cpdef object payload_view(object value)
cpdef bytes encode_request(unsigned long long step, unsigned long long request_id, bytes key)

cdef object staged_value(RecvPool pool, Py_ssize_t code, tuple shape, bytearray buf,
                         Py_ssize_t pos, Py_ssize_t nbytes)
cdef tuple own_memory(RecvPool pool, bytearray buf, str key, Py_ssize_t code, tuple shape,
                      unsigned long long payload_len, Py_ssize_t pstart, Py_ssize_t avail)

cdef class Decoder:
    cdef bytearray _buf
    cdef object _view
    cdef object _head  # _view[:PEEK], made once
    cdef Py_ssize_t _size
    cdef Py_ssize_t _start
    cdef Py_ssize_t _end
    cdef Py_ssize_t _direct_min
    cdef unsigned long long _max_payload
    cdef object _dest
    cdef Py_ssize_t _dest_filled
    cdef Py_ssize_t _dest_len
    cdef object _pending
    cdef int _state
    cdef object _failed
    cdef public RecvPool pool  # typed: its take() is a C call
    cdef Py_ssize_t _full_size
    cdef bint _peek
    cdef public object admit
    cdef public object land
    cdef object _landing
    cdef public bint stop_at_handshake
    cdef public Py_ssize_t frames
    cdef public long long bytes_in  # a C counter: no int object made per read
    cdef list _keys

    @cython.locals(end=Py_ssize_t)
    cpdef object get_buffer(self, Py_ssize_t sizehint=*)
    cpdef Py_ssize_t payload_left(self)
    @cython.locals(events=list)
    cpdef list buffer_updated(self, Py_ssize_t nbytes)
    cpdef list more(self)
    cdef _compact(self)
    cdef _grow(self)
    cdef _fail(self, str message)
    @cython.locals(buf=bytearray, pos=Py_ssize_t, end=Py_ssize_t, need=Py_ssize_t,
                   mstart=Py_ssize_t, kstart=Py_ssize_t, pstart=Py_ssize_t, pend=Py_ssize_t,
                   avail=Py_ssize_t, meta_len=Py_ssize_t, klen=Py_ssize_t, ndim=Py_ssize_t,
                   code=Py_ssize_t, ftype=int, version=int, flags=int, handshake=bint,
                   payload_len="unsigned long long")
    cdef list _parse(self)
    cdef _parsed(self, Py_ssize_t pos, Py_ssize_t need)
    @cython.locals(kstart=Py_ssize_t, pstart=Py_ssize_t, pend=Py_ssize_t, avail=Py_ssize_t,
                   klen=Py_ssize_t, ndim=Py_ssize_t, code=Py_ssize_t)
    cdef Py_ssize_t _data(self, bytearray buf, Py_ssize_t mstart, Py_ssize_t meta_len,
                          unsigned long long payload_len, Py_ssize_t end, list events) except -2
    cdef _check_header(self, int version, int ftype, int flags, Py_ssize_t meta_len)
    cdef _bad_data(self, Py_ssize_t meta_len, Py_ssize_t klen, Py_ssize_t ndim, Py_ssize_t code)
    cdef _direct(self, object step, object request_id, str key, Py_ssize_t code, tuple shape,
                 unsigned long long payload_len, Py_ssize_t pstart, Py_ssize_t avail)
    cdef bint _control(self, int ftype, bytearray buf, object view, Py_ssize_t mstart,
                       Py_ssize_t meta_len, list events) except -1
    @cython.locals(_k=Py_ssize_t, pos=Py_ssize_t, kstart=Py_ssize_t, klen=Py_ssize_t, code=Py_ssize_t,
                   ndim=Py_ssize_t, nbytes=Py_ssize_t, count="unsigned long long",
                   keys=list, values=list)
    cdef _many(self, bytearray buf, Py_ssize_t start, Py_ssize_t end, list events)
    @cython.locals(dim0="unsigned long long")
    cdef tuple _shape(self, bytearray buf, Py_ssize_t pos, Py_ssize_t ndim, Py_ssize_t code,
                      str key, unsigned long long payload_len)
    cdef _check_size(self, str key, Py_ssize_t code, tuple shape, object payload_len)
    @cython.locals(slot=Py_ssize_t, known=object, other=object, keys=list)
    cdef str _key(self, bytearray buf, Py_ssize_t start, Py_ssize_t length)
    @cython.locals(pos=Py_ssize_t, end=Py_ssize_t, klen=Py_ssize_t, count="unsigned long long",
                   _n="unsigned long long")
    cdef _requests(self, bytearray buf, object view, Py_ssize_t start, Py_ssize_t length, list events)

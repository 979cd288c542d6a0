cimport cython

cdef bint COMPILED

@cython.locals(b0="unsigned long long", b1="unsigned long long", b2="unsigned long long",
               b3="unsigned long long")
cdef unsigned long long _u32(bytearray buf, Py_ssize_t pos)
cdef unsigned long long _u64(bytearray buf, Py_ssize_t pos)
cpdef bytes encode_data(unsigned long long step, unsigned long long request_id, bytes key,
                        int code, tuple shape, unsigned long long nbytes)
cpdef bytes encode_request(unsigned long long step, unsigned long long request_id, bytes key)

cdef class Decoder:
    cdef bytearray _buf
    cdef object _view
    cdef Py_ssize_t _size
    cdef Py_ssize_t _start
    cdef Py_ssize_t _end
    cdef Py_ssize_t _direct_min
    cdef object _max_payload
    cdef object _dest
    cdef Py_ssize_t _dest_filled
    cdef Py_ssize_t _dest_len
    cdef object _pending
    cdef int _state
    cdef object _failed
    cdef object _pool
    cdef Py_ssize_t _full_size
    cdef bint _peek
    cdef public object admit
    cdef public bint stop_at_handshake
    cdef public Py_ssize_t frames
    cdef public object bytes_in

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
                   code=Py_ssize_t, ftype=int, version=int, flags=int, handshake=bint)
    cdef list _parse(self)
    cdef str _key(self, bytearray buf, Py_ssize_t start, Py_ssize_t length)
    cdef _requests(self, bytearray buf, object view, Py_ssize_t start, Py_ssize_t length, list events)

cimport cython
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_FromStringAndSize
from rvz._fast.clock cimport monotonic_ns_c
from rvz._fast.arrays cimport (append_data_c, append_frame_c, append_request_c, emptied_c,
                               many_begin_c, many_end_c, many_entry_c, reserved_c)
from rvz._fast.codec cimport Decoder
from rvz._fast.codec cimport payload_view as payload_view_c
from rvz._fast.peers cimport Peer

cdef bint COMPILED
# The writer's sizes, as C values: each frame's accounting does arithmetic with them.
cdef Py_ssize_t MESSAGE_COST, COALESCE_MAX, FLUSH_AT, MANY_PAYLOAD, MAX_MANY
cdef Py_ssize_t MANY_OVERHEAD, MAX_NDIM, MANY_HEAD, LARGE_READ, COPY_WRITE_MAX
cdef long long ALONE_NS
cdef Py_ssize_t NUMBER
cdef bytes copy_bytes(bytearray data)
cdef bytearray reserved(Py_ssize_t room)
cdef bytearray emptied(bytearray data)
cdef long long clock_ns()
cdef frame_data(bytearray out, object step, object request_id, bytes key, int code,
                tuple shape, Py_ssize_t nbytes, object value, bint with_payload)

cdef class Wire


cdef class Dispatcher:
    cdef public object loop
    cdef public str name
    cdef public Py_ssize_t answer_backlog
    cdef public object into

    cpdef dispatch(self, Wire conn, list events)
    cpdef admit(self, Wire conn, object step, object request_id, str key, object nbytes)
    cpdef arrived(self, Wire conn)
    cpdef answer_deferred(self, Wire conn)


cdef class Wire:
    cdef public Dispatcher core
    cdef public long long alone_ns
    cdef public bint outbound
    cdef public object peer
    cdef public Decoder decoder  # typed: its reads are C calls
    cdef public bint ready
    cdef public bint closed
    cdef public bint closed_here
    cdef public bint bye_received
    cdef public bint paused
    cdef public object close_reason
    cdef public dict parked
    cdef public object dataplane
    cdef public dict key_ways
    cdef public Py_ssize_t key_ways_max
    cdef public Py_ssize_t tcp_values
    cdef public Py_ssize_t tx_next
    cdef public Py_ssize_t rx_seq
    cdef public long long bytes_out  # a C counter: no int object made per write
    cdef public Py_ssize_t frames_out
    cdef public Py_ssize_t data_out
    cdef public list deferred
    cdef public bytearray _out
    cdef Py_ssize_t _room
    cdef list _gathered
    cdef Py_ssize_t _gathered_bytes
    cdef Py_ssize_t _many_at
    cdef Py_ssize_t _many_end
    cdef object _many_step
    cdef Py_ssize_t _many_count
    cdef public bint _flush_scheduled
    cdef public bint _hold_first
    cdef public Py_ssize_t _burst
    cdef long long _alone_at
    cdef public bint _answer_queued
    cdef object _call_soon
    cdef object _flush_cb
    cdef object _read_flush_cb
    cdef public object transport
    cdef public bint gather
    cdef public bint tuning
    cdef public Py_ssize_t tune_from
    cdef public Py_ssize_t arriving
    cdef dict __dict__

    # cpdef: the transport calls it from Python (typed, the read's size is a C value)
    cpdef buffer_updated(self, Py_ssize_t nbytes)
    # feed is the Python entry (bench/engine.py); buffer_updated calls _feed, a C call: a
    # cpdef called on the Python subclass looks itself up on the instance first (a bound
    # method made and dropped per read).
    cdef _feed(self, Py_ssize_t nbytes)
    cpdef deliver(self, list events)
    cpdef write_frame(self, bytes frame)
    cdef _append(self, bytes frame)
    # cdef, not cpdef: the engine's own calls on a connection, which is a Python subclass
    # (rvz.connection), where a cpdef call first looks the method up on the instance in
    # case Python overrides it (a bound method made and dropped, per message).
    cdef write_request(self, object step, object request_id, bytes key)
    @cython.locals(peer=Peer, seq=Py_ssize_t)
    cdef write_value(self, object step, object request_id, bytes key, object value, int code,
                     tuple shape, Py_ssize_t nbytes)
    @cython.locals(ways=dict, at=Py_ssize_t)
    cpdef resend(self, Py_ssize_t first, list entries)
    cdef _write_stream(self, object step, object request_id, bytes key, object value, int code,
                       tuple shape, Py_ssize_t nbytes)
    cdef bint goes_onesided(self, bytes key, object request_id, Py_ssize_t nbytes) except -1
    @cython.locals(ndim=Py_ssize_t, start=Py_ssize_t, out=bytearray)
    cdef _pack(self, object step, bytes key, object value, int code, tuple shape,
               Py_ssize_t nbytes)
    cdef _queued(self)
    @cython.locals(now="long long")
    cdef bint _at_once(self) except -1
    cpdef flush(self)
    cdef check_backlog(self)
    cdef requests_queued(self)
    cdef _write_out(self)
    cdef _write(self, object data, object payload)
    cdef _write_gathered(self, list pieces)

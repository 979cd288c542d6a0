cimport cython
from rvz._fast.peers cimport Peer, Route
from rvz._fast.wire cimport Wire

cdef Py_ssize_t MESSAGE_COST, SWEEP_SLACK


cdef class Credit:
    cdef public dict peers
    cdef public object host
    cdef public object loop
    cdef public dict queued_pushes

    cpdef attach(self, object loop)
    cpdef bint returned(self, Peer peer, object conn, object nbytes) except -1
    cpdef arrived(self, Wire conn)
    @cython.locals(conn=Wire)
    cpdef bint push(self, Peer peer, object step, Route route, object value, int code,
                    tuple shape, Py_ssize_t nbytes) except -1
    cpdef unconsumed(self, Peer peer, Py_ssize_t nbytes)
    @cython.locals(before=Py_ssize_t)
    cpdef check_window(self, Peer peer, object cost)
    @cython.locals(conn=Wire)
    cdef Wire open_link(self, Peer peer)
    cpdef Wire push_link(self, Peer peer, Py_ssize_t nbytes)
    cpdef object queue_push(self, object done, Peer peer, object step, Route route, object value,
                            int code, tuple shape, Py_ssize_t nbytes)
    @cython.locals(peer=Peer, i=Py_ssize_t)
    cpdef object drop_push(self, object done)
    @cython.locals(conn=Wire)
    cpdef pump(self, Peer peer)
    cpdef consumed_from(self, Peer peer, Py_ssize_t nbytes)
    cpdef flush_credit(self, Peer peer)
    cpdef flush_credit_now(self, object peer)
    @cython.locals(i=Py_ssize_t, item=tuple)
    cpdef object unqueue_push(self, Peer peer, object step, str text)
    @cython.locals(floor=Py_ssize_t, above=set)
    cpdef bint fresh(self, Peer peer, Py_ssize_t seq) except -1
    @cython.locals(peer=Peer, fresh=Py_ssize_t)
    cpdef on_ack(self, Wire conn, object seq)
    @cython.locals(kept=Py_ssize_t)
    cpdef resend(self, Peer peer, Wire conn)
    cpdef resync(self, Peer peer, Wire conn, Py_ssize_t window)
    cpdef drop_unacked(self, Peer peer)

cimport cython

cdef Py_ssize_t MAX_KEY


cdef class Peer


cdef class Route:
    cdef public str text
    cdef public bytes encoded
    cdef public tuple src
    cdef public tuple dst
    cdef public bint from_me
    cdef public bint to_me
    cdef public Peer peer


cdef class Peer:
    cdef public tuple id
    cdef public str name
    cdef public str address
    cdef public object out
    cdef public set inbound
    cdef public object incarnation
    cdef public str mode
    cdef public object link
    cdef public Py_ssize_t credit
    cdef public bint asked
    cdef public object queue
    cdef public Py_ssize_t owed
    cdef public bint owed_scheduled
    cdef public bint owe_now
    cdef public bint stuck
    cdef public object pushes_on
    cdef public object joined_step
    cdef public Py_ssize_t steps_opened
    cdef public Py_ssize_t window
    cdef public Py_ssize_t unreturned
    cdef public Py_ssize_t answered
    cdef public Py_ssize_t parks
    cdef public dict asking
    cdef public object held_back
    cdef public Py_ssize_t held_back_mark
    cdef public bint lost
    cdef public Py_ssize_t held_bytes
    cdef public Py_ssize_t held_count
    cdef public Py_ssize_t credit_stalls
    cdef public Py_ssize_t hold_reserved
    cdef public Py_ssize_t tx_seq
    cdef public list unacked
    cdef public Py_ssize_t unacked_head
    cdef public Py_ssize_t credit_in
    cdef public Py_ssize_t credited
    cdef public Py_ssize_t rx_floor
    cdef public set rx_above
    cdef public Py_ssize_t acked_sent
    cdef public Py_ssize_t arriving
    cdef object __weakref__

    cpdef list live_connections(self)
    cpdef dialled(self, object conn)
    cpdef dropped(self, object conn)
    cpdef forget_links(self, object keep)
    cpdef new_incarnation(self, Py_ssize_t window)
    cpdef object take_queue(self)
    cpdef left_step(self, object step)
    cpdef Py_ssize_t kept(self)
    cpdef keep(self, object step, object request_id, object key, object value)
    cpdef acked(self, Py_ssize_t values)
    cpdef bint unconnected(self) except -1


cdef class Request:
    cdef public object id
    cdef public Peer peer
    cdef public object step
    cdef public str key
    cdef public Route route
    cdef public object conn

    cdef init(self, object request_id, Peer peer, object step, Route route)

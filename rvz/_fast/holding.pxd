cimport cython
from rvz._fast.peers cimport Peer
from rvz._fast.table cimport Table

cdef Py_ssize_t MESSAGE_COST, SWEEP_SLACK, HOLD_LOW_WATER


cdef class Holding:
    cdef public Py_ssize_t hold_limit
    cdef public Py_ssize_t lost_hold_limit
    cdef public object claim_timeout
    cdef public dict asked
    cdef public Py_ssize_t held_bytes
    cdef public Py_ssize_t held_count
    cdef public object hold_waiters
    cdef public Py_ssize_t hold_reserved
    cdef public Py_ssize_t lost_bytes
    cdef public Py_ssize_t lost_count
    cdef public Py_ssize_t lost_reserved
    cdef public dict claims
    cdef public object claim_order
    cdef public list claim_times
    cdef public dict lost_claims
    cdef public dict tables

    @cython.locals(others=Py_ssize_t, count=Py_ssize_t, cost=Py_ssize_t)
    cpdef bint full(self, Peer peer, Py_ssize_t nbytes, Py_ssize_t mine) except -1
    @cython.locals(claimed=tuple, deadlines=list)
    cpdef claim(self, object step, str key, double now)
    cpdef pulled(self, object step, str key, double now)
    cpdef forget_asked(self, double horizon)
    @cython.locals(timeout=object, due=list, later=list, counted=tuple, deadlines=list,
                   key=str, peer=Peer, oldest=double, asked=object, count=Py_ssize_t,
                   deadline=double)
    cpdef list due_claims(self, double now, object route)
    @cython.locals(order=object, deadlines=list, times=list)
    cpdef object next_claim(self, double now)
    @cython.locals(deadlines=list, table=Table, excess=Py_ssize_t)
    cpdef object held_claims(self, tuple counted)
    @cython.locals(parked=list)
    cpdef park_claims(self, Peer peer, tuple counted)
    cpdef drop_claims(self)
    cpdef Py_ssize_t held_cost(self)
    cpdef count_held(self, Peer peer, Py_ssize_t nbytes)
    cpdef released_held(self, Peer peer, Py_ssize_t nbytes)
    cpdef Py_ssize_t lost_cost(self)
    @cython.locals(lost=Py_ssize_t)
    cpdef Py_ssize_t live_cost(self)
    cpdef Py_ssize_t reserve_hold(self, Peer peer, Py_ssize_t nbytes) except -1
    cpdef unreserve_hold(self, Peer peer, Py_ssize_t cost)
    @cython.locals(sign=Py_ssize_t, parked=list)
    cpdef regroup(self, Peer peer, bint lost)
    cpdef wake_holders(self)

cimport cython
from rvz._fast.peers cimport Peer, Request, Route
from rvz._fast.steps cimport Steps
from rvz._fast.table cimport Table
from rvz._fast.wire cimport Wire

cdef Py_ssize_t SWEEP_SLACK, CANCELLED_MAX


cdef class Requests:
    cdef public Steps steps
    cdef public object host
    cdef public dict by_id
    cdef public dict outstanding
    cdef public dict cancelled
    cdef public object cancel_order
    cdef long long last_request_id

    cpdef table_dropped(self, object step)
    cpdef forget_cancelled_of(self, Peer peer)
    @cython.locals(again=list, keys=dict, request=Request, table=Table)
    cpdef reask(self, Wire conn)
    cpdef ask_missing(self, Peer peer, object step, Route route, Table table)
    @cython.locals(request=Request)
    cpdef object drop(self, object request_id)
    @cython.locals(request=Request, keys=dict, key=str, request_id=object)
    cpdef Request new_request(self, Peer peer, object step, Route route)
    @cython.locals(keys=dict)
    cpdef Py_ssize_t outstanding_count(self, object step, str key) except -1
    @cython.locals(keys=dict)
    cpdef drop_outstanding(self, object step)
    @cython.locals(request=Request, conn=Wire)
    cpdef request(self, Peer peer, object step, Route route)
    @cython.locals(link=Wire)
    cpdef bint send_asks(self, Peer peer, list requests, object conn=*) except -1
    @cython.locals(held=object, kept=list)
    cpdef hold_back(self, Peer peer, list requests)
    @cython.locals(conn=Wire, go=list, room=Py_ssize_t, start=Py_ssize_t, i=Py_ssize_t,
                   request=Request)
    cpdef send_held_back(self, Peer peer)
    @cython.locals(request=Request, other=Wire, rest=list)
    cpdef send_on(self, Peer peer, Wire conn, list requests)
    cpdef asked_no_more(self, Peer peer, object request_id)
    @cython.locals(conn=Wire)
    cpdef object request_link(self, Peer peer, object request=*)
    @cython.locals(keys=dict, first=Request, earlier=Wire)
    cpdef object key_link(self, Request request, object conn)
    @cython.locals(request=Request)
    cpdef send_requests(self, Wire conn, list requests)
    cpdef send_request(self, Wire conn, Request request)
    cdef _sent_on(self, Wire conn, Request request)
    @cython.locals(keys=dict)
    cpdef forget_request(self, object request_id, object step, str key)
    cdef _drop_key(self, object step, dict keys, str key)
    @cython.locals(keys=dict)
    cpdef rebalance(self, object step, str key, Table table)
    @cython.locals(cancelled=dict, order=object)
    cpdef note_cancelled(self, Request request)
    cpdef bint settled(self, object peer, object request_id)

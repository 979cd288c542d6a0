cimport cython
from cpython.object cimport PyObject_Call
from cpython.pythread cimport PyThread_get_thread_ident
from rvz._fast.arrays cimport describe_c, nbytes_c
from rvz._fast.credit cimport Credit
from rvz._fast.deadlines cimport Deadlines
from rvz._fast.holding cimport Holding
from rvz._fast.peers cimport Peer, Request, Route
from rvz._fast.requests cimport Requests
from rvz._fast.routes cimport Routes
from rvz._fast.steps cimport Steps
from rvz._fast.table cimport Table, Waiter, check_timeout
from rvz._fast.wire cimport Dispatcher, Wire

cdef bint COMPILED
cdef str RECV, SEND
# The engine's sizes, as C values: each message's accounting does arithmetic with them.
cdef Py_ssize_t MESSAGE_COST
# The positions of an event's items (format.py)
cdef Py_ssize_t FIELD, KEY, KEYS, KIND, MESSAGE, REQUEST_ID, STEP, VALUE, VALUES
cpdef Py_ssize_t nbytes_of(object value) except -1
cdef unsigned long thread_ident()
cpdef tuple describe_value(object value)


cdef class Core


cdef class RemoteWaiter(Waiter):
    cdef public Core core
    cdef public Wire conn
    cdef public object step
    cdef public object request_id
    cdef public Route route
    cdef public bint _done

    cdef init(self, Core core, Wire conn, object step, object request_id, Route route)


cdef class Core(Dispatcher):
    cdef public object host
    cdef public object cluster
    cdef public tuple id
    cdef public str mode
    cdef public unsigned long loop_thread
    cdef public long pid
    cdef public object loop_running
    cdef dict future_kw
    cdef public bint running
    cdef public bint closed
    cdef public Py_ssize_t push_window
    cdef public Holding holding
    cdef public Steps steps
    cdef public Requests requests
    cdef public Credit credit
    cdef public Deadlines timers
    cdef public dict peers
    cdef public Routes routes
    cdef public Py_ssize_t max_parked
    cdef public Py_ssize_t waits_producer
    cdef public Py_ssize_t waits_consumer

    @cython.locals(route=Route)
    cpdef Route own_route(self, object key, bint sending)
    @cython.locals(route=Route, peer=Peer)
    cpdef admit(self, Wire conn, object step, object request_id, str key, object nbytes)
    cpdef arrived(self, Wire conn)
    cpdef attach(self, object loop, unsigned long thread)
    cpdef object future(self)
    cpdef str check_mode(self, object mode)
    @cython.locals(route=Route, table=Table, peer=Peer)
    cpdef enter(self, object timeout)
    cpdef object send(self, object key, object value, object mode, object step, object timeout)
    cpdef bint hold_full(self, Table table, Route route, Py_ssize_t nbytes,
                         Py_ssize_t mine=*) except -1
    @cython.locals(conn=Wire)
    cpdef bint asked_and_read(self, Table table, Route route) except -1
    @cython.locals(holding=Holding)
    cpdef hold(self, Table table, object step, Route route, object value, Py_ssize_t nbytes)
    cpdef object push(self, Peer peer, object step, Route route, object value, int code,
                      tuple shape, Py_ssize_t nbytes)
    @cython.locals(peer=Peer, link=Wire, code=int, shape=tuple, nbytes=Py_ssize_t)
    cpdef answer(self, Wire conn, object step, object request_id, Route route, object value)
    cpdef answer_deferred(self, Wire conn)
    @cython.locals(route=Route, nbytes=Py_ssize_t)
    cpdef undefer(self, Wire conn)
    @cython.locals(route=Route, table=Table, peer=Peer)
    cpdef object recv(self, object key, object step, object mode, object timeout)
    cpdef tuple new_waiter(self, Table table, Route route, object peer, bint dial)
    cpdef bint must_ask(self, Peer peer, object mode) except -1
    cpdef str recv_mode(self, Peer peer, object mode)
    @cython.locals(table=Table, route=Route)
    cpdef unblock(self, Peer peer)
    cpdef check_stuck(self, Peer peer)
    @cython.locals(keys=dict)
    cpdef Table drop_table(self, object step)
    cpdef unconsumed(self, tuple src, object value)
    # An event's items are read by position: the decoder made the tuple, of its kind's length.
    @cython.boundscheck(False)
    @cython.wraparound(False)
    @cython.locals(event=tuple)
    cpdef dispatch(self, Wire conn, list events)
    @cython.locals(route=Route, table=Table, peer=Peer, cost=Py_ssize_t, request=Request,
                   seq=Py_ssize_t)
    cpdef on_data(self, Wire conn, object step, object request_id, str key, object value)
    @cython.locals(route=Route, table=Table, peer=Peer, n=Py_ssize_t, i=Py_ssize_t,
                   cost=Py_ssize_t, routes=list, seq=Py_ssize_t, fresh=list)
    cpdef on_data_many(self, Wire conn, object step, list keys, list values)
    cpdef Route arriving_route(self, Peer peer, str key)
    @cython.locals(route=Route, table=Table, peer=Peer, waiter=RemoteWaiter, held=bint, reused=bint)
    cpdef on_request(self, Wire conn, object step, object request_id, str key)
    cpdef on_credit(self, Wire conn, object nbytes)
    cpdef new_incarnation(self, Peer peer, Py_ssize_t window)
    cpdef Peer identified(self, Wire conn, tuple task_id)
    cpdef accepted(self, Peer peer, Wire conn, object incarnation, Py_ssize_t parks, str mode)
    cpdef link(self, Peer peer, Wire conn)
    cpdef set_running(self, bint running)
    cpdef stop(self, bint forked=*)
    cpdef on_cancel(self, Wire conn, object request_id)

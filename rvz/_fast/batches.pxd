cimport cython
from rvz._fast.arrays cimport describe_c, nbytes_c
from rvz._fast.engine cimport Core
from rvz._fast.peers cimport Peer, Route
from rvz._fast.table cimport Table
from rvz._fast.wire cimport Wire

cdef bint COMPILED
cdef Py_ssize_t MESSAGE_COST


cpdef list described(list items)
@cython.locals(n=Py_ssize_t, i=Py_ssize_t, j=Py_ssize_t, pushing=bint)
cpdef object send_many(Core core, list keys, list values, object mode, object step,
                       Py_ssize_t start)
@cython.locals(route=Route, peer=Peer, conn=Wire, table=Table, n=Py_ssize_t,
               i=Py_ssize_t, code=int, nbytes=Py_ssize_t, cost=Py_ssize_t, shape=tuple)
cpdef Py_ssize_t push_many(Core core, list keys, list values, Py_ssize_t start,
                           object step) except -1
cpdef list check_routes(Core core, list keys, bint sending)
@cython.locals(route=Route, peer=Peer, last=Peer, ask=bint, i=Py_ssize_t, asks=dict,
               dial=dict, requests=list)
cpdef tuple ask_many(Core core, list waiting, list routes, object mode, object step)
@cython.locals(route=Route, table=Table)
cpdef object take_many(Core core, list routes, object step, bint whole=*)

cimport cython
from rvz._fast.peers cimport Peer
from rvz._fast.table cimport Table

cdef object _NO_STEP


cdef class Steps:
    cdef public dict tables
    cdef object _last_step
    cdef Table _last_table
    cdef public dict dead_steps
    cdef public object dead_order
    cdef public Py_ssize_t dead_max
    cdef public dict dead_owner
    cdef public dict step_peers
    cdef public Py_ssize_t retired_max
    cdef public dict step_openers
    cdef public Py_ssize_t max_steps
    cdef public Py_ssize_t step_share
    cdef public dict empty_seen
    cdef public dict idle_since

    cpdef Table table(self, object step)
    cpdef object remote_table(self, object step, Peer peer)
    cpdef joined(self, object step, Peer peer)
    @cython.locals(opener=Peer)
    cpdef object drop(self, object step)
    cpdef object kill(self, object step, str message)
    cpdef note_owner(self, object step, set peers, object origin)
    cpdef forget_dead_of(self, tuple task_id, object incarnation)
    @cython.locals(table=Table)
    cpdef list empty_steps(self)
    @cython.locals(table=Table)
    cpdef list idle_steps(self, double now, double idle)
    @cython.locals(excess=Py_ssize_t, peer=Peer)
    cpdef retire(self)

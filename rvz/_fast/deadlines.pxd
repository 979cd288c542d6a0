cimport cython
from rvz._fast.clock cimport monotonic_ns_c

cdef bint COMPILED
cdef tuple LOOP_TIMES

cdef double now_s() noexcept

cdef double INF
cdef Py_ssize_t SWEEP_AT


cdef class Deadlines


cdef class Deadline:
    cdef public object callback
    cdef public tuple args
    cdef public Deadlines owner

    cpdef cancel(self)
    cpdef bint cancelled(self)


cdef class Deadlines:
    cdef public object loop
    cdef list _heap
    cdef unsigned long long _number
    cdef Py_ssize_t _live
    cdef object _timer
    cdef double _armed_at
    cdef double _slack
    cdef bint _own_clock

    @cython.locals(when=double, deadline=Deadline)
    cpdef Deadline arm(self, double delay, object callback, tuple args)
    cpdef cancelled(self)
    cpdef Py_ssize_t live(self)
    cpdef Py_ssize_t entries(self)
    cdef double _now(self) except? -1.0
    cdef _set_timer(self, double when)

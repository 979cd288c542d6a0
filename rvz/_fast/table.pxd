cimport cython
from rvz._fast.deadlines cimport Deadlines

cdef list _spare
cdef object _each(object waiters)

cpdef check_timeout(object timeout)
cpdef object arm_timeout(Deadlines timers, object timeout, Table table, str key, object waiter,
                         object source, object step=*)

cdef class Waiter:
    cpdef bint done(self) except -1
    cpdef set_result(self, object value)


cdef class Table:
    cdef dict _values
    cdef dict _waiters
    cdef object _abort_cause
    cdef object _abort_message
    cdef object _abort_kind
    cdef dict _back
    cdef public long long stamp
    cdef public long long took
    cdef public long long puts
    cdef object _handed

    cpdef object aborted_error(self, str key)
    cpdef bint put(self, str key, object value) except -1
    @cython.locals(waiter=Waiter)
    cdef object _hand(self, str key, object value)
    @cython.locals(slot=Slot)
    cdef _restamp(self, object waiter, long long stamp)
    cpdef long long handed(self, object waiter, long long stamp) except? -2
    cpdef bint put_front(self, str key, object value) except -1
    cpdef object take(self, str key)
    cpdef object take_or_wait(self, str key, object waiter)
    cpdef wait(self, str key, object waiter)
    cpdef object head_waiter(self, str key)
    cpdef bint remove_waiter(self, str key, object waiter) except -1
    cpdef Py_ssize_t waiting(self, str key) except -1
    cpdef Py_ssize_t queued_waiters(self, str key) except -1
    cpdef Py_ssize_t queued(self, str key) except -1
    cpdef list abort(self, str message, object cause, object kind=*)
    cpdef bint put_back(self, str key, object value, long long stamp) except -1
    cdef long long _took_back(self, str key, long long fresh) except? -1
    cdef object _queue(self, object item)
    cdef _retire(self, object queue)


cdef class Batch:
    cdef public Table table
    cdef public list keys
    cdef public list values
    cdef public list stamps
    cdef public Py_ssize_t missing
    cdef public object future
    cdef public list slots


cdef class Slot(Waiter):
    cdef public Batch batch
    cdef public Py_ssize_t index
    cdef public bint filled

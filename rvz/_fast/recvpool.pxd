cdef class RecvPool:
    cdef public object limit
    cdef public object held
    cdef dict _blocks
    cdef Py_ssize_t _idle_refs

cimport cython
from rvz._fast.keys cimport canonical_devices as canonical_devices_c
from rvz._fast.peers cimport Peer, Route

cdef bint COMPILED


cdef class Routes:
    cdef public object cluster
    cdef public tuple me
    cdef public dict peers
    cdef public Py_ssize_t push_window
    cdef public dict by_key
    cdef public dict devices

    @cython.locals(route=Route)
    cpdef Route route(self, object key)
    cpdef tuple task_of(self, str device, str key)
    cpdef Peer peer(self, tuple task_id)

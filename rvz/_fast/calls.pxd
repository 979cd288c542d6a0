from rvz._fast.engine cimport Core
from rvz._fast.table cimport arm_timeout


cdef class NodeCalls:
    # C fields: send and recv reach the engine through C calls, with no attribute lookup.
    cdef public Core _core
    cdef public object _loop
    cdef public object _poll

cdef class Key:
    cdef readonly str src
    cdef readonly str dst
    cdef readonly str name
    cdef readonly object frame
    cdef readonly object iter
    cdef readonly object incarnation
    cdef object _text
    cdef object _src_task
    cdef object _dst_task

cpdef tuple parse_device(str device)
cpdef tuple route_of(str device)
cpdef Key as_key(object key)
cpdef object canonical_devices(str text)
cdef bint _canonical_number(str text) except -1

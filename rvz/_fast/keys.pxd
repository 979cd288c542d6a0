cimport cython

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

cdef bint COMPILED
cdef str _MAX_U64_TEXT

cdef str _check_part(str what, object value)
cdef object _check_number(str what, object value)
cdef object _parse_number(str text)
cpdef object as_index(object value)
cpdef tuple parse_device(str device)
cpdef tuple route_of(str device)
cpdef Key as_key(object key)
@cython.locals(a=Py_ssize_t, b=Py_ssize_t, c=Py_ssize_t, d=Py_ssize_t, colon=Py_ssize_t)
cpdef object canonical_devices(str text)
# The character loops compile to C compares of code points.
@cython.locals(i=Py_ssize_t, c=Py_UCS4)
cdef bint _lower_hex(str text, Py_ssize_t start, Py_ssize_t end) except -1
@cython.locals(i=Py_ssize_t, c=Py_UCS4)
cdef bint _digits(str text, Py_ssize_t start, Py_ssize_t end) except -1
@cython.locals(n=Py_ssize_t)
cdef bint _canonical_number(str text, Py_ssize_t start, Py_ssize_t end) except -1

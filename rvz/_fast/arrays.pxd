# The C entry points of arrays.pyx that other compiled modules cimport (codec's decoder).

cdef object new_array_c(int code, tuple shape, bytearray src, Py_ssize_t offset,
                        Py_ssize_t nbytes)

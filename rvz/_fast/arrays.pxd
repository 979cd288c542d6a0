# The C entry points of arrays.pyx that other compiled modules cimport: the decoder builds
# arrays with new_array_c and block_array_c (their 1-D shapes with shape1_c) and moves its
# staged bytes with move_c, the array pool checks and refills the arrays it keeps
# (same_array_c, refill_c), the engine frames (DATA, DATA_MANY) and measures values with
# the others.

from libc.stdint cimport uint64_t

cdef object new_array_c(int code, tuple shape, bytearray src, Py_ssize_t offset,
                        Py_ssize_t nbytes)
cdef object block_array_c(int code, tuple shape, object block, bytearray src,
                          Py_ssize_t offset, Py_ssize_t avail)
cdef bint same_array_c(object arr, int code, tuple shape, int flags)
cdef int refill_c(object arr, bytearray src, Py_ssize_t offset, Py_ssize_t nbytes) except -1
cdef int move_c(bytearray buf, Py_ssize_t dst, Py_ssize_t src, Py_ssize_t nbytes) except -1
cdef tuple describe_c(object value)
cdef tuple shape1_c(unsigned long long dim0)
cdef int append_data_c(bytearray out, uint64_t step, uint64_t request_id, bytes key, int code,
                       tuple shape, Py_ssize_t nbytes, object value, bint with_payload) except -1
cdef Py_ssize_t nbytes_c(object value) except -1
cdef int append_frame_c(bytearray out, bytes frame) except -1
cdef bytearray reserved_c(Py_ssize_t room)
cdef bytearray emptied_c(bytearray out, Py_ssize_t keep)
cdef int append_request_c(bytearray out, uint64_t step, uint64_t request_id,
                          bytes key) except -1
cdef int many_begin_c(bytearray out, uint64_t step) except -1
cdef int many_entry_c(bytearray out, bytes key, int code, tuple shape, Py_ssize_t nbytes,
                      object value) except -1
cdef int many_end_c(bytearray out, Py_ssize_t start, Py_ssize_t count) except -1

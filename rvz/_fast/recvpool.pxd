cimport cython
from cpython.ref cimport Py_REFCNT

from rvz._fast.arrays cimport new_array_c, refill_c, same_array_c

cdef bint COMPILED
cdef Py_ssize_t _C_RING_MAX, _C_RINGS_MAX, _C_SWEEP

@cython.locals(item=object)
cdef Py_ssize_t _refs(list items, Py_ssize_t i) except -1
@cython.locals(free=Py_ssize_t, i=Py_ssize_t)
cdef Py_ssize_t _free(list items, Py_ssize_t idle) except -1
cpdef object _made(int code, tuple shape, bytearray src, Py_ssize_t offset, Py_ssize_t nbytes)

@cython.locals(bits=Py_ssize_t, rest=Py_ssize_t, shift=Py_ssize_t, step=Py_ssize_t)
cpdef Py_ssize_t size_class(Py_ssize_t nbytes) except -1

cdef class _SizeClass:
    cdef public Py_ssize_t size
    cdef public Py_ssize_t up1
    cdef public Py_ssize_t up2
    cdef public list blocks
    cdef public Py_ssize_t peak
    cdef public Py_ssize_t prev_peak
    cdef public Py_ssize_t takes
    cdef public Py_ssize_t windows
    cdef public Py_ssize_t last

cdef class _Ring:
    cdef public Py_ssize_t code
    cdef public tuple shape
    cdef public Py_ssize_t nbytes
    cdef public int flags
    cdef public list arrays
    cdef public Py_ssize_t at
    cdef public bint used

cdef class ArrayPool:
    cdef public Py_ssize_t limit
    cdef public Py_ssize_t held
    cdef public Py_ssize_t reused
    cdef public Py_ssize_t made
    cdef dict _rings
    cdef _Ring _last
    cdef Py_ssize_t _idle_refs
    cdef Py_ssize_t _takes

    @cython.locals(ring=_Ring, arrays=list, n=Py_ssize_t, at=Py_ssize_t, free=bint)
    cpdef object take(self, int code, tuple shape, bytearray src, Py_ssize_t offset,
                      Py_ssize_t nbytes)
    @cython.locals(ring=_Ring)
    cdef _Ring _ring(self, int code, tuple shape, Py_ssize_t nbytes)
    @cython.locals(ring=_Ring)
    cdef _sweep(self)

cdef class RecvPool:
    cdef public object limit
    cdef public Py_ssize_t held
    cdef public Py_ssize_t fresh
    cdef public Py_ssize_t prepared
    cdef public Py_ssize_t reused
    cdef public Py_ssize_t missed
    cdef public Py_ssize_t released
    cdef public bint due
    cdef public ArrayPool arrays
    cdef dict _classes
    cdef Py_ssize_t _idle_refs
    cdef Py_ssize_t _tick
    cdef object _next
    cdef Py_ssize_t _swept
    cdef Py_ssize_t _window
    cdef Py_ssize_t _stale

    @cython.locals(peak=Py_ssize_t)
    cdef Py_ssize_t _target(self, _SizeClass cls)
    cdef object _serving(self, _SizeClass cls, Py_ssize_t which)
    @cython.locals(other=_SizeClass, which=Py_ssize_t)
    cdef Py_ssize_t _alloc_size(self, _SizeClass cls) except -1
    @cython.locals(size=Py_ssize_t, cls=_SizeClass, other=_SizeClass, found=_SizeClass,
                   blocks=list, idle=Py_ssize_t, busy=Py_ssize_t, at=Py_ssize_t,
                   i=Py_ssize_t, which=Py_ssize_t, decayed=Py_ssize_t)
    cpdef object take(self, Py_ssize_t nbytes)
    cdef object _exact(self, object block, Py_ssize_t nbytes)
    @cython.locals(size=Py_ssize_t, cls=_SizeClass, blocks=list, i=Py_ssize_t)
    cpdef release(self, object block)
    @cython.locals(home=_SizeClass)
    cdef object _allocate(self, Py_ssize_t size, _SizeClass cls, bint spare_only)
    @cython.locals(cls=_SizeClass, other=_SizeClass, blocks=list, idle=Py_ssize_t,
                   count=Py_ssize_t, i=Py_ssize_t, which=Py_ssize_t)
    cpdef bint maintain(self) except -1
    @cython.locals(cls=_SizeClass, target=Py_ssize_t)
    cdef dict _needed(self)
    @cython.locals(cls=_SizeClass, blocks=list, idle=Py_ssize_t, extra=Py_ssize_t,
                   i=Py_ssize_t, size=Py_ssize_t)
    cdef _sweep(self)
    @cython.locals(blocks=list, idle=Py_ssize_t, extra=Py_ssize_t, i=Py_ssize_t,
                   size=Py_ssize_t, can=Py_ssize_t, rounds=int)
    cdef bint _make_room(self, Py_ssize_t need, bint spare_only) except -1

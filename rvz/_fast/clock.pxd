# The monotonic clock in C, for the compiled modules (their pure-Python twins use
# ``time.monotonic_ns``): CLOCK_MONOTONIC, which asyncio's and uvloop's loops count too.
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec


cdef inline long long monotonic_ns_c() noexcept:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec * 1000000000LL + ts.tv_nsec

# C types for _table.py, and the hot loops as plain C over raw pointers (no Python object
# is touched per id; every kernel runs without the GIL). _table.py calls these kernels only
# when it is compiled; as Python it runs its own loops, which compute the same results.

cimport cython
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define PS_PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
    #define PS_PREFETCHW(p) __builtin_prefetch((const void *)(p), 1, 3)
    #else
    #define PS_PREFETCH(p) ((void)0)
    #define PS_PREFETCHW(p) ((void)0)
    #endif
    """
    void PS_PREFETCH(const void *p) noexcept nogil
    void PS_PREFETCHW(const void *p) noexcept nogil

cdef Py_ssize_t MIGRATE_MIN, BLOCK_BYTES, AHEAD, BLOCKS_AHEAD, INDEX_CHUNK


cdef inline uint64_t _mix(int64_t key) noexcept nogil:
    # SplitMix64's finalizer (mix() in _table.py).
    cdef uint64_t x = <uint64_t>key + <uint64_t>0x9E3779B97F4A7C15ULL
    x = (x ^ (x >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * <uint64_t>0x94D049BB133111EBULL
    return x ^ (x >> 31)


cdef inline Py_ssize_t _home(uint64_t h, Py_ssize_t cap) noexcept nogil:
    return <Py_ssize_t>(((h >> 32) * <uint64_t>cap) >> 32)


cdef inline int32_t _probe(const int64_t *keys, const int32_t *vals, Py_ssize_t cap,
                           int64_t key, uint64_t h) noexcept nogil:
    """Row of ``key`` in one index (-1: absent)."""
    cdef Py_ssize_t j = _home(h, cap)
    cdef int32_t v
    while True:
        v = vals[j]
        if v == 0:
            return -1
        if keys[j] == key:
            return v - 1
        j += 1
        if j == cap:
            j = 0


cdef inline Py_ssize_t _find_batch(const int64_t *ids, Py_ssize_t n, int32_t *rows,
                                   const int64_t *keys, const int32_t *vals, Py_ssize_t cap,
                                   const int64_t *okeys, const int32_t *ovals,
                                   Py_ssize_t ocap) noexcept nogil:
    """``rows[i]`` = row of ``ids[i]`` (-1: absent) in the index, then in the old index
    (``okeys`` not NULL: a growth is moving it over). The home slots of the ids AHEAD
    positions later are prefetched, so the cache misses of a batch overlap."""
    cdef Py_ssize_t i, j, found = 0
    cdef uint64_t h
    cdef int32_t r
    for i in range(n):
        if i + AHEAD < n:
            j = _home(_mix(ids[i + AHEAD]), cap)
            PS_PREFETCH(&vals[j])
            PS_PREFETCH(&keys[j])
        h = _mix(ids[i])
        r = _probe(keys, vals, cap, ids[i], h)
        if r < 0 and okeys != NULL:
            r = _probe(okeys, ovals, ocap, ids[i], h)
        rows[i] = r
        if r >= 0:
            found += 1
    return found


cdef inline Py_ssize_t _lookup_batch(const int64_t *ids, Py_ssize_t n, int32_t *rows,
                                     const int64_t *keys, const int32_t *vals, Py_ssize_t cap,
                                     const int64_t *okeys, const int32_t *ovals,
                                     Py_ssize_t ocap, float *out, Py_ssize_t ncols,
                                     const uint64_t *bdata, const uint64_t *bstamp, int shift,
                                     Py_ssize_t width, bint stamp,
                                     uint32_t step) noexcept nogil:
    """``_find_batch`` and ``_gather`` in one software pipeline, so that the index misses
    of later ids and the row misses of earlier ones are in flight together: at position
    i, the home slots of id i + 2 * AHEAD are prefetched, id i + AHEAD is probed and its
    row prefetched, and row i is copied out (and stamped). Returns how many were found."""
    cdef Py_ssize_t i, j, k, line, found = 0, nbytes = 4 * ncols
    cdef Py_ssize_t mask = (<Py_ssize_t>1 << shift) - 1
    cdef uint64_t h
    cdef int32_t r
    cdef const float *src
    for i in range(-AHEAD, n):
        j = i + 2 * AHEAD
        if j < n:
            k = _home(_mix(ids[j]), cap)
            PS_PREFETCH(&vals[k])
            PS_PREFETCH(&keys[k])
        j = i + AHEAD
        if j < n:
            h = _mix(ids[j])
            r = _probe(keys, vals, cap, ids[j], h)
            if r < 0 and okeys != NULL:
                r = _probe(okeys, ovals, ocap, ids[j], h)
            rows[j] = r
            if r >= 0:
                found += 1
                src = (<const float *><size_t>bdata[r >> shift]) + (r & mask) * width
                line = 0
                while line < nbytes:
                    PS_PREFETCH((<const char *>src) + line)
                    line += 64
                if stamp:
                    PS_PREFETCHW((<uint32_t *><size_t>bstamp[r >> shift]) + (r & mask))
        if i < 0:
            continue
        r = rows[i]
        if r < 0:
            memset(out + i * ncols, 0, nbytes)
            continue
        memcpy(out + i * ncols, (<const float *><size_t>bdata[r >> shift]) + (r & mask) * width,
               nbytes)
        if stamp:
            (<uint32_t *><size_t>bstamp[r >> shift])[r & mask] = step
    return found


cdef inline void _place(int64_t *keys, int32_t *vals, Py_ssize_t cap, int64_t key,
                        int32_t val) noexcept nogil:
    """Put ``key`` (known to be absent) in the index."""
    cdef Py_ssize_t j = _home(_mix(key), cap)
    while vals[j] != 0:
        j += 1
        if j == cap:
            j = 0
    keys[j] = key
    vals[j] = val


cdef inline void _migrate(const int64_t *okeys, const int32_t *ovals, Py_ssize_t start,
                          Py_ssize_t end, int64_t *keys, int32_t *vals,
                          Py_ssize_t cap) noexcept nogil:
    """Move old slots ``start .. end`` into the new index (prefetching their new homes)."""
    cdef Py_ssize_t j, k
    for j in range(start, end):
        if j + AHEAD < end and ovals[j + AHEAD] != 0:
            k = _home(_mix(okeys[j + AHEAD]), cap)
            PS_PREFETCHW(&vals[k])
            PS_PREFETCHW(&keys[k])
        if ovals[j] != 0:
            _place(keys, vals, cap, okeys[j], ovals[j])


cdef inline void _gather(const int32_t *rows, Py_ssize_t n, float *out, Py_ssize_t ncols,
                         const uint64_t *bdata, const uint64_t *bstamp, int shift,
                         Py_ssize_t width, Py_ssize_t col0, bint stamp,
                         uint32_t step) noexcept nogil:
    """``out[i] = row rows[i][col0 : col0 + ncols]`` (zeros for -1); with ``stamp``, the
    rows' access stamps become ``step``. Rows AHEAD positions later are prefetched."""
    cdef Py_ssize_t i, r, line, nbytes = 4 * ncols
    cdef Py_ssize_t mask = (<Py_ssize_t>1 << shift) - 1
    cdef const float *src
    for i in range(n):
        if i + AHEAD < n:
            r = rows[i + AHEAD]
            if r >= 0:
                src = (<const float *><size_t>bdata[r >> shift]) + (r & mask) * width + col0
                line = 0
                while line < nbytes:
                    PS_PREFETCH((<const char *>src) + line)
                    line += 64
                if stamp:
                    PS_PREFETCHW((<uint32_t *><size_t>bstamp[r >> shift]) + (r & mask))
        r = rows[i]
        if r < 0:
            memset(out + i * ncols, 0, nbytes)
            continue
        src = (<const float *><size_t>bdata[r >> shift]) + (r & mask) * width + col0
        memcpy(out + i * ncols, src, nbytes)
        if stamp:
            (<uint32_t *><size_t>bstamp[r >> shift])[r & mask] = step


cdef inline void _scatter(const int32_t *rows, Py_ssize_t n, const float *values,
                          Py_ssize_t ncols, const uint64_t *bdata, const uint64_t *bmver,
                          int shift, Py_ssize_t width, Py_ssize_t col0,
                          uint32_t version) noexcept nogil:
    """Row ``rows[i]``, columns from ``col0``, ``= values[i]`` (-1 skipped); marks the rows
    changed at ``version``."""
    cdef Py_ssize_t i, r, nbytes = 4 * ncols
    cdef Py_ssize_t mask = (<Py_ssize_t>1 << shift) - 1
    for i in range(n):
        r = rows[i]
        if r < 0:
            continue
        memcpy((<float *><size_t>bdata[r >> shift]) + (r & mask) * width + col0,
               values + i * ncols, nbytes)
        (<uint32_t *><size_t>bmver[r >> shift])[r & mask] = version


cdef inline void _meta_get(const int32_t *rows, Py_ssize_t n, uint32_t *out,
                           const uint64_t *blocks, int shift) noexcept nogil:
    cdef Py_ssize_t i, r
    cdef Py_ssize_t mask = (<Py_ssize_t>1 << shift) - 1
    for i in range(n):
        r = rows[i]
        out[i] = (<const uint32_t *><size_t>blocks[r >> shift])[r & mask] if r >= 0 else 0


cdef inline void _meta_set(const int32_t *rows, Py_ssize_t n, const uint32_t *values,
                           uint32_t value, const uint64_t *blocks, int shift) noexcept nogil:
    """``meta[rows[i]] = values[i]`` (or ``value`` when ``values`` is NULL); -1 skipped."""
    cdef Py_ssize_t i, r
    cdef Py_ssize_t mask = (<Py_ssize_t>1 << shift) - 1
    for i in range(n):
        r = rows[i]
        if r >= 0:
            (<uint32_t *><size_t>blocks[r >> shift])[r & mask] = values[i] if values != NULL else value


cdef inline void _normal_fill(const int64_t *ids, Py_ssize_t n, uint64_t salt,
                              const float *table, float scale, float *out, Py_ssize_t stride,
                              Py_ssize_t ncols) noexcept nogil:
    """``out[i, c] = scale * table[16-bit piece c % 4 of mix(mix(ids[i] ^ salt) + (c // 4) *
    GOLDEN)]`` for ``c < ncols`` (normal_fill() in _table.py)."""
    cdef Py_ssize_t i, c, k
    cdef uint64_t base, bits
    cdef float *row
    for i in range(n):
        base = _mix(<int64_t>(<uint64_t>ids[i] ^ salt))
        row = out + i * stride
        c = 0
        while c < ncols:
            bits = _mix(<int64_t>(base + <uint64_t>(c >> 2) * <uint64_t>0x9E3779B97F4A7C15ULL))
            k = 0
            while k < 4 and c < ncols:
                row[c] = scale * table[(bits >> (16 * k)) & 0xFFFF]
                k += 1
                c += 1


cpdef normal_fill(const int64_t[::1] ids, uint64_t salt, const float[::1] table, float scale,
                  float[:, ::1] out, Py_ssize_t ncols)


cdef inline void _shard_split(const int64_t *ids, Py_ssize_t n, Py_ssize_t shards, uint64_t salt,
                              int64_t *order, int64_t *bounds) noexcept nogil:
    """Counting sort of positions by owner shard (shard_split() in _table.py): the hash is
    cheap enough to compute twice rather than keep."""
    cdef Py_ssize_t i, s
    for s in range(shards + 1):
        bounds[s] = 0
    for i in range(n):
        bounds[1 + <Py_ssize_t>(_mix(<int64_t>(<uint64_t>ids[i] ^ salt)) % <uint64_t>shards)] += 1
    for s in range(shards):
        bounds[s + 1] += bounds[s]
    # bounds[s] is now where shard s starts; used as its cursor, it ends where s ends ...
    for i in range(n):
        s = <Py_ssize_t>(_mix(<int64_t>(<uint64_t>ids[i] ^ salt)) % <uint64_t>shards)
        order[bounds[s]] = i
        bounds[s] += 1
    # ... so shift back by one shard.
    s = shards
    while s > 0:
        bounds[s] = bounds[s - 1]
        s -= 1
    bounds[0] = 0


cdef inline void _scatter_rows(float *out, const int64_t *positions, Py_ssize_t n,
                               const float *rows, Py_ssize_t ncols) noexcept nogil:
    cdef Py_ssize_t i, nbytes = 4 * ncols
    for i in range(n):
        memcpy(out + positions[i] * ncols, rows + i * ncols, nbytes)


cdef inline void _gather_rows(const float *src, const int64_t *positions, Py_ssize_t n,
                              float *out, Py_ssize_t ncols) noexcept nogil:
    cdef Py_ssize_t i, nbytes = 4 * ncols
    for i in range(n):
        if i + AHEAD < n:
            PS_PREFETCH(src + positions[i + AHEAD] * ncols)
        memcpy(out + i * ncols, src + positions[i] * ncols, nbytes)


cdef inline void _touch_pages(unsigned char *data, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i = 0
    while i < n:
        data[i] = 0
        i += 4096


@cython.locals(n=Py_ssize_t)
cpdef touch_pages(unsigned char[::1] data)

@cython.locals(n=Py_ssize_t)
cpdef shard_split(const int64_t[::1] ids, Py_ssize_t num_shards, uint64_t salt, int64_t[::1] order,
                  int64_t[::1] bounds)

@cython.locals(n=Py_ssize_t)
cpdef scatter_rows(float[:, ::1] out, const int64_t[::1] positions, const float[:, ::1] rows)

@cython.locals(n=Py_ssize_t)
cpdef gather_rows(const float[:, ::1] src, const int64_t[::1] positions, float[:, ::1] out)


cdef class RowTable:
    cdef readonly Py_ssize_t width
    cdef readonly Py_ssize_t capacity
    cdef readonly Py_ssize_t size
    cdef readonly bint migrating
    cdef readonly Py_ssize_t ocap
    cdef readonly Py_ssize_t opos
    cdef readonly Py_ssize_t row_cap
    cdef readonly Py_ssize_t block_rows
    cdef readonly int block_shift
    cdef readonly Py_ssize_t nblocks
    cdef readonly Py_ssize_t nfree
    cdef readonly Py_ssize_t next_row
    cdef object _keys_arr, _vals_arr, _okeys_arr, _ovals_arr, _free_arr
    cdef object _next_index
    cdef Py_ssize_t _next_cap
    cdef list _next_chunks
    cdef bint _next_ready
    cdef list _next_blocks
    cdef list _data, _stamp, _mver
    cdef object _bdata_arr, _bstamp_arr, _bmver_arr
    cdef int64_t[::1] keys
    cdef int32_t[::1] vals
    cdef int64_t[::1] okeys
    cdef int32_t[::1] ovals
    cdef int32_t[::1] free
    cdef uint64_t[::1] bdata
    cdef uint64_t[::1] bstamp
    cdef uint64_t[::1] bmver

    @cython.locals(cap=Py_ssize_t, j=Py_ssize_t, v=int32_t, h=uint64_t, r=int32_t)
    cdef int32_t _find(self, int64_t key) except -2

    @cython.locals(cap=Py_ssize_t, j=Py_ssize_t)
    cdef _place_py(self, int64_t key, int32_t val)

    @cython.locals(start=Py_ssize_t, end=Py_ssize_t, j=Py_ssize_t, v=int32_t, key=int64_t)
    cpdef bint migrate(self, Py_ssize_t budget) except -1

    cdef bint _should_grow(self) except -1

    @cython.locals(i=Py_ssize_t)
    cdef _help_prepare(self)

    @cython.locals(cap=Py_ssize_t)
    cdef _grow_index(self)

    @cython.locals(rows=Py_ssize_t, b=Py_ssize_t)
    cdef _grow_rows(self)

    cdef _set_block(self, Py_ssize_t b, object data, object stamp, object mver)
    cdef list _new_block(self)
    cdef list _block_shapes(self)

    cdef _prepare_rows(self)

    @cython.locals(r=int32_t)
    cdef int32_t _alloc_row(self) except -1

    @cython.locals(cap=Py_ssize_t, start=Py_ssize_t)
    cdef _prepare_index(self)

    cpdef background(self, Py_ssize_t n)
    cpdef finish(self)

    @cython.locals(n=Py_ssize_t, found=Py_ssize_t)
    cpdef Py_ssize_t lookup(self, const int64_t[::1] ids, float[:, ::1] out, int32_t[::1] rows,
                            uint32_t step, bint stamp=*) except -1

    @cython.locals(n=Py_ssize_t, found=Py_ssize_t, i=Py_ssize_t, r=int32_t)
    cpdef Py_ssize_t find(self, const int64_t[::1] ids, int32_t[::1] rows) except -1

    @cython.locals(n=Py_ssize_t, i=Py_ssize_t, key=int64_t, r=int32_t)
    cpdef Py_ssize_t insert(self, const int64_t[::1] ids, int32_t[::1] rows, uint32_t version) except -1

    @cython.locals(n=Py_ssize_t)
    cdef _gather_py(self, const int32_t[::1] rows, float[:, ::1] out, Py_ssize_t col0,
                    bint stamp, uint32_t step)

    cpdef gather(self, const int32_t[::1] rows, float[:, ::1] out, Py_ssize_t col0)

    @cython.locals(n=Py_ssize_t)
    cpdef scatter(self, const int32_t[::1] rows, const float[:, ::1] values, Py_ssize_t col0,
                  uint32_t version)

    @cython.locals(n=Py_ssize_t)
    cdef _meta_set(self, const int32_t[::1] rows, uint32_t value, int which)

    cpdef touch(self, const int32_t[::1] rows, uint32_t step)

    @cython.locals(n=Py_ssize_t)
    cpdef restamp(self, const int32_t[::1] rows, const uint32_t[::1] stamps)

    @cython.locals(n=Py_ssize_t)
    cpdef get_stamps(self, const int32_t[::1] rows, uint32_t[::1] out)

    @cython.locals(n=Py_ssize_t)
    cpdef get_mvers(self, const int32_t[::1] rows, uint32_t[::1] out)

    @cython.locals(n=Py_ssize_t, removed=Py_ssize_t, cap=Py_ssize_t, i=Py_ssize_t, j=Py_ssize_t,
                   hole=Py_ssize_t, h=Py_ssize_t, v=int32_t, key=int64_t, movable=bint)
    cpdef Py_ssize_t remove(self, const int64_t[::1] ids) except -1

    cdef _push_free(self, int32_t r)

    @cython.locals(cap=Py_ssize_t, n=Py_ssize_t, j=Py_ssize_t, v=int32_t)
    cpdef Py_ssize_t items(self, int64_t[::1] ids, int32_t[::1] rows) except -1

    cpdef list blocks(self)
    cpdef Py_ssize_t index_bytes(self) except -1

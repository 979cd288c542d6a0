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

cdef Py_ssize_t MIGRATE_MIN, BLOCK_BYTES, AHEAD, BLOCKS_AHEAD, INDEX_CHUNK, MAX_ROWS
cdef uint32_t ROW_BITS, ROW_MASK, TAG_MASK


cdef inline uint64_t _mix(int64_t key) noexcept nogil:
    # SplitMix64's finalizer (mix() in _table.py).
    cdef uint64_t x = <uint64_t>key + <uint64_t>0x9E3779B97F4A7C15ULL
    x = (x ^ (x >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * <uint64_t>0x94D049BB133111EBULL
    return x ^ (x >> 31)


cdef inline Py_ssize_t _home(uint64_t h, Py_ssize_t cap) noexcept nogil:
    return <Py_ssize_t>(((h >> 32) * <uint64_t>cap) >> 32)


cdef inline int64_t _id_of(const uint64_t *bids, int shift, int32_t r) noexcept nogil:
    """The id of row ``r`` (kept with the row's block)."""
    return (<const int64_t *><size_t>bids[r >> shift])[r & ((<int32_t>1 << shift) - 1)]


cdef inline void _set_id(const uint64_t *bids, int shift, int32_t r, int64_t key) noexcept nogil:
    (<int64_t *><size_t>bids[r >> shift])[r & ((<int32_t>1 << shift) - 1)] = key


cdef inline uint32_t _slot(uint64_t h, int32_t r) noexcept nogil:
    """The slot of row ``r`` for an id of hash ``h``: its tag over r + 1 (slot_of())."""
    return ((<uint32_t>(h & TAG_MASK)) << ROW_BITS) | <uint32_t>(r + 1)


cdef inline int32_t _candidate(const uint32_t *slots, Py_ssize_t cap,
                               uint64_t h) noexcept nogil:
    """The row of the first slot in hash ``h``'s probe run that carries its tag (-1: none,
    so the id is absent from this index). Most often it is the id's row: check its id."""
    cdef Py_ssize_t j = _home(h, cap)
    cdef uint32_t s, tag = <uint32_t>(h & TAG_MASK)
    while True:
        s = slots[j]
        if s == 0:
            return -1
        if (s >> ROW_BITS) == tag:
            return <int32_t>(s & ROW_MASK) - 1
        j += 1
        if j == cap:
            j = 0


cdef inline int32_t _probe(const uint32_t *slots, Py_ssize_t cap, const uint64_t *bids,
                           int shift, int64_t key, uint64_t h) noexcept nogil:
    """Row of ``key`` in one index (-1: absent)."""
    cdef Py_ssize_t j = _home(h, cap)
    cdef uint32_t s, tag = <uint32_t>(h & TAG_MASK)
    cdef int32_t r
    while True:
        s = slots[j]
        if s == 0:
            return -1
        if (s >> ROW_BITS) == tag:
            r = <int32_t>(s & ROW_MASK) - 1
            if _id_of(bids, shift, r) == key:
                return r
        j += 1
        if j == cap:
            j = 0


cdef inline int32_t _find1(int64_t key, uint64_t h, const uint32_t *slots, Py_ssize_t cap,
                           const uint32_t *oslots, Py_ssize_t ocap, const uint64_t *bids,
                           int shift) noexcept nogil:
    """Row of ``key`` in the index, then in the old one (``oslots`` not NULL: a growth is
    moving it over); -1: absent."""
    cdef int32_t r = _probe(slots, cap, bids, shift, key, h)
    if r < 0 and oslots != NULL:
        r = _probe(oslots, ocap, bids, shift, key, h)
    return r


cdef inline void _prefetch_row(const char *src, Py_ssize_t nbytes, uint32_t *stamp) noexcept nogil:
    """Prefetch the ``nbytes`` of a row from ``src``, and for writing its access stamp
    (unless NULL)."""
    cdef Py_ssize_t line = 0
    while line < nbytes:
        PS_PREFETCH(src + line)
        line += 64
    if stamp != NULL:
        PS_PREFETCHW(stamp)


cdef inline Py_ssize_t _lookup_batch(const int64_t *ids, Py_ssize_t n, int32_t *rows,
                                     const uint32_t *slots, Py_ssize_t cap,
                                     const uint32_t *oslots, Py_ssize_t ocap,
                                     const uint64_t *bids, float *out, Py_ssize_t ncols,
                                     const uint64_t *bdata, const uint64_t *bstamp, int shift,
                                     Py_ssize_t width, bint stamp,
                                     uint32_t step) noexcept nogil:
    """Rows of ``ids`` into ``rows`` (-1: absent), and, unless ``out`` is NULL, their first
    ``ncols`` columns into ``out`` (zeros when absent) and (``stamp``) their access stamps
    set to ``step``. A software pipeline, so that the misses of a batch are in flight
    together: at position i, the home slots of id i + 2 * AHEAD are prefetched; id
    i + AHEAD is probed for a slot with its tag, and that candidate row's id (and data) are
    prefetched; id i is checked against its candidate's id (a full probe when they differ:
    another id with the same tag) and copied out. Returns how many were found."""
    cdef Py_ssize_t i, j, found = 0, nbytes = 4 * ncols
    cdef Py_ssize_t mask = (<Py_ssize_t>1 << shift) - 1
    cdef uint64_t h
    cdef int32_t r
    for i in range(-2 * AHEAD, n):
        j = i + 2 * AHEAD
        if j < n:
            PS_PREFETCH(&slots[_home(_mix(ids[j]), cap)])
        j = i + AHEAD
        if 0 <= j < n:
            h = _mix(ids[j])
            r = _candidate(slots, cap, h)
            if r < 0 and oslots != NULL:
                r = _candidate(oslots, ocap, h)
            rows[j] = r
            if r >= 0:
                PS_PREFETCH((<const int64_t *><size_t>bids[r >> shift]) + (r & mask))
                if out != NULL:
                    _prefetch_row(<const char *>((<const float *><size_t>bdata[r >> shift])
                                                 + (r & mask) * width), nbytes,
                                  (<uint32_t *><size_t>bstamp[r >> shift]) + (r & mask)
                                  if stamp else NULL)
        if i < 0:
            continue
        r = rows[i]
        if r >= 0 and _id_of(bids, shift, r) != ids[i]:
            r = _find1(ids[i], _mix(ids[i]), slots, cap, oslots, ocap, bids, shift)
            rows[i] = r
        if r >= 0:
            found += 1
        if out == NULL:
            continue
        if r < 0:
            memset(out + i * ncols, 0, nbytes)
            continue
        memcpy(out + i * ncols, (<const float *><size_t>bdata[r >> shift]) + (r & mask) * width,
               nbytes)
        if stamp:
            (<uint32_t *><size_t>bstamp[r >> shift])[r & mask] = step
    return found


cdef inline void _place(uint32_t *slots, Py_ssize_t cap, uint64_t h, uint32_t s) noexcept nogil:
    """Put slot ``s`` of an id of hash ``h`` (known to be absent) in the index."""
    cdef Py_ssize_t j = _home(h, cap)
    while slots[j] != 0:
        j += 1
        if j == cap:
            j = 0
    slots[j] = s


cdef inline void _migrate(const uint32_t *oslots, Py_ssize_t start, Py_ssize_t end,
                          uint32_t *slots, Py_ssize_t cap, const uint64_t *bids,
                          int shift) noexcept nogil:
    """Move old slots ``start .. end`` into the new index. A slot moves unchanged; its new
    home needs its id, read from the row (a random read: rows are in insertion order): the
    ids 4 * AHEAD slots on are prefetched, and the new homes of those 2 * AHEAD on."""
    cdef Py_ssize_t j, k
    cdef Py_ssize_t mask = (<Py_ssize_t>1 << shift) - 1
    cdef uint32_t s
    cdef int32_t r
    for j in range(start, end):
        k = j + 4 * AHEAD
        if k < end and oslots[k] != 0:
            r = <int32_t>(oslots[k] & ROW_MASK) - 1
            PS_PREFETCH((<const int64_t *><size_t>bids[r >> shift]) + (r & mask))
        k = j + 2 * AHEAD
        if k < end and oslots[k] != 0:
            r = <int32_t>(oslots[k] & ROW_MASK) - 1
            PS_PREFETCHW(&slots[_home(_mix(_id_of(bids, shift, r)), cap)])
        s = oslots[j]
        if s != 0:
            _place(slots, cap, _mix(_id_of(bids, shift, <int32_t>(s & ROW_MASK) - 1)), s)


cdef inline void _gather(const int32_t *rows, Py_ssize_t n, float *out, Py_ssize_t ncols,
                         const uint64_t *bdata, const uint64_t *bstamp, int shift,
                         Py_ssize_t width, Py_ssize_t col0, bint stamp,
                         uint32_t step) noexcept nogil:
    """``out[i] = row rows[i][col0 : col0 + ncols]`` (zeros for -1); with ``stamp``, the
    rows' access stamps become ``step``. Rows AHEAD positions later are prefetched."""
    cdef Py_ssize_t i, r, nbytes = 4 * ncols
    cdef Py_ssize_t mask = (<Py_ssize_t>1 << shift) - 1
    cdef const float *src
    for i in range(n):
        if i + AHEAD < n:
            r = rows[i + AHEAD]
            if r >= 0:
                _prefetch_row(<const char *>((<const float *><size_t>bdata[r >> shift])
                                             + (r & mask) * width + col0), nbytes,
                              (<uint32_t *><size_t>bstamp[r >> shift]) + (r & mask)
                              if stamp else NULL)
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


cdef inline void _gather_rows(const float *src, Py_ssize_t stride, const int64_t *positions,
                              Py_ssize_t n, float *out, Py_ssize_t ncols) noexcept nogil:
    """``out[i] = src[positions[i], :ncols]`` (rows of ``stride`` floats); the rows AHEAD
    positions on are prefetched, every line of them, so that their misses overlap."""
    cdef Py_ssize_t i, nbytes = 4 * ncols
    for i in range(n):
        if i + AHEAD < n:
            _prefetch_row(<const char *>(src + positions[i + AHEAD] * stride), nbytes, NULL)
        memcpy(out + i * ncols, src + positions[i] * stride, nbytes)


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
    cdef object _slots_arr, _oslots_arr, _free_arr
    cdef object _next_index
    cdef Py_ssize_t _next_cap
    cdef list _next_chunks
    cdef bint _next_ready
    cdef list _next_blocks
    cdef list _data, _ids, _stamp, _mver
    cdef object _bdata_arr, _bids_arr, _bstamp_arr, _bmver_arr
    cdef uint32_t[::1] slots
    cdef uint32_t[::1] oslots
    cdef int32_t[::1] free
    cdef uint64_t[::1] bdata
    cdef uint64_t[::1] bids
    cdef uint64_t[::1] bstamp
    cdef uint64_t[::1] bmver

    cdef int64_t _row_id(self, int32_t r) except? -1
    cdef _set_row_id(self, int32_t r, int64_t key)

    @cython.locals(h=uint64_t, r=int32_t)
    cdef int32_t _find(self, int64_t key) except -2

    @cython.locals(cap=Py_ssize_t, j=Py_ssize_t, h=uint64_t)
    cdef _place_py(self, int64_t key, int32_t r)

    @cython.locals(start=Py_ssize_t, end=Py_ssize_t, j=Py_ssize_t, s=uint32_t, r=int32_t)
    cpdef bint migrate(self, Py_ssize_t budget) except -1

    cdef bint _should_grow(self) except -1

    @cython.locals(i=Py_ssize_t)
    cdef _help_prepare(self)

    @cython.locals(cap=Py_ssize_t)
    cdef _grow_index(self)

    @cython.locals(rows=Py_ssize_t, b=Py_ssize_t)
    cdef _grow_rows(self)

    cdef _set_block(self, Py_ssize_t b, list block)
    cdef list _block_shapes(self, Py_ssize_t rows)

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
                   hole=Py_ssize_t, h=Py_ssize_t, s=uint32_t, key=int64_t, movable=bint)
    cpdef Py_ssize_t remove(self, const int64_t[::1] ids) except -1

    cdef Py_ssize_t _home_of(self, int64_t key, Py_ssize_t cap)

    @cython.locals(j=Py_ssize_t, tag=uint32_t, s=uint32_t)
    cdef Py_ssize_t _probe_slot(self, int64_t key, Py_ssize_t cap) except -2

    cdef _push_free(self, int32_t r)

    @cython.locals(cap=Py_ssize_t, n=Py_ssize_t, j=Py_ssize_t, s=uint32_t, r=int32_t)
    cpdef Py_ssize_t items(self, int64_t[::1] ids, int32_t[::1] rows) except -1

    cpdef list blocks(self)
    cpdef Py_ssize_t index_bytes(self) except -1

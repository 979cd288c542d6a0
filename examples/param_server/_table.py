# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The native core of an embedding table: int64 id -> float32 row, vectorised over batches.

Plain typed Python that runs as is; Cython compiles the same file when the project is built,
with ``_table.pxd`` adding C types and the hot loops as C kernels over raw pointers (the
compiled module calls those; as Python, the same work is done by loops and numpy here).
``native.py`` picks the variant.

Layout (``RowTable``):

* an open-addressing index of 4-byte slots, linear probing from a home slot picked by
  SplitMix64 of the id scaled to the capacity (multiply-shift, so any capacity works). A
  slot holds the row number + 1 in its low ``ROW_BITS`` bits (0: an empty slot) and a tag,
  5 more bits of the id's hash, above them. The id itself is kept with its row: a probe
  reads a row's id only where the tag matches, so about one slot in 32 of the others costs
  that read. The index grows by 1.5x when it is 80% full, so it is 53-80% full: 5-7.5 bytes
  per id (plus, from 75% load until the move to a grown index is over, the next index: 7.5
  more). Slots this small are why the id lives with the row: 12-byte slots (id and row)
  cost 15-22.5 bytes per id, and 37.5 at the worst moment of a growth.
* rows live in blocks of ``block_rows`` rows (a power of two, about ``BLOCK_BYTES`` each):
  a float32 matrix ``[block_rows, width]`` (the embedding and its optimizer slots side by
  side), the int64 id of each row, and two uint32 per row, ``stamp`` (the step of the last
  access, for TTL and LRU eviction) and ``mver`` (the table version of the last change, for
  incremental checkpoints). Row ``r`` is row ``r & (block_rows - 1)`` of block
  ``r >> block_shift``. Freed rows are reused first. So an id costs its row plus 16 bytes,
  plus its share of the index: 21-31 bytes in all, through growth too.

Growth never stops serving for long. More rows are one more block (never copied; only a
table's first block doubles, up to ``block_rows``). A grown index starts empty beside the
old one and every call moves a bounded number of old slots over (lookups read the new
index, then the old one, until the move is over). The OS backing fresh memory page by page
is slow on virtual machines (microseconds a page), so a helper thread maps the next row
blocks and the next index ahead of their use, off the serving thread.

Batch lookups run as a pipeline, so that a batch's cache misses overlap: the home slots of
the id ``2 * AHEAD`` positions on are requested from memory, the id ``AHEAD`` on is probed
for a slot with its tag and that row's id and data are requested, and the id at hand is
checked against its row's id and copied out.
"""

from __future__ import annotations

import mmap
import os

import cython
import numpy as np

MASK64 = 0xFFFFFFFFFFFFFFFF
GOLDEN = 0x9E3779B97F4A7C15
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB
MIGRATE_MIN = 16384        # old index slots moved per call while the index grows, at least
BLOCK_BYTES = 8 << 20      # bytes of one row block (rows are a power of two)
AHEAD = 8                  # how many ids ahead the batch loops prefetch
BLOCKS_AHEAD = 2           # row blocks kept mapped ahead of use
INDEX_CHUNK = 256 << 10    # bytes of the next index per piece of work mapping it
ROW_BITS = 27              # a slot's bits for row + 1; the 5 above them are the id's tag
ROW_MASK = (1 << ROW_BITS) - 1
TAG_MASK = 31
MAX_ROWS = ROW_MASK        # rows of one table (row + 1 must fit ROW_BITS): shard beyond it


def mix(key):
    """SplitMix64's finalizer: the 64-bit hash of an id (as an unsigned 64-bit integer)."""
    x = (key + GOLDEN) & MASK64
    x = ((x ^ (x >> 30)) * MUL1) & MASK64
    x = ((x ^ (x >> 27)) * MUL2) & MASK64
    return x ^ (x >> 31)


def home(h, cap):
    """The home slot of hash ``h`` in an index of ``cap`` slots (cap < 2**32)."""
    return ((h >> 32) * cap) >> 32


def slot_of(h, row):
    """The index slot of row ``row`` for an id of hash ``h``: its tag over row + 1."""
    return ((h & TAG_MASK) << ROW_BITS) | (int(row) + 1)


def normal_fill(ids, salt, table, scale, out, ncols):
    """``out[i, :ncols]`` = ``scale`` x normal values of id ``ids[i]``: 16-bit pieces of
    hashes of (id, salt, column // 4) pick levels of ``table`` (2**16 float32), four per
    hash (sparse.seeded_normal's values, computed in one pass without temporaries)."""
    n = ids.shape[0]
    if n == 0 or ncols == 0:
        return
    if cython.compiled:
        with cython.nogil:
            _normal_fill(cython.address(ids[0]), n, salt, cython.address(table[0]),  # noqa: F821
                         scale, cython.address(out[0, 0]), out.shape[1], ncols)
        return
    ids_np = np.asarray(ids)
    words = (ncols + 3) // 4
    with np.errstate(over="ignore"):
        base = _mix_np(ids_np.view(np.uint64) ^ np.uint64(salt))
        bits = _mix_np(base[:, None] + np.arange(words, dtype=np.uint64)[None, :] * np.uint64(GOLDEN))
    levels = bits.astype("<u8", copy=False).view("<u2").reshape(n, 4 * words)[:, :ncols]
    np.asarray(out)[:, :ncols] = np.float32(scale) * np.asarray(table).take(levels.astype(np.intp))


def shard_split(ids, num_shards, salt, order, bounds):
    """Group the positions of ``ids`` by owner shard, ``mix(id ^ salt) % num_shards``
    (sparse.shard_of): ``order[bounds[s]:bounds[s + 1]]`` are the positions of the ids of
    shard ``s``, in input order. ``order`` holds ``len(ids)``, ``bounds`` ``num_shards + 1``."""
    n = ids.shape[0]
    if cython.compiled:
        with cython.nogil:
            _shard_split(cython.address(ids[0]) if n else cython.NULL, n, num_shards, salt,  # noqa: F821
                         cython.address(order[0]) if n else cython.NULL, cython.address(bounds[0]))
        return
    with np.errstate(over="ignore"):
        owner = (_mix_np(np.asarray(ids).view(np.uint64) ^ np.uint64(salt))
                 % np.uint64(num_shards)).astype(np.int64)
    np.asarray(order)[:] = np.argsort(owner, kind="stable")
    np.asarray(bounds)[0] = 0
    np.cumsum(np.bincount(owner, minlength=num_shards), out=np.asarray(bounds)[1:])


def scatter_rows(out, positions, rows):
    """``out[positions[i]] = rows[i]`` (float32 rows of one width; positions in range)."""
    n = positions.shape[0]
    if n == 0:
        return
    if cython.compiled:
        with cython.nogil:
            _scatter_rows(cython.address(out[0, 0]), cython.address(positions[0]), n,  # noqa: F821
                          cython.address(rows[0, 0]), rows.shape[1])
        return
    np.asarray(out)[np.asarray(positions)] = np.asarray(rows)


def gather_rows(src, positions, out):
    """``out[i] = src[positions[i], :out.shape[1]]`` (float32 rows; positions in range;
    ``out`` as wide as ``src`` or narrower: the leading columns)."""
    n = positions.shape[0]
    if n == 0:
        return
    if out.shape[1] > src.shape[1]:
        raise ValueError(f"out has {out.shape[1]} columns, the rows only {src.shape[1]}")
    if cython.compiled:
        with cython.nogil:
            _gather_rows(cython.address(src[0, 0]), src.shape[1],  # noqa: F821
                         cython.address(positions[0]), n, cython.address(out[0, 0]),
                         out.shape[1])
        return
    np.take(np.asarray(src)[:, :out.shape[1]], np.asarray(positions), axis=0,
            out=np.asarray(out))


def _mix_np(x):
    with np.errstate(over="ignore"):
        x = x + np.uint64(GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(MUL1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(MUL2)
        return x ^ (x >> np.uint64(31))


HUGE_PAGE = 2 << 20


def zeroed(shape, dtype):
    """A zero-filled array; a large one is mapped from the OS directly, so its pages cost
    nothing until first written. Explicitly without transparent huge pages (numpy asks for
    them on large arrays): mapping one costs milliseconds (the kernel may compact memory to
    find 2 MiB), and that lands on single batches as stalls. Nor for the blocks the
    helper thread maps ahead: backing 2 MiB at a time, it falls behind, and the longest
    batches of a growth get longer, which the growth bound forbids."""
    dtype = np.dtype(dtype)
    count = 1
    for extent in (shape if isinstance(shape, tuple) else (shape,)):
        count *= extent
    nbytes = count * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return np.zeros(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            area.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:
            pass  # only a hint
    return np.frombuffer(area, dtype=dtype, count=count).reshape(shape)


def _address(array):
    return array.__array_interface__["data"][0]


_preparer = None


def _prepare(job, *args):
    """Run ``job(*args)`` on the table's helper thread; a future of its result."""
    global _preparer
    if _preparer is None:
        from concurrent.futures import ThreadPoolExecutor
        # At the normal priority: the thread takes the GIL between its page walks, and at
        # the lowest one a loaded machine left it holding the GIL, unscheduled, for seconds
        # while the serving thread waited for it.
        _preparer = ThreadPoolExecutor(1, thread_name_prefix="rowtable-prepare")
    return _preparer.submit(job, *args)


def _forget_preparer():
    global _preparer
    _preparer = None  # a forked child has no helper thread: it starts its own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_preparer)


def _mapped(arrays):
    """``arrays`` (zeroed, mapped lazily) with every page written once, so that the OS has
    backed them: run on the helper thread, for memory nobody else sees yet. A first write
    costs microseconds per page on a virtual machine; done where the table serves, those
    added up to stalls."""
    for array in arrays:
        touch_pages(array.reshape(-1).view(np.uint8))
    return arrays


def touch_pages(data):
    """Write a zero to the first byte of every 4 KiB page of ``data`` (fresh, zeroed
    memory), compiled without the GIL: the serving thread runs on meanwhile."""
    n = data.shape[0]
    if n == 0:
        return
    if cython.compiled:
        with cython.nogil:
            _touch_pages(cython.address(data[0]), n)  # noqa: F821
        return
    np.asarray(data)[::4096] = 0


def _mapped_new(shapes):
    """New zeroed arrays of ``[(shape, dtype), ...]``, mapped (_mapped): the mapping calls
    too are made on the helper thread."""
    return _mapped([zeroed(shape, dtype) for shape, dtype in shapes])


def _ready(future):
    """The result of a preparation that has finished, else None (it is not waited for)."""
    if future is None or not future.done():
        return None
    return future.result()


class RowTable:
    """Rows of ``width`` float32 keyed by int64 id; every method works on a batch."""

    def __init__(self, width, capacity=1024):
        if width <= 0:
            raise ValueError("width must be positive")
        self.width = width
        cap = max(16, (capacity * 5) // 4 + 1)
        self._slots_arr = zeroed(cap, np.uint32)
        self.slots = self._slots_arr
        self.capacity = cap
        self.size = 0
        self.migrating = False
        self._oslots_arr = None
        self.oslots = None
        self.ocap = 0
        self.opos = 0
        self._next_index = None    # the next index's slots, mapped ahead in chunks
        self._next_cap = 0
        self._next_chunks = []     # (future, bytes) of its chunks still being mapped
        self._next_ready = False
        self._next_blocks = []     # futures: row blocks mapped ahead, oldest first
        shift = 6
        while (4 * width) << (shift + 1) <= BLOCK_BYTES and shift < 24:
            shift += 1
        self.block_shift = shift
        self.block_rows = 1 << shift
        self._data = []
        self._ids = []
        self._stamp = []
        self._mver = []
        self._bdata_arr = np.zeros(16, dtype=np.uint64)
        self._bids_arr = np.zeros(16, dtype=np.uint64)
        self._bstamp_arr = np.zeros(16, dtype=np.uint64)
        self._bmver_arr = np.zeros(16, dtype=np.uint64)
        self.bdata = self._bdata_arr
        self.bids = self._bids_arr
        self.bstamp = self._bstamp_arr
        self.bmver = self._bmver_arr
        self.nblocks = 0
        first = 16
        while first < capacity and first < self.block_rows:
            first *= 2
        first = min(first, self.block_rows)
        self._set_block(0, [zeroed(shape, dtype) for shape, dtype in self._block_shapes(first)])
        self.row_cap = first
        self._free_arr = np.zeros(64, dtype=np.int32)
        self.free = self._free_arr
        self.nfree = 0
        self.next_row = 0

    # -- the index ------------------------------------------------------------------------------

    def _row_id(self, r):
        """The id of row ``r``."""
        if cython.compiled:
            return _id_of(cython.address(self.bids[0]), self.block_shift, r)  # noqa: F821
        return int(self._ids[r >> self.block_shift][r & (self.block_rows - 1)])

    def _set_row_id(self, r, key):
        if cython.compiled:
            _set_id(cython.address(self.bids[0]), self.block_shift, r, key)  # noqa: F821
            return
        self._ids[r >> self.block_shift][r & (self.block_rows - 1)] = key

    def _find(self, key):
        """Row of ``key``, -1 if absent (the per-id path; batches use the kernels)."""
        if cython.compiled:
            return _find1(key, _mix(key), cython.address(self.slots[0]), self.capacity,  # noqa: F821
                          cython.address(self.oslots[0]) if self.migrating else cython.NULL,
                          self.ocap, cython.address(self.bids[0]), self.block_shift)
        h = mix(int(key))
        r = self._probe_py(self.slots, self.capacity, key, h)
        if r < 0 and self.migrating:
            r = self._probe_py(self.oslots, self.ocap, key, h)
        return r

    def _probe_py(self, slots, cap, key, h):
        """Row of ``key`` (hash ``h``) in one index, -1 if absent (pure Python)."""
        tag = h & TAG_MASK
        j = home(h, cap)
        while True:
            s = int(slots[j])
            if s == 0:
                return -1
            if s >> ROW_BITS == tag and self._row_id((s & ROW_MASK) - 1) == key:
                return (s & ROW_MASK) - 1
            j += 1
            if j == cap:
                j = 0

    def _place_py(self, key, r):
        """Put ``key`` (known to be absent) in the current index, at row ``r``."""
        if cython.compiled:
            h = _mix(key)  # noqa: F821
            _place(cython.address(self.slots[0]), self.capacity, h, _slot(h, r))  # noqa: F821
            return
        cap = self.capacity
        h = mix(int(key))
        j = home(h, cap)
        while self.slots[j] != 0:
            j += 1
            if j == cap:
                j = 0
        self.slots[j] = slot_of(h, r)

    def migrate(self, budget):
        """Move up to ``budget`` slots of the old index into the new one; True when done."""
        if not self.migrating:
            return True
        start = self.opos
        end = min(start + budget, self.ocap)
        if cython.compiled:
            _migrate(cython.address(self.oslots[0]), start, end,  # noqa: F821
                     cython.address(self.slots[0]), self.capacity, cython.address(self.bids[0]),
                     self.block_shift)
        else:
            for j in range(start, end):
                s = int(self.oslots[j])
                if s != 0:
                    r = (s & ROW_MASK) - 1
                    self._place_py(self._row_id(r), r)
        self.opos = end
        if end == self.ocap:
            self.migrating = False
            self.oslots = None
            self._oslots_arr = None
            self.ocap = 0
            return True
        return False

    def _prepare_index(self):
        """From 75% load on, have the helper thread map the next index ahead of its use, in
        chunks: the OS backs pages when they are first written, and the first slots moved
        into a new index land all over it, so unprepared, the first moves would fault in
        every page of it."""
        if self._next_index is not None or self.migrating or self.size * 4 < self.capacity * 3:
            return
        cap = self.capacity + self.capacity // 2 + 1
        slots = zeroed(cap, np.uint32)
        self._next_cap = cap
        self._next_index = slots
        self._next_chunks = []
        data = slots.view(np.uint8)
        for start in range(0, data.shape[0], INDEX_CHUNK):
            part = data[start:start + INDEX_CHUNK]
            self._next_chunks.append((_prepare(touch_pages, part), part))
        self._next_ready = False

    def _help_prepare(self):
        """Track the next index's chunks; past 80% load, when the helper thread has fallen
        behind (a busy machine), map one chunk it has not started here, per call: a
        bounded cost now rather than a burst of faults when the grown index is filled."""
        chunks = [chunk for chunk in self._next_chunks if not chunk[0].done()]
        if chunks and self.size * 5 > self.capacity * 4:
            for i in range(len(chunks) - 1, -1, -1):
                if chunks[i][0].cancel():  # not started: the serving thread maps it
                    touch_pages(chunks[i][1])
                    del chunks[i]
                    break
        self._next_chunks = chunks
        self._next_ready = not chunks

    def _should_grow(self):
        """At 80% load: grow once the next index is mapped (or at 85% in any case: longer
        probe runs for a while beat a stall)."""
        return (self.size + 1) * 20 > self.capacity * 17 or self._next_index is None or self._next_ready

    def _grow_index(self):
        if self.migrating:
            self.migrate(self.ocap)
        cap = self.capacity + self.capacity // 2 + 1
        self._oslots_arr = self._slots_arr
        self.oslots = self._oslots_arr
        self.ocap = self.capacity
        self.opos = 0
        self.migrating = True
        if self._next_index is not None and self._next_cap == cap:
            # Mapped ahead; chunks the helper has not started are left to the OS (mapped as
            # the move writes to them), and the one it may be mapping is waited for (a
            # small piece of work: it writes to the arrays, which are about to be in use).
            for future, _ in self._next_chunks:
                if not future.cancel():
                    future.result()
            self._slots_arr = self._next_index
        else:
            self._slots_arr = zeroed(cap, np.uint32)
        self._next_index = None
        self._next_cap = 0
        self._next_chunks = []
        self._next_ready = False
        self.slots = self._slots_arr
        self.capacity = cap

    # -- rows -----------------------------------------------------------------------------------

    def _set_block(self, b, block):
        """Block ``b`` is ``block``: its rows, ids, stamps and versions (see _block_shapes)."""
        if b == self.nblocks:
            if b == self._bdata_arr.shape[0]:
                more = np.zeros(b, dtype=np.uint64)
                self._bdata_arr = np.concatenate([self._bdata_arr, more])
                self._bids_arr = np.concatenate([self._bids_arr, more])
                self._bstamp_arr = np.concatenate([self._bstamp_arr, more])
                self._bmver_arr = np.concatenate([self._bmver_arr, more])
                self.bdata = self._bdata_arr
                self.bids = self._bids_arr
                self.bstamp = self._bstamp_arr
                self.bmver = self._bmver_arr
            self._data.append(None)
            self._ids.append(None)
            self._stamp.append(None)
            self._mver.append(None)
            self.nblocks += 1
        self._data[b], self._ids[b], self._stamp[b], self._mver[b] = block
        self.bdata[b] = _address(block[0])
        self.bids[b] = _address(block[1])
        self.bstamp[b] = _address(block[2])
        self.bmver[b] = _address(block[3])

    def _grow_rows(self):
        rows = self.row_cap
        if self.nblocks == 1 and rows < self.block_rows:
            # The first block doubles (a small copy: at most half a block) until it is full.
            grown = min(2 * rows, self.block_rows)
            block = [zeroed(shape, dtype) for shape, dtype in self._block_shapes(grown)]
            for new, old in zip(block, (self._data[0], self._ids[0], self._stamp[0],
                                        self._mver[0]), strict=True):
                new[:rows] = old
            self._set_block(0, block)
            self.row_cap = grown
            return
        # Nothing is copied: one more block, normally mapped ahead by the helper thread
        # (_prepare_rows); if it is not ready, a fresh one, mapped as rows are written.
        block = _ready(self._next_blocks[0]) if self._next_blocks else None
        if block is not None:
            del self._next_blocks[0]
        else:
            block = [zeroed(shape, dtype) for shape, dtype in self._block_shapes(self.block_rows)]
        self._set_block(self.nblocks, block)
        self.row_cap += self.block_rows
        self._prepare_rows()

    def _block_shapes(self, rows):
        """A block of ``rows`` rows: the rows, their ids, access stamps and change versions."""
        return [((rows, self.width), np.float32), (rows, np.int64), (rows, np.uint32),
                (rows, np.uint32)]

    def _prepare_rows(self):
        """Keep ``BLOCKS_AHEAD`` row blocks mapped ahead by the helper thread once the table
        has whole blocks, so that no call pays for the OS backing a block's pages."""
        if self.row_cap < self.block_rows:
            return
        while len(self._next_blocks) < BLOCKS_AHEAD:
            self._next_blocks.append(_prepare(_mapped_new, self._block_shapes(self.block_rows)))

    def _alloc_row(self):
        if self.nfree > 0:
            self.nfree -= 1
            return self.free[self.nfree]
        if self.next_row >= MAX_ROWS:
            raise OverflowError(f"a table holds at most {MAX_ROWS} rows in one process: "
                                "spread it over more shards")
        if self.next_row == self.row_cap:
            self._grow_rows()
        r = self.next_row
        self.next_row += 1
        return r

    def background(self, n):
        """Bounded growth work for a call on ``n`` ids: part of the index move, or (on the
        helper thread) the next index and row blocks mapped ahead."""
        if self.migrating:
            self.migrate(max(MIGRATE_MIN, 4 * n))
        else:
            self._prepare_index()
            if self._next_index is not None:
                self._help_prepare()
        self._prepare_rows()

    def finish(self):
        """Complete any growth in progress (before a full scan or a removal)."""
        if self.migrating:
            self.migrate(self.ocap)

    # -- batch operations -----------------------------------------------------------------------

    def lookup(self, ids, out, rows, step, stamp=True):
        """Row numbers of ``ids`` into ``rows`` (-1: absent) and their first ``out.shape[1]``
        columns into ``out`` (zeros when absent); with ``stamp``, found rows are stamped as
        accessed at ``step``. Returns how many ids were absent."""
        n = ids.shape[0]
        if n == 0:
            return 0
        if cython.compiled:
            with cython.nogil:
                found = _lookup_batch(  # noqa: F821
                    cython.address(ids[0]), n, cython.address(rows[0]),
                    cython.address(self.slots[0]), self.capacity,
                    cython.address(self.oslots[0]) if self.migrating else cython.NULL, self.ocap,
                    cython.address(self.bids[0]), cython.address(out[0, 0]), out.shape[1],
                    cython.address(self.bdata[0]), cython.address(self.bstamp[0]),
                    self.block_shift, self.width, stamp, step)
        else:
            found = self.find(ids, rows)
            self._gather_py(rows, out, 0, stamp, step)
        if self.migrating:
            self.background(n)
        return n - found

    def find(self, ids, rows):
        """Row numbers of ``ids`` into ``rows`` (-1: absent); returns how many were found."""
        n = ids.shape[0]
        if n == 0:
            return 0
        if cython.compiled:
            with cython.nogil:  # the lookup kernel without rows to copy out
                found = _lookup_batch(  # noqa: F821
                    cython.address(ids[0]), n, cython.address(rows[0]),
                    cython.address(self.slots[0]), self.capacity,
                    cython.address(self.oslots[0]) if self.migrating else cython.NULL, self.ocap,
                    cython.address(self.bids[0]), cython.NULL, 0, cython.address(self.bdata[0]),
                    cython.address(self.bstamp[0]), self.block_shift, self.width, False, 0)
            return found
        found = 0
        for i in range(n):
            r = self._find(int(ids[i]))
            rows[i] = r
            if r >= 0:
                found += 1
        return found

    def insert(self, ids, rows, version):
        """Give each id of ``ids`` (absent and unique: the caller checked) a row; the row
        numbers go to ``rows``. Row contents are left for the caller to set."""
        n = ids.shape[0]
        for i in range(n):
            if (self.size + 1) * 5 > self.capacity * 4 and self._should_grow():
                self._grow_index()
            r = self._alloc_row()
            key = ids[i]
            self._set_row_id(r, key)
            self._place_py(key, r)
            self.size += 1
            rows[i] = r
        self._meta_set(rows, version, 1)
        self._meta_set(rows, 0, 0)
        self.background(n)
        return n

    def _gather_py(self, rows, out, col0, stamp, step):
        n = rows.shape[0]
        if n == 0:
            return
        if cython.compiled:
            with cython.nogil:
                _gather(cython.address(rows[0]), n, cython.address(out[0, 0]),  # noqa: F821
                        out.shape[1], cython.address(self.bdata[0]),
                        cython.address(self.bstamp[0]), self.block_shift, self.width, col0,
                        stamp, step)
            return
        rows_np = np.asarray(rows)
        out_np = np.asarray(out)
        ncols = out_np.shape[1]
        out_np[rows_np < 0] = 0.0
        blocks = rows_np >> self.block_shift
        offsets = rows_np & (self.block_rows - 1)
        for b in np.unique(blocks[rows_np >= 0]).tolist():
            sel = (blocks == b) & (rows_np >= 0)
            out_np[sel] = self._data[b][offsets[sel], col0:col0 + ncols]
            if stamp:
                self._stamp[b][offsets[sel]] = step

    def gather(self, rows, out, col0):
        """``out[i] = row rows[i], columns col0 .. col0 + out.shape[1]`` (zeros for -1)."""
        self._gather_py(rows, out, col0, False, 0)

    def scatter(self, rows, values, col0, version):
        """Row ``rows[i]``, columns from ``col0``, ``= values[i]`` (rows of -1 are skipped);
        marks the rows changed at ``version``."""
        n = rows.shape[0]
        if n == 0:
            return
        if cython.compiled:
            with cython.nogil:
                _scatter(cython.address(rows[0]), n, cython.address(values[0, 0]),  # noqa: F821
                         values.shape[1], cython.address(self.bdata[0]),
                         cython.address(self.bmver[0]), self.block_shift, self.width, col0,
                         version)
            return
        rows_np = np.asarray(rows)
        values_np = np.asarray(values)
        ncols = values_np.shape[1]
        blocks = rows_np >> self.block_shift
        offsets = rows_np & (self.block_rows - 1)
        for b in np.unique(blocks[rows_np >= 0]).tolist():
            sel = (blocks == b) & (rows_np >= 0)
            self._data[b][offsets[sel], col0:col0 + ncols] = values_np[sel]
            self._mver[b][offsets[sel]] = version

    def _meta_py(self, rows, values, value, which, read):
        rows_np = np.asarray(rows)
        blocks = rows_np >> self.block_shift
        offsets = rows_np & (self.block_rows - 1)
        meta = self._stamp if which == 0 else self._mver
        if read:
            values[rows_np < 0] = 0
        for b in np.unique(blocks[rows_np >= 0]).tolist():
            sel = (blocks == b) & (rows_np >= 0)
            if read:
                values[sel] = meta[b][offsets[sel]]
            elif values is None:
                meta[b][offsets[sel]] = value
            else:
                meta[b][offsets[sel]] = values[sel]

    def _meta_set(self, rows, value, which):
        """Stamps (``which`` 0) or versions (1) of ``rows`` (-1 skipped) = ``value``."""
        n = rows.shape[0]
        if n == 0:
            return
        if cython.compiled:
            with cython.nogil:
                _meta_set(cython.address(rows[0]), n, cython.NULL, value,  # noqa: F821
                          cython.address(self.bstamp[0]) if which == 0 else cython.address(self.bmver[0]),
                          self.block_shift)
            return
        self._meta_py(rows, None, value, which, False)

    def touch(self, rows, step):
        """Stamp ``rows`` (-1 skipped) as accessed at ``step``."""
        self._meta_set(rows, step, 0)

    def restamp(self, rows, stamps):
        """``stamp[rows[i]] = stamps[i]`` (restoring a checkpoint)."""
        n = rows.shape[0]
        if n == 0:
            return
        if cython.compiled:
            with cython.nogil:
                _meta_set(cython.address(rows[0]), n, cython.address(stamps[0]), 0,  # noqa: F821
                          cython.address(self.bstamp[0]), self.block_shift)
            return
        self._meta_py(rows, np.asarray(stamps), 0, 0, False)

    def get_stamps(self, rows, out):
        """``out[i]`` = the access stamp of row ``rows[i]`` (0 for -1)."""
        n = rows.shape[0]
        if n == 0:
            return
        if cython.compiled:
            with cython.nogil:
                _meta_get(cython.address(rows[0]), n, cython.address(out[0]),  # noqa: F821
                          cython.address(self.bstamp[0]), self.block_shift)
            return
        self._meta_py(rows, np.asarray(out), 0, 0, True)

    def get_mvers(self, rows, out):
        """``out[i]`` = the version row ``rows[i]`` last changed at (0 for -1)."""
        n = rows.shape[0]
        if n == 0:
            return
        if cython.compiled:
            with cython.nogil:
                _meta_get(cython.address(rows[0]), n, cython.address(out[0]),  # noqa: F821
                          cython.address(self.bmver[0]), self.block_shift)
            return
        self._meta_py(rows, np.asarray(out), 0, 1, True)

    def remove(self, ids):
        """Delete the rows of ``ids`` (absent ids are ignored); returns how many went."""
        self.finish()
        n = ids.shape[0]
        removed = 0
        cap = self.capacity
        for i in range(n):
            key = ids[i]
            j = self._probe_slot(key, cap)
            if j < 0:
                continue
            self._push_free((self.slots[j] & ROW_MASK) - 1)
            self.size -= 1
            removed += 1
            # Backward-shift deletion: pull later entries of the run into the hole when their
            # home slot allows it, so probing never needs tombstones.
            hole = j
            while True:
                j += 1
                if j == cap:
                    j = 0
                s = self.slots[j]
                if s == 0:
                    break
                h = self._home_of(self._row_id((s & ROW_MASK) - 1), cap)
                if hole <= j:
                    movable = h <= hole or h > j
                else:
                    movable = h <= hole and h > j
                if movable:
                    self.slots[hole] = s
                    hole = j
            self.slots[hole] = 0
        return removed

    def _home_of(self, key, cap):
        if cython.compiled:
            return _home(_mix(key), cap)  # noqa: F821
        return home(mix(int(key)), cap)

    def _probe_slot(self, key, cap):
        """The slot of ``key`` in the current index, -1 if absent (no growth in progress)."""
        j = self._home_of(key, cap)
        if cython.compiled:
            tag = _mix(key) & TAG_MASK  # noqa: F821
        else:
            tag = mix(int(key)) & TAG_MASK
        while True:
            s = self.slots[j]
            if s == 0:
                return -1
            if s >> ROW_BITS == tag and self._row_id((s & ROW_MASK) - 1) == key:
                return j
            j += 1
            if j == cap:
                j = 0

    def _push_free(self, r):
        if self.nfree == self.free.shape[0]:
            grown = np.zeros(2 * self.nfree, dtype=np.int32)
            grown[:self.nfree] = self._free_arr
            self._free_arr = grown
            self.free = grown
        self.free[self.nfree] = r
        self.nfree += 1

    def items(self, ids, rows):
        """Every live (id, row number) into ``ids`` and ``rows`` (len >= size); returns size."""
        self.finish()
        if not cython.compiled:
            live = self._slots_arr[self._slots_arr != 0]
            found = (live & ROW_MASK).astype(np.int64) - 1
            rows[:len(found)] = found
            for b in np.unique(found >> self.block_shift).tolist():
                sel = np.flatnonzero((found >> self.block_shift) == b)
                ids[sel] = self._ids[b][found[sel] & (self.block_rows - 1)]
            return len(found)
        cap = self.capacity
        n = 0
        for j in range(cap):
            s = self.slots[j]
            if s != 0:
                r = (s & ROW_MASK) - 1
                ids[n] = self._row_id(r)
                rows[n] = r
                n += 1
        return n

    # -- whole-table views (numpy, for checkpoints) ---------------------------------------------

    def blocks(self):
        """The row matrices of rows ``0 .. next_row`` (in use or free), block by block."""
        out = []
        left = self.next_row
        for b in range(self.nblocks):
            if left <= 0:
                break
            data = self._data[b]
            out.append(data[:min(left, data.shape[0])])
            left -= data.shape[0]
        return out

    def row_arrays(self):
        """``(rows, ids, stamps)`` of rows ``0 .. next_row`` (in use or free), block by block:
        views, for a copy taken while the table changes."""
        out = []
        left = self.next_row
        for b in range(self.nblocks):
            if left <= 0:
                break
            k = min(left, self._data[b].shape[0])
            out.append((self._data[b][:k], self._ids[b][:k], self._stamp[b][:k]))
            left -= k
        return out

    def free_rows(self):
        """A copy of the row numbers free for reuse."""
        return np.array(self._free_arr[:self.nfree], dtype=np.int32)

    def index_bytes(self):
        """Bytes of the index and per-row metadata (not the rows themselves)."""
        total = self._slots_arr.nbytes + self._free_arr.nbytes
        total += 16 * self.row_cap  # id, stamp and mver
        total += 4 * self._bdata_arr.nbytes
        if self.migrating:
            total += self._oslots_arr.nbytes
        if self._next_index is not None:
            total += 4 * self._next_cap
        total += 16 * self.block_rows * len(self._next_blocks)
        return total

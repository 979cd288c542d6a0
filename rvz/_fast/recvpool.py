"""Memory for received arrays, reused once nothing refers to it.

Large payloads: the decoder asks ``RecvPool.take(nbytes)`` for the memory a payload lands
in, and gives a block back with ``release`` when its payload will never come (the
connection closed); the transport calls ``maintain()`` between reads so the next ``take``
finds a block already mapped.  Small values (staged by the decoder, then copied out): its
``ArrayPool`` (``RecvPool.arrays``) hands out arrays nobody refers to any more, a new value
written over the old.  Nothing here touches a socket or the event loop.
"""

from __future__ import annotations

import mmap
from sys import getrefcount
from typing import Any

from . import arrays as _arrays

try:  # Cython's own module; a compiled build sees the constant True
    import cython
    COMPILED = cython.compiled
except ImportError:  # pure Python without Cython installed
    COMPILED = False

WINDOW = 32    # takes of one size class per high-water window
STALE = 1024   # takes of any size after which a size class nobody asked for is let go
DECAY = 8      # windows per block the high-water mark comes down by when fewer are alive
RING_MAX = 1024     # arrays an ArrayPool keeps of one dtype and shape
RINGS_MAX = 16      # dtypes and shapes it keeps arrays of at once
SWEEP = 4096        # takes after which it lets go of the shapes nobody asked for since
SMALL_SHARE = 8     # an ArrayPool may keep up to this fraction of its RecvPool's limit...
SMALL_LIMIT = 8 << 20  # ...and no more than this
# C copies (recvpool.pxd types them): compiled, a comparison with a Python global boxes.
_C_RING_MAX = RING_MAX
_C_RINGS_MAX = RINGS_MAX
_C_SWEEP = SWEEP
_new_array = _arrays.new_array
_same_array = _arrays.same_array
_array_flags = _arrays.array_flags
_refill = _arrays.refill
# A block is an anonymous private mapping: none of its pages is resident until a payload is
# written into it, and dropping the block unmaps them all.
_MAP_PRIVATE = getattr(mmap, "MAP_PRIVATE", None)


def _refs(items: list, i: int) -> int:
    """The reference count of ``items[i]``, seen the same way for every item (the pools
    compare it with what they measured for an item only they refer to)."""
    item = items[i]
    if COMPILED:  # the count itself, not a call through sys (8 per take)
        return Py_REFCNT(item)  # type: ignore[name-defined]  # noqa: F821
    return getrefcount(item)


def _free(items: list, idle: int) -> int:
    """How many of ``items`` nothing but the pool refers to (``idle`` references)."""
    free = 0
    for i in range(len(items)):
        if _refs(items, i) <= idle:
            free += 1
    return free


def size_class(nbytes: int) -> int:
    """The block size that serves ``nbytes``: 8 classes per octave, at least a page.

    A block of one class serves requests of its own class and of the two below it (so a
    block wastes under a quarter), which lets tensors whose sizes vary by a few percent
    share blocks even across a class boundary.
    """
    if COMPILED:  # a C loop: int.bit_length() on a C integer boxes it and calls a method
        bits = 0
        rest = nbytes
        while rest:
            rest >>= 1
            bits += 1
    else:
        bits = nbytes.bit_length()
    shift = bits - 4
    if shift < 12:
        shift = 12
    step = 1 << shift
    return (nbytes + step - 1) & -step


class _SizeClass:
    """The blocks of one size, and how many blocks its requests had alive at once lately."""

    __slots__ = ("size", "up1", "up2", "blocks", "peak", "prev_peak", "takes", "windows",
                 "last")

    def __init__(self, size: int) -> None:
        self.size = size
        self.up1 = size_class(size + 1)  # the next two classes: their blocks serve this one
        self.up2 = size_class(self.up1 + 1)
        self.blocks: list[mmap.mmap] = []  # free or in use: the pool's reference is the list's
        self.peak = 0       # most blocks alive at one take, this window (the new one included)
        self.prev_peak = 0  # the same over the windows before, less one per DECAY windows
        self.takes = 0      # takes in this window
        self.windows = 0    # windows so far
        self.last = -(1 << 40)  # the pool's take count at this class's latest take


class RecvPool:
    """Memory for large received arrays, used again once every array on it is gone.

    A fresh ``np.empty`` per large tensor costs a page fault per 4 KiB (the allocator
    returns big blocks to the kernel between messages): about as long as the copy out of
    the socket.  A pooled block pays those faults once, as its first payload arrives, and
    is used again after that.  It is an anonymous ``mmap`` the arrays are built on
    (``np.frombuffer`` of a ``memoryview``), so their views keep it referenced: the block is
    free again exactly when its reference count is back to the pool's own.  Nothing writes a
    new block's pages but the payload: a DATA header alone (its payload never sent) reserves
    address space, not memory, and ``release`` unmaps the block when its connection closes.

    The pool learns, per size class, how many blocks able to serve it are alive when one is
    taken (a consumer that keeps its previous array needs two, three when one more waits in
    the table) and keeps that many plus one spare.  ``maintain()`` maps that spare outside
    ``take``; blocks nobody needs any more are released.  At most ``limit`` bytes are kept:
    when a ``take`` would exceed it, free blocks of the sizes used longest ago are dropped;
    a block an array refers to never is.
    """

    __slots__ = ("limit", "held", "fresh", "prepared", "reused", "missed", "released", "due",
                 "arrays", "_classes", "_idle_refs", "_tick", "_next", "_swept", "_window",
                 "_stale")

    def __init__(self, limit: int = 64 << 20, window: int = WINDOW, stale: int = STALE) -> None:
        self.limit = limit
        self.held = 0       # bytes in all blocks, free or in use
        self.fresh = 0      # blocks allocated inside take(): page faults on the data path
        self.prepared = 0   # blocks allocated by maintain(), off the data path
        self.reused = 0     # takes served by a free block
        self.missed = 0     # takes answered None (over the limit): the caller allocates
        self.released = 0   # blocks dropped (evicted for room, stale or surplus)
        self.due = False    # a maintain() call is scheduled (the transport's flag, see Wire)
        # small arrays, within their own share of the limit
        self.arrays = ArrayPool(min(limit // SMALL_SHARE, SMALL_LIMIT))
        self._classes: dict[int, _SizeClass] = {}
        self._tick = 0      # takes so far
        self._next: _SizeClass | None = None  # the class of the latest take: what the next take likely needs
        self._swept = 0     # _tick at the last sweep for surplus blocks
        self._window = window if window > 0 else 1
        self._stale = stale if stale > 0 else 1
        # Measured, not assumed: the compiled and the interpreted code hold different
        # temporaries, so a block only the pool refers to is counted through _refs() itself.
        probe = [mmap.mmap(-1, 1)]
        self._idle_refs = _refs(probe, 0)

    def _target(self, cls: _SizeClass) -> int:
        """How many blocks ``cls`` should have: its high-water mark plus a spare, or none."""
        if self._tick - cls.last > self._stale:
            return 0
        peak = cls.peak if cls.peak > cls.prev_peak else cls.prev_peak
        return peak + 1

    def _serving(self, cls: _SizeClass, which: int) -> Any:
        """``cls`` itself (0) or the class one or two above it (1, 2), or None."""
        if which == 0:
            return cls
        return self._classes.get(cls.up1 if which == 1 else cls.up2)

    def _alloc_size(self, cls: _SizeClass) -> int:
        """The size of a new block for ``cls``: the largest neighbour asked for lately.

        Sizes that straddle a class boundary then end up on blocks of the upper class,
        which serve both; a stream of one exact size gets blocks of exactly its class.
        """
        for which in (2, 1):
            other = self._serving(cls, which)
            if other is not None and self._tick - other.last <= self._window \
                    and other.size <= self.limit:
                return int(other.size)
        return int(cls.size)

    def take(self, nbytes: int) -> Any:
        """Writable memory of exactly ``nbytes`` no array refers to, or None.

        The result is a ``memoryview`` of a pooled block's first ``nbytes``; build the array
        on it with ``np.frombuffer``.  None: allocate outside the pool.
        """
        size = size_class(nbytes)
        self._tick += 1
        cls = self._classes.get(size)
        if cls is None:
            if size > self.limit:
                self.missed += 1
                return None
            cls = _SizeClass(size)
            self._classes[size] = cls
        cls.last = self._tick
        self._next = cls
        idle = self._idle_refs
        busy = 0
        found: Any = None
        at = -1
        for which in range(3):
            other = self._serving(cls, which)
            if other is None:
                continue
            blocks = other.blocks
            for i in range(len(blocks)):
                if _refs(blocks, i) > idle:
                    busy += 1
                elif found is None:
                    found = other
                    at = i
        # Learn how many blocks this size had alive at once, this one included.  What the
        # windows before saw comes down by one block per DECAY windows: a queue that drains
        # and fills again (a Send-Driven stream's, with the push window's worth of values)
        # would otherwise have its blocks released and allocated again, each a page fault
        # per 4 KiB and a zeroing, over and over.
        if cls.takes >= self._window:
            cls.windows += 1
            decayed = cls.prev_peak - 1 if cls.windows % DECAY == 0 else cls.prev_peak
            cls.prev_peak = cls.peak if cls.peak > decayed else decayed
            cls.peak = 0
            cls.takes = 0
        cls.takes += 1
        if busy + 1 > cls.peak:
            cls.peak = busy + 1
        if found is not None:
            self.reused += 1
            return self._exact(found.blocks[at], nbytes)
        block = self._allocate(self._alloc_size(cls), cls, False)
        if block is None:
            self.missed += 1
            return None
        self.fresh += 1
        return self._exact(block, nbytes)

    def _exact(self, block: Any, nbytes: int) -> Any:
        if nbytes == len(block):
            return memoryview(block)
        return memoryview(block)[:nbytes]  # the view keeps the block referenced, as arrays do

    def release(self, block: Any) -> None:
        """Forget ``block`` (what ``take`` returned, or a view of it): its payload will never
        arrive.  It goes back to the system, not to the pool, once the caller drops it."""
        if type(block) is memoryview:
            block = block.obj
        if type(block) is not mmap.mmap:
            return  # not a pool block (the caller allocated outside the pool)
        size = len(block)
        cls = self._classes.get(size)
        if cls is None:
            return
        blocks = cls.blocks
        for i in range(len(blocks)):
            if blocks[i] is block:
                del blocks[i]
                self.held -= size
                self.released += 1
                return

    def _allocate(self, size: int, cls: _SizeClass, spare_only: bool) -> Any:
        """A new block of ``size`` bytes kept for ``cls``'s requests, or None.

        Mapped, not written: its pages become resident as a payload fills them."""
        if self.held + size > self.limit and not self._make_room(self.held + size - self.limit,
                                                                 spare_only):
            return None
        try:
            if _MAP_PRIVATE is None:
                block = mmap.mmap(-1, size)
            else:
                block = mmap.mmap(-1, size, flags=_MAP_PRIVATE)
        except OSError:  # out of address space or map count: allocated outside the pool
            return None
        home = self._classes.get(size)
        if home is None:
            home = _SizeClass(size)
            self._classes[size] = home
        home.blocks.append(block)
        self.held += size
        return block

    def maintain(self) -> bool:
        """Prepare the block the next ``take`` is expected to need; True if it allocated one.

        Call it when the connection is idle or after a read completes: it costs a few
        comparisons when there is nothing to do, and maps at most one block per call.  Every
        ``window`` takes it also releases free blocks beyond what their size classes need.
        """
        self.due = False
        if self._tick - self._swept >= self._window:
            self._swept = self._tick
            self._sweep()
        cls = self._next
        if cls is None:
            return False
        self._next = None
        current = self._classes.get(cls.size)
        if current is not cls:  # swept away since that take
            return False
        idle = self._idle_refs
        count = 0
        for which in range(3):
            other = self._serving(cls, which)
            if other is None:
                continue
            blocks = other.blocks
            for i in range(len(blocks)):
                if _refs(blocks, i) <= idle:
                    return False  # a free one is ready; the spare waits until it is needed
                count += 1
        if count >= self._target(cls):
            return False
        if self._allocate(self._alloc_size(cls), cls, True) is None:
            return False
        self.prepared += 1
        return True

    def _needed(self) -> dict:
        """Per block size, how many blocks the classes it serves want."""
        need: dict[int, int] = {}
        for cls in self._classes.values():
            target = self._target(cls)
            for size in (cls.size, cls.up1, cls.up2):
                if need.get(size, 0) < target:
                    need[size] = target
        return need

    def _sweep(self) -> None:
        """Release free blocks beyond what their classes need (all of a stale class's)."""
        need = self._needed()
        idle = self._idle_refs
        for size in list(self._classes):
            cls = self._classes[size]
            blocks = cls.blocks
            extra = len(blocks) - need.get(size, 0)
            i = len(blocks) - 1
            while extra > 0 and i >= 0:
                if _refs(blocks, i) <= idle:
                    del blocks[i]
                    self.held -= size
                    self.released += 1
                    extra -= 1
                i -= 1
            if not blocks and self._target(cls) == 0 and cls is not self._next:
                del self._classes[size]

    def _make_room(self, need: int, spare_only: bool) -> bool:
        """Drop free blocks until ``need`` bytes are released; False (dropping none) if not.

        Blocks beyond what their classes need go first, then (unless ``spare_only``) any
        free block, the sizes used longest ago first.
        """
        wanted = self._needed()
        idle = self._idle_refs
        order = sorted([(cls.last, size) for size, cls in self._classes.items()])
        can = 0
        for _last, size in order:
            blocks = self._classes[size].blocks
            extra = len(blocks) - wanted.get(size, 0)
            for i in range(len(blocks)):
                if (not spare_only or extra > 0) and _refs(blocks, i) <= idle:
                    can += size
                    extra -= 1
        if can < need:
            return False
        for rounds in range(1 if spare_only else 2):
            for _last, size in order:
                blocks = self._classes[size].blocks
                extra = len(blocks) - wanted.get(size, 0)
                i = len(blocks) - 1
                while need > 0 and i >= 0 and (rounds == 1 or extra > 0):
                    if _refs(blocks, i) <= idle:
                        del blocks[i]
                        self.held -= size
                        self.released += 1
                        need -= size
                        extra -= 1
                    i -= 1
        return need <= 0

    def stats(self) -> dict:
        """Per block size: ``(blocks, free, target)``; for tests and benchmarks."""
        return {size: (len(cls.blocks), _free(cls.blocks, self._idle_refs), self._target(cls))
                for size, cls in self._classes.items()}


def _made(code: int, shape: tuple, src: bytearray, offset: int, nbytes: int) -> Any:
    """A new array (``bytes`` for code 0) holding ``src[offset:offset + nbytes]``."""
    if COMPILED:
        return new_array_c(code, shape, src, offset, nbytes)  # type: ignore[name-defined]  # noqa: F821
    return _new_array(code, shape, src, offset, nbytes)


class _Ring:
    """The arrays an ArrayPool keeps of one dtype and shape, oldest handed out first."""

    __slots__ = ("code", "shape", "nbytes", "flags", "arrays", "at", "used")

    def __init__(self, code: int, shape: tuple, nbytes: int) -> None:
        self.code = code
        self.shape = shape
        self.nbytes = nbytes
        self.flags = -1     # numpy's flags of an array as made (read from the first one)
        self.arrays: list[Any] = []  # free or in use: the pool's reference is the list's
        self.at = 0         # the array handed out longest ago: the next to try
        self.used = True    # asked for since the last sweep


class ArrayPool:
    """Small received arrays, written over with a new value once nothing refers to them.

    Making a small array costs more than copying its bytes: numpy's allocation, the
    object, its dimensions, then freeing them all when the caller drops it.  This pool keeps
    the arrays it made, per dtype and shape, in the order it handed them out; the next
    value of that kind goes into the oldest one if nothing refers to it (its reference count
    is back to the pool's own, no weak reference) and it is still exactly as made (dtype,
    shape, strides, flags: a caller may have changed them in place).  Else a new array is
    made and kept too: the ring grows to how many arrays of that kind are alive at once, up
    to RING_MAX, and an array still in use when its turn comes again (a caller keeps it) is
    let go of.  At most ``limit`` bytes of arrays are kept, for RINGS_MAX dtypes and shapes;
    those nobody asked for during SWEEP takes are let go of.
    """

    __slots__ = ("limit", "held", "reused", "made", "_rings", "_last", "_idle_refs", "_takes")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0       # bytes of the arrays kept, free or in use
        self.reused = 0     # takes served by an array kept
        self.made = 0       # takes that made a new array
        self._rings: dict[tuple, _Ring] = {}
        self._last: Any = None  # the ring of the latest take: a stream repeats one kind
        self._takes = 0     # takes since the last sweep
        # Measured, not assumed (as RecvPool's): what an array only the pool refers to counts.
        probe = [_made(3, (1,), bytearray(1), 0, 1)]
        self._idle_refs = _refs(probe, 0)

    def take(self, code: int, shape: tuple, src: bytearray, offset: int, nbytes: int) -> Any:
        """An array of wire ``code`` (not bytes) and ``shape`` holding the ``nbytes`` (not 0)
        at ``offset`` of ``src``: one nothing else refers to."""
        self._takes += 1
        if self._takes >= _C_SWEEP:
            self._sweep()
        ring = self._last
        if ring is None or ring.code != code or (ring.shape is not shape and ring.shape != shape):
            ring = self._ring(code, shape, nbytes)
            if ring is None:
                return _made(code, shape, src, offset, nbytes)
        ring.used = True
        arrays = ring.arrays
        n = len(arrays)
        at = ring.at
        free = False
        if n:
            free = _refs(arrays, at) <= self._idle_refs
            if free and (same_array_c(arrays[at], code, shape, ring.flags) if COMPILED  # type: ignore[name-defined]  # noqa: F821
                         else _same_array(arrays[at], code, shape, ring.flags)):
                arr = arrays[at]
                if COMPILED:
                    refill_c(arr, src, offset, nbytes)  # type: ignore[name-defined]  # noqa: F821
                else:
                    _refill(arr, src, offset, nbytes)
                ring.at = at + 1 if at + 1 < n else 0
                self.reused += 1
                return arr
        arr = _made(code, shape, src, offset, nbytes)
        self.made += 1
        if n == 0:
            ring.flags = _array_flags(arr)
        if not free and n < _C_RING_MAX and self.held + nbytes <= self.limit:
            # The oldest is still in use: one more array of this kind is alive at once.  The
            # new one goes before it, and the turn passes over it (it counts as handed out now).
            arrays.insert(at, arr)
            self.held += nbytes
            ring.at = (at + 2) % (n + 1)
        elif n:
            arrays[at] = arr  # the old one is let go of: its holder keeps it, or it was changed
            ring.at = at + 1 if at + 1 < n else 0
        return arr

    def _ring(self, code: int, shape: tuple, nbytes: int) -> Any:
        """The ring of ``code`` and ``shape`` (made if there is room for one), or None."""
        ring = self._rings.get((code, shape))
        if ring is None:
            if len(self._rings) >= _C_RINGS_MAX or nbytes > self.limit:
                return None
            ring = _Ring(code, shape, nbytes)
            self._rings[(code, shape)] = ring
        self._last = ring
        return ring

    def _sweep(self) -> None:
        """Let go of the rings nobody asked for since the last sweep."""
        self._takes = 0
        for key in list(self._rings):
            ring = self._rings[key]
            if ring.used:
                ring.used = False
                continue
            del self._rings[key]
            self.held -= ring.nbytes * len(ring.arrays)
            if ring is self._last:
                self._last = None

    def stats(self) -> dict:
        """Per ``(code, shape)``: ``(arrays, free)``; for tests and benchmarks."""
        return {key: (len(ring.arrays), _free(ring.arrays, self._idle_refs))
                for key, ring in self._rings.items()}

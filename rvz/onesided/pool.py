"""The registered memory pool: chunks registered up front, carved into blocks.

Registering memory is slow (pinning pages costs about 2 ms per 10 MB on a NIC), so the
pool registers large chunks (``chunk_size``, 64 MiB by default, or one larger chunk for a
tensor that does not fit, rounded up to ``granule``) and never registers per tensor.  Blocks
are carved first-fit from the free ranges of the chunks and coalesce when freed.  What is
registered never exceeds ``limit``: near it a chunk is only as large as what is left, and
``capacity`` says beforehand how many blocks of a size fit.

A block handed to the application as a numpy array stays allocated as long as that array
(or any view of it) lives: the array's ``base`` is a small owner object whose finaliser
returns the block.  Finalisers may run on any thread, so they only append to a deque that
the event loop's thread drains on the next allocation, or at once when the pool is watched
(``watch``: a peer's slots, which a producer may be waiting for).
"""

from __future__ import annotations

import asyncio
import bisect
import mmap
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import TransportError
from .provider import Provider, Region

ALIGN = 64
PAGE = mmap.PAGESIZE
_U8 = np.dtype(np.uint8)


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


class Block:
    """``size`` bytes at ``offset`` of ``region``."""

    __slots__ = ("region", "offset", "size", "addr", "chunk")

    def __init__(self, chunk: _Chunk, offset: int, size: int) -> None:
        self.chunk = chunk
        self.region = chunk.region
        self.offset = offset
        self.size = size
        self.addr = chunk.region.addr + offset

    def view(self, start: int = 0, length: int | None = None) -> memoryview:
        end = self.offset + (self.size if length is None else start + length)
        return self.region.view[self.offset + start:end]

    def __repr__(self) -> str:
        return f"<Block {self.size}B at {self.addr:#x} (rkey {self.region.rkey})>"


class _Owner:
    """The ``base`` of an array that lives in a pool block; frees the block when it dies."""

    __slots__ = ("__array_interface__", "_pool", "_block", "__weakref__")
    __array_interface__: dict[str, Any]
    _pool: Pool
    _block: Block

    def __del__(self) -> None:
        pool = self._pool
        pool._released.append(self._block)
        pool._returned()


class _Chunk:
    __slots__ = ("region", "free", "live")

    def __init__(self, region: Region) -> None:
        self.region = region
        self.free: list[list[int]] = [[0, region.length]]  # sorted [offset, size]
        self.live = 0


class Pool:
    """Registered memory of one provider, shared by every channel of an engine."""

    def __init__(self, provider: Provider, chunk_size: int = 64 << 20, limit: int = 16 << 30,
                 granule: int = 1 << 20) -> None:
        if chunk_size < (1 << 20):
            raise ValueError(f"chunk_size must be at least 1 MiB, not {chunk_size}")
        self.provider = provider
        self.chunk_size = chunk_size
        self.limit = limit
        self.granule = granule  # a chunk larger than chunk_size is rounded up to a multiple
        self.chunks: list[_Chunk] = []
        self.registered = 0
        self.in_use = 0
        self._released: deque[Block] = deque()
        self._by_addr: list[int] = []        # sorted chunk base addresses, for lookup()
        self._addr_chunks: list[_Chunk] = []
        self.lent = 0   # bytes of the blocks under live arrays (``array``)
        self._loop: asyncio.AbstractEventLoop | None = None   # ``watch``
        self._on_return: Callable[[], None] | None = None
        self._waking = False
        self.closed = False

    # -- allocation --------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> Block:
        """A block of at least ``nbytes`` (``TransportError`` past ``limit``)."""
        if self.closed:
            raise TransportError("the one-sided memory pool is closed")
        if self._released:
            self.reclaim()
        size = align(max(nbytes, 1))
        for chunk in self.chunks:
            block = self._carve(chunk, size)
            if block is not None:
                return block
        chunk = self._grow(size)
        block = self._carve(chunk, size)
        assert block is not None
        return block

    def _carve(self, chunk: _Chunk, size: int) -> Block | None:
        free = chunk.free
        for i, span in enumerate(free):
            if span[1] >= size:
                offset = span[0]
                if span[1] == size:
                    del free[i]
                else:
                    span[0] += size
                    span[1] -= size
                chunk.live += 1
                self.in_use += size
                return Block(chunk, offset, size)
        return None

    def _length(self, size: int, left: int) -> int:
        """The length of a new chunk for a block of ``size`` (aligned) bytes, ``left`` bytes
        short of the limit: ``chunk_size`` or the block rounded up to ``granule``, less near
        the limit (down to the block alone); more than ``left`` when the block cannot fit."""
        granule = self.granule
        length = max(align(size, granule), min(self.chunk_size, left // granule * granule))
        return length if length <= left else size

    def capacity(self, nbytes: int, most: int) -> int:
        """How many blocks of ``nbytes`` ``alloc`` would hand out now, at most ``most``: those
        the free ranges hold, then those of new chunks within ``limit``."""
        if self._released:
            self.reclaim()
        size = align(max(nbytes, 1))
        count = 0
        for chunk in self.chunks:
            for span in chunk.free:
                count += span[1] // size
            if count >= most:
                return most
        left = self.limit - self.registered
        while count < most:
            length = self._length(size, left)
            if length > left:
                break
            count += length // size
            left -= length
        return min(count, most)

    def empty_chunks(self) -> int:
        """Chunks nothing is carved from (``trim`` unregisters them)."""
        if self._released:
            self.reclaim()
        return sum(1 for chunk in self.chunks if chunk.live == 0)

    def _grow(self, size: int) -> _Chunk:
        length = self._length(size, self.limit - self.registered)
        if self.registered + length > self.limit:
            raise TransportError(
                f"the one-sided memory pool ({self.provider.name}) would grow past its limit of "
                f"{self.limit} bytes ({self.registered} registered, {self.in_use} in use, "
                f"{length} more asked); received arrays keep their blocks while they live; "
                "raise onesided={'pool_limit': ...} on the Node")
        region = self.provider.register(length)
        chunk = _Chunk(region)
        self.chunks.append(chunk)
        self.registered += region.length
        i = bisect.bisect(self._by_addr, region.addr)
        self._by_addr.insert(i, region.addr)
        self._addr_chunks.insert(i, chunk)
        return chunk

    def free(self, block: Block) -> None:
        chunk = block.chunk
        if chunk.live <= 0:
            raise AssertionError(f"double free of {block!r}")
        chunk.live -= 1
        self.in_use -= block.size
        free = chunk.free
        start, size = block.offset, block.size
        i = bisect.bisect(free, [start, 0])
        # merge with the following span, then with the preceding one
        if i < len(free) and free[i][0] == start + size:
            size += free[i][1]
            del free[i]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:
            free[i - 1][1] += size
        else:
            free.insert(i, [start, size])
        if self.closed and chunk.live == 0:
            self._drop(chunk)

    def reclaim(self) -> int:
        """Free the blocks whose arrays died (called on the loop's thread)."""
        n = 0
        released = self._released
        while released:
            block = released.popleft()
            self.lent -= block.size
            self.free(block)
            n += 1
        return n

    def watch(self, loop: asyncio.AbstractEventLoop,
              on_return: Callable[[], None] | None = None) -> None:
        """Free the blocks of dead arrays on ``loop`` as soon as they die, then call
        ``on_return`` (unless the pool is closed by then)."""
        self._loop = loop
        self._on_return = on_return

    def _returned(self) -> None:
        """An array over a block died, on any thread: its block is in ``_released``."""
        loop = self._loop
        if loop is None:
            if self.closed:
                self.reclaim()  # nobody drains the deque any more
            return
        if self._waking and not loop.is_closed():
            return   # a drain is scheduled and has not started: it takes this block too
        self._waking = True
        try:
            if asyncio._get_running_loop() is loop:
                loop.call_soon(self._drain)
            else:
                loop.call_soon_threadsafe(self._drain)
        except RuntimeError:   # the loop is closed: nothing waits for the block any more
            self._waking = False
            if self.closed:
                self.reclaim()

    def _drain(self) -> None:
        self._waking = False   # before reclaiming: a block released meanwhile schedules again
        self.reclaim()
        if not self.closed and self._on_return is not None:
            self._on_return()

    # -- numpy views -------------------------------------------------------------------------

    def array(self, block: Block, dtype: np.dtype, shape: tuple[int, ...], start: int = 0) -> np.ndarray:
        """A numpy array over ``block`` (from ``start``); the block is freed when it dies."""
        owner = _Owner()
        owner.__array_interface__ = {"shape": tuple(shape), "typestr": dtype.str,
                                     "data": (block.addr + start, False), "version": 3}
        owner._pool = self
        owner._block = block
        self.lent += block.size
        return np.asarray(owner)

    def lookup(self, addr: int, length: int) -> Region | None:
        """The registered region that holds ``[addr, addr + length)``, if any."""
        i = bisect.bisect(self._by_addr, addr) - 1
        if i < 0:
            return None
        region = self._addr_chunks[i].region
        if addr + length <= region.addr + region.length:
            return region
        return None

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Deregister what is free; chunks still under live arrays go when those die."""
        if self.closed:
            return
        self.reclaim()
        self.closed = True
        self._on_return = None   # an array kept past close need not keep its channel alive
        for chunk in list(self.chunks):
            if chunk.live == 0:
                self._drop(chunk)

    def trim(self) -> list[int]:
        """Unregister the chunks nothing is carved from; their rkeys."""
        if self._released:
            self.reclaim()
        empty = [chunk for chunk in self.chunks if chunk.live == 0]
        for chunk in empty:
            self._drop(chunk)
        return [chunk.region.rkey for chunk in empty]

    def _drop(self, chunk: _Chunk) -> None:
        if chunk in self.chunks:
            self.chunks.remove(chunk)
            i = self._addr_chunks.index(chunk)
            del self._addr_chunks[i]
            del self._by_addr[i]
            self.registered -= chunk.region.length
            try:
                self.provider.deregister(chunk.region)
            except Exception:  # pragma: no cover - best effort at close
                pass

    def stats(self) -> dict[str, Any]:
        return {"chunks": len(self.chunks), "registered": self.registered, "in_use": self.in_use}


def address_of(view: Any) -> int:
    """The address of a contiguous buffer (numpy array, bytes, memoryview)."""
    if isinstance(view, np.ndarray):
        return int(view.__array_interface__["data"][0])
    arr = np.frombuffer(view, _U8)
    return int(arr.__array_interface__["data"][0]) if arr.size else 0

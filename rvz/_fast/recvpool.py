"""Memory for large received arrays: blocks reused once no array refers to them.

The decoder asks ``take(nbytes)`` for the block a large payload lands in; nothing here
touches a socket or the event loop.
"""

from __future__ import annotations

from sys import getrefcount
from typing import Any


class RecvPool:
    """Memory for large received arrays, used again once every array on it is gone.

    A fresh ``np.empty`` per large tensor costs a page fault per 4 KiB (the allocator
    returns big blocks to the kernel between messages): on a 2-core VM that is about as long
    as the copy out of the socket.  A pooled block is a ``bytearray`` the arrays are built on
    (``np.frombuffer``), so their views keep it referenced: the block is free again exactly
    when its reference count is back to the pool's own.  At most ``limit`` bytes are kept.
    """

    __slots__ = ("limit", "held", "_blocks", "_idle_refs")

    def __init__(self, limit: int = 64 << 20) -> None:
        self.limit = limit
        self.held = 0
        self._blocks: dict[int, list[bytearray]] = {}  # size -> blocks, free or in use
        self._idle_refs = -1  # the reference count of a free block, seen from take()

    def take(self, nbytes: int) -> Any:
        """A free block of exactly ``nbytes``, or None (then allocate outside the pool)."""
        blocks = self._blocks.get(nbytes)
        if blocks is not None:
            idle = self._idle_refs
            for block in blocks:
                if getrefcount(block) <= idle:
                    return block
        if self.held + nbytes > self.limit and not self._evict(self.held + nbytes - self.limit):
            return None
        fresh = bytearray(nbytes)
        if blocks is None:
            blocks = self._blocks[nbytes] = []
        blocks.append(fresh)
        self.held += nbytes
        if self._idle_refs < 0:
            # Measured, not assumed: the compiled and the interpreted loop hold different
            # temporaries.  Here ``fresh`` holds one reference more than a free block has.
            for block in blocks:
                if block is fresh:
                    self._idle_refs = getrefcount(block) - 1
        return fresh

    def _evict(self, need: int) -> bool:
        """Drop free blocks (of any size) until ``need`` bytes are released."""
        idle = self._idle_refs
        for size in list(self._blocks):
            kept = []
            for block in self._blocks[size]:  # the same loop shape as in take()
                if need > 0 and getrefcount(block) <= idle:
                    need -= size
                    self.held -= size
                else:
                    kept.append(block)
            if kept:
                self._blocks[size] = kept
            else:
                del self._blocks[size]
            if need <= 0:
                return True
        return False

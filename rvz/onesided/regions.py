"""The memory one peer may write: regions of its own, carved into its slots and destinations.

Nothing else of ours is ever described to the peer.  Each slot or destination handed out is a
``Target``, numbered by the immediate the peer's write into it carries; a region is described
to the peer once, and unregistered again when nothing is carved from it.
"""

from __future__ import annotations

from typing import Any

from .pool import PAGE, Block, Pool
from .provider import Provider

SLOT = 1
DEST = 2
BUFFER = 3   # the trailer block of a recv's buffer offered as a destination (buffers.py)
FENCED = 4   # the same once the buffer was fenced off, until its request settles
_IMM_MAX = (1 << 32) - 1
ARENA_STEP = 1 << 20       # a peer's region grows by 1 MiB, or by what a slot needs (to a page)


class Target:
    """Memory of ours that the peer may write: a granted slot or a request's destination
    (for a buffer offer: the block its trailer goes to)."""

    __slots__ = ("kind", "block", "key", "step", "request_id", "code", "shape", "nbytes")

    def __init__(self, kind: int, block: Block, key: str, step: int = 0, request_id: int = 0,
                 code: int = 0, shape: tuple[int, ...] = (), nbytes: int = 0) -> None:
        self.kind = kind
        self.block = block
        self.key = key
        self.step = step
        self.request_id = request_id
        self.code = code
        self.shape = shape
        self.nbytes = nbytes


class PeerRegions:
    """The regions of one peer (``arena`` for its slots, ``dest_arena`` for its destinations)
    and the targets carved from them, by immediate."""

    def __init__(self, provider: Provider, slot_budget: int, dest_limit: int) -> None:
        # The slots' regions count against the budget as registered, so that a slot a little
        # over a chunk's size costs its own size (to a page), not two chunks.
        self.arena = Pool(provider, ARENA_STEP, slot_budget, PAGE)
        self.dest_arena = Pool(provider, ARENA_STEP, dest_limit, PAGE)
        self.targets: dict[int, Target] = {}
        self._next_imm = 0
        self._described: set[int] = set()   # rkeys of the regions the peer was told of
        self._used = False   # something was carved since the watchdog last looked

    def add(self, target: Target) -> int:
        """Number ``target`` with a free immediate, which the peer's write into it carries."""
        imm = self._next_imm
        targets = self.targets
        while True:
            imm = imm + 1 if imm < _IMM_MAX else 1
            if imm not in targets:
                break
        self._next_imm = imm
        targets[imm] = target
        self._used = True
        return imm

    def describe(self, blocks: list[Block]) -> list[dict[str, Any]]:
        """The regions under ``blocks`` that the peer was not told of yet (it maps them)."""
        out = []
        for block in blocks:
            region = block.region
            if region.rkey not in self._described:
                self._described.add(region.rkey)
                out.append(region.describe())
        return out

    def free(self, target: Target) -> None:
        (self.arena if target.kind == SLOT else self.dest_arena).free(target.block)

    def trim(self) -> list[int]:
        """Unregister the regions that hold nothing: their rkeys, for the peer to unmap."""
        dropped = self.arena.trim() + self.dest_arena.trim()
        if dropped:
            self._described.difference_update(dropped)
        return dropped

    def trim_idle(self) -> list[int]:
        """``trim`` if nothing was carved since the last call (the watchdog's, every second)."""
        dropped = [] if self._used else self.trim()
        self._used = False
        return dropped

    def close(self) -> None:
        for target in self.targets.values():
            self.free(target)
        self.targets.clear()
        self.arena.close()
        self.dest_arena.close()

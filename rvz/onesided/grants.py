"""The consumer's slot accounting (Send-Driven): which slots a producer holds, per key.

Slots are the producer's credits: each slot written is granted again (a refill), all within
the channel's slot budget.  A ``want`` that does not fit waits for budget (``wanted``) or on
the key's own slots (``owed``); slots of keys idle for ``slot_idle`` seconds, or in the way
of a key that waits, are asked back (``revoke`` -> ``rel``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import TransportError
from .pool import align
from .regions import SLOT, PeerRegions, Target

if TYPE_CHECKING:
    from .engine import Channel

_WANTED_MAX = 1 << 16      # keys waiting for slots per channel (a legit producer has fewer)


class SlotGrants:
    """The slots one channel granted its producer, and the wants it could not serve yet."""

    def __init__(self, channel: Channel, regions: PeerRegions, budget: int, max_slots: int,
                 slot_idle: float) -> None:
        self._channel = channel
        self._regions = regions
        self._loop = channel.engine.loop
        self._budget = budget
        self._max_slots = max_slots
        self._slot_idle = slot_idle
        self.slot_imms: dict[str, set[int]] = {}
        self._granted = 0                              # bytes of granted slots not written yet
        self.refill: dict[str, list[int]] = {}        # key -> [count, size] to grant again
        self._refill_scheduled = False
        self.wanted: dict[str, int] = {}               # key -> slot size, waiting for budget
        self._owed: dict[str, int] = {}                # key -> slot size, waiting on its own slots
        # key -> when its slots last moved; only keys holding granted slots (``_release``)
        self.last_use: dict[str, float] = {}
        self.revoking: dict[str, set[int]] = {}        # key -> its slots asked back
        # Slots the producer filled when we asked for them back (it gave back the others):
        # their writes are on their way, so they are not asked for again (``revoke``).
        self._filled: set[int] = set()
        self.count = 0                                 # slots granted, for the stats
        # Slots lent to the application as arrays come back when those die (``returned``).
        regions.arena.watch(self._loop, self.returned)

    # -- control messages from the producer ---------------------------------------------------

    def on_want(self, f: dict[str, Any]) -> None:
        """The producer holds no slot of a key that fits its next value."""
        key = str(f["k"])
        self._owed.pop(key, None)   # a want comes only after the last was answered
        for imm in f.get("rel", ()):
            self._free_slot(int(imm), key)
        size = int(f["n"])
        if size <= 0 or align(size) > self._budget:
            raise TransportError(f"slot of {size} bytes asked for key {key}: the slot budget "
                                 f"is {self._budget} bytes (larger values come in pieces)")
        # Slots already granted (maybe still on their way) or about to be re-granted count
        # against max_slots: the producer asks when it runs dry, which races our refills.
        have = self._have(key, size)
        refill = self.refill.get(key)
        if refill is not None and refill[1] >= size:
            have += refill[0]
        count = self._room(size, self._max_slots - have)
        if count > 0 and not self.wanted:
            self._grant(key, size, count)
        elif key not in self.wanted and len(self.wanted) + len(self._owed) >= _WANTED_MAX:
            # Owed keys wait too (``_settle`` moves them to ``wanted``): one bound for both.
            raise TransportError(f"more than {_WANTED_MAX} keys wait for slots")
        elif have == 0:   # no room now: wait, in order, for slots to come back
            self.wanted[key] = max(size, self.wanted.get(key, 0))
            self._serve()
        else:
            self._owe(key, size)

    def on_rel(self, f: dict[str, Any]) -> None:
        """Slots given back (the answer to ``revoke``)."""
        key = str(f["k"])
        for imm in f["s"]:
            self._free_slot(int(imm), key)
        # Those it kept it had filled before it read the revoke (a grant and a revoke
        # travel in order): asked again, it would give nothing back again.
        targets = self._regions.targets
        for imm in self.revoking.pop(key, ()):
            if imm in targets:
                self._filled.add(imm)
        self._settle(key)
        self._serve()

    # -- slots written and granted again ------------------------------------------------------

    def written(self, imm: int, key: str, size: int) -> None:
        """Slot ``imm`` of ``key`` (out of the targets already) was written: grant it again
        once this pass over the completions is done."""
        if not self._release(imm, key, size):
            self.last_use[key] = self._loop.time()  # (its refill's grant sets it)
        refill = self.refill.get(key)
        if refill is None:
            self.refill[key] = [1, size]
        else:
            refill[0] += 1
            refill[1] = max(refill[1], size)
        if not self._refill_scheduled:
            self._refill_scheduled = True
            self._loop.call_soon(self._flush_refill)

    def _flush_refill(self) -> None:
        self._refill_scheduled = False
        channel = self._channel
        if channel.closed or channel.failed is not None:
            self.refill.clear()
            return
        refill = self.refill
        self.refill = {}
        try:
            self._serve()   # keys that wait for budget come before refills
            for key, (count, size) in refill.items():
                count = self._room(size, min(count, self._max_slots - self._have(key, size)))
                if count > 0:
                    self._grant(key, size, count)
            waiting = len(self.wanted)
            for key in refill:   # a refill the budget did not allow: its want waits its turn
                self._settle(key)
            if len(self.wanted) > waiting:
                self._serve()
        except TransportError as exc:
            channel.fail(exc)

    def _grant(self, key: str, size: int, count: int) -> None:
        blocks = []
        slots = []
        imms = self.slot_imms.setdefault(key, set())
        self._owed.pop(key, None)   # any grant answers the producer's want (it asks again if short)
        self.last_use[key] = self._loop.time()
        regions = self._regions
        arena = regions.arena
        for _ in range(count):
            block = arena.alloc(size)
            imm = regions.add(Target(SLOT, block, key))
            imms.add(imm)
            self._granted += block.size
            blocks.append(block)
            slots.append([imm, block.addr, block.region.rkey, block.size])
        self.count += count
        self._channel._control({"op": "slots", "k": key, "s": slots,
                                "m": regions.describe(blocks)})

    def _have(self, key: str, size: int) -> int:
        """Slots of ``key`` granted and not filled yet that hold ``size`` bytes."""
        targets = self._regions.targets
        return sum(1 for imm in self.slot_imms.get(key, ()) if targets[imm].block.size >= size)

    def _room(self, size: int, most: int) -> int:
        """How many more slots of ``size`` bytes the budget allows, at most ``most``.

        Regions no slot is carved from are unregistered when they stand in the way."""
        if most <= 0:
            return 0
        arena = self._regions.arena
        room = arena.capacity(size, most)
        if room < most and arena.empty_chunks():
            self._channel.unmap(self._regions.trim())
            room = arena.capacity(size, most)
        return room

    def _free_slot(self, imm: int, key: str) -> None:
        targets = self._regions.targets
        target = targets.get(imm)
        if target is None or target.kind != SLOT or target.key != key:
            return
        del targets[imm]
        self._release(imm, key, target.block.size)
        self._regions.arena.free(target.block)

    def _release(self, imm: int, key: str, size: int) -> bool:
        """Slot ``imm`` of ``key``, already out of the targets, is granted no more (given
        back, or its write seen); True if it was the key's last.  A key with no slot left
        leaves ``last_use`` too: nothing of it is there to revoke, and a key used once (a
        sparse embedding id) whose last slot was written and not granted again (no room
        for the refill) would otherwise stay there for good, walked every second."""
        self._filled.discard(imm)
        self._granted -= size
        imms = self.slot_imms.get(key)
        if imms is None:
            return False
        imms.discard(imm)
        if imms:
            return False
        del self.slot_imms[key]
        self.last_use.pop(key, None)
        return True

    def returned(self) -> None:
        """Slots lent to the application came back (their arrays died): the budget they
        free goes to the keys that wait for it."""
        channel = self._channel
        if channel.closed or channel.failed is not None:
            return
        try:
            self._serve()
        except TransportError as exc:
            channel.fail(exc)

    # -- waiting for budget -------------------------------------------------------------------

    def _serve(self) -> None:
        """Grant the keys that wait for budget, in the order they asked."""
        wanted = self.wanted
        while wanted:
            key = next(iter(wanted))
            size = wanted[key]
            have = self._have(key, size)
            count = self._room(size, self._max_slots - have)
            if count <= 0 and have == 0:
                self._reclaim(size, key)
                return
            del wanted[key]
            if count > 0:
                self._grant(key, size, count)
            else:
                self._owe(key, size)

    def _owe(self, key: str, size: int) -> None:
        """Let the producer's want of ``key`` wait on slots we count as its own.

        The producer asks only when it holds no slot that fits, so those slots are on their way
        to it, or already filled and their writes not seen yet (a want travels on the TCP
        connection, a write's completion apart from it), to be granted again as a refill.  The
        budget may not allow that refill: then the want must not be forgotten (``_settle``)."""
        self._owed[key] = max(size, self._owed.get(key, 0))

    def _settle(self, key: str) -> None:
        """A want of ``key`` that waited on its own slots, none of which is left and no refill
        coming: it waits for budget in ``wanted``, behind the keys already there."""
        size = self._owed.get(key)
        if size is None or key in self.refill or self._have(key, size):
            return
        del self._owed[key]
        self.wanted[key] = max(size, self.wanted.get(key, 0))

    def _reclaim(self, size: int, keep: str) -> None:
        """Ask for the slots of the least recently used keys back until ``size`` would fit.

        Short by what registering a region for it would pass the budget by: slots given back
        may leave their regions partly used, so each pass that still finds no room asks for
        more (once their regions are empty, ``_room`` unregisters them)."""
        short = align(size) - (self._budget - self._regions.arena.registered)
        targets = self._regions.targets
        for key in sorted(self.last_use, key=self.last_use.__getitem__):
            if short <= 0:
                return
            if key == keep or key in self.revoking:
                continue
            short -= sum(targets[imm].block.size for imm in self.slot_imms.get(key, ()))
            self._revoke(key)

    def revoke_idle(self, now: float) -> None:
        """Ask for the slots of keys unused for ``slot_idle`` seconds back (the watchdog)."""
        idle = now - self._slot_idle
        for key, used in list(self.last_use.items()):
            if used < idle:
                self._revoke(key)

    def _revoke(self, key: str) -> None:
        if key in self.revoking:
            return
        imms = self.slot_imms.get(key, set()) - self._filled
        if imms:
            self.revoking[key] = imms
            self._channel._control({"op": "revoke", "k": key, "s": sorted(imms)})

    def close(self) -> None:
        self.slot_imms.clear()
        self.wanted.clear()
        self._owed.clear()
        self.last_use.clear()
        self.revoking.clear()
        self._filled.clear()

"""Where held values are counted: the Recv-Driven values a producer keeps until their
consumers ask, against ``hold_limit`` (payload bytes plus MESSAGE_COST a value); the room
that waiting sends reserved; what lost consumers hold, apart; and the claims, the deadlines
after which a held value nobody asked for is pushed (``claim_timeout``).

The engine (``Core``) decides when a value is held, taken or pushed and tells this part;
the node waits on ``hold_waiters`` for room and asks ``due_claims`` what to push.
"""

from __future__ import annotations

from collections import deque
from heapq import heappop, heappush
from typing import Any

from .peers import MESSAGE_COST, SWEEP_SLACK, Peer

# Producers waiting for room under hold_limit are woken once an eighth of it is free, not at
# every value taken (each wake-up of every waiting task, most of which find no room, cost
# more than the value it waited for).
HOLD_LOW_WATER = 8


class Holding:
    """The held values' counts and claims, for every consumer of one node."""

    def __init__(self, hold_limit: int, lost_hold_limit: Any, claim_timeout: Any,
                 tables: dict) -> None:
        self.hold_limit = hold_limit
        # Of the values held for lost consumers (``Peer.lost``), this much does not count
        # against hold_limit for the sends to the others (None: as much as hold_limit).
        self.lost_hold_limit = hold_limit if lost_hold_limit is None else lost_hold_limit
        self.claim_timeout = claim_timeout
        # (step, key) -> loop time of the last request for it, so a value a consumer is
        # pulling is not pushed at claim_timeout (that would reorder it).
        self.asked: dict = {}
        self.held_bytes = 0                # Recv-Driven values waiting for remote consumers
        self.held_count = 0
        self.hold_waiters: deque = deque()
        self.hold_reserved = 0             # room (bytes + MESSAGE_COST) waiting sends reserved
        # Of the three above, the part of the consumers that are lost (``regroup``).
        self.lost_bytes = 0
        self.lost_count = 0
        self.lost_reserved = 0
        # (step, key) -> the deadlines of its held values, in the order they were held:
        # the claims ``due_claims`` looks at.  Values are taken oldest first, so the last
        # ``table.queued(key)`` are the claims of the values still held.
        self.claims: dict = {}
        # A pass looks only at the keys whose time came, each key being in one of these
        # (a pass over every key held would stall the loop with many keys).  The keys new
        # in ``claims``, in the order they came: nothing touches a key's deadlines before
        # it is first looked at, when its first one came, so they stay in deadline order.
        self.claim_order: deque = deque()
        # The keys looked at and still held: a heap of (when to look again, (step, key)).
        self.claim_times: list = []
        # Consumer -> the (step, key) of its keys that came due while it was lost (no ready
        # connection): looked at again once it is back (``regroup``), not at every pass.
        self.lost_claims: dict = {}
        self.tables = tables               # the core's step -> Table (read: what is still queued)

    def full(self, peer: Peer, nbytes: int, mine: int) -> bool:
        """Whether held values leave no room for a value of ``nbytes`` for ``peer`` (what a
        value its consumer already asked for needs, ``Core.hold_full`` checks apart).

        Sends that wait keep their turn: the room they reserved counts as taken for the
        sends behind them, else a value near ``hold_limit`` waits for ever while smaller
        ones keep a value or two held.  A waiting send goes when there is room besides
        the others' reservations, or nothing is held (a value larger than the limit goes
        alone), so two waiting sends never wait for each other.

        For a consumer that is connected, what is held for lost ones counts only beyond
        ``lost_hold_limit``, and their waiting sends' reservations not at all (those dial
        and fail, or go once it is back): a consumer that died with the limit full of its
        values does not stall the traffic to the live ones, and everything held stays
        under ``hold_limit + lost_hold_limit``.  A send to a lost consumer counts
        everything.
        """
        others = self.hold_reserved - mine
        count = self.held_count
        cost = self.held_cost()
        if (self.lost_count or self.lost_reserved) and not peer.lost:
            others -= self.lost_reserved
            cost = self.live_cost()
            if self.lost_cost() <= self.lost_hold_limit:  # (then none of theirs counts)
                count -= self.lost_count
        return bool((count or (others and not mine))
                    and cost + others + nbytes + MESSAGE_COST > self.hold_limit)

    def claim(self, step: Any, key: str, now: float) -> None:
        """A value of ``key`` was held at loop time ``now``: it is pushed if nobody asks for
        it within ``claim_timeout``."""
        claimed = (step, key)
        deadlines = self.claims.get(claimed)
        if deadlines is None:
            self.claims[claimed] = [now + self.claim_timeout]
            self.claim_order.append(claimed)
        else:
            deadlines.append(now + self.claim_timeout)

    def pulled(self, step: Any, key: str, now: float) -> None:
        """A consumer asked for ``key`` at loop time ``now``: its values held before are
        not pushed at claim_timeout (``due_claims``), which could reorder them."""
        self.asked[(step, key)] = now

    def forget_asked(self, horizon: float) -> None:
        """Forget the requests of held keys made before ``horizon`` (loop time)."""
        self.asked = {k: t for k, t in self.asked.items() if t >= horizon}

    def due_claims(self, now: float, route: Any) -> list:
        """The held values nobody asked for within claim_timeout, as ``(step, key, count)``:
        push the ``count`` oldest values of ``key`` (``Heartbeat._push_unclaimed``).  ``route``
        gives a key's ``Route``.

        Only the keys whose time came (``next_claim``) are looked at, each once a pass:
        - The claims of values taken since are dropped first: a key's claims, like its
          values, go oldest first, so all but its last ``queued`` are of values taken.
          One look a key a pass, however many values it moved.
        - A key its consumer asked for after its oldest value was held is pulled
          (``asked``): that consumer will likely ask for this one too, and its request
          moves it without taking the push window.  But a consumer may have asked once and
          then wait locally (recvs with mode="send", or a request made only because the
          handshake said we hold): its values wait until claim_timeout after the key's last
          request, and then go, for credit like any push.  (A request that comes while
          such a push waits for credit takes it first, so that no answer overtakes it:
          ``on_request``.  Holding them until they could be written at once instead left
          a consumer that waits locally waiting for ever behind a window full of values
          it did not take.)
        - The keys of a lost consumer wait in ``lost_claims`` until it is back.
        """
        timeout = self.claim_timeout
        if timeout is None:
            return []   # (nothing is claimed)
        due = []
        later = []   # (looked at again from the next pass on)
        while True:
            counted = self.next_claim(now)
            if counted is None:
                break
            deadlines = self.held_claims(counted)
            if deadlines is None:
                continue   # (it left ``claims``)
            oldest = deadlines[0]
            if oldest > now:
                later.append((oldest, counted))
                continue
            asked = self.asked.get(counted)
            if asked is not None and asked >= oldest - timeout and asked + timeout > now:
                later.append((asked + timeout, counted))   # put off
                continue
            key = counted[1]
            peer = route(key).peer
            if peer.lost:  # held for the consumer to ask, or until it is back
                self.park_claims(peer, counted)
                continue
            count = 0
            for deadline in deadlines:
                if deadline > now:
                    break
                count += 1
            due.append((counted[0], key, count))
            # The next look: at its next deadline, or the next pass drops what was pushed.
            later.append((deadlines[count] if count < len(deadlines) else now, counted))
        for entry in later:
            heappush(self.claim_times, entry)
        return due

    def next_claim(self, now: float) -> Any:
        """The next key of ``claims`` whose time came (``claim_order``'s head when its first
        deadline came, else ``claim_times``'s), out of where it waited; None when none."""
        order = self.claim_order
        while order:
            deadlines = self.claims.get(order[0])
            if deadlines is not None and deadlines[0] > now:
                break
            counted = order.popleft()
            if deadlines is not None:
                return counted
        times = self.claim_times
        if times and times[0][0] <= now:
            return heappop(times)[1]
        return None

    def held_claims(self, counted: tuple) -> Any:
        """The claims of the values of ``counted`` (``(step, key)``) still held, those of
        values taken since dropped; None when none is left (the key leaves ``claims``)."""
        deadlines = self.claims.get(counted)
        if deadlines is None:
            return None
        table = self.tables.get(counted[0])
        excess = len(deadlines) - (0 if table is None or table.aborted else table.queued(counted[1]))
        if excess > 0:
            del deadlines[:excess]
        if not deadlines:
            del self.claims[counted]
            return None
        return deadlines

    def park_claims(self, peer: Peer, counted: tuple) -> None:
        """A key of ``peer``, lost, came due: it waits in ``lost_claims`` until ``peer`` is
        back.  Keys whose values left meanwhile (their step was dropped) are swept out once
        the list outgrows twice the values held for ``peer``."""
        parked = self.lost_claims.get(peer)
        if parked is None:
            parked = self.lost_claims[peer] = []
        parked.append(counted)
        if len(parked) > SWEEP_SLACK + 2 * peer.held_count:
            parked[:] = [c for c in parked if self.held_claims(c) is not None]

    def drop_claims(self) -> None:
        """Forget every claim (close() pushes what is held)."""
        self.claims.clear()
        self.claim_order.clear()
        self.claim_times.clear()
        self.lost_claims.clear()

    def held_cost(self) -> int:
        """What the held Recv-Driven values count against ``hold_limit``: their bytes and
        MESSAGE_COST for each."""
        return self.held_bytes + MESSAGE_COST * self.held_count

    def count_held(self, peer: Peer, nbytes: int) -> None:
        """A value of ``nbytes`` is held for ``peer`` (``released_held`` undoes it)."""
        self.held_bytes += nbytes
        self.held_count += 1
        peer.held_bytes += nbytes
        peer.held_count += 1
        if peer.lost:
            self.lost_bytes += nbytes
            self.lost_count += 1

    def released_held(self, peer: Peer, nbytes: int) -> None:
        """A value held for ``peer`` left (taken, pushed, or its step dropped)."""
        self.held_bytes -= nbytes
        self.held_count -= 1
        peer.held_bytes -= nbytes
        peer.held_count -= 1
        if peer.lost:
            self.lost_bytes -= nbytes
            self.lost_count -= 1
        # Below the low-water mark (or empty: a value larger than the limit goes alone), the
        # waiting producers look again; those that still find no room wait again.  The
        # mark is of what a send to a connected consumer counts (``hold_full``): the sends
        # waiting are theirs (a send to a lost one dials it), and a look at the larger
        # total would never wake them while lost consumers hold most of it.
        if self.hold_waiters and (self.held_count == self.lost_count or self.live_cost()
                                  <= self.hold_limit - self.hold_limit // HOLD_LOW_WATER):
            self.wake_holders()

    def lost_cost(self) -> int:
        """What the values held for lost consumers count, as ``held_cost`` does."""
        return self.lost_bytes + MESSAGE_COST * self.lost_count

    def live_cost(self) -> int:
        """What the held values count against ``hold_limit`` for a send to a connected
        consumer: all but what lost consumers hold within ``lost_hold_limit``."""
        lost = self.lost_cost()
        return self.held_cost() - (lost if lost <= self.lost_hold_limit else self.lost_hold_limit)

    def reserve_hold(self, peer: Peer, nbytes: int) -> int:
        """A send of ``nbytes`` to ``peer`` starts waiting for room under hold_limit: it
        keeps its turn (``hold_full``).  Returns the room it reserved (``unreserve_hold``
        gives it back)."""
        cost = nbytes + MESSAGE_COST
        self.hold_reserved += cost
        peer.hold_reserved += cost
        if peer.lost:
            self.lost_reserved += cost
        return cost

    def unreserve_hold(self, peer: Peer, cost: int) -> None:
        self.hold_reserved -= cost
        peer.hold_reserved -= cost
        if peer.lost:
            self.lost_reserved -= cost

    def regroup(self, peer: Peer, lost: bool) -> None:
        """``peer`` is ``lost`` (the node saw its last ready connection close) or not (one
        became ready): its held values and reservations move to the lost consumers' count
        or back (``hold_full``).  A consumer that comes back counts in full again."""
        if lost == peer.lost:
            return
        peer.lost = lost
        sign = 1 if lost else -1
        self.lost_bytes += sign * peer.held_bytes
        self.lost_count += sign * peer.held_count
        self.lost_reserved += sign * peer.hold_reserved
        if self.hold_waiters:  # lost: room for the others; back: its own sends count less
            self.wake_holders()
        if not lost:  # its keys that came due meanwhile are looked at in the next pass
            parked = self.lost_claims.pop(peer, None)
            if parked is not None:
                for counted in parked:
                    heappush(self.claim_times, (0.0, counted))

    def wake_holders(self) -> None:
        """Let every send waiting for room under hold_limit look again (``hold_full``)."""
        for waiter in self.hold_waiters:
            if not waiter.done():
                waiter.set_result(None)

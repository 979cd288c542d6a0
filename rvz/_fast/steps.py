"""The step registry: each step's ``Table`` (where its keys are matched), the steps cleaned
up (dead for good, their later calls fail), who took part in each step (a clean-up must reach
them), how many tables each peer made, and which tables went empty or idle.

The engine looks tables up here on every message (``table``, ``remote_table``); the node's
heartbeat asks which tables to drop (``empty_steps``, ``idle_steps``) and acts on the answer.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..errors import Aborted, ProtocolError
from . import keys as _keys
from .peers import Peer
from .table import Table

_NO_STEP = object()  # ``Steps._last_step`` before any table is looked up: no step is it
# Cleaned-up steps remembered (their later calls fail); the oldest are forgotten past it.
DEAD_STEPS_MAX = 1 << 16
# Steps without a table whose peers are still remembered, to relay a late clean-up to them.
RETIRED_STEPS_MAX = 1 << 12


def step_id(step: Any) -> int:
    """``step`` as a step id: an integer in [0, 2**64), which the wire carries as a u64.
    Checked when a step's table is made, when an id that is not an int looks one up (and by
    ``node.step``): an id the wire cannot carry would otherwise fail only when its first
    frame is written, away from the caller."""
    if type(step) is int:  # the common id: no call
        n = step
    else:
        n = _keys.as_index(step)  # (True would be step 1)
        if n is None:
            raise TypeError(f"a step id is an integer, not {type(step).__name__}")
    if not 0 <= n < 1 << 64:
        raise ValueError(f"step id {n} is out of range [0, 2**64)")
    return n


class Steps:
    """Every step this node knows of; ``max_steps`` tables at most made by peers, each of the
    ``others`` other tasks making at most its share."""

    def __init__(self, max_steps: int, others: int) -> None:
        self.tables: dict = {}             # step -> Table: where a key is matched
        # The step of the last table looked up, and its table: nearly every send, recv and
        # frame names the step the one before it did, and an identity test costs less than
        # a dict lookup.  ``drop``, the only place a table leaves ``tables``, resets it.
        self._last_step: Any = _NO_STEP
        self._last_table: Any = None
        self.dead_steps: dict = {}         # step -> why it was cleaned up
        self.dead_order: deque = deque()   # its keys, oldest first (``kill``)
        self.dead_max = DEAD_STEPS_MAX
        # dead step -> (task id, incarnation) of the one peer process that took part in it
        self.dead_owner: dict = {}
        self.step_peers: dict = {}         # step -> peers that took part in it
        self.retired_max = RETIRED_STEPS_MAX
        # step -> the peer whose frame made its table, each peer making at most
        # ``step_share`` (``remote_table``): one peer cannot take every step for all.
        self.step_openers: dict = {}
        self.max_steps = max_steps
        self.step_share = max(1, max_steps // max(1, others))
        self.empty_seen: dict = {}         # step -> (table, stamp, puts) found empty last time
        self.idle_since: dict = {}         # step -> ((stamp, puts), loop time it was seen so)

    def table(self, step: Any) -> Table:
        """The table of ``step``, made on first use; ``Aborted`` if it was cleaned up."""
        if step is self._last_step:
            return self._last_table
        if type(step) is not int:
            # True, 1.0 or np.int64(1) equal the id 1 as a dict key: they would find its
            # table (or its cleanup) unchecked. Checked here, and looked up as the int.
            step = step_id(step)
        table = self.tables.get(step)
        if table is None:
            dead = self.dead_steps.get(step)
            if dead is not None:
                raise Aborted(dead)
            step_id(step)
            table = Table()
            self.tables[step] = table
        self._last_step = step
        self._last_table = table
        return table

    def remote_table(self, step: Any, peer: Peer) -> Any:
        """The table of ``step`` for a frame from ``peer``: None if the step was cleaned up;
        a new table only while that peer made fewer than its share of ``max_steps`` of the
        tables that exist: past it, that peer's connection closes, and no other peer's
        frames are refused for it."""
        if step is self._last_step:
            return self._last_table
        table = self.tables.get(step)
        if table is None:
            if step in self.dead_steps:
                return None
            if peer.steps_opened >= self.step_share:
                raise ProtocolError(f"{peer.name} opened more than its share of "
                                    f"{self.step_share} steps (max_steps {self.max_steps} over "
                                    "the cluster's other tasks)")
            table = Table()
            self.tables[step] = table
            self.step_openers[step] = peer
            peer.steps_opened += 1
        self._last_step = step
        self._last_table = table
        return table

    def joined(self, step: Any, peer: Peer) -> None:
        """Remember that ``peer`` took part in ``step`` (its clean-up must reach it)."""
        if peer.joined_step is not None and peer.joined_step == step:
            return
        peer.joined_step = step
        peers = self.step_peers.get(step)
        if peers is None:
            self.step_peers[step] = {peer}
        elif peer not in peers:
            peers.add(peer)

    def drop(self, step: Any) -> Any:
        """Forget ``step``'s table (empty, expired or aborted) and return it (None if none)."""
        table = self.tables.pop(step, None)
        opener = self.step_openers.pop(step, None)
        if opener is not None:
            opener.steps_opened -= 1
        self.idle_since.pop(step, None)
        self._last_step = _NO_STEP
        self._last_table = None
        return table

    def kill(self, step: Any, message: str) -> Any:
        """``step`` is cleaned up, for ``message``: its later calls fail.  Returns the peers
        that took part in it (now forgotten), or None if it was dead already.  Past
        ``dead_max`` dead steps the oldest is forgotten: through a queue of its own, as the
        first key of a dict whose front was deleted costs a walk over every freed slot."""
        if step in self.dead_steps:
            return None
        if len(self.dead_steps) >= self.dead_max:
            oldest = self.dead_order.popleft()
            del self.dead_steps[oldest]
            self.dead_owner.pop(oldest, None)
        self.dead_steps[step] = message
        self.dead_order.append(step)
        return self.step_peers.pop(step, set())

    def note_owner(self, step: Any, peers: set, origin: Any) -> None:
        """Remember a dead step whose only other party was one peer's process: it dies with
        that process (``forget_dead_of``)."""
        parties = (peers | {origin}) if origin is not None else peers
        if len(parties) == 1:
            peer = next(iter(parties))
            if peer.incarnation is not None:
                self.dead_owner[step] = (peer.id, peer.incarnation)

    def forget_dead_of(self, task_id: tuple, incarnation: Any) -> None:
        """The process ``incarnation`` of ``task_id`` was replaced by a new one: the step ids
        that died with only that process taking part are free again.

        A restarted process that names its steps by a counter uses the same ids again, and
        would find them dead, cleaned up by its earlier self.  Forgetting them is safe: the
        old process's connections are closed, so no late frame of the old step can come from
        it, and no other peer took part in the step here.  Steps another peer took part in
        stay dead: a late frame from that peer would land in the new step."""
        owner = (task_id, incarnation)
        gone = [step for step, who in self.dead_owner.items() if who == owner]
        if not gone:
            return
        for step in gone:
            del self.dead_owner[step]
            self.dead_steps.pop(step, None)
        self.dead_order = deque(self.dead_steps)  # (dicts keep their insertion order)

    def empty_steps(self) -> list:
        """The steps whose tables to drop: empty and untouched at two looks in a row.

        A value delivered to a recv that is then cancelled leaves its table empty until
        that recv's task wakes and gives the value back; the wake-up is already scheduled,
        so it runs before the next look, but it may run after this one.  Dropped at once,
        the table would take the value back where no recv looks for it."""
        seen = self.empty_seen
        now_empty: dict = {}
        due = []
        for step, table in self.tables.items():
            if not table.empty():
                continue
            mark = (table, table.stamp, table.puts)  # a table compares by identity
            if seen.get(step) == mark:
                due.append(step)
            else:
                now_empty[step] = mark
        self.empty_seen = now_empty
        return due

    def idle_steps(self, now: float, idle: float) -> list:
        """The steps (but step 0) whose tables nothing touched for ``idle`` seconds, as
        ``(step, table)``; ``now`` is the loop time."""
        seen = self.idle_since
        due = []
        for step, table in self.tables.items():
            if step == 0:
                continue
            mark = (table.stamp, table.puts)
            last = seen.get(step)
            if last is None or last[0] != mark:
                seen[step] = (mark, now)
            elif now - last[1] >= idle:
                due.append((step, table))
        return due

    def retire(self) -> None:
        """Forget who took part in the oldest steps that have no table any more, past the
        last ``retired_max``: a clean-up that reaches us later is relayed to a step's peers,
        but steps named by a counter would keep one entry each for ever."""
        excess = len(self.step_peers) - len(self.tables) - self.retired_max
        if excess <= 0:
            return
        for step in list(self.step_peers):  # oldest first (the order they were joined)
            if excess <= 0:
                break
            if step in self.tables:
                continue
            for peer in self.step_peers.pop(step):
                peer.left_step(step)
            excess -= 1

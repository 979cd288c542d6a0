"""The worker's side of the parameter server: dedup, shard, pull, scatter back, push.

``PSClient`` turns a batch of (possibly repeated) ids per table into one message per shard
holding only that shard's unique ids, and reassembles the replies in the caller's order.
Pushes are summed per id first. Both channels number their clocks from 0 (see protocol.py).

Failures:

* a step that fails in the worker (``abort_step(clock)``) is cleaned up with rvz's step
  clean-up: every shard drops what it had of that step and goes on;
* a shard that restarts from its checkpoint (after ``kill -9``, say) shows up as ``PeerLost``
  or as its next ``HELLO``; the client then waits (up to ``restart_timeout``) for the new
  incarnation's greeting, tells it where its clocks stand (``REJOIN``), and retries what it
  had in flight with that shard. Rows the shard had not checkpointed are lost (they come
  back as new rows): the usual trade of PS recovery;
* a worker process that was killed and started again as the same task (shards started with
  ``worker_rejoin``): its greetings say so; the client continues at the largest clock the
  shards' greetings give (``rejoined_at``), tells every shard (``JOIN``), and the caller
  goes on from ``next_step``. Under bsp (``replay=True``) it does not take the shards' clock:
  it replays from the clock of its own journal, which the caller gives to ``join_at``
  (``restarted`` says whether it must).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import numpy as np

import rvz

from .native import gather_rows, scatter_rows, shard_split
from .protocol import (
    END,
    HELLO,
    JOIN,
    KNOCK,
    PS_JOB,
    PULL_IDS,
    PULL_ROWS,
    PUSH_ACK,
    PUSH_GRADS,
    PUSH_IDS,
    READ_IDS,
    READ_ROWS,
    REJOIN,
    WORKER_JOB,
    edge,
    frame,
    pack_ids,
    pack_rows,
    read_step_id,
    step_id,
    unpack_rows,
)
from .sparse import SHARD_SALT, as_ids, sum_by_id

log = logging.getLogger(__name__)

CHANNELS = ("lookup", "push", "read")  # the order of the clocks in REJOIN
TRAINING = ("lookup", "push")         # the channels whose clocks are training steps


def _quiet(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a watcher's failure reaches the exchanges that wait on it


# A shard started again without --restore serves a new epoch 0 from clock 0: it neither
# greets its workers as a restarted shard nor answers their clocks, so they can only time out.
FRESH_HINT = ("; if that shard was restarted, was it with --restore? A shard started afresh "
              "does not know its workers' clocks")


# A fresh worker waits for epoch 0; a shard started with --restore greets with its next
# epoch, and only workers that knew it answer.
WHOLE_JOB_HINT = ("; is that shard running, at that address? (One started with --restore greets "
                  "only the workers it knew: to restart a whole job, resume it from a whole-job cut: "
                  "--cut-every, then --resume.)")


async def by_table(dims: dict[str, int], ids: dict[str, Any], fetch: Any) -> dict[str, np.ndarray]:
    """``fetch(unique ids of each table of dims, in order)`` -> their rows, expanded back to
    ``ids``'s shapes (tables left out of ``ids`` get nothing)."""
    flat = {name: np.asarray(ids.get(name, np.zeros(0)), dtype=np.int64) for name in dims}
    uniq, inverse = {}, {}
    for name, arr in flat.items():
        uniq[name], inverse[name] = np.unique(arr.reshape(-1), return_inverse=True)
    rows = await fetch([uniq[n] for n in dims])
    return {name: rows[t][inverse[name].reshape(-1)].reshape(flat[name].shape + (dims[name],))
            for t, name in enumerate(dims) if name in ids}


class ShardRestarted(Exception):
    """The shard greeted us from a new incarnation while we waited for it."""


class PSClient:
    """Talks to ``num_shards`` PS shards from ``node`` (a task of the worker job).

    ``tables``: the service's tables as ``{name: dim}`` in the shards' order, or one dim for a
    single table named ``"default"``. ``timeout`` bounds each wait for a reply from a live
    shard; ``restart_timeout`` bounds the wait for a lost shard to come back (0: the shards
    are never restarted, a lost one fails the call at once). ``replay``: a restarted process
    of this task joins at the clock the caller gives ``join_at`` (bsp), not at the shards'.
    """

    def __init__(self, node: rvz.Node, num_shards: int, tables: int | dict[str, int], *,
                 timeout: float | None = 30.0, restart_timeout: float = 60.0,
                 worker_job: str = WORKER_JOB, replay: bool = False) -> None:
        if node.job != worker_job:
            raise ValueError(f"the client runs on a {worker_job!r} task, not on {node.name}")
        self.node = node
        self.worker = node.task
        self.num_shards = num_shards
        self.dims = {"default": tables} if isinstance(tables, int) else dict(tables)
        self.names = list(self.dims)
        self.dim = self.dims[self.names[0]]
        self.timeout = timeout
        self.restart_timeout = restart_timeout
        self.worker_job = worker_job
        self.next_step = {"lookup": 0, "push": 0, "read": 0}
        self.epoch = [0] * num_shards
        self.generation = [0] * num_shards  # this process's generation, as each shard counts it
        self.rejoined_at: int | None = None  # the clock this process joined at, if a restarted one
        self.replay = replay
        self.nonce = secrets.randbits(62)  # this process, to the shards (KNOCK, JOIN)
        self.restarted = False  # with ``replay``: a restarted process, which must call join_at
        self.restarts = 0
        self.closed = False
        self._greeted: asyncio.Future[None] | None = None
        self._inflight: dict[str, dict[int, int]] = {c: {} for c in CHANNELS}
        self._next_hello: list[asyncio.Future[Any] | None] = [None] * num_shards
        self._watchers: list[asyncio.Task[None]] = []
        self._resync_lock = [asyncio.Lock() for _ in range(num_shards)]
        self._gone: list[str | None] = [None] * num_shards  # why we gave up on a lost shard

    def start_at(self, clock: int) -> None:
        """Continue a job resumed from a whole-job cut at ``clock`` (its shards serve every
        worker from there); before the first call."""
        if self._greeted is not None or any(self.next_step[c] for c in TRAINING):
            raise RuntimeError("start_at() comes before the client's first call")
        for channel in TRAINING:
            self.next_step[channel] = clock

    # -- the handshake ---------------------------------------------------------------------

    async def connect(self) -> None:
        """Wait for every shard's greeting (done by the first pull or push anyway)."""
        if self._greeted is None:
            self._greeted = asyncio.ensure_future(self._greet())
        await asyncio.shield(self._greeted)

    async def _greet(self) -> None:
        clocks = [0] * self.num_shards
        if self.replay:
            # Who this process is, before any greeting: see protocol.py (KNOCK).
            for shard in range(self.num_shards):
                await self.node.send(edge(KNOCK, self.worker, shard, 0, 0, self.worker_job),
                                     np.array([self.nonce], dtype=np.int64), timeout=self.timeout)

        async def one(shard: int) -> None:
            hello = await self._recv_hello(shard, 0, self.timeout)
            self.epoch[shard] = int(hello[0])
            tail = hello[1 + len(self.names):]
            if len(tail) == 2:
                self.generation[shard], clocks[shard] = int(tail[0]), int(tail[1])
        await asyncio.gather(*(one(s) for s in range(self.num_shards)))
        if any(self.generation) and self.replay:
            self.restarted = True  # the caller knows where to replay from: join_at
        elif any(self.generation):
            await self._join(max(clocks))
        for shard in range(self.num_shards):
            self._watch(shard)

    async def join_at(self, clock: int) -> None:
        """A restarted process (``restarted``, with ``replay``) continues at ``clock`` on every
        shard: the first clock it will send again (the shards acknowledge what they already
        hold of it, and answer its pulls as they did). Call it after ``connect``."""
        if not self.restarted or self.rejoined_at is not None:
            raise RuntimeError(f"worker {self.worker}: join_at is for a restarted process, once")
        await self._join(clock, exact=True)

    async def _join(self, clock: int, exact: bool = False) -> None:
        """This process replaces a lost one of the same task: continue at ``clock`` (the
        furthest any shard's greeting says the lost one's pushes got, or with ``exact`` the
        clock given) on every shard."""
        if not all(self.generation):
            raise RuntimeError(f"worker {self.worker}: shards {self.generation} disagree on whether "
                               "this task was restarted")
        if not exact:
            clock = max(clock, *(self.next_step[c] for c in TRAINING))
        for channel in TRAINING:
            self.next_step[channel] = clock
        for shard in range(self.num_shards):
            await self.node.send(self._edge(JOIN, shard, 0), np.array([clock, self.nonce], dtype=np.int64),
                                 timeout=self.timeout)
        self.rejoined_at = clock
        log.warning("worker %d: a restarted process (generation %s); rejoined at clock %d",
                    self.worker, self.generation, clock)

    async def _recv_hello(self, shard: int, epoch: int, timeout: float | None) -> Any:
        """The greeting of ``shard``'s incarnation ``epoch``, redialling while it is down."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = None if timeout is None else started + timeout
        key = edge(HELLO, self.worker, shard, epoch, 0, self.worker_job)
        while True:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                return await self.node.recv(key, timeout=left)
            except (rvz.PeerLost, TimeoutError) as exc:
                if deadline is not None and loop.time() >= deadline:
                    # rvz's timeout gives the last retry's share of the wait, not the wait: left
                    # out; why the last dial failed is kept.
                    why = f": {exc}" if isinstance(exc, rvz.PeerLost) else ""
                    raise type(exc)(
                        f"worker {self.worker}: no greeting from PS shard {shard} (epoch {epoch}, at "
                        f"{self.node.cluster.address(PS_JOB, shard)}) within {timeout:g} s "
                        f"(waited {loop.time() - started:.1f} s){why}"
                        + (WHOLE_JOB_HINT if epoch == 0 else "")) from None
                if isinstance(exc, TimeoutError):
                    raise
                await asyncio.sleep(0.05)

    def _watch(self, shard: int) -> None:
        """Listen for the next incarnation of ``shard`` in the background."""
        fut = asyncio.get_running_loop().create_future()
        self._next_hello[shard] = fut

        async def watch(epoch: int) -> None:
            try:
                hello = await self._recv_hello(shard, epoch, None)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                if not fut.done():
                    fut.set_exception(exc)
                    fut.exception()  # nobody may ever look: do not log it as lost
                raise
            if not fut.done():
                fut.set_result(hello)
            # Rejoin at once, not when an exchange with the shard fails: the shard waits for
            # every worker's clocks before it serves (its consistency bound needs them).
            await self._resync(shard, epoch - 1)

        task = asyncio.ensure_future(watch(self.epoch[shard] + 1))
        task.add_done_callback(_quiet)
        self._watchers.append(task)

    async def _resync(self, shard: int, failed_epoch: int) -> None:
        """After a failure with ``shard`` at ``failed_epoch``: wait for its next incarnation
        and rejoin it (once, whichever channel noticed first)."""
        async with self._resync_lock[shard]:
            if self.epoch[shard] != failed_epoch:
                return  # the other channel already did it
            if self.restart_timeout <= 0:
                raise rvz.PeerLost(f"worker {self.worker}: PS shard {shard} was lost (its shards "
                                   "are not restarted)")
            if self._gone[shard] is not None:
                # Given up on already (by the other channel): one wait per loss, not one each.
                raise rvz.PeerLost(self._gone[shard])
            fut = self._next_hello[shard]
            assert fut is not None
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                hello = await asyncio.wait_for(asyncio.shield(fut), self.restart_timeout)
            except (TimeoutError, asyncio.TimeoutError):  # (two classes before 3.11)
                self._gone[shard] = (f"worker {self.worker}: PS shard {shard} did not come back "
                                     f"within {self.restart_timeout:g} s (waited "
                                     f"{loop.time() - started:.1f} s){FRESH_HINT}")
                raise rvz.PeerLost(self._gone[shard]) from None
            epoch = int(hello[0])
            clocks = np.array([self._inflight[c].get(shard, self.next_step[c]) for c in CHANNELS],
                              dtype=np.int64)
            log.warning("worker %d: PS shard %d restarted (epoch %d); rejoining at clocks %s",
                        self.worker, shard, epoch, clocks.tolist())
            # A restarted shard counts this task's processes from 0 again (its epoch keeps the
            # keys apart).
            self.generation[shard] = 0
            await self.node.send(edge(REJOIN, self.worker, shard, 0, epoch, self.worker_job), clocks)
            self.epoch[shard] = epoch
            self.restarts += 1
            self._watch(shard)

    def _edge(self, kind: str, shard: int, clock: int) -> rvz.Key:
        return edge(kind, self.worker, shard, clock, frame(self.epoch[shard], self.generation[shard]),
                    self.worker_job)

    async def _send(self, shard: int, clock: int, messages: list[tuple[str, Any]], step: int) -> None:
        # One call per shard (the push's ids and gradients leave in one write): a failure
        # then says exactly which shard did not get its messages.
        await self.node.send_many([(self._edge(kind, shard, clock), value) for kind, value in messages],
                                  step=step)

    async def _replies(self, shards: list[int], clock: int, reply: str, step: int) -> list[Any]:
        """The ``reply`` of every shard of ``shards`` at ``clock``, in one ``recv_many``
        (all or nothing); ``ShardRestarted`` if one of them greeted us from a new
        incarnation meanwhile."""
        restarted: list[asyncio.Future[Any]] = []
        for shard in shards:
            fut = self._next_hello[shard]
            if fut is None or fut.done():
                raise ShardRestarted(f"PS shard {shard} restarted")
            restarted.append(fut)
        answer = asyncio.ensure_future(self.node.recv_many(
            [self._edge(reply, s, clock) for s in shards], step=step, timeout=self.timeout))
        try:
            await asyncio.wait([answer, *restarted], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not answer.done():
                answer.cancel()
                await asyncio.gather(answer, return_exceptions=True)
        if answer.cancelled():
            raise ShardRestarted("a PS shard restarted")
        try:
            return answer.result()
        except TimeoutError as exc:
            # rvz's own message names the keys, not what they mean here.
            channel = {PULL_ROWS: "rows of its pull", READ_ROWS: "rows of its read"}.get(
                reply, "acknowledgement of its push")
            silent = self._silent(shards, clock, reply, str(exc))
            raise TimeoutError(f"worker {self.worker}: no {channel} at clock {clock} from PS "
                               f"shard{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} "
                               f"within {self.timeout:g} s{FRESH_HINT}") from None

    def _silent(self, shards: list[int], clock: int, reply: str, message: str) -> list[int]:
        """The shards whose ``reply`` a timed-out ``recv_many`` still waited for: rvz names the
        missing keys (the first three) in its message; all of ``shards`` if it names none."""
        named = [s for s in shards if str(self._edge(reply, s, clock)) in message]
        return named if named and "more" not in message.rsplit("waiting for", 1)[-1] else shards

    async def _round(self, channel: str, clock: int, messages: list[list[tuple[str, Any]]],
                     reply: str) -> list[Any]:
        """Send ``messages[s]`` to every shard ``s`` and return their ``reply`` values, in
        shard order, across restarts.

        The usual case is one send per shard and one ``recv_many`` for all the replies, in
        this task. When a shard fails, each shard finishes on its own: the ones that got
        their messages are only waited for; the others are resynced and sent them again.
        """
        n = self.num_shards
        step = (read_step_id if channel == "read" else step_id)(self.worker, clock)
        inflight = self._inflight[channel]
        for shard in range(n):
            inflight[shard] = clock
        try:
            epochs = list(self.epoch)  # the incarnation each shard's messages went to
            sent = [False] * n
            for shard in range(n):
                try:
                    await self._send(shard, clock, messages[shard], step)
                    sent[shard] = True
                except (rvz.PeerLost, ShardRestarted):
                    pass
            if all(sent):
                try:
                    return await self._replies(list(range(n)), clock, reply, step)
                except (rvz.PeerLost, ShardRestarted):
                    pass  # nothing was taken: every shard finishes on its own below
            return list(await asyncio.gather(*(
                self._finish(s, clock, messages[s], reply, step, epochs[s], sent[s]) for s in range(n))))
        finally:
            for shard in range(n):
                inflight.pop(shard, None)

    async def _finish(self, shard: int, clock: int, messages: list[tuple[str, Any]], reply: str,
                      step: int, epoch: int, sent: bool) -> Any:
        """``shard``'s reply after a failed round: its messages went to incarnation ``epoch``
        if ``sent``; resync and send again as often as the shard restarts."""
        while True:
            try:
                if not sent or self.epoch[shard] != epoch:
                    epoch = self.epoch[shard]
                    await self._send(shard, clock, messages, step)
                    sent = True
                return (await self._replies([shard], clock, reply, step))[0]
            except (rvz.PeerLost, ShardRestarted):
                await self._resync(shard, epoch)
                sent = False

    def _take_step(self, channel: str, step: int | None) -> int:
        # Taken before the first await: concurrent calls still get distinct, ordered steps.
        if self.closed:
            raise RuntimeError("the PS client is closed")
        expected = self.next_step[channel]
        if step is not None and step != expected:
            raise ValueError(f"{channel} step {step} out of order: the shards expect step {expected}")
        self.next_step[channel] = expected + 1
        return expected

    # -- pull ------------------------------------------------------------------------------

    async def pull(self, ids: dict[str, Any], step: int | None = None, *,
                   create: bool = True) -> dict[str, np.ndarray]:
        """Rows of several tables at once: ``{name: ids (any shape)}`` -> ``{name: rows}``
        (``ids.shape + (dim,)``); tables left out get nothing. With ``create=False`` (an
        evaluation read) the shards create no row: absent ids read as zeros."""
        clock = self._take_step("lookup", step)
        await self.connect()
        return await self._by_table(ids, lambda unique: self._pull_unique(unique, clock, create))

    async def _by_table(self, ids: dict[str, Any], fetch: Any) -> dict[str, np.ndarray]:
        return await by_table(self.dims, ids, fetch)

    def _split(self, unique: list[np.ndarray]) -> list[list[np.ndarray]] | None:
        """For each shard, the positions in each table's ids that it owns, in order (None:
        one shard owns everything). One compiled pass per table (sparse.shard_of's hash)."""
        n = self.num_shards
        if n == 1:
            return None
        out: list[list[np.ndarray]] = [[] for _ in range(n)]
        for u in unique:
            order = np.empty(len(u), dtype=np.int64)
            bounds = np.empty(n + 1, dtype=np.int64)
            shard_split(u, n, SHARD_SALT, order, bounds)
            for s in range(n):
                out[s].append(order[bounds[s]:bounds[s + 1]])
        return out

    async def _pull_unique(self, unique: list[np.ndarray], clock: int,
                           create: bool = True) -> list[np.ndarray]:
        return await self._fetch_unique(unique, clock, "lookup", PULL_IDS, create, PULL_ROWS)

    async def _fetch_unique(self, unique: list[np.ndarray], clock: int, channel: str, kind: str,
                            create: bool, reply: str) -> list[np.ndarray]:
        """Rows of each table's unique ids, from their shards over ``channel``."""
        positions = self._split(unique)
        dims = [self.dims[n] for n in self.names]
        if positions is None:
            messages = [[(kind, pack_ids(unique, create))]]
        else:
            messages = [[(kind, pack_ids([u[p] for u, p in zip(unique, where, strict=True)], create))]
                        for where in positions]
        replies = await self._round(channel, clock, messages, reply)
        if positions is None:  # the shard's rows are the answer, as they are
            reply = replies[0]
            if isinstance(reply, np.ndarray) and not reply.flags.writeable:
                reply = reply.copy()  # callers get arrays of their own, as from the scatter
            return unpack_rows(reply, [len(u) for u in unique], dims)
        out = [np.empty((len(u), d), dtype=np.float32) for u, d in zip(unique, dims, strict=True)]
        for where, rows in zip(positions, replies, strict=True):
            for t, part in enumerate(unpack_rows(rows, [len(p) for p in where], dims)):
                scatter_rows(out[t], where[t], part)  # out[t][where[t]] = part, row by row
        return out

    async def lookup(self, ids: np.ndarray, step: int | None = None, *, create: bool = True) -> np.ndarray:
        """Embeddings of ``ids`` of the first table (any shape, repeats allowed);
        ``create=False``: an evaluation read (see ``pull``)."""
        return (await self.pull({self.names[0]: ids}, step, create=create))[self.names[0]]

    async def lookup_unique(self, unique: np.ndarray, step: int | None = None, *,
                            create: bool = True) -> np.ndarray:
        """Rows (``[len(unique), dim]``) of ids the caller already made unique (first
        table); ``create=False``: an evaluation read (see ``pull``)."""
        clock = self._take_step("lookup", step)
        await self.connect()
        parts = [as_ids(unique)] + [np.zeros(0, dtype=np.int64)] * (len(self.names) - 1)
        return (await self._pull_unique(parts, clock, create))[0]

    # -- read-only lookups (no clock) ---------------------------------------------------------

    async def read(self, ids: dict[str, Any]) -> dict[str, np.ndarray]:
        """Rows of several tables (``{name: ids}`` -> ``{name: rows}``, as ``pull``) for an
        evaluation: the shards' current rows, read without a clock (no consistency wait, no
        place among the training steps) and without any effect: no row is created, no access
        counted; an absent id reads as the initial row it would get (zeros under admission)."""
        seq = self._take_step("read", None)
        await self.connect()
        return await self._by_table(ids, lambda unique: self._read_unique(unique, seq))

    async def read_unique(self, unique: np.ndarray) -> np.ndarray:
        """``read`` of ids the caller already made unique, first table: ``[len(unique), dim]``."""
        seq = self._take_step("read", None)
        await self.connect()
        parts = [as_ids(unique)] + [np.zeros(0, dtype=np.int64)] * (len(self.names) - 1)
        return (await self._read_unique(parts, seq))[0]

    async def _read_unique(self, unique: list[np.ndarray], seq: int) -> list[np.ndarray]:
        return await self._fetch_unique(unique, seq, "read", READ_IDS, True, READ_ROWS)

    # -- push ------------------------------------------------------------------------------

    async def push_tables(self, ids: dict[str, Any], grads: dict[str, Any],
                          step: int | None = None) -> np.ndarray:
        """Gradients for several tables at once (repeats summed); returns when every shard
        applied them: ``[num_shards, num_tables]`` global steps after the update."""
        clock = self._take_step("push", step)
        await self.connect()
        unique, summed = [], []
        for name in self.names:
            dim = self.dims[name]
            if name in ids:
                g = np.asarray(grads[name], dtype=np.float32).reshape(-1, dim)
                u, g = sum_by_id(np.asarray(ids[name]), g)
            else:
                u, g = np.zeros(0, dtype=np.int64), np.zeros((0, dim), dtype=np.float32)
            unique.append(u)
            summed.append(g)
        return await self._push_unique(unique, summed, clock)

    async def _push_unique(self, unique: list[np.ndarray], grads: list[np.ndarray],
                           clock: int) -> np.ndarray:
        positions = self._split(unique)
        if positions is None:
            messages = [[(PUSH_IDS, pack_ids(unique)), (PUSH_GRADS, pack_rows(grads))]]
        else:
            messages = []
            for where in positions:
                ids = pack_ids([u[p] for u, p in zip(unique, where, strict=True)])
                # The shard's gradient rows, gathered straight into the message.
                packed = np.empty(sum(len(p) * g.shape[1] for g, p in zip(grads, where, strict=True)),
                                  dtype=np.float32)
                start = 0
                for g, p in zip(grads, where, strict=True):
                    size = len(p) * g.shape[1]
                    gather_rows(np.ascontiguousarray(g, dtype=np.float32), p,
                                packed[start:start + size].reshape(len(p), g.shape[1]))
                    start += size
                messages.append([(PUSH_IDS, ids), (PUSH_GRADS, packed)])
        acks = await self._round("push", clock, messages, PUSH_ACK)
        return np.stack([np.asarray(a, dtype=np.int64) for a in acks])

    async def push(self, ids: np.ndarray, grads: np.ndarray, step: int | None = None) -> np.ndarray:
        """Push gradients of ``ids`` of the first table (repeats summed)."""
        return await self.push_tables({self.names[0]: ids}, {self.names[0]: grads}, step)

    async def push_unique(self, unique: np.ndarray, grads: np.ndarray,
                          step: int | None = None) -> np.ndarray:
        """Push one gradient row per unique id of the first table; returns once every shard
        applied it (``[num_shards, num_tables]`` global steps)."""
        clock = self._take_step("push", step)
        await self.connect()
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        unique = as_ids(unique)
        if grads.shape != (len(unique), self.dim):
            raise ValueError(f"gradients {grads.shape} do not match {len(unique)} ids of dim {self.dim}")
        rest = len(self.names) - 1
        return await self._push_unique(
            [unique] + [np.zeros(0, dtype=np.int64)] * rest,
            [grads] + [np.zeros((0, self.dims[n]), dtype=np.float32) for n in self.names[1:]], clock)

    # -- failures and the end ------------------------------------------------------------------

    async def abort_step(self, clock: int) -> None:
        """Give up this worker's step ``clock`` (pull or push failed or never happened): every
        shard drops it (rvz step clean-up) and counts it as an empty push."""
        await self.node.step(step_id(self.worker, clock)).cleanup(
            f"worker {self.worker} gave up its step {clock}")
        for channel in TRAINING:
            if self.next_step[channel] == clock:
                self.next_step[channel] = clock + 1

    async def close(self) -> None:
        """Tell every shard this worker is done: ``END`` on both channels."""
        if self.closed:
            return
        self.closed = True
        try:
            try:
                await self.connect()  # a shard serves until every worker said END
            except (rvz.RvzError, TimeoutError):
                return  # no shard to tell
            # Every live shard hears END even when another one is gone (each serves until
            # every worker said it); the first failure is raised afterwards.
            failure: BaseException | None = None
            for shard in range(self.num_shards):
                for kind, channel in ((PULL_IDS, "lookup"), (PUSH_IDS, "push"), (READ_IDS, "read")):
                    clock = self.next_step[channel]
                    step = (read_step_id if channel == "read" else step_id)(self.worker, clock)
                    try:
                        await self.node.send(self._edge(kind, shard, clock), END, step=step)
                    except (rvz.RvzError, TimeoutError) as exc:
                        failure = failure or exc
                        break  # this shard is gone: its other channel would fail the same way
            if failure is not None:
                raise failure
        finally:
            for task in self._watchers:
                task.cancel()
            await asyncio.gather(*self._watchers, return_exceptions=True)
            if self._greeted is not None and not self._greeted.done():
                self._greeted.cancel()

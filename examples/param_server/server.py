"""One PS shard: serves pulls and applies pushes for every worker, over rvz.

The shard holds one or more named ``EmbeddingTable`` (each its own dim and optimizer). For
each worker it runs two loops, one per channel of protocol.py, clock 0, 1, 2, ... until the
worker sends ``END`` or is lost.

Consistency (``consistency=``):

* ``"asp"``: pulls never wait; each push is one ``apply_gradients`` call.
* ``"ssp"`` with ``staleness=s``: a worker's pull at clock c waits until every active worker
  has pushed clocks below c - s; pushes apply as they come.
* ``"bsp"``: s = 0, and the pushes of one clock are applied together, once every active
  worker's push of that clock is in: their ids and gradients concatenated in worker order,
  one ``apply_gradients`` call per clock. That is exactly a sequential run on the combined
  batch, whatever order the pushes arrived in.

A step that a worker cleans up (rvz ``Aborted`` on one of its keys) counts as an empty push
for that clock, so nobody waits for it; a worker that leaves (``END``) or is lost
(``PeerLost``) no longer counts for the barrier. With ``worker_rejoin`` (asp and ssp), a lost
worker's place waits that many seconds for a new process of the task: the shard greets it
with the clock the lost one's pushes reached, and serves it from the clock it answers (see
protocol.py) while the others go on meanwhile; it counts for the consistency bound again
from there.

Under bsp with ``worker_rejoin`` the lost worker keeps its place in the barrier: no clock is
applied without its push, so the others wait. The new process replays from the clock it
names (its own journal's), which may be below what the shard already has of it: a push the
shard already holds (applied, or waiting in the barrier) is acknowledged and not applied
again, and a pull the shard already answered gets the same reply (the last two are kept),
since the rows may have changed since. If no new process joins in time, the shard applies
nothing more, cleans up the other workers' clocks in flight with an error naming the worker
and its clock, and reports that error.

Every ``checkpoint_every`` clocks (of the slowest worker) the shard saves its tables to
``checkpoint_dir``, incrementally except every ``full_every``-th save; ``evict_every`` clocks
it runs each table's eviction policy. A worker that ends its run (``END`` on its push
channel) is noted there too (``FINISHED.json``): a shard restarted from that directory
greets it no more and waits for no rejoin of it.

A peer that cannot talk to the shard (a worker with the wrong secret or rvz version, or
traffic that is not rvz at all) is logged and waited out: the shard retries that worker's
channel until a well-configured process serves as that worker, and goes on serving the
others meanwhile. A message that does not decode is logged and counts as an aborted step.
Every ``progress_every`` seconds the shard logs where its clocks stand.

Replicas (``replicas``, tasks of the ``replica`` job): the shard answers each replica's
delta asks (protocol.py) with what changed in its tables since the versions the replica
names, computed in one go between two updates, so every delta brings a copy to one state the
shard was in. A replica's loop ends with the shard's service (or at the replica's END).

Whole-job cuts (``cut_every``, bsp only; see cut.py): when the pushes of clock C - 1 are
applied and C is a multiple of ``cut_every``, the shard copies its tables out at once (before
it acknowledges clock C - 1, so before any worker pulls again) and writes the copy in a
helper thread while it goes on serving. A shard started from a cut at C (``start_clock``)
serves every worker from clock C.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import rvz

from ..common import run_together, until_set
from .cut import write_shard_part
from .protocol import (
    DELTA_ASK,
    DELTA_META,
    DELTA_ROWS,
    HELLO,
    JOIN,
    KNOCK,
    PULL_IDS,
    PULL_ROWS,
    PUSH_ACK,
    PUSH_GRADS,
    PUSH_IDS,
    READ_IDS,
    READ_ROWS,
    REJOIN,
    REPLICA_JOB,
    WORKER_JOB,
    edge,
    frame,
    is_end,
    pack_delta,
    pack_rows,
    read_step_id,
    step_id,
    unpack_ids,
    unpack_pull,
    unpack_rows,
)
from .table import EmbeddingTable, PendingSave, RowCopy, rows_digest

log = logging.getLogger(__name__)

CONSISTENCY = ("asp", "ssp", "bsp")

# What a misconfigured peer raises (a wrong secret, another rvz version, not rvz at all): the
# shard logs it and tries again every ``REFUSED_RETRY`` seconds, for as long as it serves.
REFUSED = (rvz.AuthError, rvz.ProtocolError)
REFUSED_RETRY = 0.5
# Rows a checkpoint or cut copies per loop pass: a small part of a pull's time (about 0.06 ms
# at dim 16 with Adam, faulting in the copy's pages included).
COPY_ROWS = 256
# A loop pass longer than this ran something besides the copy (a request, most likely): the
# copy waits for a pass that ran nothing else, but never more than ``COPY_WAIT`` seconds.
COPY_IDLE = 1e-4
COPY_WAIT = 0.002  # under constant load: 1M rows in about 8 s, 3% of the loop
# After ``COPY_BURST`` seconds of copying the loop sleeps ``COPY_PAUSE``: on a busy machine
# the scheduler preempts a thread that never sleeps, for several ms, whatever it serves.
COPY_BURST, COPY_PAUSE = 1e-3, 2e-4
SKIP, STOP = object(), object()  # what ``_request`` returns instead of a request
FINISHED = "FINISHED.json"  # in a shard's checkpoint directory: the workers that ended there


async def _copy_out(copies: Iterable[RowCopy | PendingSave]) -> None:
    """Take ``copies`` a slice per loop pass, and only in a pass with nothing else to run
    (as far as a pass's length tells): requests go first, a slice waits for them; with a
    short sleep every ``COPY_BURST`` seconds."""
    loop = asyncio.get_running_loop()
    for copy in copies:
        last = burst = loop.time()
        while True:
            started = loop.time()
            await asyncio.sleep(0)
            now = loop.time()
            if now - started > COPY_IDLE and now - last < COPY_WAIT:
                continue
            if copy.step(COPY_ROWS):
                break
            last = loop.time()
            if last - burst > COPY_BURST:
                await asyncio.sleep(COPY_PAUSE)
                burst = loop.time()


@dataclass
class ShardStats:
    lookups: int = 0
    ids_looked_up: int = 0
    pushes: int = 0
    ids_pushed: int = 0
    aborted_steps: int = 0
    lost_workers: int = 0
    reads: int = 0              # read-only lookups (no clock) served
    refused: int = 0            # failures of a misconfigured peer, waited out
    bad_messages: int = 0       # messages that did not decode (counted as aborted steps)
    checkpoints: list[str] = field(default_factory=list)
    evicted: int = 0
    max_staleness: int = 0  # the largest c - (slowest clock) a pull was served at
    served: list[tuple[int, int, int]] = field(default_factory=list)  # (worker, clock, slowest)
    deltas: int = 0             # deltas sent to replicas
    # With ``record``: (replica, table versions, rows_digest) of each delta, as it was sent.
    delta_digests: list[tuple[int, tuple[int, ...], str]] = field(default_factory=list)


class ShardServer:
    """Serves ``tables`` (one table, or a dict name -> table) on ``node`` (a ps task) to
    ``num_workers`` workers; see the module doc for the options."""

    def __init__(self, node: rvz.Node, tables: EmbeddingTable | dict[str, EmbeddingTable],
                 num_workers: int, *, worker_job: str = WORKER_JOB, consistency: str = "asp",
                 staleness: int = 0, evict_every: int = 0, checkpoint_dir: str | Path | None = None,
                 checkpoint_every: int = 0, full_every: int = 4, epoch: int = 0,
                 rejoin_timeout: float = 30.0, record: bool = False, fsync: bool = True,
                 progress_every: float = 0.0, start_clock: int = 0, cut_every: int = 0,
                 cut_root: str | Path | None = None, replicas: int = 0,
                 replica_job: str = REPLICA_JOB, worker_rejoin: float = 0.0) -> None:
        if consistency not in CONSISTENCY:
            raise ValueError(f"consistency must be one of {CONSISTENCY}, not {consistency!r}")
        self.node = node
        self.shard = node.task
        self.tables = tables if isinstance(tables, dict) else {"default": tables}
        self.names = list(self.tables)
        self.dims = [self.tables[n].dim for n in self.names]
        self.num_workers = num_workers
        self.worker_job = worker_job
        self.consistency = consistency
        self.staleness = 0 if consistency == "bsp" else staleness
        self.evict_every = evict_every
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.full_every = max(1, full_every)
        self.epoch = epoch
        self.rejoin_timeout = rejoin_timeout
        self.record = record
        self.fsync = fsync
        self.stats = ShardStats()
        self.progress_every = progress_every
        self._next_progress = time.monotonic() + progress_every
        if cut_every and consistency != "bsp":
            raise ValueError("whole-job cuts need bsp: with asp or ssp no clock is one state")
        self.start_clock = start_clock
        self.cut_every = cut_every
        self.cut_root = Path(cut_root) if cut_root is not None else None
        self._writes: list[asyncio.Future[Any]] = []
        self._checkpointing: asyncio.Future[list[str]] | None = None
        self.replicas = replicas
        self.worker_rejoin = worker_rejoin
        self.generation = [0] * num_workers  # processes of each worker task after the first
        self._lost_event: list[asyncio.Event | None] = [None] * num_workers
        # bsp rejoin: each worker's last answered pulls (clock -> reply), for a replay.
        self._replay = consistency == "bsp" and worker_rejoin > 0
        self._answered: list[dict[int, np.ndarray]] = [{} for _ in range(num_workers)]
        self._serving: list[int | None] = [None] * num_workers  # the nonce of each worker's process
        self.failed: str | None = None  # why a bsp job cannot go on (a worker that never came back)
        self.replica_job = replica_job
        self.clock = [start_clock] * num_workers  # pushes done (applied or aborted) per worker
        self.active = set(range(num_workers))
        self._changed: asyncio.Event | None = None
        self._bsp: dict[int, dict[int, tuple[list[np.ndarray], list[np.ndarray]] | None]] = {}
        self._bsp_done: dict[int, asyncio.Future[None]] = {}
        self._housekept = start_clock
        self._saves = 0
        self._rejoining = num_workers if epoch > 0 else 0
        self._finished: dict[int, int] = {}  # worker -> the clock it ended at (its END)
        # Demo hook (``demo --kill-shard``): this process kills itself with SIGKILL once the
        # slowest worker reached this clock, a crash at a known point of the run.
        self.crash_at: int | None = None

    @property
    def store(self) -> EmbeddingTable:
        """The first table (the only one in single-table services)."""
        return self.tables[self.names[0]]

    def _edge(self, kind: str, worker: int, clock: int) -> rvz.Key:
        return edge(kind, worker, self.shard, clock, frame(self.epoch, self.generation[worker]),
                    self.worker_job)

    def _hello(self, worker: int) -> np.ndarray:
        return np.array([self.epoch, *[t.global_step for t in self.tables.values()],
                         self.generation[worker], self.clock[worker]], dtype=np.int64)

    # -- life -----------------------------------------------------------------------------------

    @property
    def who(self) -> str:
        """How log lines and errors name this shard."""
        return f"ps {self.shard} epoch {self.epoch}"

    async def serve(self) -> ShardStats:
        """Greet every worker, then serve until each has left."""
        self._changed = asyncio.Event()
        self._finished = self._load_finished()
        log.info("%s: serving %d workers, tables %s, %s", self.who, self.num_workers,
                 ", ".join(f"{n} (dim {t.dim}, {t.optimizer.name}, {len(t)} rows)"
                           for n, t in self.tables.items()), self.consistency)
        replicas = [asyncio.ensure_future(self._serve_replica(r)) for r in range(self.replicas)]
        if self._replay:
            replicas += [asyncio.ensure_future(self._watch_knocks(w)) for w in range(self.num_workers)]
        try:
            await run_together(*(self._serve_worker(w) for w in range(self.num_workers)))
        finally:
            for task in replicas:
                task.cancel()
            await asyncio.gather(*replicas, return_exceptions=True)
            await asyncio.gather(*self._writes)  # the last cut is on disk before we return
        log.info("%s: every worker left; %d pulls, %d pushes served", self.who, self.stats.lookups,
                 self.stats.pushes)
        return self.stats

    async def _patient(self, worker: int, clock: int, what: str, call: Any) -> Any:
        """``await call()``, again every ``REFUSED_RETRY`` s while the process serving as
        ``worker`` is misconfigured (logged once per kind of failure)."""
        seen: set[type] = set()
        while True:
            try:
                return await call()
            except REFUSED as exc:
                self.stats.refused += 1
                if type(exc) not in seen:
                    seen.add(type(exc))
                    log.warning("%s: worker %d (clock %d, %s) refused: %s: %s; still serving the "
                                "others, and waiting for a worker %d that is configured like this "
                                "shard", self.who, worker, clock, what, type(exc).__name__, exc, worker)
                await asyncio.sleep(REFUSED_RETRY)

    def _load_finished(self) -> dict[int, int]:
        """The workers that ended their run before this shard restarted (none at epoch 0,
        a new run: what an earlier run in the directory noted is dropped)."""
        path = self.checkpoint_dir / FINISHED if self.checkpoint_dir is not None else None
        if path is None or not path.exists():
            return {}
        if self.epoch == 0:
            path.unlink()
            return {}
        try:
            return {int(w): int(c) for w, c in json.loads(path.read_text()).items()}
        except (ValueError, AttributeError) as exc:
            log.warning("%s: %s is unreadable (%s); every worker is waited for", self.who, path, exc)
            return {}

    def _note_finished(self, worker: int, clock: int) -> None:
        """Note next to the checkpoints that ``worker`` ended its run at ``clock``. Not
        flushed to disk: a note lost in a crash only costs a restarted shard a wait of
        ``rejoin_timeout`` for that worker."""
        self._finished[worker] = clock
        if self.checkpoint_dir is None:
            return
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        path = self.checkpoint_dir / FINISHED
        tmp = path.with_name(f".{FINISHED}-{os.getpid()}")
        tmp.write_text(json.dumps({str(w): c for w, c in sorted(self._finished.items())}))
        os.replace(tmp, path)

    async def _serve_worker(self, worker: int) -> None:
        if worker in self._finished:
            # It ended its run before this shard restarted: it will never rejoin.
            log.info("%s: worker %d finished at clock %d before this restart; not waiting for it",
                     self.who, worker, self._finished[worker])
            self.clock[worker] = max(self.clock[worker], self._finished[worker])
            self._leave(worker)
            self._rejoined()
            return
        hello = self._hello(worker)
        key = edge(HELLO, worker, self.shard, self.epoch, 0, self.worker_job)
        await self._patient(worker, 0, "greeting", lambda: self.node.send(key, hello))
        pull_clock = push_clock = self.start_clock
        read_seq = 0
        if self.epoch > 0:
            # Restarted: until the worker says where its clocks stand, it counts as clock 0
            # (the consistency bound then holds back the others, never lets them run ahead).
            pull_clock, push_clock, read_seq = await self._rejoin(worker)
            self._rejoined()
            if push_clock < 0:
                self._lost(worker, None)  # _rejoin said why
                return
            self.clock[worker] = push_clock
            self._wake()
            self._bsp_recheck()
        if not self.worker_rejoin:
            await run_together(self._serve_pulls(worker, pull_clock),
                               self._serve_pushes(worker, push_clock),
                               self._serve_pulls(worker, read_seq, read=True))
            return
        while await self._serve_process(worker, pull_clock, push_clock, read_seq):
            pull_clock = push_clock = await self._next_process(worker)
            read_seq = 0
            if pull_clock < 0:
                return

    async def _serve_process(self, worker: int, pull_clock: int, push_clock: int, read_seq: int) -> bool:
        """Serve one process of ``worker`` until it leaves (False) or is lost (True: the
        other loops of that process are stopped at once)."""
        lost = self._lost_event[worker] = asyncio.Event()
        loops = asyncio.ensure_future(run_together(self._serve_pulls(worker, pull_clock),
                                                   self._serve_pushes(worker, push_clock),
                                                   self._serve_pulls(worker, read_seq, read=True)))
        await until_set(loops, lost)
        if not loops.cancelled() and loops.exception() is not None:
            raise loops.exception()  # type: ignore[misc]
        return lost.is_set()

    async def _next_process(self, worker: int) -> int:
        """Greet the next process of ``worker`` (its next generation) and return the clock it
        continues at; -1 if none joins within ``worker_rejoin`` seconds."""
        self.generation[worker] += 1
        hello = self._hello(worker)
        key = edge(HELLO, worker, self.shard, self.epoch, 0, self.worker_job)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.worker_rejoin
        log.warning("%s: waiting up to %g s for a new process of worker %d (its pushes stand at clock "
                    "%d)", self.who, self.worker_rejoin, worker, self.clock[worker])
        try:
            while True:
                try:
                    await self.node.send(key, hello, timeout=max(0.0, deadline - loop.time()))
                    break
                except (rvz.PeerLost, *REFUSED):
                    if loop.time() >= deadline:
                        raise TimeoutError("no new process") from None
                    await asyncio.sleep(0.05)
            msg = await self.node.recv(self._edge(JOIN, worker, 0), timeout=max(0.0, deadline - loop.time()))
            clock = int(msg[0])
            if len(msg) > 1:
                self._serving[worker] = int(msg[1])
        except (TimeoutError, rvz.PeerLost, *REFUSED, TypeError, ValueError, IndexError) as exc:
            if self._replay:
                await self._give_up(worker)
                return -1
            log.warning("%s: no new process of worker %d joined within %g s (%s: %s); serving without it",
                        self.who, worker, self.worker_rejoin, type(exc).__name__, exc)
            return -1
        log.warning("%s: worker %d's process %d joined at clock %d", self.who, worker,
                    self.generation[worker], clock)
        if self._replay:
            # It replays from ``clock``; what the shard holds of it beyond stays (its pushes
            # are acknowledged, not applied again, when they come back).
            return clock
        self.clock[worker] = max(clock, self.clock[worker])
        self.active.add(worker)
        self._wake()
        return self.clock[worker]

    async def _watch_knocks(self, worker: int) -> None:
        """bsp rejoin: a knock from a process of ``worker`` other than the one served means
        that one is gone (see protocol.py)."""
        seen: set[int] = set()
        while True:
            try:
                msg = await self.node.recv(edge(KNOCK, worker, self.shard, 0, 0, self.worker_job))
                nonce = int(msg[0])
            except (rvz.PeerLost, *REFUSED):
                await asyncio.sleep(REFUSED_RETRY)
                continue
            except (TypeError, ValueError, IndexError):
                continue
            if self._serving[worker] is None and not seen:
                self._serving[worker] = nonce  # the job's first process of the task
            elif nonce not in seen and nonce != self._serving[worker]:
                log.warning("%s: a new process of worker %d knocked; the one served is gone", self.who,
                            worker)
                self._lost(worker, None)
            seen.add(nonce)

    async def _give_up(self, worker: int) -> None:
        """bsp: no new process of ``worker`` joined in time. Nothing is applied any more (a
        clock without its push would be a partial step); the others' clocks in flight are
        cleaned up with the reason, so that they fail at once, naming it."""
        self.failed = (f"worker {worker} was lost at PS clock {self.clock[worker]} and no new process of "
                       f"it joined within {self.worker_rejoin:g} s (ps {self.shard})")
        log.error("%s: %s; the job cannot go on", self.who, self.failed)
        self._leave(worker)
        for other in sorted(self.active):
            try:
                await self.node.step(step_id(other, self.clock[other])).cleanup(self.failed)
            except rvz.RvzError:
                pass  # that worker is gone too

    async def _rejoin(self, worker: int) -> tuple[int, int, int]:
        """The clocks (pull, push) and read sequence ``worker`` continues at after this shard
        restarted ((-1, -1, -1): gone)."""
        try:
            msg = await self.node.recv(self._edge(REJOIN, worker, 0), timeout=self.rejoin_timeout)
            pull, push, read = int(msg[0]), int(msg[1]), int(msg[2])
        except (TimeoutError, rvz.PeerLost, *REFUSED, TypeError, ValueError, IndexError) as exc:
            log.warning("%s: worker %d did not rejoin within %g s (%s: %s); serving without it",
                        self.who, worker, self.rejoin_timeout, type(exc).__name__, exc)
            return -1, -1, -1
        log.info("%s: worker %d rejoined at pull clock %d, push clock %d", self.who, worker, pull, push)
        return pull, push, read

    def _rejoined(self) -> None:
        self._rejoining -= 1
        if self._rejoining == 0:
            # Every worker said where it stands: count housekeeping periods from there. From
            # 0, the first push after a restart would look like a period boundary and save
            # (or evict) at once, whatever ``checkpoint_every`` says.
            slowest = self.slowest()
            self._housekept = max(self._housekept, 0 if slowest >= 1 << 62 else slowest)

    def _leave(self, worker: int) -> None:
        self.active.discard(worker)
        self._wake()
        self._bsp_recheck()

    def _bsp_recheck(self) -> None:
        for clock in list(self._bsp):
            self._bsp_maybe_apply(clock)

    def _wake(self) -> None:
        assert self._changed is not None
        self._changed.set()
        self._changed = asyncio.Event()

    def slowest(self) -> int:
        return min((self.clock[w] for w in self.active), default=1 << 62)

    # -- pulls ----------------------------------------------------------------------------------

    async def _request(self, worker: int, clock: int, what: str, kind: str, step: int) -> Any:
        """The next ``kind`` message of ``worker`` at ``clock`` (a pull's or a read's ids),
        decoded: ``SKIP`` when the worker cleaned that step up or sent what does not decode,
        ``STOP`` at its END or when it is lost (``_lost`` for a pull)."""
        key = self._edge(kind, worker, clock)
        try:
            msg = await self._patient(worker, clock, what, lambda: self.node.recv(key, step=step))
        except rvz.Aborted:
            return SKIP  # the worker cleaned this step up before (or while) sending it
        except rvz.PeerLost:
            if kind == PULL_IDS:
                self._lost(worker, clock)  # (a read's loss: the pull and push loops see it too)
            return STOP
        if is_end(msg):
            return STOP
        try:
            return unpack_pull(msg, len(self.names))
        except ValueError as exc:
            self._bad_message(worker, clock, what, exc)
            return SKIP

    async def _serve_pulls(self, worker: int, clock: int, read: bool = False) -> None:
        """``worker``'s pulls from ``clock`` on; with ``read``, its read-only lookups instead
        (numbered by their own sequence): answered at once from the current rows
        (``EmbeddingTable.peek``), whatever the consistency bound, and they change nothing."""
        kinds = (READ_IDS, READ_ROWS) if read else (PULL_IDS, PULL_ROWS)
        while True:
            step = (read_step_id if read else step_id)(worker, clock)
            request = await self._request(worker, clock, "read" if read else "pull", kinds[0], step)
            if request is STOP:
                return
            if request is SKIP:
                clock += 1
                continue
            parts, create = request
            answered = self._answered[worker].get(clock) if not read and self._replay else None
            if answered is not None:
                # A replayed pull: the rows may have changed since; the reply may not.
                rows_message = answered
            elif read:
                rows = [self.tables[name].peek(ids) for name, ids in zip(self.names, parts, strict=True)]
                self.stats.reads += 1
            else:
                if self.consistency != "asp":
                    while self.slowest() < clock - self.staleness:
                        assert self._changed is not None
                        await self._changed.wait()
                slowest = self.slowest()
                self.stats.max_staleness = max(self.stats.max_staleness, clock - min(slowest, clock))
                if self.record:
                    self.stats.served.append((worker, clock, slowest))
                rows = [self.tables[name].lookup(ids, create)
                        for name, ids in zip(self.names, parts, strict=True)]
                self.stats.lookups += 1
                self.stats.ids_looked_up += sum(len(p) for p in parts)
            if answered is None:
                rows_message = pack_rows(rows)
                if self._replay and not read:
                    kept = self._answered[worker]
                    kept[clock] = rows_message
                    kept.pop(clock - 2, None)  # a replay starts at most one pull back
            try:
                await self.node.send(self._edge(kinds[1], worker, clock), rows_message, step=step)
            except rvz.Aborted:
                pass
            except rvz.PeerLost:
                if not read:
                    self._lost(worker, clock)
                return
            clock += 1

    # -- replicas -------------------------------------------------------------------------------

    async def _serve_replica(self, replica: int) -> None:
        """Answer ``replica``'s delta asks, one at a time, until its END; a new process of
        the replica numbers its asks from 0 again."""
        seq = 0
        while True:
            try:
                ask = await self.node.recv(edge(DELTA_ASK, replica, self.shard, seq, 0, self.replica_job))
            except rvz.PeerLost:
                seq = 0
                await asyncio.sleep(REFUSED_RETRY)  # (no busy loop while it stays away)
                continue
            except REFUSED as exc:
                log.warning("%s: replica %d refused: %s: %s", self.who, replica, type(exc).__name__, exc)
                await asyncio.sleep(REFUSED_RETRY)
                continue
            if is_end(ask):
                return
            try:
                session, since = self._parse_ask(ask)
            except ValueError as exc:
                self.stats.bad_messages += 1
                log.warning("%s: replica %d's ask %d does not decode (%s); ignored", self.who, replica,
                            seq, exc)
                seq += 1
                continue
            parts = []
            for name, version in zip(self.names, since, strict=True):
                table = self.tables[name]
                ids, rows, removed, full = table.delta_since(version)
                parts.append((full, table.version, ids, rows, removed))
            if self.record:
                self.stats.delta_digests.append(
                    (replica, tuple(t.version for t in self.tables.values()), self.rows_digest()))
            meta, rows = pack_delta(self.epoch, parts)
            try:
                await self.node.send_many(
                    [(edge(DELTA_META, replica, self.shard, seq, session, self.replica_job), meta),
                     (edge(DELTA_ROWS, replica, self.shard, seq, session, self.replica_job), rows)])
            except rvz.PeerLost:
                seq = 0
                continue
            self.stats.deltas += 1
            seq += 1

    def _parse_ask(self, ask: Any) -> tuple[int, list[int]]:
        if (not isinstance(ask, np.ndarray) or ask.dtype != np.int64 or ask.shape != (2 + len(self.names),)
                or ask[1] != len(self.names) or ask[0] < 0):
            raise ValueError(f"expected int64 [session, {len(self.names)}, versions...]")
        return int(ask[0]), [int(v) for v in ask[2:]]

    # -- pushes ---------------------------------------------------------------------------------

    async def _serve_pushes(self, worker: int, clock: int) -> None:
        while True:
            step = step_id(worker, clock)
            update: tuple[list[np.ndarray], list[np.ndarray]] | None
            # Both receives are posted at once: Recv-Driven, the gradients' request then
            # travels with the ids' one instead of a round trip later. END comes alone.
            ids_key, grads_key = self._edge(PUSH_IDS, worker, clock), self._edge(PUSH_GRADS, worker, clock)
            grads_recv = asyncio.ensure_future(self._patient(
                worker, clock, "push", lambda: self.node.recv(grads_key, step=step)))  # noqa: B023
            try:
                msg = await self._patient(worker, clock, "push",
                                          lambda: self.node.recv(ids_key, step=step))  # noqa: B023
                if is_end(msg):
                    await _drop(grads_recv)
                    self._note_finished(worker, clock)
                    self._leave(worker)
                    return
                grads = await grads_recv
                ids = unpack_ids(msg, len(self.names))
                update = ids, unpack_rows(grads, [len(i) for i in ids], self.dims)
            except (rvz.Aborted, ValueError) as exc:
                await _drop(grads_recv)
                update = None  # cleaned up mid-step: an empty push for this clock
                self.stats.aborted_steps += 1
                if isinstance(exc, ValueError):
                    self._bad_message(worker, clock, "push", exc)
            except rvz.PeerLost:
                await _drop(grads_recv)
                self._lost(worker, clock)
                return
            except BaseException:
                await _drop(grads_recv)
                raise
            if self._replay and (clock < self.clock[worker] or worker in self._bsp.get(clock, {})):
                # A replayed push the shard already holds (applied, or in the barrier): the
                # same bits again, so it is acknowledged once its clock is applied, not added.
                if clock >= self.clock[worker]:
                    await asyncio.shield(self._bsp_done[clock])
                update = None
            elif self.consistency == "bsp":
                await self._bsp_push(worker, clock, update)
            elif update is not None:
                for name, ids, grads in zip(self.names, *update, strict=True):
                    self.tables[name].apply_gradients(ids, grads, create=False)
            if update is not None:
                self.stats.pushes += 1
                self.stats.ids_pushed += sum(len(i) for i in update[0])
            self.clock[worker] = max(self.clock[worker], clock + 1)
            self._wake()
            self._housekeeping()
            self._progress()
            ack = np.array([t.global_step for t in self.tables.values()], dtype=np.int64)
            try:
                await self.node.send(self._edge(PUSH_ACK, worker, clock), ack, step=step)
            except rvz.Aborted:
                pass
            except rvz.PeerLost:
                self._lost(worker, clock)
                return
            clock += 1

    async def _bsp_push(self, worker: int, clock: int,
                        update: tuple[list[np.ndarray], list[np.ndarray]] | None) -> None:
        self._bsp.setdefault(clock, {})[worker] = update
        done = self._bsp_done.get(clock)
        if done is None:
            done = self._bsp_done[clock] = asyncio.get_running_loop().create_future()
        self._bsp_maybe_apply(clock)
        # Shielded: the loop of a lost process is cancelled here, and cancelling the shared
        # future would fail every other worker's push of this clock.
        await asyncio.shield(done)

    def _bsp_maybe_apply(self, clock: int) -> None:
        pushes = self._bsp.get(clock, {})
        if self.failed is not None:
            # The job cannot go on: apply nothing more, release whoever waits on the clock.
            self._bsp.pop(clock, None)
            done = self._bsp_done.pop(clock, None)
            if done is not None and not done.done():
                done.set_result(None)
            return
        # Only workers that have not passed ``clock`` push it. In a run without restarts that
        # is every active worker (none passes a clock before it is applied); after this shard
        # restarted, a worker whose ack of ``clock`` the old incarnation sent rejoins one
        # clock ahead of one whose ack was lost, and will never send ``clock`` again.
        if not {w for w in self.active if self.clock[w] <= clock} <= set(pushes):
            return
        del self._bsp[clock]
        for t, name in enumerate(self.names):
            ids = [u[0][t] for w, u in sorted(pushes.items()) if u is not None]
            grads = [u[1][t] for w, u in sorted(pushes.items()) if u is not None]
            dim = self.dims[t]
            self.tables[name].apply_gradients(
                np.concatenate([np.zeros(0, dtype=np.int64), *ids]),
                np.concatenate([np.zeros((0, dim), dtype=np.float32), *grads]), create=False)
        # Applied: each of these pushes is done, even one whose loop a lost process stopped
        # first, so that its next process's replay of it is not applied again.
        for w in pushes:
            self.clock[w] = max(self.clock[w], clock + 1)
        self._wake()
        if self.cut_every and (clock + 1) % self.cut_every == 0:
            self._cut(clock + 1)  # before the acknowledgements: no worker pulls past it
        done = self._bsp_done.pop(clock)
        if not done.done():
            done.set_result(None)

    def _cut(self, clock: int) -> None:
        """This shard's part of the whole-job cut at ``clock``: copied out now, written by a
        helper thread."""
        root = self.cut_root
        assert root is not None
        copies = {name: table.copy_rows() for name, table in self.tables.items()}
        self._writes.append(asyncio.ensure_future(self._write_cut(root, clock, copies)))

    async def _write_cut(self, root: Path, clock: int, copies: dict[str, RowCopy]) -> None:
        started = time.perf_counter()
        try:
            await _copy_out(copies.values())
        except BaseException:
            for copy in copies.values():
                copy.cancel()
            raise
        snapshots = {name: copy.snapshot() for name, copy in copies.items()}

        def write() -> None:
            write_shard_part(root, clock, self.shard, snapshots, fsync=self.fsync)
            log.info("%s: its part of the cut at clock %d is written (%d rows, %.3f s)", self.who, clock,
                     sum(len(s.ids) for s in snapshots.values()), time.perf_counter() - started)
            copies.clear()  # the copies are unmapped here, not on the event loop
            snapshots.clear()

        await asyncio.get_running_loop().run_in_executor(None, write)

    def _lost(self, worker: int, clock: int | None) -> None:
        event = self._lost_event[worker]
        if self._replay and event is not None:
            # bsp: it keeps its place in the barrier while its next process is waited for.
            if not event.is_set():
                self.stats.lost_workers += 1
                log.warning("%s: worker %d lost at clock %d; the barrier waits for its next process",
                            self.who, worker, self.clock[worker])
            event.set()
            return
        if worker in self.active:
            self.stats.lost_workers += 1
        if worker in self.active and clock is not None:
            log.warning("%s: worker %d lost at clock %d; serving the others", self.who, worker, clock)
        self._leave(worker)
        if event is not None:
            event.set()

    def _bad_message(self, worker: int, clock: int, what: str, exc: Exception) -> None:
        self.stats.bad_messages += 1
        log.warning("%s: worker %d's %s at clock %d does not decode (%s); dropped as an aborted "
                    "step", self.who, worker, what, clock, exc)

    def _progress(self) -> None:
        if not self.progress_every or time.monotonic() < self._next_progress:
            return
        self._next_progress = time.monotonic() + self.progress_every
        slowest = self.slowest()
        log.info("%s: slowest worker at clock %s, %d pulls, %d pushes, live rows %s%s", self.who,
                 "-" if slowest >= 1 << 62 else slowest, self.stats.lookups, self.stats.pushes,
                 ", ".join(f"{n} {len(t)}" for n, t in self.tables.items()),
                 f", {self.stats.refused} refused" if self.stats.refused else "")

    # -- housekeeping ---------------------------------------------------------------------------

    def _housekeeping(self) -> None:
        slowest = self.slowest()
        if slowest >= 1 << 62 or slowest <= self._housekept:
            return
        previous, self._housekept = self._housekept, slowest
        if self.crash_at is not None and slowest >= self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.evict_every and slowest // self.evict_every > previous // self.evict_every:
            for table in self.tables.values():
                self.stats.evicted += len(table.evict())
        if (self.checkpoint_dir is not None and self.checkpoint_every
                and slowest // self.checkpoint_every > previous // self.checkpoint_every):
            self.checkpoint()

    def checkpoint(self) -> asyncio.Future[list[str]]:
        """Save every table as it is now (full every ``full_every``-th time, else incremental),
        in the background: the rows are copied a slice per loop pass with nothing else to
        run (copy on write keeps this moment's rows) and written by a helper thread, so
        pulls go on being answered, first.
        Saves are written one after the other; the future gives the entries' names."""
        assert self.checkpoint_dir is not None
        full = self._saves % self.full_every == 0
        self._saves += 1
        pending = {name: table.begin_save(incremental=not full) for name, table in self.tables.items()}
        previous = self._checkpointing
        task = asyncio.ensure_future(self._write_checkpoint(pending, previous))
        self._checkpointing = task
        self._writes.append(task)
        return task

    async def _write_checkpoint(self, pending: dict[str, PendingSave],
                                previous: asyncio.Future[list[str]] | None) -> list[str]:
        started = time.perf_counter()
        root = self.checkpoint_dir
        assert root is not None
        try:
            await _copy_out(pending.values())
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)

            def write() -> list[str]:
                return [save.write(root / name, fsync=self.fsync) for name, save in pending.items()]

            names = await asyncio.get_running_loop().run_in_executor(None, write)
        except BaseException:
            for save in pending.values():
                if save.copy is not None:
                    save.copy.cancel()
            raise
        self.stats.checkpoints.append(f"{names[0]} ({time.perf_counter() - started:.3f} s)")
        log.info("%s: checkpoint %s written in the background (%.3f s)", self.who, names[0],
                 time.perf_counter() - started)
        return names

    def summary(self) -> dict[str, Any]:
        tables = {name: t.stats() for name, t in self.tables.items()}
        first = tables[self.names[0]]
        return {"shard": self.shard, "epoch": self.epoch, "live": first["live"],
                "global_step": first["global_step"], "tables": tables,
                "lookups": self.stats.lookups, "ids_looked_up": self.stats.ids_looked_up,
                "reads": self.stats.reads,
                "pushes": self.stats.pushes, "ids_pushed": self.stats.ids_pushed,
                "aborted_steps": self.stats.aborted_steps, "lost_workers": self.stats.lost_workers,
                "worker_clocks": list(self.clock), "worker_processes": [g + 1 for g in self.generation],
                "checkpoints": list(self.stats.checkpoints), "evicted": self.stats.evicted,
                "max_staleness": self.stats.max_staleness, "consistency": self.consistency,
                "busy_poll_spins": (self.node.stats()["busy_poll"] or {}).get("spins"),
                "rows_digest": self.rows_digest() if self.consistency == "bsp" else None,
                **({"error": self.failed} if self.failed else {})}

    def rows_digest(self) -> str:
        """A hash of every table's ids and whole rows (embedding and slots), in id order: equal
        digests, identical tables (what a resumed job is compared by)."""
        return rows_digest((name, ids, self.tables[name].rows(ids))
                           for name in self.names for ids in [self.tables[name].ids()])


async def _drop(receive: asyncio.Future[Any]) -> None:
    """Cancel a pending receive (or collect its outcome) so that nothing is left dangling."""
    if not receive.done():
        receive.cancel()
    await asyncio.gather(receive, return_exceptions=True)


def load_tables(root: Path, names: list[str]) -> dict[str, EmbeddingTable]:
    """The tables a shard saved under ``root`` (one checkpoint directory per table)."""
    return {name: EmbeddingTable.load(root / name) for name in names}

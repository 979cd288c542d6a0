"""A killed worker restarted as its task, under bsp: its journal, and the dense all-reduce that
waits for it.

The journal (``journal_dir``): at every step c >= 1 each worker writes its part of a cut at c
into a directory of its own (the same part as a whole-job cut's: MG's dense model and Adam
state after step c - 1 with the losses and evaluations so far, and EG's rows pulled ahead for
steps c .. c + k - 1), and EG sends push c only once that part is written. So whenever the
process dies, its newest complete part at c* is one whose push c* + 1 never left: the shards
hold at most its pushes up to c* and its pulls up to c* + 1, and they answer those again as
they did (server.py). The new process loads that part and replays from step c*: the data is
read by step number and nothing else is random, so it sends the very same bits. The two
newest parts are kept; a fresh process (generation 0) clears what an earlier job left.

The dense all-reduce (``Peers.allreduce``): each worker counts the processes of every worker
task (``generations``); the ring's keys carry their sum (the epoch), so that an exchange with
a dead process is never mixed with one with its successor. A worker that loses a ring peer
waits, up to ``worker_rejoin`` seconds, for a new process of it to announce itself; then it
runs the ring of that step again at the new epoch (so does every other worker, whichever
step of the ring it had reached). The new process announces itself to every other worker
with the step it replays from, and each answers with its generation and the results of the
all-reduces it completed from that step on (every worker keeps the last few): the replayed
steps the others had already finished take those results (the same bits) instead of a ring.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np

import rvz

from ..common import until_set
from ..param_server.cut import CutError, cuts, load_worker_part, write_worker_part
from .allreduce import ring_allreduce, worker_device
from .exchange import pipeline_step

log = logging.getLogger(__name__)

JOIN = "pipeline_join"          # new process -> each other worker: [generation, step it replays from]
JOINED = "pipeline_joined"      # answer: [generation, last step all-reduced, steps whose results follow...]
JOINED_RESULTS = "pipeline_joined_results"  # their results, back to back (float32)
RETRY = 0.1                     # seconds between dials of a peer that is down


class WorkerGone(RuntimeError):
    """A ring peer was lost and no new process of it came back in time."""


# -- the journal ---------------------------------------------------------------------------------

def journal_dir(root: str | Path, worker: int) -> Path:
    return Path(root) / f"worker{worker}"


def clear_journal(root: str | Path, worker: int) -> None:
    """A fresh process of ``worker``: nothing of an earlier job's journal may be replayed."""
    shutil.rmtree(journal_dir(root, worker), ignore_errors=True)


def write_part(root: str | Path, clock: int, worker: int, arrays: dict[str, np.ndarray],
               meta: dict[str, Any], keep: int = 2) -> None:
    """Worker ``worker``'s part of the step-``clock`` cut into its journal; older parts beyond
    the ``keep`` newest go. No fsync: the journal outlives a killed process, not the host."""
    mine = journal_dir(root, worker)
    write_worker_part(mine, clock, worker, arrays, meta, fsync=False)
    for _, where in cuts(mine)[:-keep]:
        shutil.rmtree(where, ignore_errors=True)


def newest_part(root: str | Path, worker: int) -> tuple[int, dict[str, np.ndarray], dict[str, Any]] | None:
    """The newest complete part of ``worker``'s journal (clock, arrays, meta), or None."""
    mine = journal_dir(root, worker)
    for clock, where in reversed(cuts(mine)):
        if not (where / f"worker{worker}.done.json").exists():
            continue  # the write the process died in
        try:
            arrays, meta = load_worker_part(where, worker)
        except (CutError, OSError, ValueError):
            continue
        return clock, arrays, meta
    return None


# -- the peers -------------------------------------------------------------------------------------

class Peers:
    """The other worker tasks of the dense all-reduce, and their processes (see the module doc).

    ``generation``: this process's (0: the job's first; the shards count them). ``keep``:
    how many completed all-reduce results to keep for a process that replays."""

    def __init__(self, node: rvz.Node, num_workers: int, *, worker_rejoin: float,
                 timeout: float | None, generation: int = 0, keep: int = 4) -> None:
        self.node = node
        self.n = num_workers
        self.w = node.task
        self.worker_rejoin = worker_rejoin
        self.timeout = timeout
        self.generations = [0] * num_workers
        self.generations[self.w] = generation
        self.keep = keep
        self.results: dict[int, np.ndarray] = {}
        self.done_through = -1              # the last step all-reduced here
        self._changed = asyncio.Event()
        self._watchers: list[asyncio.Task[None]] = []

    @property
    def epoch(self) -> int:
        return sum(self.generations)

    def _device(self, task: int) -> str:
        return worker_device(self.node.job, task)

    def start(self) -> None:
        """Listen for new processes of every other worker task (with ``worker_rejoin``)."""
        if self.worker_rejoin > 0 and self.n > 1:
            self._watchers = [asyncio.ensure_future(self._watch(v)) for v in range(self.n) if v != self.w]

    async def stop(self) -> None:
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)

    def _bump(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _watch(self, v: int) -> None:
        me, them = self._device(self.w), self._device(v)
        while True:
            key = rvz.Key(src=them, dst=me, name=JOIN, iter=self.generations[v] + 1)
            try:
                msg = await self.node.recv(key)
            except (rvz.PeerLost, rvz.AuthError):
                await asyncio.sleep(RETRY)  # down (or not up yet): ask again
                continue
            generation, first = int(msg[0]), int(msg[1])
            self.generations[v] = generation
            steps = [t for t in sorted(self.results) if t >= first]
            meta = np.array([self.generations[self.w], self.done_through, *steps], dtype=np.int64)
            data = (np.concatenate([self.results[t] for t in steps]) if steps
                    else np.zeros(0, dtype=np.float32))
            log.warning("worker %d: worker %d joined again (generation %d), replaying from step %d; %d "
                        "all-reduce results handed over, the ring goes on at epoch %d", self.w, v, generation,
                        first, len(steps), self.epoch)
            try:
                await self.node.send_many(
                    [(rvz.Key(src=me, dst=them, name=JOINED, frame=generation), meta),
                     (rvz.Key(src=me, dst=them, name=JOINED_RESULTS, frame=generation), data)],
                    timeout=self.timeout)
            except (rvz.PeerLost, TimeoutError):
                pass  # it died again: its next process announces itself anew
            self._bump()

    async def announce(self, first: int) -> None:
        """This process replaces a lost one and replays from step ``first``: tell every other
        worker, and take their generations and the all-reduce results they have from there."""
        g = self.generations[self.w]
        me = self._device(self.w)

        async def one(v: int) -> None:
            them = self._device(v)
            await self.node.send(rvz.Key(src=me, dst=them, name=JOIN, iter=g),
                                 np.array([g, first], dtype=np.int64), timeout=self.timeout)
            meta, data = await self.node.recv_many(
                [rvz.Key(src=them, dst=me, name=JOINED, frame=g),
                 rvz.Key(src=them, dst=me, name=JOINED_RESULTS, frame=g)], timeout=self.timeout)
            self.generations[v] = int(meta[0])
            steps = [int(t) for t in meta[2:]]
            if steps:
                for t, part in zip(steps, np.split(np.asarray(data), len(steps)), strict=True):
                    self.results.setdefault(t, part)
                self.done_through = max(self.done_through, max(steps))

        await asyncio.gather(*(one(v) for v in range(self.n) if v != self.w))
        log.warning("worker %d: generation %d replays from step %d; steps %s all-reduced already, the ring "
                    "goes on at epoch %d", self.w, g, first,
                    f"{first} to {self.done_through}" if self.done_through >= first else "none", self.epoch)

    async def allreduce(self, vector: np.ndarray, t: int, clock: int) -> np.ndarray:
        """The ring all-reduce of step ``t`` (``clock``: this worker's PS clock, for errors),
        across the loss and return of a peer (see the module doc)."""
        while True:
            if t in self.results:
                return self.results[t]  # a step the others finished before this process joined
            changed = self._changed
            attempt = asyncio.ensure_future(ring_allreduce(
                self.node, vector, self.n, step=pipeline_step(t), tag=t, timeout=self.timeout,
                epoch=self.epoch))
            # A peer's new process (``changed``) cancels the attempt: the ring starts again at
            # the new epoch.
            await until_set(attempt, changed)
            if attempt.cancelled():
                continue
            try:
                out = attempt.result()
            except rvz.PeerLost as exc:
                if self.worker_rejoin <= 0:
                    raise
                peer = getattr(exc, "peer", "?")
                log.warning("worker %d: ring peer worker %s lost at step %d; waiting up to %g s for its "
                            "next process", self.w, peer, t, self.worker_rejoin)
                try:
                    await asyncio.wait_for(changed.wait(), self.worker_rejoin)
                except (TimeoutError, asyncio.TimeoutError):  # (two classes before 3.11)
                    raise WorkerGone(f"worker {peer} was lost at step {t} (PS clock {clock}) and no new "
                                     f"process of it joined within {self.worker_rejoin:g} s") from None
                continue
            self.done_through = max(self.done_through, t)
            if self.worker_rejoin > 0:
                self.results[t] = out
                for old in [s for s in self.results if s <= t - self.keep]:
                    del self.results[old]
            return out

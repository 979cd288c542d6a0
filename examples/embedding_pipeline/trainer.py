"""One data-parallel worker: its Embedding Graph and Main Graph, with deterministic staleness.

Data parallelism: training step t reads global batch t (``global_batch`` consecutive
samples); worker w of N takes its w-th share. Every worker has its own EG and MG. Sparse
updates go to the shared PS tables, run with the ``bsp`` consistency: the pushes of one
clock are applied together, in worker order, once every worker's push of that clock is in,
and only then acknowledged. Dense gradients (and the loss) are summed by a ring all-reduce
(allreduce.py) every step, so every worker's dense copy stays bit-identical.

Staleness k, exactly: the embeddings used at step t are the rows after the sparse update
of step t - k - 1 (the initial rows for t <= k), and nothing newer. EG's order of work:

    pull rows for steps 0..k (one PS pull, their union)
    for s = 0, 1, ...:  wait for MG's gradients of step s
                        push step s, wait for its ack   (=> every worker's step s applied)
                        pull rows for step s + k + 1     (=> sees steps <= s, and no later one:
                                                             pushes of s + 1 go out after it)

With k = 0 this is the sequential loop (lookup, dense step, update, next lookup); with
k >= 1 the push of step t - 1 and the pull of step t + k run while MG computes step t, which
is where the speed comes from. Every PS clock of EG is a PS step that other workers' pushes
cannot interleave with, so for any k and any N two runs with the same seed give
bit-identical losses; for N = 1 and k = 0 they are those of a plain sequential loop.

Evaluation (worker 0): at every ``eval_every``-th step t, right after its pull of step t
(and before its push of step t - k, which every worker's update of t - k waits for), EG reads
the held-out set's unique ids with the PS's read-only lookup: no clock, no row created, no
access counted, an unknown id read as its initial row. So the held-out embeddings are
exactly those step t trains with, and training is the same with or without evaluation (the
same rows, admission counts and evictions). MG scores the held-out set before training
step t (AUC by ranks, logloss). The final evaluation reads after the last push is
acknowledged.

Whole-job cuts (``checkpoint_every`` C, with the shards' cuts, see param_server/cut.py): at
every step t = C, 2C, ... each worker writes its part of the cut at t: MG's dense model and
Adam state right after step t - 1 (with the losses and evaluations so far), and EG's rows
pulled ahead for steps t .. t + k - 1 (and held-out rows for evaluations among them), as they
stand right after the acknowledgement of push t - 1, the moment the shards copy their tables
out. A worker started from such a cut (``resume``) hands those rows to MG, pulls step t + k
and goes on from step t: the same bits as a run that was never interrupted. The data is read
by step number, and nothing else is random after the model's initialisation.

A killed worker restarted as its task (``worker_rejoin`` S, with ``journal``; see rejoin.py):
at every step c each worker writes its part of a cut at c into its own journal, and EG
pushes c only once it is written. The shards keep a lost worker's place in the barrier, the
other workers wait in the dense all-reduce of the step it died in (up to S seconds), and the
new process replays from its newest part: the run's bits are those of a run never stopped.

Failures: a failure in EG or MG at step t aborts step t through rvz step clean-up (the
other side of this worker and the other workers waiting in step t's all-reduce fail with the
same message), cleans up any PS clock in flight, and raises ``StepFailed`` naming the step.
Every wait is bounded by ``timeout``; a lost worker surfaces as ``rvz.PeerLost``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import rvz

from ..common import run_together
from ..param_server.client import PSClient
from ..param_server.cut import write_worker_part
from .allreduce import ring_allreduce
from .criteo import NUM_CAT, Chunk
from .exchange import (
    EMBEDDINGS,
    EVAL_EMBEDDINGS,
    GRADIENTS,
    ExchangeManager,
    PipelineDataset,
    in_training_steps,
    pipeline_step,
)
from .metrics import auc, logloss
from .model import MLP
from .rejoin import Peers, write_part

log = logging.getLogger(__name__)

# Seconds a dial may take once every process of the run has been up (see
# ``Worker._everyone_was_up``): a live peer on loopback answers in milliseconds.
PEER_DIAL_TIMEOUT = 1.0


class StepFailed(RuntimeError):
    """A training step failed; the message names the step, the worker and the cause."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class TrainConfig:
    staleness: int = 0
    num_workers: int = 1
    global_batch: int = 1024
    hidden: tuple[int, ...] = (512, 256)
    dense_lr: float = 1e-3
    seed: int = 0
    eval_every: int = 0          # steps between held-out evaluations (0: only at the end)
    timeout: float = 60.0        # bound on every wait
    compute_in_thread: bool = True
    max_steps: int | None = None
    progress_every: float = 0.0  # seconds between progress lines (0: none)
    checkpoint_every: int = 0    # steps between whole-job cuts (0: none)
    checkpoint_dir: str | None = None
    worker_rejoin: float = 0.0   # seconds a lost worker's place waits for its next process (0: none)
    journal: str | None = None   # with worker_rejoin: where each worker writes its part every step


@dataclass
class RunResult:
    worker: int
    staleness: int
    workers: int
    steps: int = 0
    samples: int = 0
    losses: list[float] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)
    auc: float | None = None
    logloss: float | None = None
    seconds: float = 0.0         # training wall time, evaluations excluded
    eval_seconds: float = 0.0
    mg_waiting: float = 0.0      # seconds MG waited for embeddings (lookups not overlapped)
    mg_compute: float = 0.0      # seconds of MG's dense forward/backward and update
    eg_ps: float = 0.0           # seconds EG spent in PS pulls and pushes
    pulled_ids: int = 0          # unique ids of every training pull (their rows cross the wire)
    freed: int = 0
    first_step: int = 0          # the step this process started at (> 0: resumed or rejoined)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def loss_digest(self) -> str:
        """A hash of the float32 bits of every step's loss: equal digests, identical runs."""
        return hashlib.sha256(np.asarray(self.losses, dtype=np.float32).tobytes()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(steps_per_s=self.steps_per_s, samples_per_s=self.samples_per_s,
                   loss_digest=self.loss_digest())
        return out


def num_steps(num_samples: int, cfg: TrainConfig) -> int:
    steps = num_samples // cfg.global_batch
    return steps if cfg.max_steps is None else min(steps, cfg.max_steps)


@dataclass
class WorkerCut:
    """A worker's part of a whole-job cut at ``clock`` (see the module doc)."""

    clock: int
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]


def worker_batches(data: Any, cfg: TrainConfig, worker: int, start: int = 0) -> Iterator[Chunk]:
    """Worker ``worker``'s share of each global batch of ``data`` (anything with ``rows``),
    from step ``start``."""
    share = cfg.global_batch // cfg.num_workers
    for t in range(start, num_steps(len(data), cfg)):
        start = t * cfg.global_batch + worker * share
        yield data.rows(start, start + share)


class HeldOut:
    """The held-out set as MG scores it: unique ids (what EG pulls) and how to expand them."""

    def __init__(self, data: Chunk) -> None:
        self.data = data
        self.unique, inverse = np.unique(data.ids.reshape(-1), return_inverse=True)
        self.inverse = inverse.reshape(data.ids.shape)

    def evaluate(self, model: MLP, rows: np.ndarray, block: int = 16384) -> tuple[float, float]:
        logits = np.empty(len(self.data), dtype=np.float32)
        for start in range(0, len(self.data), block):
            emb = rows[self.inverse[start:start + block]]
            x = np.concatenate([emb.reshape(len(emb), -1), self.data.dense[start:start + block]], axis=1)
            logits[start:start + block] = model.logits(x)
        return auc(logits, self.data.labels), logloss(logits, self.data.labels)


def sum_by_unique(grads: np.ndarray, inverse: np.ndarray, num_unique: int) -> np.ndarray:
    """Per-id sums of ``grads`` rows: accumulated in float64 in sample order (deterministic,
    and several times faster than ``np.add.at``), then rounded once to float32."""
    dim = grads.shape[-1]
    flat, index = grads.reshape(-1, dim), inverse.reshape(-1)
    out = np.empty((num_unique, dim), dtype=np.float32)
    for j in range(dim):
        out[:, j] = np.bincount(index, weights=flat[:, j], minlength=num_unique)
    return out


class Worker:
    """EG and MG of worker ``node.task``; ``run()`` trains and returns its ``RunResult``."""

    def __init__(self, node: rvz.Node, ps: PSClient, data: Any, cfg: TrainConfig,
                 held_out: HeldOut | None = None, model: MLP | None = None,
                 resume: WorkerCut | None = None, peers: Peers | None = None) -> None:
        if cfg.global_batch % cfg.num_workers:
            raise ValueError(f"the global batch {cfg.global_batch} does not split into "
                             f"{cfg.num_workers} equal shares")
        if cfg.staleness < 0:
            raise ValueError("staleness must be >= 0")
        self.node = node
        self.ps = ps
        self.cfg = cfg
        self.w = node.task
        self._failure: StepFailed | None = None  # the first failure of either loop
        self.dim = ps.dim
        self.steps = num_steps(len(data), cfg)
        self.share = cfg.global_batch // cfg.num_workers
        self.held_out = held_out if self.w == 0 else None
        self.model = model or MLP(NUM_CAT * self.dim + data.dense.shape[1], list(cfg.hidden),
                                  lr=cfg.dense_lr, seed=cfg.seed)
        self.exchange = ExchangeManager(node, timeout=cfg.timeout)
        self.start = resume.clock if resume is not None else 0
        self.resume = resume
        self.dataset = PipelineDataset(worker_batches(data, cfg, self.w, self.start), self.exchange,
                                       first_id=self.start)
        self.result = RunResult(worker=self.w, staleness=cfg.staleness, workers=cfg.num_workers,
                                first_step=self.start)
        self.peers = peers
        self.inflight: dict[str, int] = {}    # PS channel -> clock of a call not finished
        self._train_losses: list[float] = []
        self._up = False                       # a step of this process completed
        # Whole-job cuts: the rows pulled ahead (for the EG half of a cut), each cut's two
        # halves until both are in, and the writes in flight.
        self._journal = cfg.worker_rejoin > 0 and cfg.journal is not None
        self._keep = cfg.checkpoint_every > 0 or self._journal
        self._ahead: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # step -> (unique ids, rows)
        self._ahead_eval: dict[int, np.ndarray] = {}
        self._halves: dict[int, dict[str, tuple[dict[str, np.ndarray], dict[str, Any]]]] = {}
        self._writes: list[asyncio.Future[Any]] = []
        self._journaled: dict[int, asyncio.Future[Any]] = {}  # clock -> the write of its part
        # One thread, so the parts land in clock order: a newer part on disk means every
        # older one is too (see rejoin.py).
        self._journal_pool = ThreadPoolExecutor(1, "journal") if self._journal else None
        if resume is not None:
            self._restore(resume)

    def eval_step(self, t: int) -> bool:
        return self.held_out is not None and self.cfg.eval_every > 0 and 0 < t < self.steps \
            and t % self.cfg.eval_every == 0

    # -- the parameter server, with the clocks in flight remembered ----------------------------

    async def _ps_call(self, channel: str, call: Any) -> Any:
        self.inflight[channel] = self.ps.next_step[channel]
        started = time.perf_counter()
        result = await call
        self.result.eg_ps += time.perf_counter() - started
        del self.inflight[channel]
        return result

    async def _abandon_ps_clocks(self) -> None:
        """Clean up the PS clocks a failure left half-done, so no shard waits for them."""
        for clock in sorted(set(self.inflight.values())):
            try:
                await asyncio.wait_for(self.ps.abort_step(clock), self.cfg.timeout)
            except (rvz.RvzError, TimeoutError, asyncio.TimeoutError):  # (two classes before 3.11)
                pass
        self.inflight.clear()

    # -- EG -------------------------------------------------------------------------------------

    def _index(self, b: int) -> np.ndarray:
        """Batch ``b``'s unique ids (and their index into its samples, kept by the exchange)."""
        ids = self.exchange.samples(b).ids
        unique, inverse = np.unique(ids.reshape(-1), return_inverse=True)
        self.exchange.set_index(b, unique, inverse.reshape(ids.shape))
        return unique

    async def _hand_over(self, b: int, rows: np.ndarray) -> None:
        """Batch ``b``'s embeddings to MG, from the rows of its unique ids."""
        unique, inverse = self.exchange.index(b)
        if self._keep:
            self._ahead[b] = (unique, rows)
        await self.exchange.send(EMBEDDINGS, b, rows[inverse])

    async def _hand_over_eval(self, b: int, rows: np.ndarray) -> None:
        if self._keep:
            self._ahead_eval[b] = rows
        await self.exchange.send(EVAL_EMBEDDINGS, b, rows)

    async def _pull(self, batch_ids: list[int]) -> None:
        """One PS pull for ``batch_ids``; hands each batch's embeddings to MG, and at an
        evaluation step the held-out rows, read without a clock right after that pull."""
        uniques = [self._index(b) for b in batch_ids]
        union = uniques[0] if len(uniques) == 1 else np.unique(np.concatenate(uniques))
        self.result.pulled_ids += len(union)
        rows = await self._ps_call("lookup", self.ps.lookup_unique(union))
        for b, unique in zip(batch_ids, uniques, strict=True):
            await self._hand_over(b, rows if unique is union else rows[np.searchsorted(union, unique)])
        evals = [b for b in batch_ids if self.eval_step(b)]
        if evals:
            held_out = await self._read_held_out()
            for b in evals:
                await self._hand_over_eval(b, held_out)

    async def _read_held_out(self) -> np.ndarray:
        """The held-out ids' current rows, by the PS's read-only lookup (changes nothing)."""
        assert self.held_out is not None
        started = time.perf_counter()
        rows = await self.ps.read_unique(self.held_out.unique)
        self.result.eg_ps += time.perf_counter() - started
        return rows

    async def embedding_graph(self) -> None:
        k = self.cfg.staleness
        batches = self.dataset.iterator("eg")
        current = start = self.start
        try:
            if self.resume is None:
                first = [next(batches) for _ in range(min(k + 1, self.steps))]
                if first:
                    await self._pull(first)
            else:
                # The rows this worker had pulled ahead when the cut was taken, then the pull
                # that came next (that of step start + k, after push start - 1's ack).
                await self._restore_ahead([next(batches) for _ in range(start, min(start + k, self.steps))])
                if start + k < self.steps:
                    current = start + k
                    await self._pull([next(batches)])
            for s in range(start, self.steps):
                current = s
                grads = await self.exchange.recv(GRADIENTS, s)
                unique, inverse = self.exchange.index(s)
                summed = sum_by_unique(grads, inverse, len(unique))
                written = self._journaled.pop(s, None)
                if written is not None:
                    await written  # push s leaves only once the part at s is on disk
                await self._ps_call("push", self.ps.push_unique(unique, summed))
                self.exchange.done(s, "eg")
                self._ahead.pop(s, None)
                self._ahead_eval.pop(s, None)
                if self._cut_due(s + 1):
                    self._eg_half(s + 1)
                if s + k + 1 < self.steps:
                    current = s + k + 1
                    await self._pull([next(batches)])
        except (asyncio.CancelledError, StepFailed):
            raise
        except BaseException as exc:
            raise await self._fail("EG", current, exc) from exc

    # -- MG -------------------------------------------------------------------------------------

    async def _compute(self, fn: Any, *args: Any) -> Any:
        if self.cfg.compute_in_thread:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def _evaluate(self, t: int, rows: np.ndarray) -> None:
        assert self.held_out is not None
        started = time.perf_counter()
        score, loss = await self._compute(self.held_out.evaluate, self.model, rows)
        self.result.eval_seconds += time.perf_counter() - started
        train_loss = float(np.mean(self._train_losses)) if self._train_losses else float("nan")
        self._train_losses = []
        self.result.history.append({"step": t, "samples": t * self.cfg.global_batch, "train_loss": train_loss,
                                    "auc": score, "logloss": loss})

    async def main_graph(self) -> None:
        n = self.cfg.num_workers
        t = 0
        every = self.cfg.progress_every
        started = time.perf_counter()
        next_progress = time.monotonic() + every
        try:
            for t in self.dataset.iterator("mg"):
                if every and time.monotonic() >= next_progress and self.result.losses:
                    next_progress = time.monotonic() + every
                    log.info("worker %d: step %d of %d (PS clock %d), loss %.4f, %.1f steps/s",
                             self.w, t, self.steps, self.ps.next_step["push"], self.result.losses[-1],
                             t / (time.perf_counter() - started))
                if self.eval_step(t):
                    await self._evaluate(t, await self.exchange.recv(EVAL_EMBEDDINGS, t))
                waited = time.perf_counter()
                emb = await self.exchange.recv(EMBEDDINGS, t)
                self.result.mg_waiting += time.perf_counter() - waited
                batch: Chunk = self.exchange.samples(t)
                x = np.concatenate([emb.reshape(len(emb), -1), batch.dense], axis=1)
                started = time.perf_counter()
                loss, dx, grads = await self._compute(self.model.forward_backward, x, batch.labels,
                                                      self.cfg.global_batch)
                self.result.mg_compute += time.perf_counter() - started
                demb = np.ascontiguousarray(dx[:, :emb.shape[1] * self.dim]).reshape(emb.shape)
                await self.exchange.send(GRADIENTS, t, demb)
                flat = self.model.flatten(grads, loss)
                if self.peers is not None:
                    total = await self.peers.allreduce(flat, t, self.ps.next_step["push"])
                else:
                    total = await ring_allreduce(self.node, flat, n, step=pipeline_step(t), tag=t,
                                                 timeout=self.cfg.timeout)
                grads, loss = self.model.unflatten(total)
                if not self._up:
                    self._up = True
                    self._everyone_was_up()
                started = time.perf_counter()
                await self._compute(self.model.apply, grads)
                self.result.mg_compute += time.perf_counter() - started
                self.result.losses.append(loss)
                self._train_losses.append(loss)
                self.exchange.done(t, "mg")
                if self._cut_due(t + 1):
                    self._mg_half(t + 1)
        except (asyncio.CancelledError, StepFailed):
            raise
        except BaseException as exc:
            raise await self._fail("MG", t, exc) from exc

    # -- whole-job cuts ------------------------------------------------------------------------

    def _cut_due(self, clock: int) -> bool:
        """A whole-job cut, or the journal's part, is taken at ``clock``."""
        every = self.cfg.checkpoint_every
        # The shards cut at the last step too: a finished job's final cut is complete (and a
        # job resumed from it with more --max-steps goes on from there).
        return (self._journal or bool(every) and clock % every == 0) and clock <= self.steps

    def _mg_half(self, clock: int) -> None:
        """MG's half of the cut at ``clock``: the dense model and Adam state after step
        ``clock`` - 1, and what was reported so far."""
        m = self.model
        arrays = {f"{name}{i}": np.copy(a) for name, group in (("param", m.params), ("m", m.m), ("v", m.v))
                  for i, a in enumerate(group)}
        meta = {"model_steps": m.steps, "losses": list(self.result.losses),
                "history": [dict(h) for h in self.result.history], "train_losses": list(self._train_losses)}
        self._half(clock, "mg", arrays, meta)

    def _eg_half(self, clock: int) -> None:
        """EG's half: the rows pulled for steps ``clock`` .. ``clock`` + k - 1 (and held-out rows)."""
        arrays: dict[str, np.ndarray] = {}
        for b, (unique, rows) in self._ahead.items():
            arrays[f"ids{b}"], arrays[f"rows{b}"] = unique, rows
        for b, rows in self._ahead_eval.items():
            arrays[f"eval{b}"] = rows
        self._half(clock, "eg", arrays, {"ahead": sorted(self._ahead), "evals": sorted(self._ahead_eval)})

    def _half(self, clock: int, side: str, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        halves = self._halves.setdefault(clock, {})
        halves[side] = (arrays, meta)
        if len(halves) < 2:
            return
        del self._halves[clock]
        both = {**halves["mg"][0], **halves["eg"][0]}
        info = {**halves["mg"][1], **halves["eg"][1], "clock": clock, "staleness": self.cfg.staleness}
        every = self.cfg.checkpoint_every
        if every and clock % every == 0:
            root = self.cfg.checkpoint_dir
            assert root is not None
            self._writes.append(asyncio.ensure_future(asyncio.to_thread(
                write_worker_part, root, clock, self.w, both, info)))
        if self._journal:
            assert self.cfg.journal is not None
            self._journaled[clock] = asyncio.get_running_loop().run_in_executor(
                self._journal_pool, write_part, self.cfg.journal, clock, self.w, both, info)

    def _restore(self, cut: WorkerCut) -> None:
        """MG's state from ``cut`` (EG's rows are handed over by ``embedding_graph``)."""
        meta, arrays, m = cut.meta, cut.arrays, self.model
        if meta["staleness"] != self.cfg.staleness:
            raise ValueError(f"the cut was taken at staleness {meta['staleness']}, not {self.cfg.staleness}")
        for name, group in (("param", m.params), ("m", m.m), ("v", m.v)):
            for i, a in enumerate(group):
                a[...] = arrays[f"{name}{i}"]
        m.steps = meta["model_steps"]
        self.result.losses = list(meta["losses"])
        self.result.history = [dict(h) for h in meta["history"]]
        self._train_losses = list(meta["train_losses"])
        if self.ps.rejoined_at is None:  # (a rejoined process told the shards already)
            self.ps.start_at(cut.clock)

    async def _restore_ahead(self, batch_ids: list[int]) -> None:
        assert self.resume is not None
        arrays, evals = self.resume.arrays, set(self.resume.meta["evals"])
        for b in batch_ids:
            unique = self._index(b)
            if not np.array_equal(unique, arrays[f"ids{b}"]):
                raise ValueError(f"step {b}'s ids differ from the cut's: not the data it was taken on")
            await self._hand_over(b, arrays[f"rows{b}"])
            if b in evals:
                await self._hand_over_eval(b, arrays[f"eval{b}"])

    # -- failures -------------------------------------------------------------------------------

    def _everyone_was_up(self) -> None:
        """After the first all-reduce (it carries every worker's share) and the shards'
        greetings, every process of the run has been up and listening. A dial refused from
        then on (the clean-up of a failed step reaches every peer, including ones never
        dialled before) means a dead process: fail it within ``PEER_DIAL_TIMEOUT`` rather
        than retrying for the node's whole start-up allowance (``connect_timeout``)."""
        self.node.connect_timeout = min(self.node.connect_timeout, PEER_DIAL_TIMEOUT)

    async def _fail(self, side: str, step: int, exc: BaseException) -> StepFailed:
        """Clean step ``step`` up everywhere; the error to raise, naming the step.

        The first failure of this worker is the one reported: the other loop then sees the
        clean-up that failure started (an ``Aborted``), which is its consequence, not news.
        """
        if self._failure is not None:
            return StepFailed(str(self._failure), self._failure.step)
        text = in_training_steps(str(exc))
        if isinstance(exc, rvz.Aborted) and f"step {step} " in text:
            message = f"worker {self.w}: step {step} was aborted elsewhere: {text}"
        elif isinstance(exc, rvz.PeerLost):
            message = f"step {step} aborted: worker {self.w} lost a peer in {side}: {text}"
        else:
            message = f"step {step} aborted: {side} of worker {self.w} failed: {type(exc).__name__}: {text}"
        self._failure = StepFailed(message, step)  # before the await: the other loop may fail meanwhile
        try:
            await self.exchange.abort(step, message)
        except rvz.RvzError:
            pass  # the node is closing: nobody is left to tell
        return StepFailed(message, step)

    # -- the whole run --------------------------------------------------------------------------

    async def run(self) -> RunResult:
        await self.ps.connect()
        started = time.perf_counter()
        try:
            await run_together(self.embedding_graph(), self.main_graph())
        except BaseException:
            await self._abandon_ps_clocks()
            raise
        await asyncio.gather(*self._writes, *self._journaled.values())  # every cut is on disk
        if self._journal_pool is not None:
            self._journal_pool.shutdown()
        self.result.seconds = time.perf_counter() - started - self.result.eval_seconds
        self.result.steps = len(self.result.losses)
        self.result.samples = self.result.steps * self.cfg.global_batch
        self.result.freed = self.exchange.freed
        if self.held_out is not None:
            # Every worker's last push was applied before ours was acknowledged (bsp).
            await self._evaluate(self.steps, await self._read_held_out())
            self.result.auc = self.result.history[-1]["auc"]
            self.result.logloss = self.result.history[-1]["logloss"]
        return self.result

"""A synthetic sparse workload for the demo workers, and the Zipf id sampler it uses.

Each sample is a bag of ids drawn from a Zipf law (a few hot ids, a long tail: the shape of
real feature ids, and what makes frequency eviction worth having). The task is a regression:
the sum of a bag's embeddings must match the sum of hidden "teacher" vectors of its ids.
Its gradient couples the ids of a bag, so it is a real (if small) learning problem.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import rvz

from ..common import child_signals
from . import cut
from .client import PSClient
from .launch import PSConfig, keep_freed_memory
from .sparse import mix64, seeded_uniform

log = logging.getLogger(__name__)

LOST_DIAL_TIMEOUT = 1.0  # seconds a dial may take once every shard has answered


class ZipfIds:
    """Samples int64 ids: rank r is drawn with probability ~ 1/(r+1)**exponent, then
    scrambled into a large, sparse id (as hashed feature ids are)."""

    def __init__(self, vocab: int, exponent: float = 1.1, salt: int = 0) -> None:
        weights = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** exponent
        self.cdf = np.cumsum(weights / weights.sum())
        ranks = np.arange(vocab, dtype=np.uint64) + np.uint64(salt) * np.uint64(vocab)
        # >> 1 keeps the ids non-negative as int64.
        self.ids = (mix64(ranks) >> np.uint64(1)).astype(np.int64)

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        ranks = np.searchsorted(self.cdf, rng.random(shape), side="right")
        return self.ids[np.minimum(ranks, len(self.ids) - 1)]


@dataclass(frozen=True)
class WorkerConfig:
    steps: int = 200
    batch: int = 256
    bag: int = 4
    vocab: int = 20000
    zipf: float = 1.1
    seed: int = 0
    timeout: float = 30.0
    restart_timeout: float = 60.0
    progress_every: float = 0.0  # seconds between progress lines (0: none)
    cut_every: int = 0           # whole-job cuts (bsp): this worker's part every this many steps
    cut_root: str | None = None
    resume_cut: str | None = None  # resume from this cut directory, at ``start_clock``
    start_clock: int = 0
    crash_job_at: int | None = None  # a demo: worker 0 SIGKILLs the job's process group here


def teacher(ids: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """The hidden vector each id should learn (a fixed function of the id)."""
    return seeded_uniform(ids.reshape(-1), dim, seed + 1_000_003).reshape(ids.shape + (dim,))


def loss_digest(losses: list[float]) -> str:
    """A hash of the float32 bits of every step's loss: equal digests, identical runs."""
    return hashlib.sha256(np.asarray(losses, dtype=np.float32).tobytes()).hexdigest()[:16]


async def train_worker(client: PSClient, cfg: WorkerConfig, num_workers: int = 1) -> dict[str, Any]:
    """Run ``cfg.steps`` steps (pull, gradient, push) against the shards, on every table
    of the service (each table its own ids: the same Zipf law, salted by the table).

    With ``cut_every`` (bsp), after the acknowledgement of every ``cut_every``-th step the
    worker writes its part of the whole-job cut (its sampler's state and its losses): the
    shards copy their tables out at that very clock. ``resume_cut`` starts from such a part."""
    worker = client.worker
    rng = np.random.default_rng([cfg.seed, worker])
    samplers = {name: ZipfIds(cfg.vocab, cfg.zipf, salt=t) for t, name in enumerate(client.names)}
    losses: list[float] = []
    if cfg.resume_cut is not None:
        _, meta = cut.load_worker_part(Path(cfg.resume_cut), worker)
        rng.bit_generator.state = meta["rng"]
        losses = list(meta["losses"])
        client.start_at(cfg.start_clock)
    await client.connect()
    # A restarted process of a worker task goes on where the shards say the lost one got.
    first = client.next_step["push"]
    writes: list[asyncio.Future[Any]] = []
    started = time.perf_counter()
    acks = np.zeros((client.num_shards, len(client.names)), dtype=np.int64)
    log.info("worker %d: training %d steps of %d samples on %d PS shards", worker, cfg.steps,
             cfg.batch, client.num_shards)
    next_progress = time.monotonic() + cfg.progress_every
    for step in range(first, cfg.steps):
        if cfg.crash_job_at == step and worker == 0:
            await asyncio.to_thread(cut.kill_job_after_cut, cfg.cut_root, cfg.cut_every, step,
                                    client.num_shards, num_workers)
        if cfg.progress_every and time.monotonic() >= next_progress:
            next_progress = time.monotonic() + cfg.progress_every
            log.info("worker %d: step %d of %d, clock %d, loss %.4f, %.0f steps/s, shard restarts %d",
                     worker, step, cfg.steps, client.next_step["push"], losses[-1],
                     step / (time.perf_counter() - started), client.restarts)
        ids = {name: s.sample(rng, (cfg.batch, cfg.bag)) for name, s in samplers.items()}
        emb = await client.pull(ids, step)                       # name -> [batch, bag, dim]
        loss = 0.0
        grads = {}
        for t, name in enumerate(client.names):
            dim = client.dims[name]
            target = teacher(ids[name], dim, cfg.seed + t).sum(axis=1)
            err = emb[name].sum(axis=1) - target                 # [batch, dim]
            loss += 0.5 * float(np.mean(np.sum(err * err, axis=1)))
            grads[name] = np.broadcast_to((err / cfg.batch)[:, None, :], emb[name].shape)
        losses.append(loss)
        acks = await client.push_tables(ids, grads, step)
        if step == first:
            # Every shard answered: a dial refused from now on is a lost shard, not one still
            # starting. Fail it within a second (rvz would redial for its whole start-up
            # allowance) so that ``restart_timeout`` counts from about when the shard died.
            client.node.connect_timeout = min(client.node.connect_timeout, LOST_DIAL_TIMEOUT)
        if cfg.cut_every and (step + 1) % cfg.cut_every == 0:  # the shards cut at the last step too
            assert cfg.cut_root is not None
            meta = {"rng": rng.bit_generator.state, "losses": list(losses)}
            writes.append(asyncio.ensure_future(asyncio.to_thread(
                cut.write_worker_part, cfg.cut_root, step + 1, worker, {}, meta)))
    await client.close()
    await asyncio.gather(*writes)
    seconds = time.perf_counter() - started
    head = max(1, cfg.steps // 10)
    done = cfg.steps - first
    return {"worker": worker, "steps": cfg.steps, "first_step": first, "seconds": seconds,
            "ids_per_s": done * cfg.batch * cfg.bag * len(client.names) / seconds,
            "loss_first": float(np.mean(losses[:head])), "loss_last": float(np.mean(losses[-head:])),
            "loss_digest": loss_digest(losses), "acks": acks.tolist(), "restarts": client.restarts}



async def run_worker(cluster: dict[str, Any], worker: int, ps: PSConfig,
                     cfg: WorkerConfig) -> dict[str, Any]:
    num_shards = len(cluster["ps"])
    async with rvz.Node(cluster, ps.worker_job, worker, mode=ps.mode, **ps.node_kwargs()) as node:
        client = PSClient(node, num_shards, ps.dims(), timeout=cfg.timeout,
                          restart_timeout=cfg.restart_timeout, worker_job=ps.worker_job)
        return await train_worker(client, cfg, len(cluster[ps.worker_job]))


def worker_process(cluster: dict[str, Any], worker: int, ps: PSConfig, cfg: WorkerConfig,
                   results: Any) -> None:
    """Entry point of a demo worker process."""
    child_signals()
    keep_freed_memory()
    summary = rvz.run(run_worker(cluster, worker, ps, cfg), loop=ps.loop)
    results.put((ps.worker_job, worker, summary))

"""Runs of the DLRM: over the parameter server (PS shard processes, this process the worker)
and the reference in one process (``nn.EmbeddingBag`` + ``torch.optim.SparseAdam``).

``run_ps`` starts the shards (the embedding pipeline's bsp settings, one table per
categorical field, ``sparse_adam`` by default), trains with an ``EmbeddingService`` at
staleness k, evaluates on the held-out set with read-only lookups, and stops every shard
whatever happens. ``run_local`` trains the same model on local tables whose initial rows
are the ones the shards would create. Both return a ``Report``: per-step losses, held-out
AUC and logloss, and where the time of a step went.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import rvz

from ..common import LOCAL_HOST, child_signals
from ..embedding_pipeline.criteo import Columns
from ..embedding_pipeline.launch import ps_config as pipeline_ps_config
from ..embedding_pipeline.metrics import auc, logloss
from ..param_server.launch import Processes, PSConfig, TableSpec, make_table, run_shard
from ..param_server.launch import local_cluster as ps_cluster
from ..param_server.protocol import PS_JOB, WORKER_JOB
from .data import TABLES, batches, to_batch, vocabulary
from .embedding import LocalEmbeddingBagCollection, PSEmbeddingBagCollection
from .model import DLRM
from .service import EmbeddingService
from .shards import shard_process
from .sparse_adam import NAME as SPARSE_ADAM
from .sparse_adam import register

log = logging.getLogger(__name__)

# The GIL switch interval of a worker process: torch and the rvz loop share it (seconds).
SWITCH_INTERVAL = 0.0005

DENSE_OPTIMIZERS = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}


@dataclass(frozen=True)
class RunConfig:
    """One run's data, model, optimizers and processes (the CLI's options)."""

    batch_size: int = 1024
    steps: int = 100
    dim: int = 16
    bottom: tuple[int, ...] = (64,)
    top: tuple[int, ...] = (64, 32)
    interaction: str = "dot"
    pooling: str = "sum"
    lr: float = 0.01                # sparse (PS) learning rate
    dense_lr: float = 1e-3
    dense_optimizer: str = "adam"
    sparse_optimizer: str = SPARSE_ADAM
    seed: int = 0
    init_std: float = 0.01
    keep_missing: bool = False      # an empty categorical value: its own id, not an empty bag
    staleness: int = 0
    workers: int = 1                # each takes an equal share of every batch
    shards: int = 2
    mode: str = "send"              # rvz mode of every node
    loop: str = "auto"
    timeout: float = 60.0
    host: str = LOCAL_HOST
    eval_block: int = 8192
    progress_every: float = 0.0
    node_options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    """What a run reports: its losses, held-out metrics and where the time went (seconds)."""

    losses: list[float] = field(default_factory=list)
    auc: float | None = None
    logloss: float | None = None
    seconds: float = 0.0            # training wall time (evaluation excluded)
    compute: float = 0.0            # the rest: torch forward, backward and dense update
    waiting: float = 0.0            # waiting for the next batch and its rows (rvz hand-off; PS
                                    # pull and push not overlapped)
    handing: float = 0.0            # handing the gradients to EG (rvz hand-off)
    allreduce: float = 0.0          # the dense gradients' ring all-reduce (several workers)
    ps: float = 0.0                 # EG in PS pulls and pushes (overlapped when staleness >= 1)
    loop_cpu: float = 0.0           # CPU of the service's thread (rvz, PS client, hand-offs)
    eval_seconds: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.losses)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "steps": self.steps}

    def overhead(self) -> str:
        """Per step: time in rvz and the PS next to the step's compute."""
        n = max(1, self.steps)
        ms = {k: 1000 * getattr(self, k) / n
              for k in ("seconds", "compute", "waiting", "handing", "allreduce", "ps", "loop_cpu")}
        path = self.waiting + self.handing + self.allreduce
        share = 100 * path / self.seconds if self.seconds else 0.0
        ring = f", dense all-reduce {ms['allreduce']:.2f} ms" if self.allreduce else ""
        return (f"per step {ms['seconds']:.2f} ms: torch compute {ms['compute']:.2f} ms, waiting for rows "
                f"{ms['waiting']:.2f} ms, handing gradients {ms['handing']:.2f} ms{ring} (rvz + PS on the "
                f"step's path: {share:.0f}% of it); EG's PS pulls and pushes {ms['ps']:.2f} ms; the rvz "
                f"thread's CPU {ms['loop_cpu']:.2f} ms")


def table_specs(cfg: RunConfig) -> tuple[TableSpec, ...]:
    return tuple(TableSpec(name, cfg.dim, cfg.sparse_optimizer, cfg.lr) for name in TABLES)


def ps_config(cfg: RunConfig) -> PSConfig:
    """The pipeline's PS settings: bsp, every worker's push of a clock applied, in worker
    order, before any pull of the next is answered."""
    return pipeline_ps_config(PSConfig(dim=cfg.dim, optimizer=cfg.sparse_optimizer, lr=cfg.lr, seed=cfg.seed,
                                       tables=table_specs(cfg), init_std=cfg.init_std, mode=cfg.mode,
                                       loop=cfg.loop, node_options=cfg.node_options), cfg.workers)


def make_model(embeddings: torch.nn.Module, cfg: RunConfig) -> DLRM:
    return DLRM(embeddings, len(TABLES), cfg.dim, bottom=cfg.bottom, top=cfg.top, interaction=cfg.interaction,
                seed=cfg.seed)


def dense_optimizer(params: Any, cfg: RunConfig) -> torch.optim.Optimizer:
    return DENSE_OPTIMIZERS[cfg.dense_optimizer](params, lr=cfg.dense_lr)


def bce(logits: torch.Tensor, labels: Any) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.as_tensor(labels))


def evaluate(model: DLRM, data: Any, cfg: RunConfig) -> tuple[float, float]:
    """Held-out AUC and logloss (``data``: whole ``Columns``), scored block by block."""
    model.eval()
    logits = np.empty(len(data), dtype=np.float32)
    with torch.no_grad():
        for start in range(0, len(data), cfg.eval_block):
            batch = to_batch(data.rows(start, start + cfg.eval_block), cfg.keep_missing)
            logits[start:start + len(batch)] = model(batch).numpy()
    model.train()
    return auc(logits, data.labels), logloss(logits, data.labels)


class Progress:
    """A log line every ``every`` seconds (0: none)."""

    def __init__(self, every: float, steps: int, name: str) -> None:
        self.every, self.steps, self.name = every, steps, name
        self.started = self.last = time.perf_counter()

    def step(self, t: int, loss: float) -> None:
        now = time.perf_counter()
        if self.every and now - self.last >= self.every:
            self.last = now
            log.info("%s: step %d of %d, loss %.4f, %.1f steps/s", self.name, t, self.steps, loss,
                     t / (now - self.started))


class ShardThread:
    """The shards as tasks of one event loop in a thread of this process (tests: no process
    to start, no second torch import). ``wait`` returns their summaries once every worker
    left; leaving the ``with`` block cancels whatever still runs."""

    def __init__(self, cluster: dict[str, Any], ps: PSConfig) -> None:
        register()
        self.loop = rvz.new_event_loop(ps.loop)  # type: ignore[arg-type]
        self.thread = threading.Thread(target=self.loop.run_forever, name="ps-shards", daemon=True)
        self.thread.start()
        self.serving = asyncio.run_coroutine_threadsafe(self._serve(cluster, ps), self.loop)

    @staticmethod
    async def _serve(cluster: dict[str, Any], ps: PSConfig) -> list[Any]:
        return list(await asyncio.gather(*(run_shard(cluster, s, ps) for s in range(len(cluster[PS_JOB])))))

    def wait(self, timeout: float) -> list[Any]:
        return list(self.serving.result(timeout))

    def __enter__(self) -> ShardThread:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.serving.cancel()
        try:
            self.serving.result(10)
        except BaseException:  # noqa: BLE001 - cancelled, or the failure already reported
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def run_ps(train: Any, held_out: Any | None, cfg: RunConfig, in_process: bool = False,
           train_dir: str | None = None) -> Report:
    """Train on ``train`` (``Columns``) over PS shard processes, worker 0 in this process and
    the other workers in processes of their own, which open ``train_dir`` (or, ``in_process``,
    shards and workers in threads of this one). Worker 0's report."""
    register()
    ps = ps_config(cfg)
    cluster = ps_cluster(cfg.shards, cfg.workers, WORKER_JOB, cfg.host)
    names = [f"ps{s}" for s in range(cfg.shards)] + [f"worker{w}" for w in range(1, cfg.workers)]
    with contextlib.ExitStack() as stack:
        if in_process:
            shards: Any = stack.enter_context(ShardThread(cluster, ps))
            pool = stack.enter_context(ThreadPoolExecutor(max(1, cfg.workers - 1)))
            others = [pool.submit(train_worker, cluster, w, train, None, cfg, ps)
                      for w in range(1, cfg.workers)]
        else:
            if cfg.workers > 1 and train_dir is None:
                raise ValueError("several worker processes need train_dir")
            shards = stack.enter_context(Processes())
            for s in range(cfg.shards):
                shards.start(f"ps{s}", shard_process, cluster, s, ps, False)
            for w in range(1, cfg.workers):
                shards.start(f"worker{w}", worker_process, cluster, w, train_dir, cfg, ps)
        report = train_worker(cluster, 0, train, held_out, cfg, ps)
        if in_process:
            for other in others:
                other.result(cfg.timeout)
            summaries = shards.wait(cfg.timeout)
        else:
            shards.wait(cfg.timeout, names)
            summaries = [shards.collected.get((PS_JOB, s)) for s in range(cfg.shards)]
    log.debug("shards: %s", summaries)
    return report


def worker_process(cluster: dict[str, Any], w: int, train_dir: str, cfg: RunConfig, ps: PSConfig,
                   results: Any) -> None:
    """Entry point of the process of worker ``w`` (> 0: worker 0 is the launcher)."""
    child_signals()
    torch.set_num_threads(1)
    sys.setswitchinterval(SWITCH_INTERVAL)
    report = train_worker(cluster, w, Columns.open(train_dir), None, cfg, ps)
    results.put((WORKER_JOB, w, report.to_dict()))


def train_worker(cluster: dict[str, Any], w: int, train: Any, held_out: Any | None, cfg: RunConfig,
                 ps: PSConfig) -> Report:
    """Worker ``w`` of ``cluster``: train on its share of every batch, evaluate (if given
    ``held_out``), and tell the shards it is done. With several workers each one's loss is
    its share of the batch's mean loss, and the dense gradients and the losses are summed
    over the workers before every dense update, so every worker's model stays the same."""
    report = Report()
    service = EmbeddingService(cluster, w, cfg.shards, ps.dims(), staleness=cfg.staleness,
                               workers=cfg.workers, timeout=cfg.timeout, mode=cfg.mode, loop=cfg.loop,
                               node_options={"connect_timeout": min(10.0, cfg.timeout), **cfg.node_options})
    try:
        service.start(batches(train, cfg.batch_size, cfg.steps, cfg.keep_missing, worker=w,
                              workers=cfg.workers))
        model = make_model(PSEmbeddingBagCollection(service, cfg.pooling), cfg)
        params = list(model.parameters())
        optimizer = dense_optimizer(params, cfg)
        progress = Progress(cfg.progress_every, cfg.steps, f"worker {w}")
        started = time.perf_counter()
        for batch in service.batches():
            loss = bce(model(batch), batch.labels)
            if cfg.workers > 1:
                loss = loss * (len(batch) / cfg.batch_size)
            optimizer.zero_grad()
            loss.backward()          # hands the rows' gradients to EG, which pushes them
            value = loss.item()
            if cfg.workers > 1:
                value = sum_over_workers(service, batch.batch_id, params, loss)
            optimizer.step()
            report.losses.append(value)
            progress.step(len(report.losses), report.losses[-1])
        service.finish()             # the last push acknowledged
        report.seconds = time.perf_counter() - started
        t = service.timings
        report.waiting, report.handing, report.ps, report.loop_cpu = t.waiting, t.handing, t.ps, t.loop_cpu
        report.allreduce = t.allreduce
        report.compute = report.seconds - report.waiting - report.handing - report.allreduce
        if held_out is not None:
            started = time.perf_counter()
            report.auc, report.logloss = evaluate(model, held_out, cfg)
            report.eval_seconds = time.perf_counter() - started
    finally:
        service.close()
    return report


def sum_over_workers(service: EmbeddingService, b: Any, params: list[torch.Tensor],
                     loss: torch.Tensor) -> float:
    """Replace every gradient of ``params`` by its sum over the workers; the summed loss."""
    flat = torch.cat([*(p.grad.reshape(-1) for p in params), loss.detach().reshape(1)])  # type: ignore[union-attr]
    total = torch.from_numpy(service.allreduce(b, flat.numpy()))
    start = 0
    for p in params:
        assert p.grad is not None
        p.grad.copy_(total[start:start + p.numel()].view_as(p.grad))
        start += p.numel()
    return float(total[-1])


def initial_rows(cfg: RunConfig, vocab: list[np.ndarray]) -> list[np.ndarray]:
    """The rows the shards create for ``vocab``'s ids (a function of seed, id and column)."""
    register()
    ps = ps_config(cfg)
    return [make_table(ps, spec).lookup(ids) for spec, ids in zip(ps.table_specs(), vocab, strict=True)]


def run_local(train: Any, held_out: Any | None, cfg: RunConfig) -> Report:
    """The same training with ``nn.EmbeddingBag`` tables and ``torch.optim.SparseAdam`` here.
    At staleness k, step t computes with the rows as they were after the update of step
    t - k - 1 and SparseAdam applies its gradient to the current rows, as over the PS."""
    if cfg.sparse_optimizer != SPARSE_ADAM:
        raise ValueError(f"the reference uses torch.optim.SparseAdam: the PS must run {SPARSE_ADAM}")
    datasets = [train] if held_out is None else [train, held_out]
    vocab = vocabulary(*datasets, keep_missing=cfg.keep_missing)
    embeddings = LocalEmbeddingBagCollection(TABLES, vocab, initial_rows(cfg, vocab), cfg.pooling)
    model = make_model(embeddings, cfg)
    sparse = torch.optim.SparseAdam(list(embeddings.parameters()), lr=cfg.lr)
    own = {id(p) for p in embeddings.parameters()}
    optimizer = dense_optimizer([p for p in model.parameters() if id(p) not in own], cfg)
    report = Report()
    progress = Progress(cfg.progress_every, cfg.steps, "reference")
    weights = [bag.weight for bag in embeddings.bags]
    after: dict[int, list[torch.Tensor]] = {0: [w.detach().clone() for w in weights]}  # t -> rows after t - 1
    started = time.perf_counter()
    for t, batch in enumerate(batches(train, cfg.batch_size, cfg.steps, cfg.keep_missing)):
        current = None
        if cfg.staleness:
            current = swap(weights, after[max(0, t - cfg.staleness)])
            after.pop(t - cfg.staleness, None)  # the last step that reads it
        loss = bce(model(batch), batch.labels)
        optimizer.zero_grad()
        sparse.zero_grad()
        loss.backward()
        if current is not None:
            swap(weights, current)
        optimizer.step()
        sparse.step()
        if cfg.staleness:
            after[t + 1] = [w.detach().clone() for w in weights]
        report.losses.append(loss.item())
        progress.step(len(report.losses), report.losses[-1])
    report.seconds = report.compute = time.perf_counter() - started
    if held_out is not None:
        started = time.perf_counter()
        report.auc, report.logloss = evaluate(model, held_out, cfg)
        report.eval_seconds = time.perf_counter() - started
    return report


def swap(weights: list[torch.Tensor], values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Put ``values`` into ``weights``; returns what they held."""
    with torch.no_grad():
        held = [w.detach().clone() for w in weights]
        for w, v in zip(weights, values, strict=True):
            w.copy_(v)
    return held


def max_relative_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise ValueError(f"{len(a)} losses against {len(b)}")
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(x - y) / np.abs(y))) if len(x) else 0.0

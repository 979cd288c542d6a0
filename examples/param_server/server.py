"""One PS shard: serves lookups and applies pushes for every worker over rvz.

The shard owns one ``EmbeddingStore``. For each worker it runs two loops, one per channel of
protocol.py, each receiving step 0, 1, 2, ... until the worker sends ``END``. Housekeeping
runs on the push path, where the store changes anyway: frequency eviction and incremental
export every N pushes (N counted by the replicated global step, so all shards run them at
the same steps).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import rvz

from ..common import run_together
from .protocol import LOOKUP_IDS, LOOKUP_ROWS, PUSH_ACK, PUSH_GRADS, PUSH_IDS, WORKER_JOB, edge, is_end
from .store import EmbeddingStore, Export


@dataclass
class ShardStats:
    lookups: int = 0
    ids_looked_up: int = 0
    pushes: int = 0
    ids_pushed: int = 0
    evicted_by_policy: int = 0
    exports: list[tuple[int, int, int, int]] = field(default_factory=list)  # since, version, rows, deleted


class ShardServer:
    """Serves ``store`` on ``node`` (a task of the ``ps`` job) to ``num_workers`` workers.

    ``evict_every``: every that many pushes, drop rows looked up fewer than ``min_count``
    times since the previous round (0: never). ``export_every``: every that many pushes,
    take an incremental export and hand it to ``on_export`` (0: never).
    """

    def __init__(self, node: rvz.Node, store: EmbeddingStore, num_workers: int, *,
                 worker_job: str = WORKER_JOB, evict_every: int = 0, min_count: int = 2,
                 export_every: int = 0, on_export: Any = None) -> None:
        self.node = node
        self.shard = node.task
        self.store = store
        self.num_workers = num_workers
        self.worker_job = worker_job
        self.evict_every = evict_every
        self.min_count = min_count
        self.export_every = export_every
        self.on_export = on_export
        self.exported_version = 0
        self.stats = ShardStats()

    def _edge(self, kind: str, worker: int, step: int) -> rvz.Key:
        return edge(kind, worker, self.shard, step, self.worker_job)

    async def serve(self) -> ShardStats:
        """Serve until every worker closed both its channels."""
        loops = []
        for worker in range(self.num_workers):
            loops.append(self._serve_lookups(worker))
            loops.append(self._serve_pushes(worker))
        await run_together(*loops)
        return self.stats

    async def _serve_lookups(self, worker: int) -> None:
        for step in itertools.count():
            ids = await self.node.recv(self._edge(LOOKUP_IDS, worker, step))
            if is_end(ids):
                return
            rows = self.store.lookup(self._checked_ids(ids, worker, step))
            await self.node.send(self._edge(LOOKUP_ROWS, worker, step), rows)
            self.stats.lookups += 1
            self.stats.ids_looked_up += len(ids)

    async def _serve_pushes(self, worker: int) -> None:
        for step in itertools.count():
            ids = await self.node.recv(self._edge(PUSH_IDS, worker, step))
            if is_end(ids):
                return
            grads = await self.node.recv(self._edge(PUSH_GRADS, worker, step))
            ids = self._checked_ids(ids, worker, step)
            if grads.dtype != np.float32 or grads.shape != (len(ids), self.store.dim):
                raise ValueError(f"shard {self.shard}: worker {worker} step {step} pushed "
                                 f"{grads.dtype}{list(grads.shape)} gradients for {len(ids)} ids "
                                 f"of dim {self.store.dim}")
            self.store.apply_gradients(ids, grads)
            self.stats.pushes += 1
            self.stats.ids_pushed += len(ids)
            self._housekeeping()
            ack = np.array([self.store.global_step, self.store.version], dtype=np.int64)
            await self.node.send(self._edge(PUSH_ACK, worker, step), ack)

    def _checked_ids(self, ids: Any, worker: int, step: int) -> np.ndarray:
        if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 1:
            raise ValueError(f"shard {self.shard}: worker {worker} step {step} sent ids that are "
                             f"not a 1-D int64 array: {type(ids).__name__} "
                             f"{getattr(ids, 'dtype', '')}{list(getattr(ids, 'shape', []))}")
        return ids

    def _housekeeping(self) -> None:
        step = self.store.global_step
        if self.evict_every and step % self.evict_every == 0:
            self.stats.evicted_by_policy += self.store.evict(self.min_count)
        if self.export_every and step % self.export_every == 0:
            self.export()

    def export(self) -> Export:
        """Take the incremental export since the previous one (and forget its tombstones)."""
        exported = self.store.export_since(self.exported_version)
        self.exported_version = exported.version
        self.store.forget_deletions(exported.version)
        self.stats.exports.append((exported.since, exported.version, len(exported.ids),
                                   len(exported.deleted)))
        if self.on_export is not None:
            self.on_export(exported)
        return exported

    def summary(self) -> dict[str, Any]:
        return {"shard": self.shard, **self.store.stats(), **self.store.optimizer.hot_state(),
                "lookups": self.stats.lookups, "ids_looked_up": self.stats.ids_looked_up,
                "pushes": self.stats.pushes, "ids_pushed": self.stats.ids_pushed,
                "exports": list(self.stats.exports)}

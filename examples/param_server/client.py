"""The worker's side of the parameter server: dedup, shard, look up, scatter back, push.

``PSClient`` turns a batch of (possibly repeated) ids into one message per shard holding
only that shard's unique ids, and reassembles the replies in the caller's order. Pushes
are summed per id first, so every id reaches the optimizer once per step.
"""

from __future__ import annotations

import asyncio

import numpy as np

import rvz

from .protocol import END, LOOKUP_IDS, LOOKUP_ROWS, PUSH_ACK, PUSH_GRADS, PUSH_IDS, WORKER_JOB, edge
from .sparse import as_ids, split_by_shard, sum_by_id


class PSClient:
    """Talks to ``num_shards`` PS shards from ``node`` (a task of the worker job).

    Steps are numbered per channel from 0 (see protocol.py); pass ``step=`` to have a wrong
    sequence caught here instead of as a hang on the shard. ``timeout`` bounds each wait for
    a reply, so a lost shard is an error, not a hang.
    """

    def __init__(self, node: rvz.Node, num_shards: int, dim: int, *, timeout: float | None = 30.0,
                 worker_job: str = WORKER_JOB) -> None:
        if node.job != worker_job:
            raise ValueError(f"the client runs on a {worker_job!r} task, not on {node.name}")
        self.node = node
        self.worker = node.task
        self.num_shards = num_shards
        self.dim = dim
        self.timeout = timeout
        self.worker_job = worker_job
        self.next_step = {"lookup": 0, "push": 0}
        self.closed = False

    def _edge(self, kind: str, shard: int, step: int) -> rvz.Key:
        return edge(kind, self.worker, shard, step, self.worker_job)

    def _take_step(self, channel: str, step: int | None) -> int:
        # Taken before the first await: concurrent calls still get distinct, ordered steps.
        if self.closed:
            raise RuntimeError("the PS client is closed")
        expected = self.next_step[channel]
        if step is not None and step != expected:
            raise ValueError(f"{channel} step {step} out of order: the shards expect step {expected}")
        self.next_step[channel] = expected + 1
        return expected

    async def _recv_all(self, kind: str, step: int) -> list[object]:
        return list(await asyncio.gather(*(
            self.node.recv(self._edge(kind, shard, step), timeout=self.timeout)
            for shard in range(self.num_shards))))

    # -- lookup --------------------------------------------------------------------------------

    async def lookup(self, ids: np.ndarray, step: int | None = None) -> np.ndarray:
        """Embeddings of ``ids`` (any shape, repeats allowed): ``ids.shape + (dim,)``."""
        ids = np.asarray(ids, dtype=np.int64)
        unique, inverse = np.unique(ids.reshape(-1), return_inverse=True)
        rows = await self.lookup_unique(unique, step)
        return rows[inverse.reshape(-1)].reshape(ids.shape + (self.dim,))

    async def lookup_unique(self, unique: np.ndarray, step: int | None = None) -> np.ndarray:
        """Rows (``[len(unique), dim]``) of ids the caller already made unique."""
        step = self._take_step("lookup", step)
        unique = as_ids(unique)
        owned = split_by_shard(unique, self.num_shards)
        for shard, positions in enumerate(owned):
            await self.node.send(self._edge(LOOKUP_IDS, shard, step), unique[positions])
        replies = await self._recv_all(LOOKUP_ROWS, step)
        rows = np.empty((len(unique), self.dim), dtype=np.float32)
        for shard, (positions, reply) in enumerate(zip(owned, replies, strict=True)):
            if not isinstance(reply, np.ndarray) or reply.shape != (len(positions), self.dim):
                raise ValueError(f"shard {shard} answered lookup step {step} with "
                                 f"{getattr(reply, 'shape', type(reply).__name__)}, expected "
                                 f"{(len(positions), self.dim)}")
            rows[positions] = reply
        return rows

    # -- push ------------------------------------------------------------------------------------

    async def push(self, ids: np.ndarray, grads: np.ndarray, step: int | None = None) -> np.ndarray:
        """Push gradients of ``ids`` (repeats summed); see ``push_unique``."""
        grads = np.asarray(grads, dtype=np.float32).reshape(-1, self.dim)
        unique, summed = sum_by_id(ids, grads)
        return await self.push_unique(unique, summed, step)

    async def push_unique(self, unique: np.ndarray, grads: np.ndarray,
                          step: int | None = None) -> np.ndarray:
        """Push one gradient row per unique id; returns once every shard applied it.

        The result is ``[num_shards, 2]``: each shard's ``(global_step, version)`` after the
        update, so a caller can see that the replicated global step agrees.
        """
        step = self._take_step("push", step)
        unique = as_ids(unique)
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        if grads.shape != (len(unique), self.dim):
            raise ValueError(f"gradients {grads.shape} do not match {len(unique)} ids of dim {self.dim}")
        for shard, positions in enumerate(split_by_shard(unique, self.num_shards)):
            await self.node.send(self._edge(PUSH_IDS, shard, step), unique[positions])
            await self.node.send(self._edge(PUSH_GRADS, shard, step), grads[positions])
        acks = await self._recv_all(PUSH_ACK, step)
        return np.stack([np.asarray(a, dtype=np.int64) for a in acks])

    async def close(self) -> None:
        """Tell every shard this worker is done: ``END`` on both channels."""
        if self.closed:
            return
        self.closed = True
        for shard in range(self.num_shards):
            await self.node.send(self._edge(LOOKUP_IDS, shard, self.next_step["lookup"]), END)
            await self.node.send(self._edge(PUSH_IDS, shard, self.next_step["push"]), END)

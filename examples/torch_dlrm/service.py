"""The Embedding Graph of one torch worker: PS pulls ahead at staleness k, pushes, reads.

``EmbeddingService`` owns an rvz Node and a ``PSClient`` on an event loop of its own, in a
background thread, so that a plain (synchronous) torch training loop can use the parameter
server. It is the embedding pipeline's EG for several tables: the batches come from a
``PipelineDataset`` and cross to the torch side (MG) through the pipeline's
``ExchangeManager``, as rvz keys in the batch's own step. Staleness k, exactly as there: the
rows used at step t are those after the sparse update of step t - k - 1:

    pull rows for steps 0..k (one PS pull, their union)
    for s = 0, 1, ...:  wait for MG's gradients of step s
                        push step s, wait for its acknowledgement
                        pull rows for step s + k + 1

With k = 0 that is the sequential loop; with k >= 1 the push of step t - 1 and the pull of
step t + k run while torch computes step t. The PS runs ``bsp``: with several workers, the
pushes of one clock are applied together, in worker order.

The torch side calls ``batches()`` (the batches in order, numbered, each once its rows are
here), ``take(batch)`` (its unique ids, their positions and rows, per table),
``give(b, grads)`` (the summed gradient of each unique row), ``allreduce(b, vector)``
(several workers: the dense gradients summed over every worker by the pipeline's ring
all-reduce) and ``read(ids)`` (read-only rows, for evaluation); each blocks the calling
thread only, never the loop. Rows and gradients are float32 numpy arrays, shared with torch
without a copy.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import rvz

from ..embedding_pipeline.allreduce import ring_allreduce
from ..embedding_pipeline.exchange import (
    EMBEDDINGS,
    GRADIENTS,
    ExchangeManager,
    PipelineDataset,
    pipeline_step,
)
from ..param_server.client import PSClient
from ..param_server.protocol import WORKER_JOB, pack_rows, unpack_rows


@dataclass
class SparseBatch:
    """One batch: ``features`` maps each table to its jagged ids ``(values, offsets)``
    (int64 numpy, ``offsets[i]`` the start of sample i's bag), plus whatever the model
    needs besides (``dense``, ``labels``). ``batch_id`` is set by the service."""

    features: dict[str, tuple[np.ndarray, np.ndarray]]
    dense: Any = None
    labels: Any = None
    batch_id: int | None = None
    rows: Any = None  # with the batch id: its unique ids, their positions and rows (``take``)

    def __len__(self) -> int:
        """Samples: one bag of each table per sample."""
        _, offsets = next(iter(self.features.values()))
        return len(offsets)


@dataclass
class Timings:
    """Seconds spent, summed over the run (see ``EmbeddingService``)."""

    ps: float = 0.0        # EG in PS pulls and pushes (overlapped with compute when k >= 1)
    waiting: float = 0.0   # the torch side waiting for the next batch and its rows
    handing: float = 0.0   # the torch side handing gradients over
    reading: float = 0.0   # read-only lookups (evaluation)
    allreduce: float = 0.0  # the torch side in the dense all-reduce (several workers)
    loop_cpu: float = 0.0  # CPU time of the service's thread from start to finish (rvz, the
                           # PS client, the hand-offs: work that shares the GIL with torch)


class EmbeddingService:
    """EG of worker ``task`` of ``cluster`` against ``num_shards`` PS shards serving ``dims``
    (``{table: dim}``, in the shards' order). ``start(source)`` starts it on the batches of
    ``source`` (``SparseBatch`` objects, in training order); ``close()`` ends it."""

    def __init__(self, cluster: dict[str, list[str]], task: int, num_shards: int, dims: dict[str, int], *,
                 staleness: int = 0, workers: int = 1, timeout: float = 60.0, mode: str = "send",
                 loop: str = "auto", node_options: dict[str, Any] | None = None) -> None:
        if staleness < 0:
            raise ValueError("staleness must be >= 0")
        self.cluster, self.task, self.num_shards = cluster, task, num_shards
        self.dims = dict(dims)
        self.names = list(self.dims)
        self.staleness = staleness
        self.workers = workers
        self.timeout = timeout
        self.mode = mode
        self.loop_name = loop
        self.node_options = dict(node_options or {})
        self.timings = Timings()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._node: rvz.Node | None = None
        self.ps: PSClient | None = None
        self.exchange: ExchangeManager | None = None
        self._mg: Iterator[int] | None = None
        self._eg: asyncio.Future[None] | None = None
        self._given: Any = None  # the last hand-off of gradients (a concurrent future)
        self._cpu_started = 0.0
        self._inflight: set[int] = set()  # PS clocks of calls not finished

    # -- life ------------------------------------------------------------------------------

    def start(self, source: Iterable[SparseBatch]) -> None:
        self.loop = rvz.new_event_loop(self.loop_name)  # type: ignore[arg-type]
        self._thread = threading.Thread(target=self.loop.run_forever, name="embedding-graph", daemon=True)
        self._thread.start()
        try:
            self._call(self._open(source))
        except BaseException:
            self.close()
            raise

    async def _open(self, source: Iterable[SparseBatch]) -> None:
        self._node = rvz.Node(self.cluster, WORKER_JOB, self.task, mode=self.mode, **self.node_options)
        await self._node.__aenter__()
        # The shards are never restarted in these runs: a lost one fails the step at once.
        self.ps = PSClient(self._node, self.num_shards, self.dims, timeout=self.timeout, restart_timeout=0)
        await self.ps.connect()
        self.exchange = ExchangeManager(self._node, timeout=self.timeout)
        dataset = PipelineDataset(source, self.exchange)
        self._mg = dataset.iterator("mg")
        self._eg = asyncio.ensure_future(self._embedding_graph(dataset.iterator("eg")))
        self._cpu_started = time.thread_time()

    def _call(self, coro: Any) -> Any:
        """Run ``coro`` on the service's loop and wait for its result in this thread; if the
        wait ends otherwise (a signal, say), ``coro`` is cancelled."""
        assert self.loop is not None
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def finish(self) -> None:
        """Wait until every batch was pushed and acknowledged (EG done)."""
        if self._given is not None:
            self._given.result()
        if self._eg is not None:
            self._call(self._wait_eg())

    async def _wait_eg(self) -> None:
        assert self._eg is not None
        await self._eg
        self.timings.loop_cpu = time.thread_time() - self._cpu_started

    def close(self) -> None:
        """End EG (cancelled if still running), tell the shards this worker is done, close
        the node and stop the loop's thread."""
        if self.loop is None:
            return
        try:
            self._call(self._close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            assert self._thread is not None
            self._thread.join(timeout=self.timeout)
            self.loop.close()
            self.loop = None

    async def _close(self) -> None:
        if self._eg is not None and not self._eg.done():
            self._eg.cancel()
            await asyncio.gather(self._eg, return_exceptions=True)
        try:
            if self.ps is not None:
                # A PS clock left half done (EG failed or was cancelled in it): every shard
                # drops it and counts it as an empty push, so none waits for it.
                for clock in sorted(self._inflight):
                    await asyncio.wait_for(self.ps.abort_step(clock), self.timeout)
                await asyncio.wait_for(self.ps.close(), self.timeout)
        finally:
            if self._node is not None:
                await self._node.__aexit__(None, None, None)

    # -- EG (on the loop) --------------------------------------------------------------------

    def _index(self, b: int) -> list[np.ndarray]:
        """Batch ``b``'s unique ids per table (kept by the exchange with each id's position)."""
        assert self.exchange is not None
        batch: SparseBatch = self.exchange.samples(b)
        uniques, inverses = [], []
        for name in self.names:
            unique, inverse = np.unique(batch.features[name][0], return_inverse=True)
            uniques.append(unique)
            inverses.append(inverse.reshape(-1))
        self.exchange.set_index(b, uniques, inverses)  # type: ignore[arg-type]
        return uniques

    async def _ps_call(self, channel: str, call: Any) -> Any:
        """``call`` on the PS ``channel`` ("lookup" or "push"); its clock is kept while it runs."""
        assert self.ps is not None
        clock = self.ps.next_step[channel]
        self._inflight.add(clock)
        started = time.perf_counter()
        try:
            return await call
        finally:
            self.timings.ps += time.perf_counter() - started
        self._inflight.discard(clock)  # (not on a failure: that clock is cleaned up by _close)

    async def _pull(self, batch_ids: list[int]) -> None:
        """One PS pull for ``batch_ids`` (the union of their ids); each batch's rows to MG."""
        assert self.ps is not None and self.exchange is not None
        uniques = [self._index(b) for b in batch_ids]
        union = {name: uniques[0][t] if len(uniques) == 1 else
                 np.unique(np.concatenate([u[t] for u in uniques])) for t, name in enumerate(self.names)}
        rows = await self._ps_call("lookup", self.ps.pull(union))
        for b, unique in zip(batch_ids, uniques, strict=True):
            parts = [rows[name] if len(uniques) == 1 else rows[name][np.searchsorted(union[name], unique[t])]
                     for t, name in enumerate(self.names)]
            await self.exchange.send(EMBEDDINGS, b, pack_rows(parts))

    async def _embedding_graph(self, batches: Iterator[int]) -> None:
        assert self.ps is not None and self.exchange is not None
        pulled = list(itertools.islice(batches, self.staleness + 1))  # pulled, not yet pushed
        if pulled:
            await self._pull(pulled)
        while pulled:
            s = pulled.pop(0)
            grads = await self.exchange.recv(GRADIENTS, s)
            uniques, _ = self.exchange.index(s)
            parts = unpack_rows(grads, [len(u) for u in uniques], [self.dims[n] for n in self.names])
            await self._ps_call("push", self.ps.push_tables(dict(zip(self.names, uniques, strict=True)),
                                                            dict(zip(self.names, parts, strict=True))))
            self.exchange.done(s, "eg")
            after = next(batches, None)
            if after is not None:
                await self._pull([after])
                pulled.append(after)

    # -- the torch side (any other thread) ----------------------------------------------------

    def batches(self) -> Iterator[SparseBatch]:
        """The source's batches in order, each with its ``batch_id``, once its rows are here
        (one wait on the loop per batch: the batch and its rows come together)."""
        while True:
            self._check_given()
            started = time.perf_counter()
            batch = self._call(self._next_batch())
            self.timings.waiting += time.perf_counter() - started
            if batch is None:
                return
            yield batch

    async def _next_batch(self) -> SparseBatch | None:
        assert self._mg is not None and self.exchange is not None and self._eg is not None
        b = next(self._mg, None)
        if b is None:
            if self._eg.done():
                await self._eg  # the source ended in EG's hands: by an error, if it failed
            return None
        batch: SparseBatch = self.exchange.samples(b)
        batch.batch_id = b
        batch.rows = await self._take(b)
        return batch

    def take(self, batch: SparseBatch) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        """``batch``'s unique ids, each id's position among them, and their rows (per table);
        once for each batch of ``batches()``."""
        if batch.rows is None:
            raise ValueError(f"batch {batch.batch_id}: its rows were taken already, or it does not come "
                             "from this service's batches()")
        rows, batch.rows = batch.rows, None
        return rows

    async def _take(self, b: int) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        assert self.exchange is not None
        rows = await self._until_eg_fails(self.exchange.recv(EMBEDDINGS, b))
        uniques, inverses = self.exchange.index(b)
        if not rows.flags.writeable:
            rows = rows.copy()  # torch shares only writeable memory
        parts = unpack_rows(rows, [len(u) for u in uniques], [self.dims[n] for n in self.names])
        return uniques, inverses, parts  # type: ignore[return-value]

    async def _until_eg_fails(self, call: Any) -> Any:
        """``call``'s result; EG's error instead, should EG fail first (no wait for a
        hand-off that will never come)."""
        assert self._eg is not None
        work = asyncio.ensure_future(call)
        try:
            while not work.done():
                if self._eg.done():
                    if self._eg.cancelled() or self._eg.exception() is not None:
                        await self._eg
                    await work
                    break
                await asyncio.wait([work, self._eg], return_when=asyncio.FIRST_COMPLETED)
            return work.result()
        finally:
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)

    def give(self, b: int, grads: list[np.ndarray]) -> None:
        """Hand batch ``b``'s gradients to EG: one float32 row per unique id of each table, in
        ``take``'s order. The torch side is then done with the batch. Returns without waiting
        for the loop (a failure shows at the next ``take``, or at ``finish``)."""
        assert self.loop is not None
        started = time.perf_counter()
        self._given = asyncio.run_coroutine_threadsafe(self._give(b, pack_rows(grads)), self.loop)
        self.timings.handing += time.perf_counter() - started

    def _check_given(self) -> None:
        if self._given is not None and self._given.done():
            self._given.result()  # raises what the hand-off raised

    async def _give(self, b: int, packed: np.ndarray) -> None:
        assert self.exchange is not None
        await self.exchange.send(GRADIENTS, b, packed)
        self.exchange.done(b, "mg")

    def allreduce(self, b: int, vector: np.ndarray) -> np.ndarray:
        """The sum of ``vector`` (float32) over every worker's, for batch ``b``: the
        pipeline's ring all-reduce, in the batch's rvz step."""
        if self.workers == 1:
            return vector
        assert self._node is not None
        started = time.perf_counter()
        total: np.ndarray = self._call(self._until_eg_fails(ring_allreduce(
            self._node, vector, self.workers, step=pipeline_step(b), tag=b, timeout=self.timeout)))
        self.timings.allreduce += time.perf_counter() - started
        return total

    def read(self, ids: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The current rows of ``ids`` (``{table: ids}``), read without a clock and without
        creating or touching any row (an absent id reads as its initial row)."""
        assert self.ps is not None
        started = time.perf_counter()
        out: dict[str, np.ndarray] = self._call(self.ps.read(ids))
        self.timings.reading += time.perf_counter() - started
        return out

"""The EG/MG training loop: Embedding Graph and Main Graph running concurrently.

EG (two coroutines):
  * lookup stage: for each batch, make its ids unique (kept in the exchange as the
    unique-id index), fetch those rows from the parameter server, mean-pool them per field
    and hand the ``[batch, fields, dim]`` vectors to MG;
  * update stage: take MG's gradients for the batch, spread them back over the bag and
    sum them per unique id, push them to the parameter server (which applies Adagrad/Adam).
MG (one coroutine): dense forward/backward and dense update; its numpy work runs in a
thread so the event loop stays free for EG's traffic meanwhile.

Prefetch depth ``p``: the lookup of batch ``b`` may start once the updates of batches up to
``b - p - 1`` are applied, so up to ``p`` batches are looked up ahead of the one MG works on.
``p = 0`` is fully synchronous (lookup, dense step, update, next lookup); ``p = 2`` lets
lookups overlap dense compute at the price of reading rows up to two updates stale.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..common import run_together
from ..param_server.client import PSClient
from ..param_server.sparse import segment_sum
from .data import Batch
from .exchange import EMBEDDINGS, GRADIENTS, ExchangeManager, PipelineDataset
from .model import DenseModel


@dataclass
class RunResult:
    prefetch: int
    batches: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    max_lookahead: int = 0   # most batches EG had looked up beyond the one MG was on
    mg_waiting: float = 0.0  # seconds MG spent waiting for embeddings (not overlapped)
    exchange: ExchangeManager | None = None

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.seconds if self.seconds > 0 else 0.0

    def loss_drop(self, fraction: float = 0.2) -> tuple[float, float]:
        """Mean loss of the first and of the last ``fraction`` of the batches."""
        n = max(1, int(len(self.losses) * fraction))
        return float(np.mean(self.losses[:n])), float(np.mean(self.losses[-n:]))


class EmbeddingGraph:
    """EG: lookups ahead (bounded by the prefetch window) and sparse updates, in batch order."""

    def __init__(self, ps: PSClient, exchange: ExchangeManager, result: RunResult, *,
                 prefetch: int, timeout: float | None) -> None:
        if prefetch < 0:
            raise ValueError("prefetch must be >= 0")
        self.ps = ps
        self.exchange = exchange
        self.result = result
        self.timeout = timeout
        # One permit per batch between "lookup started" and "update applied".
        self.window = asyncio.Semaphore(prefetch + 1)
        self.to_update: asyncio.Queue[int | None] = asyncio.Queue()
        self.mg_finished = 0  # batches MG is done with (MG updates it)
        # The PS numbers each channel's steps; batch ids continue from where they are.
        self.first_lookup_step = ps.next_step["lookup"]
        self.first_push_step = ps.next_step["push"]

    async def lookups(self, batch_ids: Iterable[int]) -> None:
        try:
            for batch_id in batch_ids:
                await self.window.acquire()
                batch: Batch = self.exchange.samples(batch_id)
                unique, inverse = np.unique(batch.ids.reshape(-1), return_inverse=True)
                inverse = inverse.reshape(-1)
                self.exchange.set_index(batch_id, unique, inverse)
                rows = await self.ps.lookup_unique(unique, step=self.first_lookup_step + batch_id)
                size, fields, bag = batch.ids.shape
                pooled = rows[inverse].reshape(size, fields, bag, -1).mean(axis=2)
                self.exchange.send(EMBEDDINGS, batch_id, pooled)
                self.result.max_lookahead = max(self.result.max_lookahead, batch_id - self.mg_finished)
                self.to_update.put_nowait(batch_id)
        finally:
            self.to_update.put_nowait(None)  # no more batches: the update stage may finish

    async def updates(self) -> None:
        while (batch_id := await self.to_update.get()) is not None:
            grads = await self.exchange.recv(GRADIENTS, batch_id, timeout=self.timeout)
            unique, inverse = self.exchange.index(batch_id)
            size, fields, bag = self.exchange.samples(batch_id).ids.shape
            # Mean pooling: each id of a bag gets the bag's gradient divided by the bag size.
            per_id = np.broadcast_to((grads / bag)[:, :, None, :], (size, fields, bag, grads.shape[-1]))
            summed = segment_sum(per_id.reshape(-1, grads.shape[-1]), inverse, len(unique))
            await self.ps.push_unique(unique, summed, step=self.first_push_step + batch_id)
            self.window.release()
            self.exchange.done(batch_id, "eg")


async def main_graph(model: DenseModel, exchange: ExchangeManager, batch_ids: Iterable[int],
                     eg: EmbeddingGraph, result: RunResult, *, timeout: float | None,
                     compute_in_thread: bool) -> None:
    """MG: dense step per batch, gradients back to EG."""
    for batch_id in batch_ids:
        waited = time.perf_counter()
        x = await exchange.recv(EMBEDDINGS, batch_id, timeout=timeout)
        result.mg_waiting += time.perf_counter() - waited
        labels = exchange.samples(batch_id).labels
        if compute_in_thread:
            loss, dx = await asyncio.to_thread(model.train_step, x, labels)
        else:
            loss, dx = model.train_step(x, labels)
        exchange.send(GRADIENTS, batch_id, dx)
        exchange.done(batch_id, "mg")
        result.losses.append(loss)
        eg.mg_finished += 1


async def train(ps: PSClient, batches: Iterable[Batch], model: DenseModel, *, prefetch: int = 2,
                timeout: float | None = 30.0, compute_in_thread: bool = True) -> RunResult:
    """Train on ``batches`` with EG and MG running concurrently; returns losses and timing.

    Global batch ids start at 0; the PS steps continue from where ``ps`` left off.
    """
    exchange = ExchangeManager()
    dataset = PipelineDataset(batches, exchange)
    result = RunResult(prefetch=prefetch, exchange=exchange)
    eg = EmbeddingGraph(ps, exchange, result, prefetch=prefetch, timeout=timeout)
    started = time.perf_counter()
    try:
        await run_together(
            eg.lookups(dataset.iterator("eg")),
            eg.updates(),
            main_graph(model, exchange, dataset.iterator("mg"), eg, result, timeout=timeout,
                       compute_in_thread=compute_in_thread))
    except BaseException as exc:
        exchange.abort(exc)
        raise
    result.seconds = time.perf_counter() - started
    result.batches = len(result.losses)
    return result

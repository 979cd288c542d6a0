"""The example applications: the sparse parameter server and the EG/MG embedding pipeline.

Store and model tests are plain numpy. Everything that moves data runs in-process on real
rvz Nodes over loopback (several Nodes on one loop), on both loops and in both rvz modes.
The two ``python -m`` demos are run once per loop as real multi-process runs. Numbers are
compared against numpy references written here, independently of the examples' code.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rvz
from examples.embedding_pipeline.data import Batch, TaskSpec, synthetic_batches
from examples.embedding_pipeline.exchange import (
    EMBEDDINGS,
    GRADIENTS,
    ExchangeManager,
    PipelineDataset,
)
from examples.embedding_pipeline.model import DenseModel
from examples.embedding_pipeline.trainer import train
from examples.param_server.client import PSClient
from examples.param_server.launch import PSConfig, make_store
from examples.param_server.optimizers import Adagrad, Adam
from examples.param_server.protocol import PUSH_ACK, PUSH_GRADS, PUSH_IDS, edge
from examples.param_server.server import ShardServer
from examples.param_server.sparse import seeded_uniform, shard_of, sum_by_id
from examples.param_server.store import EmbeddingStore, Export

from .conftest import free_ports

MODES = ["recv", "send"]
REPO = Path(__file__).resolve().parent.parent
DIM = 4


# -- numpy references (written independently of the examples) -------------------------------

def adagrad_reference(w: np.ndarray, acc: np.ndarray, g: np.ndarray, lr: float) -> None:
    acc += g * g
    w -= lr * g / np.sqrt(acc)


def adam_reference(w: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, t: int,
                   lr: float = 0.01, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> None:
    m[:] = b1 * m + (1 - b1) * g
    v[:] = b2 * v + (1 - b2) * g * g
    lr_t = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    w -= lr_t * m / (np.sqrt(v) + eps)


def initial_embedding(id_: int, store: EmbeddingStore) -> np.ndarray:
    return store.init_scale * seeded_uniform(np.array([id_]), store.dim, store.seed)[0].astype(np.float64)


# -- sparse helpers ------------------------------------------------------------------------------

def test_sharding_is_deterministic_and_spreads_ids() -> None:
    ids = np.arange(10_000, dtype=np.int64)
    owner = shard_of(ids, 4)
    assert np.array_equal(owner, shard_of(ids.copy(), 4))
    counts = np.bincount(owner, minlength=4)
    assert counts.min() > 2000, counts  # a hash: consecutive ids do not pile on one shard
    assert set(shard_of(ids, 1).tolist()) == {0}


def test_seeded_init_depends_on_id_and_seed_only() -> None:
    a = seeded_uniform(np.array([3, 99, 3]), 5, seed=1)
    assert a.shape == (3, 5) and a.dtype == np.float32
    assert np.array_equal(a[0], a[2]) and not np.array_equal(a[0], a[1])
    assert np.array_equal(seeded_uniform(np.array([99]), 5, seed=1)[0], a[1])
    assert not np.array_equal(seeded_uniform(np.array([3]), 5, seed=2)[0], a[0])
    assert np.all(a >= -1) and np.all(a < 1)


def test_sum_by_id_sums_duplicates() -> None:
    ids = np.array([7, 3, 7, 1, 3])
    grads = np.arange(10, dtype=np.float32).reshape(5, 2)
    unique, summed = sum_by_id(ids, grads)
    assert unique.tolist() == [1, 3, 7]
    assert summed.tolist() == [[6, 7], [2 + 8, 3 + 9], [0 + 4, 1 + 5]]
    unique, summed = sum_by_id(np.array([5, 2]), grads[:2])  # no duplicates: just reordered
    assert unique.tolist() == [2, 5] and summed.tolist() == [[2, 3], [0, 1]]


# -- the store ----------------------------------------------------------------------------------

def test_store_creates_rows_on_first_lookup_and_grows() -> None:
    store = EmbeddingStore(DIM, Adagrad(), seed=7, init_scale=0.5, capacity=4)
    ids = np.array([10, 20, 10, 30, 40, 50, 60], dtype=np.int64)
    rows = store.lookup(ids)
    assert rows.shape == (7, DIM) and rows.dtype == np.float32
    assert len(store) == 6 and store.created == 6
    assert store.capacity == 8  # doubled once past 4 rows
    for id_, row in zip(ids.tolist(), rows, strict=True):
        np.testing.assert_allclose(row, initial_embedding(id_, store), rtol=1e-6)
    # The slots start at Adagrad's initial accumulator, in the same row.
    np.testing.assert_allclose(store.peek(np.array([20]))[0, DIM:], 0.1)
    # Another store with the same seed creates the same rows, in any order.
    other = EmbeddingStore(DIM, Adagrad(), seed=7, init_scale=0.5)
    np.testing.assert_array_equal(other.lookup(ids[::-1])[::-1], rows)
    with pytest.raises(KeyError):
        store.peek(np.array([11]))


def test_store_adagrad_update_matches_numpy_reference() -> None:
    lr = 0.3
    store = EmbeddingStore(DIM, Adagrad(lr=lr, initial_accumulator=0.1), seed=1, init_scale=0.1)
    rng = np.random.default_rng(0)
    ref_w: dict[int, np.ndarray] = {}
    ref_acc: dict[int, np.ndarray] = {}
    for _ in range(5):
        ids = rng.integers(0, 12, size=9)  # duplicates on purpose
        grads = rng.standard_normal((9, DIM)).astype(np.float32)
        store.apply_gradients(ids, grads)
        summed: dict[int, np.ndarray] = {}
        for id_, g in zip(ids.tolist(), grads.astype(np.float64), strict=True):
            summed[id_] = summed.get(id_, 0) + g
        for id_, g in summed.items():
            w = ref_w.setdefault(id_, initial_embedding(id_, store))
            acc = ref_acc.setdefault(id_, np.full(DIM, 0.1))
            adagrad_reference(w, acc, g, lr)
    assert store.global_step == 5
    for id_ in ref_w:
        row = store.peek(np.array([id_]))[0]
        np.testing.assert_allclose(row[:DIM], ref_w[id_], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(row[DIM:], ref_acc[id_], rtol=1e-5, atol=1e-6)


def test_store_adam_update_matches_numpy_reference() -> None:
    store = EmbeddingStore(DIM, Adam(lr=0.01), seed=2, init_scale=0.1)
    ids = np.array([4, 8, 15])
    rng = np.random.default_rng(1)
    w = {i: initial_embedding(i, store) for i in ids.tolist()}
    m = {i: np.zeros(DIM) for i in w}
    v = {i: np.zeros(DIM) for i in w}
    for t in range(1, 5):
        # Row 15 only in odd steps: lazy Adam leaves a row alone when it is not pushed,
        # while the step (and beta powers) advance for the whole shard.
        chosen = ids if t % 2 else ids[:2]
        grads = rng.standard_normal((len(chosen), DIM)).astype(np.float32)
        store.apply_gradients(chosen, grads)
        for id_, g in zip(chosen.tolist(), grads.astype(np.float64), strict=True):
            adam_reference(w[id_], m[id_], v[id_], g, t)
    opt = store.optimizer
    assert isinstance(opt, Adam)
    assert store.global_step == 4
    assert opt.beta1_power == pytest.approx(0.9 ** 4) and opt.beta2_power == pytest.approx(0.999 ** 4)
    for id_ in w:
        row = store.peek(np.array([id_]))[0]
        np.testing.assert_allclose(row[:DIM], w[id_], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(row[DIM:2 * DIM], m[id_], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(row[2 * DIM:], v[id_], rtol=1e-5, atol=1e-9)


def test_store_evicts_rare_rows_deletes_and_shrinks() -> None:
    store = EmbeddingStore(DIM, Adagrad(), seed=3, capacity=4)
    hot = np.array([1, 2, 3])
    cold = np.arange(100, 160)
    store.lookup(hot)
    store.lookup(hot)
    store.lookup(cold)
    assert len(store) == 63 and store.capacity == 64
    before = store.lookup(np.array([2]))[0].copy()

    assert store.evict(min_count=2) == 60  # seen once: gone
    assert sorted(store.ids().tolist()) == [1, 2, 3]
    assert store.capacity < 64  # compacted once three quarters were free
    np.testing.assert_array_equal(store.lookup(np.array([2]))[0], before)  # survivors intact

    assert store.delete(np.array([3, 999])) == 1  # explicit delete; absent ids ignored
    assert 3 not in store and len(store) == 2 and store.evicted == 61
    # A re-created row starts again from its seeded init, with a fresh accumulator.
    store.apply_gradients(np.array([100]), np.ones((1, DIM), dtype=np.float32))
    store.delete(np.array([100]))
    row = store.lookup(np.array([100]))[0]
    np.testing.assert_allclose(row, initial_embedding(100, store), rtol=1e-6)
    np.testing.assert_allclose(store.peek(np.array([100]))[0, DIM:], 0.1)


def test_incremental_export_returns_exactly_the_changed_rows() -> None:
    store = EmbeddingStore(DIM, Adagrad(), seed=4)
    store.lookup(np.array([5, 6, 7, 8]))
    first = store.export_since(0)
    assert first.ids.tolist() == [5, 6, 7, 8] and first.deleted.tolist() == []
    np.testing.assert_array_equal(first.embeddings, store.peek(first.ids)[:, :DIM])

    store.lookup(np.array([5, 6, 7, 8]))  # reads change nothing
    assert store.export_since(first.version).ids.tolist() == []

    store.apply_gradients(np.array([8, 6]), np.ones((2, DIM), dtype=np.float32))
    store.lookup(np.array([9, 5]))  # 9 is created, 5 only read
    store.delete(np.array([7]))
    second = store.export_since(first.version)
    assert second.ids.tolist() == [6, 8, 9]
    assert second.deleted.tolist() == [7]
    np.testing.assert_array_equal(second.rows, store.peek(np.array([6, 8, 9])))  # with slots

    assert store.export_since(second.version).ids.tolist() == []
    store.forget_deletions(second.version)
    assert store.export_since(0).deleted.tolist() == []  # tombstones already shipped


# -- the parameter server over rvz -----------------------------------------------------------------

@dataclass
class InProcessPS:
    servers: list[ShardServer]
    clients: list[PSClient]
    serving: list[asyncio.Task[Any]]

    def store_of(self, id_: int) -> EmbeddingStore:
        return self.servers[int(shard_of(np.array([id_]), len(self.servers))[0])].store

    async def finish(self) -> None:
        for client in self.clients:
            await client.close()
        await asyncio.wait_for(asyncio.gather(*self.serving), 10)


def abort_on_failure(node: rvz.Node) -> Callable[[asyncio.Future[Any]], None]:
    def done(task: asyncio.Future[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            node.abort(task.exception())
    return done


@contextlib.asynccontextmanager
async def ps_cluster(mode: str, cfg: PSConfig, shards: int = 2, workers: int = 1,
                     **server_options: object) -> AsyncIterator[InProcessPS]:
    """PS shards and workers as Nodes of one process; shards serve in background tasks."""
    ports = free_ports(shards + workers)
    cluster = {"ps": [f"127.0.0.1:{p}" for p in ports[:shards]],
               "worker": [f"127.0.0.1:{p}" for p in ports[shards:]]}
    async with contextlib.AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(rvz.Node(cluster, "ps", s, mode=mode, linger=1.0))
                 for s in range(shards)]
        servers = [ShardServer(n, make_store(cfg), workers, **server_options) for n in nodes]  # type: ignore[arg-type]
        serving = [asyncio.ensure_future(s.serve()) for s in servers]
        for node, task in zip(nodes, serving, strict=True):
            # As in a PS process, where the error leaves ``async with Node``: a failed shard
            # aborts its node, so its workers get an error instead of waiting.
            task.add_done_callback(abort_on_failure(node))
        try:
            workers_nodes = [await stack.enter_async_context(
                rvz.Node(cluster, "worker", w, mode=mode, linger=1.0)) for w in range(workers)]
            clients = [PSClient(n, shards, cfg.dim, timeout=10) for n in workers_nodes]
            yield InProcessPS(servers, clients, serving)
        finally:
            for task in serving:
                task.cancel()
            await asyncio.gather(*serving, return_exceptions=True)


@pytest.mark.parametrize("mode", MODES)
def test_ps_lookup_returns_store_rows_and_push_applies_adagrad(run, mode) -> None:  # type: ignore[no-untyped-def]
    cfg = PSConfig(dim=DIM, optimizer="adagrad", lr=0.5, seed=11, init_scale=0.2)

    async def main() -> None:
        async with ps_cluster(mode, cfg, shards=2) as ps:
            client = ps.clients[0]
            ids = np.array([[5, 7, 5], [90001, 5, 2**40 + 3]], dtype=np.int64)
            emb = await client.lookup(ids, step=0)
            assert emb.shape == (2, 3, DIM)
            owners = {int(shard_of(np.array([i]), 2)[0]) for i in ids.ravel().tolist()}
            assert owners == {0, 1}  # the batch really spans both shards
            for pos in np.ndindex(ids.shape):
                id_ = int(ids[pos])
                np.testing.assert_array_equal(emb[pos], ps.store_of(id_).peek(np.array([id_]))[0, :DIM])
                np.testing.assert_allclose(emb[pos], initial_embedding(id_, ps.store_of(id_)), rtol=1e-6)
            assert sum(len(s.store) for s in ps.servers) == 4  # unique ids only

            # Per-occurrence gradients: id 5 appears three times and gets their sum.
            grads = np.arange(2 * 3 * DIM, dtype=np.float32).reshape(2, 3, DIM) / 10
            acks = await client.push(ids, grads, step=0)
            assert acks[:, 0].tolist() == [1, 1]  # the replicated global step, on both shards
            expected = {}
            for id_ in set(ids.ravel().tolist()):
                g = grads[ids == id_].astype(np.float64).sum(axis=0)
                w, acc = initial_embedding(id_, ps.store_of(id_)), np.full(DIM, 0.1)
                adagrad_reference(w, acc, g, cfg.lr or 0.0)
                expected[id_] = w
            unique = np.array(sorted(expected))
            after = await client.lookup(unique, step=1)
            for id_, row in zip(unique.tolist(), after, strict=True):
                np.testing.assert_allclose(row, expected[id_], rtol=1e-5, atol=1e-6)

            with pytest.raises(ValueError, match="out of order"):
                await client.lookup(unique, step=5)
            await ps.finish()
            assert [s.stats.pushes for s in ps.servers] == [1, 1]
            assert [s.stats.lookups for s in ps.servers] == [2, 2]

    run(main(), timeout=15)


@pytest.mark.parametrize("mode", MODES)
def test_ps_adam_hot_state_is_replicated_on_every_shard(run, mode) -> None:  # type: ignore[no-untyped-def]
    cfg = PSConfig(dim=DIM, optimizer="adam", lr=0.01, seed=5)

    async def main() -> None:
        async with ps_cluster(mode, cfg, shards=3, workers=2) as ps:
            rng = np.random.default_rng(2)
            w: dict[int, np.ndarray] = {}
            m: dict[int, np.ndarray] = {}
            v: dict[int, np.ndarray] = {}
            t = 0
            for step in range(3):
                for client in ps.clients:  # one push at a time: a deterministic order
                    ids = rng.choice(40, size=6, replace=False).astype(np.int64)
                    await client.lookup(ids, step=step)
                    grads = rng.standard_normal((6, DIM)).astype(np.float32)
                    acks = await client.push(ids, grads, step=step)
                    t += 1
                    # Shards without ids in this push still counted it.
                    assert acks[:, 0].tolist() == [t, t, t]
                    for id_, g in zip(ids.tolist(), grads.astype(np.float64), strict=True):
                        if id_ not in w:
                            w[id_] = initial_embedding(id_, ps.store_of(id_))
                            m[id_], v[id_] = np.zeros(DIM), np.zeros(DIM)
                        adam_reference(w[id_], m[id_], v[id_], g, t)
            for server in ps.servers:
                opt = server.store.optimizer
                assert isinstance(opt, Adam)
                assert opt.step == 6 and opt.beta1_power == pytest.approx(0.9 ** 6)
            for id_, expected in w.items():
                row = ps.store_of(id_).peek(np.array([id_]))[0]
                np.testing.assert_allclose(row[:DIM], expected, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(row[DIM:2 * DIM], m[id_], rtol=1e-5, atol=1e-7)
            await ps.finish()

    run(main(), timeout=15)


@pytest.mark.parametrize("mode", MODES)
def test_ps_evicts_and_exports_on_its_push_path(run, mode) -> None:  # type: ignore[no-untyped-def]
    cfg = PSConfig(dim=DIM, seed=6)
    exports: list[Export] = []

    async def main() -> None:
        async with ps_cluster(mode, cfg, shards=1, evict_every=2, min_count=2, export_every=2,
                              on_export=exports.append) as ps:
            client = ps.clients[0]
            store = ps.servers[0].store
            hot, cold = np.array([1, 2]), np.array([50, 51, 52])
            await client.lookup(np.concatenate([hot, cold]), step=0)
            await client.push(hot, np.ones((2, DIM), dtype=np.float32), step=0)
            await client.lookup(hot, step=1)
            await client.push(np.array([], dtype=np.int64), np.zeros((0, DIM), dtype=np.float32), step=1)
            # Second push: eviction round (cold ids were looked up once), then the export.
            assert sorted(store.ids().tolist()) == [1, 2]
            assert len(exports) == 1
            assert exports[0].ids.tolist() == [1, 2] and exports[0].deleted.tolist() == [50, 51, 52]
            await client.lookup(np.array([1, 77]), step=2)
            await client.push(np.array([77, 1]), np.ones((2, DIM), dtype=np.float32), step=2)
            await client.lookup(np.array([1]), step=3)
            await client.push(np.array([], dtype=np.int64), np.zeros((0, DIM), dtype=np.float32), step=3)
            # Round two: 2 and 77 were not looked up twice since the last round, 1 was; the
            # export has 1 (updated) but not 77 (updated, then evicted).
            assert store.ids().tolist() == [1]
            assert len(exports) == 2
            assert exports[1].since == exports[0].version
            assert exports[1].ids.tolist() == [1] and exports[1].deleted.tolist() == [2, 77]
            await ps.finish()

    run(main(), timeout=15)


@pytest.mark.parametrize("mode", MODES)
def test_ps_fails_loudly_on_a_malformed_push(run, mode) -> None:  # type: ignore[no-untyped-def]
    cfg = PSConfig(dim=DIM)

    async def main() -> None:
        async with ps_cluster(mode, cfg, shards=1) as ps:
            node = ps.clients[0].node
            await node.send(edge(PUSH_IDS, 0, 0, 0), np.array([1, 2], dtype=np.int64))
            await node.send(edge(PUSH_GRADS, 0, 0, 0), np.zeros((2, DIM + 1), dtype=np.float32))
            with pytest.raises(ValueError, match="gradients for 2 ids of dim 4"):
                await asyncio.wait_for(ps.serving[0], 5)
            # The shard's node went down with the error: the worker's wait for the ack fails
            # (it does not wait for its timeout).
            with pytest.raises(rvz.RvzError):
                await node.recv(edge(PUSH_ACK, 0, 0, 0), timeout=5)

    run(main(), timeout=15)


# -- the embedding pipeline -----------------------------------------------------------------------

def test_exchange_manager_frees_a_batch_once_both_sides_are_done(run) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        exchange = ExchangeManager()
        samples = Batch(ids=np.zeros((2, 1, 1), dtype=np.int64), labels=np.zeros(2, dtype=np.float32))
        exchange.open(0, samples)
        exchange.open(1, samples)
        assert exchange.samples(0) is samples
        exchange.set_index(0, np.array([3, 4]), np.array([0, 1, 1]))
        # MG waits before EG sends, and EG's gradient wait before MG sends: either order meets.
        mg_wait = asyncio.ensure_future(exchange.recv(EMBEDDINGS, 0, timeout=5))
        await asyncio.sleep(0)
        assert exchange.pending(EMBEDDINGS, 0) == (0, 1)
        emb = np.ones((2, 1, DIM), dtype=np.float32)
        exchange.send(EMBEDDINGS, 0, emb)
        assert await mg_wait is emb
        exchange.send(GRADIENTS, 0, emb * 2)
        assert exchange.pending(GRADIENTS, 0) == (1, 0)
        assert exchange.done(0, "mg") is False
        assert exchange.live() == [0, 1]  # EG still needs the index and the gradients
        assert exchange.index(0)[0].tolist() == [3, 4]
        assert (await exchange.recv(GRADIENTS, 0)).tolist() == (emb * 2).tolist()
        assert exchange.done(0, "eg") is True
        assert exchange.live() == [1] and exchange.freed == 1 and exchange.leftovers == 0
        with pytest.raises(KeyError):
            exchange.samples(0)
        # A batch whose hand-off was never received is still freed, with what it held.
        exchange.send(EMBEDDINGS, 1, emb)
        exchange.done(1, "eg")
        exchange.done(1, "mg")
        assert exchange.live() == [] and exchange.leftovers == 1

    run(main(), timeout=5)


def test_exchange_abort_wakes_the_waiting_side_with_the_cause(run) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        exchange = ExchangeManager()
        exchange.open(0, None)
        waiting = asyncio.ensure_future(exchange.recv(GRADIENTS, 0))
        await asyncio.sleep(0)
        cause = RuntimeError("MG crashed")
        exchange.abort(cause)
        with pytest.raises(rvz.Aborted) as info:
            await waiting
        assert info.value.__cause__ is cause
        exchange.open(1, None)  # batches opened later are born aborted
        with pytest.raises(rvz.Aborted):
            await exchange.recv(EMBEDDINGS, 1)

    run(main(), timeout=5)


def test_pipeline_dataset_gives_both_sides_the_same_batches() -> None:
    read: list[int] = []

    def source():  # type: ignore[no-untyped-def]
        for i in range(5):
            read.append(i)
            yield f"batch-{i}"

    exchange = ExchangeManager()
    dataset = PipelineDataset(source(), exchange, first_id=100)
    eg, mg = dataset.iterator("eg"), dataset.iterator("mg")
    with pytest.raises(ValueError):
        dataset.iterator("eg")
    assert [next(eg), next(eg), next(eg)] == [100, 101, 102]  # EG runs ahead
    assert read == [0, 1, 2]
    assert next(mg) == 100 and read == [0, 1, 2]  # MG gets the same batch, not a new read
    assert exchange.samples(100) == "batch-0" and exchange.samples(102) == "batch-2"
    assert list(mg) == [101, 102, 103, 104]  # now MG is ahead and reads for both
    assert list(eg) == [103, 104]
    assert read == [0, 1, 2, 3, 4] and exchange.opened == 5


def test_dense_model_gradients_match_finite_differences() -> None:
    model = DenseModel(6, 5, seed=3, dtype=np.float64)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((7, 2, 3))
    labels = (rng.random(7) > 0.5).astype(np.float64)
    _, dx, grads = model.loss_and_grads(x, labels)
    eps = 1e-6

    def numeric(array: np.ndarray) -> np.ndarray:
        out = np.zeros_like(array)
        for i in np.ndindex(array.shape):
            old = array[i]
            array[i] = old + eps
            up = model.loss_and_grads(x, labels)[0]
            array[i] = old - eps
            down = model.loss_and_grads(x, labels)[0]
            array[i] = old
            out[i] = (up - down) / (2 * eps)
        return out

    np.testing.assert_allclose(dx, numeric(x), rtol=1e-5, atol=1e-8)
    for name in ("W1", "b1", "w2", "b2"):
        np.testing.assert_allclose(grads[name], numeric(model.params[name]), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("mode", MODES)
def test_pipeline_training_reduces_the_loss(run, mode, prefetch) -> None:  # type: ignore[no-untyped-def]
    cfg = PSConfig(dim=8, optimizer="adagrad", lr=0.2, seed=0)
    spec = TaskSpec(batch_size=128, fields=4, bag=3, vocab=300, seed=0)
    num_batches = 150

    async def main() -> None:
        async with ps_cluster(mode, cfg, shards=2) as ps:
            model = DenseModel(spec.fields * cfg.dim, 32, lr=3e-3, seed=0)
            result = await train(ps.clients[0], synthetic_batches(spec, num_batches), model,
                                 prefetch=prefetch, timeout=10)
            await ps.finish()
            first, last = result.loss_drop()
            assert result.batches == num_batches
            assert last < first - 0.1 and last < 0.6, (first, last)
            # Every batch was freed once EG and MG were both done with it.
            assert result.exchange is not None
            assert result.exchange.live() == [] and result.exchange.freed == num_batches
            assert result.exchange.leftovers == 0
            # Lookups never ran further ahead than the prefetch depth allows.
            assert result.max_lookahead <= prefetch
            # Every batch was looked up and pushed once on every shard.
            assert [s.stats.pushes for s in ps.servers] == [num_batches] * 2
            assert [s.store.global_step for s in ps.servers] == [num_batches] * 2

    run(main(), timeout=18)


def test_pipeline_failure_in_mg_aborts_instead_of_hanging(run) -> None:  # type: ignore[no-untyped-def]
    cfg = PSConfig(dim=8, seed=0)
    spec = TaskSpec(batch_size=16, fields=2, bag=2, vocab=50)

    class Broken(DenseModel):
        def train_step(self, x: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
            if self.steps == 3:
                raise FloatingPointError("dense step diverged")
            return super().train_step(x, labels)

    async def main() -> None:
        async with ps_cluster("send", cfg, shards=1) as ps:
            with pytest.raises(FloatingPointError, match="diverged"):
                await train(ps.clients[0], synthetic_batches(spec, 20), Broken(16, 8), prefetch=2,
                            timeout=5)

    run(main(), timeout=15)


# -- the demos, as real processes ------------------------------------------------------------------

def run_demo(module: str, *args: str, timeout: float = 18) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("mode", MODES)
def test_param_server_demo_runs_shards_and_workers_as_processes(loop_name, mode) -> None:  # type: ignore[no-untyped-def]
    out = run_demo("examples.param_server", "--shards", "2", "--workers", "2", "--steps", "20",
                   "--batch", "64", "--evict-every", "10", "--export-every", "10", "--optimizer",
                   "adam", "--mode", mode, "--loop", loop_name)
    lines = out.splitlines()
    assert f"mode={mode}" in lines[0]
    assert sum(line.startswith("worker ") for line in lines) == 2
    assert sum(line.startswith("ps ") for line in lines) == 2
    assert sum(line.startswith("  export ") for line in lines) == 8  # every 10 of 40 pushes
    assert "global step 40" in out and "beta1^t" in out
    assert lines[-1] == "replicated global step: [40] (equal on every shard)"


def test_embedding_pipeline_demo_compares_prefetch_depths(loop_name) -> None:  # type: ignore[no-untyped-def]
    out = run_demo("examples.embedding_pipeline", "--batches", "30", "--batch-size", "64",
                   "--fields", "2", "--hidden", "16", "--shards", "2", "--loop", loop_name)
    lines = out.splitlines()
    assert lines[1].startswith("prefetch 0: 30 batches")
    assert lines[2].startswith("prefetch 2: 30 batches")
    for line in lines[1:3]:
        assert "exchange freed 30 batches" in line and "MG waited" in line
    assert lines[3].startswith("throughput prefetch 2 / prefetch 0: ")


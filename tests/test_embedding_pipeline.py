"""The embedding pipeline (examples/embedding_pipeline): data, metrics, model, exchange,
all-reduce, deterministic staleness with 1-3 workers, failures, and the CLI.

Data, metric and model checks are plain numpy. Everything that moves data runs on real rvz
Nodes over loopback, on both loops: in-process (PS shards, served by the parameter server's
``run_shard``, and workers as Nodes of one loop) for exactness, and as real processes for
the CLI and for a worker killed mid-run. The sequential references the pipeline must match
bit for bit are written here, from the definitions, not taken from the example.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rvz
from examples.embedding_pipeline import criteo
from examples.embedding_pipeline.__main__ import parse_args
from examples.embedding_pipeline.allreduce import ring_allreduce
from examples.embedding_pipeline.criteo import (
    Columns,
    CriteoFormatError,
    LoadStats,
    read_batches,
    read_chunks,
)
from examples.embedding_pipeline.exchange import (
    EMBEDDINGS,
    GRADIENTS,
    ExchangeManager,
    PipelineDataset,
    pipeline_step,
)
from examples.embedding_pipeline.launch import JobFailed, JobSpec, local_cluster, ps_config, run_job
from examples.embedding_pipeline.metrics import auc, logloss
from examples.embedding_pipeline.model import MLP
from examples.embedding_pipeline.synthetic import Planted
from examples.embedding_pipeline.trainer import HeldOut, RunResult, StepFailed, TrainConfig, Worker
from examples.param_server import Adagrad, Adam, EmbeddingTable
from examples.param_server.client import PSClient
from examples.param_server.launch import PSConfig, run_shard
from examples.param_server.protocol import WORKER_JOB

from .procs import run_module

pytestmark = [pytest.mark.timeout(60), pytest.mark.process]  # an example program

REPO = Path(__file__).resolve().parent.parent
DIM = 4
HIDDEN = (24, 12)
BATCH = 48          # global batch: splits over 1, 2 and 3 workers
SPARSE_LR = {"adagrad": 0.2, "adam": 0.01}   # the PS's optimizer and its learning rate
DENSE_LR = 3e-3
FAST_NODE = dict(heartbeat=0.2, peer_timeout=5.0, linger=1.0, connect_timeout=5.0)


# -- hand-written Criteo lines ------------------------------------------------------------------------

def line(label: str = "1", ints: list[str] | None = None, cats: list[str] | None = None) -> str:
    ints = ints if ints is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
    return "\t".join([label, *ints, *cats])


def write(path: Path, lines: list[str], *, gz: bool = False, newline: str = "\n") -> Path:
    data = "".join(x + newline for x in lines).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def test_loader_encodes_integers_categoricals_and_empty_fields(tmp_path: Path) -> None:
    ints = ["", "-3", "0", "7", *["1"] * 9]
    cats = ["", "68fd1e64", *["0000000a"] * 24]
    path = write(tmp_path / "a.tsv", [line("0", ints, cats), line("1", ints, ["68fd1e64", *cats[1:]])])
    (chunk,) = list(read_chunks(path))
    assert chunk.labels.tolist() == [0.0, 1.0]
    assert chunk.dense.dtype == np.float32 and chunk.ids.dtype == np.int64
    # Empty -> 0; negatives -> -log(1 - x); others log(1 + x).
    np.testing.assert_allclose(chunk.dense[0, :4], [0.0, -np.log(4.0), 0.0, np.log(8.0)], rtol=1e-6)
    ids = chunk.ids
    assert (ids >= 0).all()
    # The same value in two fields gets two ids; the same value in one field, one id.
    assert ids[0, 1] != ids[1, 0]
    assert ids[0, 1] == ids[1, 1] and ids[0, 2] == ids[1, 2] and ids[0, 2] != ids[0, 3]
    # An empty field is its field's own id, different from every value seen.
    assert ids[0, 0] not in set(ids[:, 1:].reshape(-1).tolist()) and ids[0, 0] != ids[1, 0]
    # Hashing is a pure function of (field, value): another file, the same ids.
    again = list(read_chunks(write(tmp_path / "b.tsv", [line("0", ints, cats)])))[0]
    assert np.array_equal(again.ids[0], ids[0])


def test_loader_skips_and_counts_bad_lines_or_names_them_in_strict_mode(tmp_path: Path) -> None:
    good = line()
    bad = {
        2: "1\t2\t3",                                       # too few fields
        4: line(label="2"),                                 # label not 0/1
        5: line(ints=["x1", *["1"] * 12]),                  # not an integer
        6: line(cats=["zz", *["00000001"] * 25]),           # not hex
        7: "",                                              # blank line
        9: line() + "\textra",                              # too many fields
    }
    lines = [bad.get(n, good) for n in range(1, 11)]
    path = write(tmp_path / "bad.tsv", lines, newline="\r\n")   # CRLF line ends are fine
    stats = LoadStats()
    chunks = list(read_chunks(path, chunk_size=3, stats=stats))
    assert [len(c) for c in chunks] == [3, 1]
    assert stats.lines == 10 and stats.samples == 4 and stats.bad == 6
    assert [n for n, _ in stats.bad_examples] == [2, 4, 5, 6, 7, 9]
    reasons = dict(stats.bad_examples)
    assert "fields" in reasons[2] and "label" in reasons[4] and "I1" in reasons[5]
    assert "C1" in reasons[6] and "empty" in reasons[7]
    with pytest.raises(CriteoFormatError, match=r"bad\.tsv:2: bad line: 3 fields"):
        list(read_chunks(path, strict=True))


def test_loader_reads_gzip_like_plain_and_batches_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    lines = [line(str(i % 2), [str(x) for x in rng.integers(0, 50, 13)],
                  [f"{x:08x}" for x in rng.integers(0, 1 << 32, 26)]) for i in range(103)]
    plain = list(read_chunks(write(tmp_path / "p.tsv", lines)))[0]
    zipped = list(read_chunks(write(tmp_path / "p.gz", lines, gz=True)))[0]
    for name in ("labels", "dense", "ids"):
        assert np.array_equal(getattr(plain, name), getattr(zipped, name))
    sizes = [len(b) for b in read_batches(tmp_path / "p.gz", 25)]
    assert sizes == [25, 25, 25, 25, 3]
    assert [len(b) for b in read_batches(tmp_path / "p.gz", 25, drop_last=True)] == [25] * 4
    # The column cache holds the same samples, memory-mapped.
    stats = criteo.encode(tmp_path / "p.gz", tmp_path / "cache")
    cols = Columns.open(tmp_path / "cache")
    assert stats.samples == len(cols) == 103 and cols.meta["bad"] == 0
    assert np.array_equal(cols.rows(10, 20).ids, plain.ids[10:20])
    assert np.array_equal(cols.rows(0, 103).dense, plain.dense)


def test_synthetic_data_is_criteo_format_deterministic_and_calibrated(tmp_path: Path) -> None:
    planted = Planted(seed=3)
    oracle = planted.write(tmp_path / "s.tsv.gz", 4000, sample_seed=1)
    again = Planted(seed=3).write(tmp_path / "t.tsv.gz", 4000, sample_seed=1)
    assert gzip.decompress((tmp_path / "s.tsv.gz").read_bytes()) == gzip.decompress(
        (tmp_path / "t.tsv.gz").read_bytes())
    assert oracle == again
    stats = LoadStats()
    chunk = criteo.concat(list(read_chunks(tmp_path / "s.tsv.gz", strict=True, stats=stats)))
    assert len(chunk) == 4000 and stats.bad == 0
    assert int(chunk.labels.sum()) == oracle.positives
    lines = gzip.decompress((tmp_path / "s.tsv.gz").read_bytes()).decode().splitlines()
    fields = [x.split("\t") for x in lines]
    assert {len(f) for f in fields} == {40}
    assert any(f[3] == "" for f in fields) and any(f[14 + 3] == "" for f in fields)  # empties
    assert any(f[2].startswith("-") for f in fields)  # the negative column
    # The labels are drawn from the planted probabilities: the oracle ranks far better
    # than chance, and its probabilities are calibrated on average.
    _, _, p, labels = planted.sample(20000, sample_seed=9)
    assert auc(p, labels) > 0.85 and oracle.auc > 0.85
    assert abs(p.mean() - labels.mean()) < 0.01


# -- metrics --------------------------------------------------------------------------------------------

def test_auc_counts_pairs_exactly_with_ties() -> None:
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 6, 300).astype(np.float64)   # many ties
    labels = (rng.random(300) < 0.4).astype(np.int64)
    pos, neg = scores[labels == 1], scores[labels == 0]
    brute = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (
        len(pos) * len(neg))
    assert auc(scores, labels) == pytest.approx(brute, abs=1e-12)
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75
    assert auc(np.ones(4), np.array([0, 1, 0, 1])) == 0.5
    with pytest.raises(ValueError):
        auc(np.ones(3), np.ones(3))
    z = np.array([-3.0, 0.0, 2.0, 5.0])
    y = np.array([0.0, 1.0, 0.0, 1.0])
    p = 1 / (1 + np.exp(-z))
    direct = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert logloss(z, y) == pytest.approx(direct, rel=1e-9)
    # Confident predictions stay finite: right ones cost ~0, wrong ones their margin.
    assert logloss(np.array([800.0]), np.array([1.0])) == 0.0
    assert logloss(np.array([-800.0]), np.array([1.0])) == 800.0


# -- the dense model ---------------------------------------------------------------------------------

def test_mlp_gradients_match_finite_differences() -> None:
    model = MLP(6, [5, 4], seed=3)
    model.params = [p.astype(np.float64) + 0.1 for p in model.params]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((7, 6))
    labels = (rng.random(7) > 0.5).astype(np.float64)

    def loss_at() -> float:
        return model.forward_backward(x, labels, 10)[0]

    _, dx, grads = model.forward_backward(x, labels, 10)
    eps = 1e-6

    def numeric(array: np.ndarray) -> np.ndarray:
        out = np.zeros_like(array)
        for i in np.ndindex(array.shape):
            old = array[i]
            array[i] = old + eps
            up = loss_at()
            array[i] = old - eps
            down = loss_at()
            array[i] = old
            out[i] = (up - down) / (2 * eps)
        return out

    np.testing.assert_allclose(dx, numeric(x), rtol=1e-5, atol=1e-9)
    for p, g in zip(model.params, grads, strict=True):
        np.testing.assert_allclose(g.reshape(p.shape), numeric(p), rtol=1e-5, atol=1e-9)


def test_mlp_shares_of_a_batch_sum_to_the_whole_batch() -> None:
    model = MLP(10, [8], seed=0)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((12, 10)).astype(np.float32)
    y = (rng.random(12) > 0.5).astype(np.float32)
    loss, _, grads = model.forward_backward(x, y, 12)
    a = model.forward_backward(x[:5], y[:5], 12)
    b = model.forward_backward(x[5:], y[5:], 12)
    assert a[0] + b[0] == pytest.approx(loss, rel=1e-6)
    for g, ga, gb in zip(grads, a[2], b[2], strict=True):
        np.testing.assert_allclose(ga + gb, g, rtol=1e-5, atol=1e-7)


# -- the sequential references (written from the definitions) -------------------------------------------

class RefMLP:
    """The dense model, forward/backward and Adam, written out again."""

    def __init__(self, params: list[np.ndarray], lr: float) -> None:
        self.params = [p.copy() for p in params]
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]
        self.lr = lr
        self.t = 0

    def grads(self, x: np.ndarray, y: np.ndarray,
              batch: int) -> tuple[np.float32, np.ndarray, list[np.ndarray]]:
        acts, pres = [x], []
        n = len(self.params) // 2
        for i in range(n):
            pre = acts[-1] @ self.params[2 * i] + self.params[2 * i + 1]
            pres.append(pre)
            acts.append(np.maximum(pre, 0) if i < n - 1 else pre)
        z = acts[-1].reshape(-1)
        loss = np.float32(np.sum(np.logaddexp(0, z) - y * z, dtype=np.float64) / batch)
        delta = ((1.0 / (1.0 + np.exp(-z)) - y) / batch).astype(np.float32).reshape(-1, 1)
        out: list[np.ndarray] = [np.empty(0)] * len(self.params)
        for i in range(n - 1, -1, -1):
            out[2 * i] = acts[i].T @ delta
            out[2 * i + 1] = delta.sum(axis=0)
            back = delta @ self.params[2 * i].T
            delta = back * (pres[i - 1] > 0) if i else back
        return loss, delta, out

    def adam(self, grads: list[np.ndarray]) -> None:
        self.t += 1
        c = np.sqrt(1 - 0.999 ** self.t) / (1 - 0.9 ** self.t)
        for p, m, v, g in zip(self.params, self.m, self.v, grads, strict=True):
            m *= 0.9
            m += (1 - 0.9) * g
            v *= 0.999
            v += (1 - 0.999) * g * g
            p -= (self.lr * c) * m / (np.sqrt(v) + 1e-8)


def reference_run(cols: Columns, staleness: int, workers: int, steps: int, seed: int = 0,
                  optimizer: str = "adagrad") -> list[float]:
    """Sequential training, by definition: the rows used at step t are read right after the
    sparse update of step t - k - 1; with N workers each takes its share of the global batch,
    their dense gradients are added (g0 + g1: exact in either order) and their sparse
    updates (each worker's per-id sums) applied as one update, worker 0's first."""
    opt = Adagrad(lr=SPARSE_LR["adagrad"]) if optimizer == "adagrad" else Adam(lr=SPARSE_LR["adam"])
    table = EmbeddingTable(DIM, opt, "normal", seed, init_std=0.01)
    init = MLP(26 * DIM + 13, list(HIDDEN), lr=DENSE_LR, seed=seed).params
    model = RefMLP(init, DENSE_LR)
    share = BATCH // workers

    def part(t: int, w: int) -> Any:
        return cols.rows(t * BATCH + w * share, t * BATCH + (w + 1) * share)

    def read(t: int) -> list[np.ndarray]:
        return [table.lookup(part(t, w).ids.reshape(-1)).reshape(share, 26, DIM) for w in range(workers)]

    looked_up = {t: read(t) for t in range(min(staleness + 1, steps))}
    losses = []
    for t in range(steps):
        rows = looked_up.pop(t)
        total_grads, ids, sparse = None, [], []
        for w in range(workers):
            b = part(t, w)
            x = np.concatenate([rows[w].reshape(share, -1), b.dense], axis=1)
            loss, dx, grads = model.grads(x, b.labels, BATCH)
            flat = np.concatenate([*(g.reshape(-1) for g in grads), [loss]]).astype(np.float32)
            total_grads = flat if total_grads is None else total_grads + flat
            uniq, inv = np.unique(b.ids.reshape(-1), return_inverse=True)
            per_id = np.zeros((len(uniq), DIM), dtype=np.float64)   # summed in float64, in order
            np.add.at(per_id, inv, dx[:, :26 * DIM].reshape(-1, DIM).astype(np.float64))
            ids.append(uniq)
            sparse.append(per_id.astype(np.float32))
        assert total_grads is not None
        split, start = [], 0
        for p in model.params:
            split.append(total_grads[start:start + p.size].reshape(p.shape))
            start += p.size
        model.adam(split)
        losses.append(float(total_grads[-1]))
        table.apply_gradients(np.concatenate(ids), np.concatenate(sparse))
        if t + staleness + 1 < steps:
            looked_up[t + staleness + 1] = read(t + staleness + 1)
    return losses


# -- in-process runs on real Nodes ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Columns, Columns]:
    root = tmp_path_factory.mktemp("planted")
    Planted(seed=5).write(root / "train.tsv", 40 * BATCH, sample_seed=1)
    Planted(seed=5).write(root / "eval.tsv.gz", 600, sample_seed=2)
    criteo.encode(root / "train.tsv", root / "train")
    criteo.encode(root / "eval.tsv.gz", root / "eval")
    return Columns.open(root / "train"), Columns.open(root / "eval")


def train_config(staleness: int, workers: int, steps: int, **kw: Any) -> TrainConfig:
    return TrainConfig(staleness=staleness, num_workers=workers, global_batch=BATCH, hidden=HIDDEN,
                       dense_lr=DENSE_LR, seed=0, timeout=10.0, compute_in_thread=False, max_steps=steps,
                       **kw)


async def in_process(cols: Columns, cfg: TrainConfig, *, mode: str = "send", shards: int = 2,
                     held_out: HeldOut | None = None, optimizer: str = "adagrad",
                     patch: Callable[[Worker], None] | None = None, min_count: int = 0,
                     summaries: list[dict[str, Any]] | None = None) -> list[RunResult | BaseException]:
    """PS shards and workers as Nodes of this loop; one result (or error) per worker (and the
    shards' summaries into ``summaries``)."""
    cluster = local_cluster(shards, cfg.num_workers)
    ps = ps_config(PSConfig(dim=DIM, optimizer=optimizer, lr=SPARSE_LR[optimizer], seed=0, mode=mode,
                            node_options=FAST_NODE, min_count=min_count), cfg.num_workers)
    serving = [asyncio.ensure_future(run_shard(cluster, s, ps)) for s in range(shards)]

    async def worker(w: int) -> RunResult:
        async with rvz.Node(cluster, WORKER_JOB, w, mode=mode, **FAST_NODE) as node:
            client = PSClient(node, shards, DIM, timeout=10.0)
            try:
                me = Worker(node, client, cols, cfg, held_out)
                if patch is not None:
                    patch(me)
                return await me.run()
            finally:
                await client.close()

    try:
        results = await asyncio.gather(*(worker(w) for w in range(cfg.num_workers)), return_exceptions=True)
        done = await asyncio.wait_for(asyncio.gather(*serving), 10)
        if summaries is not None:
            summaries.extend(done)
        return list(results)
    finally:
        for task in serving:
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)


def ok(results: list[RunResult | BaseException]) -> list[RunResult]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


@pytest.mark.parametrize("min_count", [0, 2])
def test_evaluation_changes_no_row_admission_or_loss(run, planted, min_count) -> None:  # type: ignore[no-untyped-def]
    # Held-out reads create no row and count toward no admission: the same rows live on
    # every shard, and the same losses, with evaluation every 2 steps as without any.
    cols, ev = planted
    held_out = HeldOut(ev.rows(0, len(ev)))
    runs = []
    for evaluate in (False, True):
        summaries: list[dict[str, Any]] = []
        # One worker: with two, which worker's pull of an id reaches MinCount's threshold
        # first depends on arrival order, evaluation or not.
        results = ok(run(in_process(cols, train_config(1, 1, 8, eval_every=2 if evaluate else 0),
                                    held_out=held_out if evaluate else None, min_count=min_count,
                                    summaries=summaries), timeout=40))
        runs.append(([s["tables"]["default"]["live"] for s in summaries],
                     [s["tables"]["default"]["created"] for s in summaries],
                     [r.losses for r in results], results[0].history))
    (live, created, losses, _), (live_eval, created_eval, losses_eval, history) = runs
    assert live_eval == live and created_eval == created and sum(live) > 0
    assert losses_eval == losses
    assert [h["step"] for h in history] == [2, 4, 6, 8] and 0.0 < history[-1]["auc"] < 1.0


@pytest.mark.parametrize("mode", ["send", "recv"])
def test_staleness_0_one_worker_is_bit_identical_to_the_sequential_loop(run, planted, mode) -> None:  # type: ignore[no-untyped-def]
    cols, ev = planted
    steps = 16
    expected = reference_run(cols, 0, 1, steps)
    held_out = HeldOut(ev.rows(0, len(ev)))
    results = ok(run(in_process(cols, train_config(0, 1, steps, eval_every=5), mode=mode,
                                held_out=held_out), timeout=40))
    result = results[0]
    assert result.losses == expected          # every bit of every step's loss
    assert result.steps == steps and result.freed == steps
    # The held-out evaluations (piggybacked on pulls) did not disturb training; they were
    # taken at steps 5, 10, 15 and at the end, and the last one scores the final state.
    assert [h["step"] for h in result.history] == [5, 10, 15, 16]
    assert result.auc == result.history[-1]["auc"] and 0.5 < result.auc <= 1.0
    assert result.logloss is not None and result.logloss < 0.69


@pytest.mark.parametrize(("staleness", "optimizer"), [(1, "adagrad"), (2, "adam")])
def test_staleness_k_uses_the_rows_after_step_t_minus_k_minus_1(run, planted, staleness, optimizer) -> None:  # type: ignore[no-untyped-def]
    cols, _ = planted
    steps = 14
    result = ok(run(in_process(cols, train_config(staleness, 1, steps), optimizer=optimizer), timeout=40))[0]
    assert result.losses == reference_run(cols, staleness, 1, steps, optimizer=optimizer)
    # Staleness changed something: the definition is what is checked, not a no-op.
    assert result.losses != reference_run(cols, 0, 1, steps, optimizer=optimizer)


def test_two_workers_are_bit_identical_to_the_reference_at_staleness_0_and_2(run, planted) -> None:  # type: ignore[no-untyped-def]
    cols, _ = planted
    steps = 12
    for staleness in (0, 2):
        results = ok(run(in_process(cols, train_config(staleness, 2, steps)), timeout=40))
        expected = reference_run(cols, staleness, 2, steps)
        # Both workers saw the same all-reduced losses, equal to the sequential reference.
        assert results[0].losses == results[1].losses == expected


def test_three_workers_reproduce_bit_for_bit_and_match_one_worker_closely(run, planted) -> None:  # type: ignore[no-untyped-def]
    cols, _ = planted
    steps = 10
    first = ok(run(in_process(cols, train_config(1, 3, steps), shards=1), timeout=40))
    second = ok(run(in_process(cols, train_config(1, 3, steps), shards=1), timeout=40))
    assert first[0].losses == first[1].losses == first[2].losses
    assert first[0].losses == second[0].losses
    # The same samples per step as one worker: the sums only differ in rounding order.
    np.testing.assert_allclose(first[0].losses, reference_run(cols, 1, 1, steps), rtol=1e-4)


# -- failures ---------------------------------------------------------------------------------------

def test_a_failure_in_mg_aborts_its_step_on_every_worker(run, planted) -> None:  # type: ignore[no-untyped-def]
    cols, _ = planted

    def break_worker_1(worker: Worker) -> None:
        if worker.w != 1:
            return
        original = worker.model.forward_backward

        def forward_backward(*args: Any) -> Any:
            if worker.model.steps == 3:
                raise FloatingPointError("dense step diverged")
            return original(*args)
        worker.model.forward_backward = forward_backward  # type: ignore[method-assign]

    results = run(in_process(cols, train_config(1, 2, 12), patch=break_worker_1), timeout=40)
    assert all(isinstance(r, StepFailed) and r.step == 3 for r in results), results
    assert "step 3 aborted: MG of worker 1 failed: FloatingPointError: dense step diverged" in str(results[1])
    # worker 0 names its own step, then rvz's error: which step (the training step, not the
    # rvz step id the pipeline runs it in) and who cleaned it up, then worker 1's text
    assert re.match(
        r"worker 0: step 3 was aborted elsewhere: step 3 was cleaned up by /job:worker/replica:0/task:1 "
        r"\(incarnation 0x[0-9a-f]+\): step 3 aborted: MG of worker 1", str(results[0])), results[0]
    assert str(pipeline_step(3)) not in str(results[0])


def test_a_failure_in_eg_aborts_the_step_and_mg_hears_which(run, planted) -> None:  # type: ignore[no-untyped-def]
    cols, _ = planted

    def break_push(worker: Worker) -> None:
        original = worker.ps.push_unique
        pushes = []

        async def push_unique(*args: Any, **kw: Any) -> Any:
            pushes.append(1)
            if len(pushes) == 3:
                raise ConnectionError("PS unreachable")
            return await original(*args, **kw)
        worker.ps.push_unique = push_unique  # type: ignore[method-assign]

    results = run(in_process(cols, train_config(0, 1, 12), patch=break_push), timeout=40)
    (error,) = results
    assert isinstance(error, StepFailed) and error.step == 2
    assert "step 2 aborted: EG of worker 0 failed: ConnectionError: PS unreachable" in str(error)


def test_exchange_hands_off_in_either_order_and_aborts_by_step(run) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        cluster = local_cluster(0, 1)
        async with rvz.Node(cluster, WORKER_JOB, 0, mode="send", **FAST_NODE) as node:
            ex = ExchangeManager(node, timeout=5)
            ex.open(0, "batch-0")
            ex.open(1, "batch-1")
            waiting = asyncio.ensure_future(ex.recv(EMBEDDINGS, 0))   # MG first
            await asyncio.sleep(0.01)
            emb = np.ones((2, 3), dtype=np.float32)
            await ex.send(EMBEDDINGS, 0, emb)
            assert (await waiting).tolist() == emb.tolist()
            await ex.send(GRADIENTS, 0, emb * 2)                      # MG first the other way
            assert (await ex.recv(GRADIENTS, 0)).tolist() == (emb * 2).tolist()
            assert ex.done(0, "mg") is False and ex.live() == [0, 1]
            assert ex.done(0, "eg") is True and ex.live() == [1] and ex.freed == 1
            with pytest.raises(KeyError):
                ex.samples(0)
            blocked = asyncio.ensure_future(ex.recv(GRADIENTS, 1))
            await asyncio.sleep(0.01)
            await ex.abort(1, "step 1 aborted: test")
            with pytest.raises(rvz.Aborted, match="step 1 aborted: test"):
                await blocked
            with pytest.raises(rvz.Aborted, match="step 1 aborted"):      # and later waits too
                await ex.send(EMBEDDINGS, 1, emb)

    run(main(), timeout=15)


def test_pipeline_dataset_gives_both_sides_the_same_batches(run) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        read: list[int] = []

        def source():  # type: ignore[no-untyped-def]
            for i in range(5):
                read.append(i)
                yield f"batch-{i}"

        async with rvz.Node(local_cluster(0, 1), WORKER_JOB, 0, **FAST_NODE) as node:
            exchange = ExchangeManager(node)
            dataset = PipelineDataset(source(), exchange, first_id=100)
            eg, mg = dataset.iterator("eg"), dataset.iterator("mg")
            with pytest.raises(ValueError):
                dataset.iterator("eg")
            assert [next(eg), next(eg), next(eg)] == [100, 101, 102]  # EG runs ahead
            assert next(mg) == 100 and read == [0, 1, 2]  # the same batch, not a new read
            assert exchange.samples(102) == "batch-2"
            assert list(mg) == [101, 102, 103, 104] and list(eg) == [103, 104]
            assert read == [0, 1, 2, 3, 4] and exchange.opened == 5

    run(main(), timeout=15)


@pytest.mark.parametrize("workers", [2, 3])
def test_ring_allreduce_sums_identically_everywhere(run, workers) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        cluster = local_cluster(0, workers)
        rng = np.random.default_rng(workers)
        vectors = [rng.standard_normal(1001).astype(np.float32) for _ in range(workers)]
        async with contextlib.AsyncExitStack() as stack:
            nodes = [await stack.enter_async_context(
                rvz.Node(cluster, WORKER_JOB, w, mode="send", **FAST_NODE)) for w in range(workers)]
            out = await asyncio.gather(*(ring_allreduce(n, v, workers, step=7, tag=7, timeout=5)
                                         for n, v in zip(nodes, vectors, strict=True)))
            assert all(np.array_equal(o, out[0]) for o in out)
            np.testing.assert_allclose(out[0], np.sum(vectors, axis=0), rtol=1e-5, atol=1e-6)
            if workers == 2:
                assert np.array_equal(out[0], vectors[0] + vectors[1])
            # One worker gives up the step: the others' waits in it fail, naming it.
            waits = [asyncio.ensure_future(ring_allreduce(n, v, workers, step=8, tag=8, timeout=5))
                     for n, v in zip(nodes[1:], vectors[1:], strict=True)]
            await asyncio.sleep(0.05)
            await nodes[0].step(8).cleanup("step 8 aborted: worker 0 gave up")
            for wait in waits:
                with pytest.raises(rvz.Aborted, match="step 8 aborted: worker 0 gave up"):
                    await wait

    run(main(), timeout=20)


# -- real processes: a killed worker, the CLI ----------------------------------------------------------

def test_a_killed_worker_gets_a_clear_report_not_a_hang(planted, loop_name) -> None:  # type: ignore[no-untyped-def]
    cols, _ = planted
    root = Path(cols.labels.filename).parent  # type: ignore[attr-defined]
    cfg = TrainConfig(staleness=1, num_workers=2, global_batch=BATCH, hidden=HIDDEN, timeout=10.0,
                      max_steps=30)
    ps = PSConfig(dim=DIM, lr=SPARSE_LR["adagrad"], mode="send", loop=loop_name)
    spec = JobSpec(str(root), None, cfg, ps, shards=1, timeout=40, kill_worker=(1, 4),
                   node_options=dict(FAST_NODE))
    with pytest.raises(JobFailed) as info:
        run_job(spec)
    text = str(info.value)
    assert "worker 1: killed by SIGKILL" in text
    assert "worker 0: StepFailed: step 4 aborted: worker 0 lost a peer in MG" in text, text


def run_cli(*args: str, timeout: float = 50) -> subprocess.CompletedProcess[str]:
    """The CLI, killed whatever happens with the PS and worker processes it started."""
    return run_module("examples.embedding_pipeline", *args, cwd=str(REPO), timeout=timeout)


def test_cli_compares_staleness_and_workers_and_writes_json(tmp_path: Path, loop_name: str) -> None:
    out = tmp_path / "out.json"
    proc = run_cli("train", "--samples", "2400", "--eval-samples", "400", "--batch-size", "96", "--dim", "4",
                   "--hidden", "16", "--shards", "2", "--compare-workers", "1,2",
                   "--compare-staleness", "0,1", "--eval-every", "10", "--reference", "--loop", loop_name,
                   "--timeout", "10", "--run-timeout", "40", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert "oracle held-out AUC" in text and "train: 2400 samples from 2400 lines" in text
    for w in (1, 2):
        for k in (0, 1):
            assert f"workers {w} staleness {k}: 25 steps" in text
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [(r["workers"], r["staleness"]) for r in runs] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    # The reference ran in the CLI's own process, without rvz: same bits as staleness 0.
    assert f"sequential reference: 25 steps, losses {runs[0]['loss_digest']}: bit-identical" in text
    for r in runs:
        assert set(r) >= {"auc", "logloss", "steps_per_s", "samples_per_s", "history"}
        assert [h["step"] for h in r["history"]] == [10, 20, 25]
        assert r["history"][-1]["auc"] == r["auc"] and r["steps"] == 25 and len(r["losses"]) == 25
        # 25 small steps learn something, and stay below the planted model's own ranking.
        assert 0.5 < r["auc"] < report["oracle"]["auc"]


def test_cli_runs_one_process_per_host_and_role_as_a_local_run_does(tmp_path: Path) -> None:
    # One process per role from --cluster (and one from TF_CONFIG): the same bits as the
    # launcher's own run of the same settings.
    common = ["train", "--samples", "960", "--eval-samples", "200", "--batch-size", "96", "--max-steps", "6",
              "--dim", "4", "--hidden", "8", "--staleness", "1", "--eval-every", "3", "--timeout", "20",
              "--log-level", "WARNING"]
    local = run_cli(*common, "--workers", "2", "--shards", "1", "--json", str(tmp_path / "local.json"))
    assert local.returncode == 0, local.stdout + local.stderr
    cluster = local_cluster(1, 2)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TF_CONFIG", None)
    argv = [sys.executable, "-m", "examples.embedding_pipeline", *common]
    by_cluster = ["--cluster", json.dumps(cluster)]
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}})
    procs = [subprocess.Popen(argv + by_cluster + ["--job", "ps", "--task", "0"], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
             subprocess.Popen(argv + by_cluster + ["--job", "worker", "--task", "0", "--json",
                                                   str(tmp_path / "w0.json")], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
             subprocess.Popen(argv, env=dict(env, TF_CONFIG=tf_config), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    try:
        outputs = [p.communicate(timeout=40) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out + err
    assert '"done": "ps"' in outputs[0][0] and "worker 1 of 2: 6 steps" in outputs[2][0]
    mine = json.loads((tmp_path / "w0.json").read_text())
    theirs = json.loads((tmp_path / "local.json").read_text())
    assert mine["losses"] == theirs["losses"] and mine["loss_digest"] == theirs["loss_digest"]
    assert mine["auc"] == theirs["auc"] and mine["history"] == theirs["history"]


RESUMABLE = ["train", "--samples", "960", "--eval-samples", "200", "--batch-size", "48", "--max-steps", "12",
             "--workers", "2", "--shards", "2", "--staleness", "1", "--eval-every", "4", "--dim", "4",
             "--hidden", "8", "--timeout", "20"]


def test_a_job_killed_whole_resumes_from_its_last_cut_bit_for_bit(tmp_path: Path) -> None:
    # Every process of the job (launcher, shards, workers) is SIGKILLed at step 8; resumed
    # from the cut at step 6 with fresh processes, the job ends with the bits of a job that
    # never stopped: every step's loss, every evaluation, the final AUC and logloss.
    full = run_cli(*RESUMABLE, "--json", str(tmp_path / "full.json"))
    assert full.returncode == 0, full.stdout + full.stderr
    ck = tmp_path / "ck"
    crashed = run_cli(*RESUMABLE, "--checkpoint-every", "3", "--checkpoint-dir", str(ck),
                      "--crash-job-at", "8")
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    assert sorted(p.name for p in ck.iterdir()) == ["JOB.json", "cut-00000003", "cut-00000006"]
    resumed = run_cli(*RESUMABLE, "--resume", str(ck), "--json", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "cut-00000006 (step 6)" in resumed.stderr, resumed.stderr
    want = json.loads((tmp_path / "full.json").read_text())
    got = json.loads((tmp_path / "resumed.json").read_text())
    assert got["losses"] == want["losses"] and len(got["losses"]) == 12
    assert got["loss_digest"] == want["loss_digest"] and got["history"] == want["history"]
    assert (got["auc"], got["logloss"]) == (want["auc"], want["logloss"])
    # A resume with other settings is refused, naming the option and the value to give.
    other = run_cli(*RESUMABLE[:-2], "--timeout", "20", "--staleness", "2", "--resume", str(ck))
    assert other.returncode == 2 and "give --staleness 1 to resume it" in other.stderr, other.stderr


REJOIN = ["train", "--samples", "960", "--eval-samples", "200", "--batch-size", "48", "--max-steps", "16",
          "--workers", "2", "--shards", "2", "--staleness", "1", "--eval-every", "4", "--dim", "4",
          "--hidden", "8", "--timeout", "30", "--consistency", "bsp"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["send", "recv"])
def test_a_killed_worker_restarted_under_bsp_replays_its_step_bit_for_bit(tmp_path: Path, mode: str) -> None:
    # Worker 1 SIGKILLs itself as MG starts step 10; the launcher starts it again as task 1,
    # which replays from its journal's newest part while worker 0 and the shards wait for it.
    # Every step's loss, every evaluation, the final AUC and logloss are those of the same
    # job never stopped.
    args = [*REJOIN, "--mode", mode, "--cache-dir", str(tmp_path / "cache")]
    full = run_cli(*args, "--json", str(tmp_path / "full.json"), timeout=100)
    assert full.returncode == 0, full.stdout + full.stderr
    again = run_cli(*args, "--worker-rejoin", "30", "--kill-worker", "1:10", "--json",
                    str(tmp_path / "rejoined.json"), timeout=100)
    assert again.returncode == 0, again.stdout + again.stderr
    replayed = re.search(r"worker 1 was killed and started again; its new process replayed from step (\d+)",
                         again.stdout)
    assert replayed and 8 <= int(replayed[1]) <= 10, again.stdout + again.stderr
    want = json.loads((tmp_path / "full.json").read_text())
    got = json.loads((tmp_path / "rejoined.json").read_text())
    assert got["losses"] == want["losses"] and len(got["losses"]) == 16
    assert got["loss_digest"] == want["loss_digest"] and got["history"] == want["history"]
    assert (got["auc"], got["logloss"]) == (want["auc"], want["logloss"])


def test_a_killed_worker_that_never_comes_back_fails_the_bsp_job_naming_it(planted, loop_name) -> None:  # type: ignore[no-untyped-def]
    cols, _ = planted
    root = Path(cols.labels.filename).parent  # type: ignore[attr-defined]
    cfg = TrainConfig(staleness=1, num_workers=2, global_batch=BATCH, hidden=HIDDEN, timeout=20.0,
                      max_steps=30, worker_rejoin=3.0)
    ps = PSConfig(dim=DIM, lr=SPARSE_LR["adagrad"], mode="send", loop=loop_name)
    spec = JobSpec(str(root), None, cfg, ps, shards=2, timeout=40, kill_worker=(1, 10), restarts=0,
                   node_options=dict(FAST_NODE))
    started = time.monotonic()
    with pytest.raises(JobFailed) as info:
        run_job(spec)
    took = time.monotonic() - started
    text = str(info.value)
    assert "worker 1: killed by SIGKILL" in text, text
    # Worker 0 waits for it (MG in the dense all-reduce of step 10, EG at the shards' barrier,
    # its push 9 or 10 in flight) for the rejoin timeout, then fails: whichever side gives up
    # first names the lost worker, the step and the PS clock.
    assert re.search(r"worker 0: StepFailed: step (9|10) aborted: .*worker 1 was lost at (step 10 \(PS "
                     r"clock \d+\)|PS clock (9|10)) and no new process of it joined within 3 s", text), text
    assert re.search(r"ps [01]: worker 1 was lost at PS clock (9|10) and no new process of it joined within "
                     r"3 s", text), text
    assert took < 3.0 + 25, took  # the give-up itself, not the run's --timeout


def test_an_incomplete_cut_is_never_used_and_the_error_names_what_it_lacks(tmp_path: Path) -> None:
    from examples.param_server import cut

    table = EmbeddingTable(4, Adagrad(0.1), "normal", 0)
    table.lookup(np.arange(10))
    for clock in (3, 6):
        cut.write_shard_part(tmp_path, clock, 0, {"default": table.snapshot()}, fsync=False)
        for w in range(2):
            if (clock, w) != (6, 1):  # worker 1 died before writing its part of the cut at 6
                cut.write_worker_part(tmp_path, clock, w, {"x": np.arange(3)}, {"w": w}, fsync=False)
    clock, where = cut.latest(tmp_path, 1, 2)
    assert clock == 3 and where.name == "cut-00000003"
    (tmp_path / "cut-00000003" / "worker0.npz").write_bytes(b"cut short")
    with pytest.raises(cut.CutError) as info:
        cut.latest(tmp_path, 1, 2)
    assert "cut-00000006 (step 6), lacks worker1" in str(info.value), info.value
    assert "so do the 1 older ones" in str(info.value)
    with pytest.raises(cut.CutError, match="no checkpoint"):
        cut.latest(tmp_path / "none", 1, 2)
    restored = cut.load_shard_part(tmp_path / "cut-00000006", 0)["default"]
    np.testing.assert_array_equal(restored.rows(np.arange(10)), table.rows(np.arange(10)))
    assert restored.global_step == table.global_step and len(restored) == 10


def test_cli_generate_and_the_plot_option(tmp_path: Path) -> None:
    proc = run_cli("generate", "--samples", "300", "--eval-samples", "100", "--out", str(tmp_path), "--plain")
    assert proc.returncode == 0, proc.stderr
    assert "oracle AUC" in proc.stdout
    assert len((tmp_path / "train.tsv").read_text().splitlines()) == 300
    assert json.loads((tmp_path / "oracle.json").read_text())["samples"] == 100
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit) as info:
            parse_args(["train", "--plot", str(tmp_path / "p.png")])
        assert info.value.code == 2
    else:
        assert parse_args(["train", "--plot", str(tmp_path / "p.png")]).plot
    with pytest.raises(SystemExit):
        parse_args(["train", "--data", "x.tsv"])   # needs --eval-data


def test_a_lost_shard_is_reported_with_the_step_it_failed_within_the_timeout(planted, loop_name) -> None:  # type: ignore[no-untyped-def]
    # The run's shards are never restarted: the step fails at once (not after the PS
    # client's restart allowance), and closing the client afterwards, which cannot reach the
    # dead shard either, adds a note to that report instead of replacing it.
    cols, _ = planted
    root = Path(cols.labels.filename).parent  # type: ignore[attr-defined]
    cfg = TrainConfig(staleness=1, num_workers=2, global_batch=BATCH, hidden=HIDDEN, timeout=3.0,
                      max_steps=30)
    ps = PSConfig(dim=DIM, lr=SPARSE_LR["adagrad"], mode="send", loop=loop_name)
    spec = JobSpec(str(root), None, cfg, ps, shards=2, timeout=40, kill_shard=(0, 5),
                   node_options=dict(FAST_NODE))
    started = time.monotonic()
    with pytest.raises(JobFailed) as info:
        run_job(spec)
    text = str(info.value)
    assert "ps 0: killed by SIGKILL" in text, text
    # Each worker's report is its step failure (its own, or the clean-up of the other's),
    # naming the step and the lost shard: the loss itself, or, for a worker whose pull was
    # waiting for the shard's pushed rows when the loss came, its timeout naming the shard.
    lost = r"(PS shard 0 was lost|no rows of its pull at clock \d+ from PS shard 0 within)"
    for w in (0, 1):
        assert re.search(rf"worker {w}: StepFailed: [^\n]*step \d+ [^\n]*{lost}", text), text
    assert "worker 0: StepFailed: step" in text or "worker 1: StepFailed: step" in text, text
    # Start-up (two shards and two workers spawned) plus a few seconds, not 60 s or more.
    assert time.monotonic() - started < 25, text


@pytest.mark.parametrize(("argv", "message"), [
    (["train", "--shards", "0"], "--shards must be at least 1"),
    (["train", "--workers", "0"], "--workers must be at least 1"),
    (["train", "--dim", "0"], "--dim must be at least 1"),
    (["train", "--samples", "0"], "--samples must be at least 1"),
    (["train", "--max-steps", "0"], "--max-steps must be at least 1"),
    (["train", "--hidden", "8,0"], "--hidden must be at least 1"),
    (["train", "--timeout", "0"], "--timeout must be positive"),
    (["train", "--data", "/nonexistent/x.tsv", "--eval-data", "/nonexistent/y.tsv"], "no such file"),
    (["train", "--kill-worker", "5:3"], "worker 5 does not exist"),
    (["train", "--kill-worker", "1:3", "--compare-workers", "1,2"], "in the runs with 1 worker(s)"),
    (["train", "--kill-worker", "0:9", "--max-steps", "5"], "step 9 is not within the run"),
    (["train", "--workers", "3", "--batch-size", "1000"], "does not split into 3 equal shares"),
    (["generate", "--samples", "0", "--out", "x"], "--samples must be at least 1"),
])
def test_the_cli_refuses_bad_options(argv: list[str], message: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_cli_refuses_a_batch_larger_than_the_data(tmp_path: Path) -> None:
    proc = run_cli("train", "--samples", "300", "--eval-samples", "50", "--batch-size", "1000",
                   "--cache-dir", str(tmp_path / "cache"), timeout=40)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--batch-size 1000 is more than the 300 training samples" in proc.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_every_child_and_removes_its_cache(tmp_path: Path,
                                                                          signum: int) -> None:
    from .test_param_server_service import stop_launcher_and_check

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    err = stop_launcher_and_check(
        ["examples.embedding_pipeline", "train", "--samples", "200000", "--eval-samples", "500",
         "--batch-size", "32", "--dim", "4", "--hidden", "8", "--workers", "2", "--timeout", "20"], signum,
        lambda log: "embedding_pipeline:" in log.read_text(), tmp_path, env={"TMPDIR": str(tmp)})
    assert f"stopped by {signal.Signals(signum).name}" in err
    assert list(tmp.glob("rvz-pipeline-*")) == []  # the temporary column cache is gone too

"""The torch DLRM over the parameter server (examples/torch_dlrm): the PS optimizer against
``torch.optim.SparseAdam``, the embedding-bag module's forward and gradients against
``nn.EmbeddingBag``, parity of a whole run with the same model trained in one process,
staleness, and the CLI.

Runs over the PS use real rvz Nodes on loopback: the shards on a loop of their own in a
thread of this process, the worker's EG on another (as the CLI runs it, except that the CLI
starts the shards as processes, which its own test does).
"""

# ruff: noqa: E402 - the example's modules import torch: they come after importorskip
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch example needs torch (the 'torch' extra)")

from examples.embedding_pipeline import criteo
from examples.embedding_pipeline.criteo import Columns
from examples.embedding_pipeline.synthetic import Planted
from examples.param_server.launch import local_cluster
from examples.param_server.protocol import WORKER_JOB
from examples.torch_dlrm.data import MISSING_IDS, TABLES, batches, jagged
from examples.torch_dlrm.embedding import PSEmbeddingBagCollection
from examples.torch_dlrm.service import EmbeddingService, SparseBatch
from examples.torch_dlrm.sparse_adam import SparseAdam
from examples.torch_dlrm.train import (
    RunConfig,
    ShardThread,
    make_model,
    max_relative_difference,
    ps_config,
    run_local,
    run_ps,
)

from .procs import run_module

REPO = Path(__file__).resolve().parent.parent
FAST_NODE = dict(heartbeat=0.2, peer_timeout=5.0, linger=1.0, connect_timeout=5.0)
BATCH = 32


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the PS optimizer ----------------------------------------------------------------------------------

def test_sparse_adam_on_the_ps_is_torch_sparse_adam_bit_for_bit() -> None:
    rng = np.random.default_rng(1)
    vocab, dim = 40, 6
    emb = torch.nn.Embedding(vocab, dim, sparse=True)
    reference = torch.optim.SparseAdam(emb.parameters(), lr=0.02)
    rows = np.zeros((vocab, 3 * dim), dtype=np.float32)   # [w | m | v], as the table keeps them
    rows[:, :dim] = emb.weight.detach().numpy()
    ours = SparseAdam(lr=0.02)
    for t in range(1, 80):
        ids = torch.from_numpy(rng.integers(0, vocab, 25))   # repeats: summed by coalesce
        out = emb(ids)
        loss = (out * torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))).sum() ** 2
        reference.zero_grad()
        loss.backward()
        grad = emb.weight.grad.coalesce()
        present = grad.indices()[0].numpy()
        reference.step()
        part = rows[present]
        ours.apply(part, grad.values().numpy().copy(), t)
        rows[present] = part
        assert np.array_equal(rows[:, :dim], emb.weight.detach().numpy()), f"step {t}"


# -- the module against nn.EmbeddingBag --------------------------------------------------------------------

class LocalService:
    """What the module asks of an ``EmbeddingService``, over rows held here: ``take`` gives a
    batch's unique ids and their rows (as EG's pull does), ``give`` keeps the gradients."""

    def __init__(self, tables: dict[str, np.ndarray]) -> None:
        self.tables = tables
        self.names = list(tables)
        self.dims = {name: rows.shape[1] for name, rows in tables.items()}
        self.given: dict[int, list[np.ndarray]] = {}

    def take(self, batch: SparseBatch) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        uniques, inverses, rows = [], [], []
        for name in self.names:
            unique, inverse = np.unique(batch.features[name][0], return_inverse=True)
            uniques.append(unique)
            inverses.append(inverse.reshape(-1))
            rows.append(self.tables[name][unique].copy())
        return uniques, inverses, rows

    def give(self, b: int, grads: list[np.ndarray]) -> None:
        self.given[b] = [np.array(g) for g in grads]

    def read(self, ids: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: self.tables[name][i] for name, i in ids.items()}


def jagged_batch(rng: np.random.Generator, sizes: dict[str, int], n: int) -> SparseBatch:
    """Multi-hot bags of 0 to 4 ids (repeats within and across bags), some empty."""
    features = {}
    for name, vocab in sizes.items():
        lengths = rng.integers(0, 5, n)
        lengths[rng.integers(0, n)] = 0
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        features[name] = (rng.integers(0, vocab, int(lengths.sum())).astype(np.int64), offsets)
    return SparseBatch(features)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_the_module_pools_and_differentiates_as_nn_embedding_bag(mode: str) -> None:
    rng = np.random.default_rng(7)
    sizes, dims = {"a": 30, "b": 9, "c": 50}, {"a": 4, "b": 3, "c": 8}
    weights = {name: rng.standard_normal((sizes[name], dims[name])).astype(np.float32) for name in sizes}
    service = LocalService(weights)
    module = PSEmbeddingBagCollection(service, mode)  # type: ignore[arg-type]
    local = {name: torch.nn.EmbeddingBag(sizes[name], dims[name], mode=mode, sparse=True) for name in sizes}
    dense = {name: torch.nn.EmbeddingBag(sizes[name], dims[name], mode=mode) for name in sizes}
    for name, bag in [*local.items(), *dense.items()]:
        with torch.no_grad():
            bag.weight.copy_(torch.from_numpy(weights[name]))
    for b in range(3):
        batch = jagged_batch(rng, sizes, 12)
        batch.batch_id = b
        head = [torch.from_numpy(rng.standard_normal((dims[n], 1)).astype(np.float32)) for n in sizes]
        ours = module(batch)
        theirs = [local[n](*(torch.from_numpy(x) for x in batch.features[n])) for n in sizes]
        plain = [dense[n](*(torch.from_numpy(x) for x in batch.features[n])) for n in sizes]
        for o, t in zip(ours, theirs, strict=True):
            assert torch.equal(o, t)          # the same kernel on the same rows
        loss = sum(((o @ h) ** 2).sum() for o, h in zip(ours, head, strict=True))
        torch.autograd.backward([loss, sum(((t @ h) ** 2).sum() for t, h in zip(theirs, head, strict=True)),
                                 sum(((p @ h) ** 2).sum() for p, h in zip(plain, head, strict=True))])
        for t, name in enumerate(sizes):
            unique = np.unique(batch.features[name][0])
            sparse = local[name].weight.grad.coalesce()
            # Exactly SparseAdam's input: torch's sparse gradient, duplicates summed by coalesce.
            assert np.array_equal(sparse.indices()[0].numpy(), unique)
            assert np.array_equal(service.given[b][t], sparse.values().numpy())
            # And the gradient itself (a dense one, summed differently) to float tolerance.
            np.testing.assert_allclose(service.given[b][t], dense[name].weight.grad.numpy()[unique],
                                       rtol=1e-5, atol=1e-6)
            local[name].weight.grad = None
            dense[name].weight.grad = None
    # Outside training the rows are read, and nothing is handed back.
    module.eval()
    batch = jagged_batch(rng, sizes, 5)
    with torch.no_grad():
        out = module(batch)
    assert [o.shape for o in out] == [(5, dims[n]) for n in sizes]
    assert torch.equal(out[0], local["a"](*(torch.from_numpy(x) for x in batch.features["a"])))
    assert sorted(service.given) == [0, 1, 2]


def test_criteo_ids_become_jagged_bags_with_empty_values_as_empty_bags() -> None:
    ids = np.tile(np.arange(26, dtype=np.int64) + 100, (3, 1))
    ids[1, 0] = MISSING_IDS[0]
    ids[:, 5] = MISSING_IDS[5]
    features = jagged(ids)
    assert list(features) == list(TABLES)
    values, offsets = features["C1"]
    assert values.tolist() == [100, 100] and offsets.tolist() == [0, 1, 1]
    assert features["C6"][0].tolist() == [] and features["C6"][1].tolist() == [0, 0, 0]
    kept = jagged(ids, keep_missing=True)["C1"]
    assert kept[0].tolist() == [100, MISSING_IDS[0], 100] and kept[1].tolist() == [0, 1, 2]


# -- whole runs ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Columns, Columns]:
    """Planted Criteo-format data, training and held-out, parsed into column caches."""
    root = tmp_path_factory.mktemp("planted")
    for name, samples, seed in (("train", 24 * BATCH, 1), ("eval", 400, 2)):
        Planted(seed=5).write(root / f"{name}.tsv", samples, sample_seed=seed)
        criteo.encode(root / f"{name}.tsv", root / name)
    return Columns.open(root / "train"), Columns.open(root / "eval")


def config(**kw: Any) -> RunConfig:
    return RunConfig(**{"batch_size": BATCH, "steps": 20, "dim": 4, "bottom": (8,), "top": (8,), "shards": 2,
                        "timeout": 20.0, "node_options": FAST_NODE, **kw})


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("pooling", "interaction", "keep_missing"), [("sum", "dot", False),
                                                                       ("mean", "cat", True)])
def test_a_run_over_the_ps_matches_nn_embedding_bag_and_sparse_adam(planted, pooling, interaction,
                                                                     keep_missing) -> None:  # type: ignore[no-untyped-def]
    train, held_out = planted
    cfg = config(pooling=pooling, interaction=interaction, keep_missing=keep_missing)
    ours = run_ps(train, held_out, cfg, in_process=True)
    theirs = run_local(train, held_out, cfg)
    assert ours.steps == theirs.steps == 20
    rel = np.abs(np.array(ours.losses) - theirs.losses) / np.abs(theirs.losses)
    assert (rel <= 1e-5).all(), rel                 # at every step
    assert max_relative_difference(ours.losses, theirs.losses) == rel.max()
    assert ours.auc is not None and theirs.auc is not None and abs(ours.auc - theirs.auc) <= 1e-3
    assert 0.0 < ours.auc < 1.0 and ours.logloss is not None
    assert ours.seconds > 0 and ours.waiting > 0 and ours.ps > 0 and "torch compute" in ours.overhead()


@pytest.mark.timeout(120)
def test_staleness_2_trains_with_the_rows_after_step_t_minus_3(planted) -> None:  # type: ignore[no-untyped-def]
    train, _ = planted
    cfg = config(steps=10, staleness=2)
    ours = run_ps(train, None, cfg, in_process=True)
    # The reference computes step t on the rows after the update of step t - 3, and applies
    # its gradient to the current rows.
    theirs = run_local(train, None, cfg)
    assert max_relative_difference(ours.losses, theirs.losses) <= 1e-5
    fresh = run_local(train, None, config(steps=10))
    assert ours.losses[0] == fresh.losses[0] and max_relative_difference(ours.losses, fresh.losses) > 1e-4


@pytest.mark.timeout(120)
def test_two_workers_split_each_batch_and_stay_within_float_rounding_of_one(planted) -> None:  # type: ignore[no-untyped-def]
    train, held_out = planted
    cfg = config(steps=12)
    two = run_ps(train, held_out, dataclasses.replace(cfg, workers=2), in_process=True)
    one = run_local(train, held_out, cfg)
    # Each worker's loss and gradients are its share of the batch's; the shares' sums round
    # differently from the whole batch's, and nothing else differs.
    assert two.steps == 12 and max_relative_difference(two.losses, one.losses) <= 1e-5
    assert two.allreduce > 0 and "dense all-reduce" in two.overhead()
    assert two.auc is not None and one.auc is not None and abs(two.auc - one.auc) <= 1e-3


def test_a_failing_source_fails_the_training_loop_and_the_shards_end(planted) -> None:  # type: ignore[no-untyped-def]
    train, _ = planted
    cfg = config()
    ps = ps_config(cfg)
    cluster = local_cluster(cfg.shards, 1, WORKER_JOB)

    def source() -> Any:
        yield from batches(train, BATCH, 3)
        raise OSError("the data went away")

    with ShardThread(cluster, ps) as shards:
        service = EmbeddingService(cluster, 0, cfg.shards, ps.dims(), staleness=1, timeout=10.0,
                                   node_options=FAST_NODE)
        seen = []
        try:
            service.start(source())
            model = make_model(PSEmbeddingBagCollection(service), cfg)
            with pytest.raises(OSError, match="the data went away"):
                for batch in service.batches():
                    model(batch).sum().backward()
                    seen.append(batch.batch_id)
        finally:
            service.close()
        # Batches 0 and 1 trained; batch 2 too if its rows reached the training loop before
        # the failure did. Every shard ended, none waits for a push.
        assert seen in ([0, 1], [0, 1, 2])
        steps = [s["global_step"] for s in shards.wait(10.0)]
        assert steps in ([2] * cfg.shards, [3] * cfg.shards) and steps[0] >= len(seen) - 1


# -- the CLI ------------------------------------------------------------------------------------------------

@pytest.mark.process
@pytest.mark.timeout(180)
def test_cli_trains_with_worker_and_shard_processes_and_reports_auc_and_overhead(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    proc = run_module("examples.torch_dlrm", "train", "--samples", "640", "--eval-samples", "300",
                      "--batch-size", "64", "--dim", "4", "--bottom", "8", "--top", "8", "--shards", "1",
                      "--workers", "2", "--staleness", "1", "--timeout", "30", "--log-level", "WARNING",
                      "--json", str(out), cwd=str(REPO), timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "over the PS: 10 steps" in proc.stdout and "held-out AUC" in proc.stdout, proc.stdout
    assert "overhead: per step" in proc.stdout and "torch compute" in proc.stdout
    import json

    report = json.loads(out.read_text())
    assert report["ps"]["steps"] == 10 and 0.0 < report["ps"]["auc"] < 1.0
    assert report["config"]["staleness"] == 1 and report["config"]["workers"] == 2
    assert "dense all-reduce" in proc.stdout


def test_the_cli_refuses_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    from examples.torch_dlrm.__main__ import parse_args

    for argv, message in ((["train", "--staleness", "-1"], "--staleness"),
                          (["train", "--data", "x.tsv"], "--eval-data"),
                          (["parity", "--steps", "0"], "--steps"),
                          (["train", "--batch-size", "10", "--workers", "3"], "3 equal shares")):
        with pytest.raises(SystemExit) as info:
            parse_args(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.process
@pytest.mark.timeout(180)
def test_cli_parity_reports_the_loss_difference_and_both_aucs() -> None:
    proc = run_module("examples.torch_dlrm", "parity", "--steps", "8", "--samples", "600",
                      "--eval-samples", "300", "--batch-size", "64", "--dim", "4", "--bottom", "8",
                      "--top", "8", "--shards", "1", "--pooling", "mean", "--timeout", "30",
                      "--log-level", "WARNING", cwd=str(REPO), timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parity over 8 steps: max relative loss difference 0 " in proc.stdout, proc.stdout
    assert "8 of 8 losses bit-identical" in proc.stdout and ": OK" in proc.stdout

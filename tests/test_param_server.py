"""The parameter server's table: native core, optimizers against independent references,
admission, eviction, checkpoints.

The references below are plain numpy loops over ids and columns, written from the published
update rules (PyTorch's Adagrad and SparseAdam, TF's LazyAdam and FTRL-Proximal), in
float64, independently of examples/param_server.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from examples.param_server import (
    SGD,
    Adagrad,
    Adam,
    EmbeddingTable,
    Ftrl,
    MinCount,
    Probability,
    checkpoint,
    native,
)
from examples.param_server.checkpoint import MANIFEST, CheckpointError
from examples.param_server.sparse import SHARD_SALT, shard_of

# An example or a program, which the choice of hot paths does not change: scripts/test
# runs these in its compiled leg only.
pytestmark = pytest.mark.process

CORES = ["python"] + (["compiled"] if native.implementation() == "compiled" else [])


# -- the native core -------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", CORES)
def test_core_maps_ids_to_rows_through_growth_and_removal(variant: str) -> None:
    core = native.load(variant).RowTable(3, 16)
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(-2**63, 2**63 - 1, 3000, dtype=np.int64))
    ids = np.concatenate([ids, np.array([0, -1, 2**63 - 1, -2**63], dtype=np.int64)])
    ids = np.unique(ids)
    rows = np.empty(len(ids), dtype=np.int32)
    reference: dict[int, int] = {}
    for start in range(0, len(ids), 500):  # inserts in batches: growth happens mid-way
        batch = ids[start:start + 500]
        core.insert(batch, rows[start:start + 500], 1)
        reference.update(zip(batch.tolist(), rows[start:start + 500].tolist(), strict=True))
        values = np.repeat(batch[:, None].astype(np.float32), 3, axis=1)
        core.scatter(rows[start:start + 500], values, 0, 1)
        found = np.empty(start + len(batch), dtype=np.int32)
        assert core.find(ids[:start + len(batch)], found) == start + len(batch)
        np.testing.assert_array_equal(found, rows[:start + len(batch)])
    assert core.size == len(ids) and len(set(rows.tolist())) == len(ids)
    out = np.empty((len(ids), 2), dtype=np.float32)
    got = np.empty(len(ids), dtype=np.int32)
    assert core.lookup(ids, out, got, 7) == 0
    np.testing.assert_array_equal(out[:, 0], ids.astype(np.float32))
    # Remove every other id: the rest are still found (backward-shift deletion keeps runs).
    gone, kept = ids[::2].copy(), ids[1::2].copy()
    assert core.remove(gone) == len(gone) and core.remove(gone) == 0
    found = np.empty(len(ids), dtype=np.int32)
    assert core.find(ids, found) == len(kept)
    assert (found[::2] == -1).all()
    np.testing.assert_array_equal(found[1::2], [reference[i] for i in kept.tolist()])
    listed_ids = np.empty(core.size, dtype=np.int64)
    listed_rows = np.empty(core.size, dtype=np.int32)
    assert core.items(listed_ids, listed_rows) == len(kept)
    assert sorted(listed_ids.tolist()) == sorted(kept.tolist())
    # Freed rows are reused before the matrix grows.
    before = core.row_cap
    fresh = np.empty(len(gone), dtype=np.int32)
    core.insert(gone, fresh, 2)
    assert core.row_cap == before and set(fresh.tolist()) == {reference[i] for i in gone.tolist()}


@pytest.mark.parametrize("variant", CORES)
def test_core_keeps_every_id_while_its_index_grows_in_mapped_chunks(variant: str) -> None:
    # 120k ids: indexes of megabytes, mapped ahead in chunks by the helper thread (or by
    # the serving thread when it falls behind), several growths and moves; every id
    # inserted so far is found after each batch, lookups included.
    core = native.load(variant).RowTable(1, 16)
    ids = np.random.default_rng(9).permutation(np.arange(120_000, dtype=np.int64) * 1_000_003)
    rows = np.empty(len(ids), dtype=np.int32)
    for start in range(0, len(ids), 4000):
        part = slice(start, start + 4000)
        core.insert(ids[part], rows[part], 1)
        core.scatter(rows[part], ids[part, None].astype(np.float32), 0, 1)
        sample = ids[:start + 4000:7].copy()
        found = np.empty(len(sample), dtype=np.int32)
        assert core.find(sample, found) == len(sample)
        np.testing.assert_array_equal(found, rows[:start + 4000:7])
        out = np.empty((len(sample), 1), dtype=np.float32)
        assert core.lookup(sample, out, found, 1) == 0
        np.testing.assert_array_equal(out[:, 0], sample.astype(np.float32))
    assert core.size == len(ids) and len(set(rows.tolist())) == len(ids)


@pytest.mark.parametrize("variant", CORES)
def test_core_costs_at_most_32_bytes_per_id_beyond_the_row(variant: str) -> None:
    # The table's memory bound, counted by the core itself after every batch of inserts: the index
    # (with its successor beside it while it grows), each row's id, stamp and version, and
    # the row blocks mapped ahead. Width 192 is dim 64 with Adam's two slots. Below 100k
    # ids the blocks mapped ahead are still a large share, so the bound is checked above.
    core = native.load(variant).RowTable(192, 16)
    ids = np.random.default_rng(3).permutation(np.arange(200_000, dtype=np.int64) * 7_000_003)
    rows = np.empty(len(ids), dtype=np.int32)
    worst = 0.0
    grew = 0
    for start in range(0, len(ids), 4096):
        part = slice(start, start + 4096)
        capacity = core.capacity
        core.insert(ids[part], rows[part], 1)
        if core.size >= 100_000:
            grew += core.capacity != capacity
            worst = max(worst, core.index_bytes() / core.size)
    assert grew >= 1  # the index grew (and its successor was counted) in the checked range
    assert 16 < worst <= 32
    found = np.empty(len(ids), dtype=np.int32)
    assert core.find(ids, found) == len(ids)
    np.testing.assert_array_equal(found, rows)


@pytest.mark.parametrize("variant", CORES)
def test_core_rows_span_blocks(variant: str) -> None:
    # Wide rows make small blocks (about 8 MiB each): 1500 rows take several, and the
    # next block is mapped ahead while the last one fills.
    core = native.load(variant).RowTable(4096, 16)
    assert core.block_rows == 512
    ids = np.arange(1500, dtype=np.int64) * 7919 - 3000
    rows = np.empty(len(ids), dtype=np.int32)
    for start in range(0, len(ids), 100):
        part = slice(start, start + 100)
        core.insert(ids[part], rows[part], 3)
        values = np.repeat(ids[part, None].astype(np.float32), 4096, axis=1)
        values[:, -1] = -ids[part]
        core.scatter(rows[part], np.ascontiguousarray(values), 0, 4)
    assert core.nblocks >= 3 and core.row_cap >= len(ids)
    probe = np.concatenate([ids[::-7], [123456789]])
    out = np.empty((len(probe), 3), dtype=np.float32)
    found = np.empty(len(probe), dtype=np.int32)
    assert core.lookup(probe, out, found, 9) == 1
    np.testing.assert_array_equal(out[:-1], np.repeat(probe[:-1, None], 3, axis=1).astype(np.float32))
    np.testing.assert_array_equal(out[-1], [0, 0, 0])
    tail = np.empty((len(probe), 2), dtype=np.float32)
    core.gather(found, tail, 4094)
    np.testing.assert_array_equal(tail[:-1, 1], -probe[:-1].astype(np.float32))
    stamps = np.empty(len(found), dtype=np.uint32)
    versions = np.empty(len(found), dtype=np.uint32)
    core.get_stamps(found, stamps)
    core.get_mvers(found, versions)
    assert stamps[:-1].tolist() == [9] * (len(probe) - 1) and stamps[-1] == 0
    assert versions[:-1].tolist() == [4] * (len(probe) - 1)
    assert sum(len(b) for b in core.blocks()) == core.next_row == len(ids)


def test_normal_initializer_is_the_same_in_both_cores() -> None:
    from examples.param_server.sparse import normal_levels, normal_salt, seeded_normal

    ids = np.array([0, -1, 5, 2**62, -2**63], dtype=np.int64)
    expected = np.float32(0.5) * seeded_normal(ids, 7, 3)
    for variant in CORES:
        out = np.zeros((len(ids), 9), dtype=np.float32)
        native.load(variant).normal_fill(ids, normal_salt(3), normal_levels(), 0.5, out, 7)
        np.testing.assert_array_equal(out[:, :7], expected)
        np.testing.assert_array_equal(out[:, 7:], 0.0)  # columns past ncols untouched


def test_both_cores_give_the_same_answers() -> None:
    if len(CORES) < 2:
        pytest.skip("the compiled core is not built")
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 5000, 4000, dtype=np.int64)
    results = []
    for variant in CORES:
        core = native.load(variant).RowTable(2, 16)
        unique = np.unique(ids)
        rows = np.empty(len(unique), dtype=np.int32)
        core.insert(unique, rows, 0)
        core.scatter(rows, np.stack([unique, -unique], axis=1).astype(np.float32), 0, 0)
        core.remove(unique[:100])
        out = np.empty((len(ids), 2), dtype=np.float32)
        found = np.empty(len(ids), dtype=np.int32)
        missing = core.lookup(ids, out, found, 3)
        results.append((missing, out))
    assert results[0][0] == results[1][0] > 0
    np.testing.assert_array_equal(results[0][1], results[1][1])


# -- creation, evaluation reads, initializers ------------------------------------------------------

def test_lookup_creates_rows_and_evaluation_reads_never_do() -> None:
    t = EmbeddingTable(dim=4, optimizer=SGD(lr=0.1), initializer="zeros")
    assert len(t) == 0
    np.testing.assert_array_equal(t.lookup([5, 6, 5], create=False), np.zeros((3, 4), np.float32))
    assert len(t) == 0
    rows = t.lookup(np.array([5, 6, 5, 7]))
    assert rows.shape == (4, 4) and rows.dtype == np.float32 and len(t) == 3
    t.apply_gradients([5], np.ones((1, 4)), create=False)
    t.apply_gradients([99], np.ones((1, 4)), create=False)  # absent: dropped, not created
    assert len(t) == 3 and t.dropped == 1 and 99 not in t
    np.testing.assert_allclose(t.lookup([5, 99], create=False), [[-0.1] * 4, [0.0] * 4])
    assert len(t) == 3


def test_initializers_are_seeded_per_id() -> None:
    a = EmbeddingTable(dim=8, initializer="normal", seed=3, init_std=1.0)
    b = EmbeddingTable(dim=8, initializer="normal", seed=3, init_std=1.0)
    c = EmbeddingTable(dim=8, initializer="normal", seed=4, init_std=1.0)
    first = a.lookup([1, 2, 3])
    np.testing.assert_array_equal(first, b.lookup([3, 2, 1])[::-1])  # order does not matter
    assert not np.allclose(first, c.lookup([1, 2, 3]))
    big = EmbeddingTable(dim=16, initializer="normal", seed=0, init_std=1.0).lookup(np.arange(4000))
    assert abs(big.mean()) < 0.05 and abs(big.std() - 1.0) < 0.05
    z = EmbeddingTable(dim=2, initializer="zeros").lookup([4])
    np.testing.assert_array_equal(z, [[0.0, 0.0]])
    f = EmbeddingTable(dim=2, initializer=lambda ids, dim: np.stack([ids, 2 * ids], axis=1))
    np.testing.assert_array_equal(f.lookup([3, 1]), [[3, 6], [1, 2]])


def test_assign_sets_rows_and_resets_slots() -> None:
    t = EmbeddingTable(dim=2, optimizer=Adagrad(lr=1.0, initial_accumulator_value=0.5))
    t.lookup([1, 2])
    t.apply_gradients([1, 2], np.full((2, 2), 3.0))
    t.assign([1, 3, 1], np.array([[1, 1], [2, 2], [5, 6]], dtype=np.float32))  # last 1 wins
    rows = t.rows([1, 2, 3])
    np.testing.assert_array_equal(rows[0], [5, 6, 0.5, 0.5])
    np.testing.assert_array_equal(rows[2], [2, 2, 0.5, 0.5])
    assert rows[1, 2] == pytest.approx(9.5)  # row 2 kept its accumulator
    assert len(t) == 3


# -- optimizers against references -------------------------------------------------------------

Reference = Callable[[dict[int, list[np.ndarray]], np.ndarray, int, int], None]


def sgd_ref(state: dict[int, list[np.ndarray]], g: np.ndarray, id_: int, t: int, lr: float = 0.05) -> None:
    w = state[id_][0]
    for j in range(len(w)):
        w[j] -= lr * g[j]


def adagrad_ref(state: dict[int, list[np.ndarray]], g: np.ndarray, id_: int, t: int,
                lr: float = 0.3, init: float = 0.1, eps: float = 1e-10) -> None:
    if len(state[id_]) == 1:
        state[id_].append(np.full(len(g), init))
    w, acc = state[id_]
    for j in range(len(w)):
        acc[j] += g[j] * g[j]
        w[j] -= lr * g[j] / (math.sqrt(acc[j]) + eps)


def adam_ref(state: dict[int, list[np.ndarray]], g: np.ndarray, id_: int, t: int,
             lr: float = 0.02, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> None:
    if len(state[id_]) == 1:
        state[id_] += [np.zeros(len(g)), np.zeros(len(g))]
    w, m, v = state[id_]
    bias1, bias2 = 1 - b1 ** t, 1 - b2 ** t  # t: the global step, not the row's updates
    for j in range(len(w)):
        m[j] = b1 * m[j] + (1 - b1) * g[j]
        v[j] = b2 * v[j] + (1 - b2) * g[j] * g[j]
        w[j] -= lr * math.sqrt(bias2) / bias1 * m[j] / (math.sqrt(v[j]) + eps)


def ftrl_ref(state: dict[int, list[np.ndarray]], g: np.ndarray, id_: int, t: int, lr: float = 0.2,
             power: float = -0.5, init: float = 0.1, l1: float = 0.002, l2: float = 0.01) -> None:
    if len(state[id_]) == 1:
        state[id_] += [np.full(len(g), init), np.zeros(len(g))]
    w, n, z = state[id_]
    for j in range(len(w)):
        n_new = n[j] + g[j] * g[j]
        sigma = (n_new ** -power - n[j] ** -power) / lr
        z[j] += g[j] - sigma * w[j]
        if abs(z[j]) <= l1:
            w[j] = 0.0
        else:
            w[j] = (math.copysign(l1, z[j]) - z[j]) / (n_new ** -power / lr + 2 * l2)
        n[j] = n_new


OPTIMIZERS: dict[str, tuple[Callable[[], object], Reference]] = {
    "sgd": (lambda: SGD(lr=0.05), sgd_ref),
    "adagrad": (lambda: Adagrad(lr=0.3, initial_accumulator_value=0.1, eps=1e-10), adagrad_ref),
    "adam": (lambda: Adam(lr=0.02, beta1=0.9, beta2=0.999, eps=1e-8), adam_ref),
    "ftrl": (lambda: Ftrl(lr=0.2, lr_power=-0.5, initial_accumulator_value=0.1, l1=0.002, l2=0.01),
             ftrl_ref),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_matches_its_reference_with_duplicated_ids(name: str) -> None:
    make, ref = OPTIMIZERS[name]
    dim = 5
    table = EmbeddingTable(dim=dim, optimizer=make(), initializer="normal", seed=7, init_std=0.5)  # type: ignore[arg-type]
    rng = np.random.default_rng(11)
    state: dict[int, list[np.ndarray]] = {}
    for t in range(1, 9):
        # 48 ids from 6 distinct values: every batch repeats ids many times; some ids sit
        # out some steps (lazy optimizers must leave them alone).
        pool = rng.choice(10, size=6, replace=False)
        ids = rng.choice(pool, size=48).astype(np.int64)
        before = table.lookup(ids)
        for id_, row in zip(ids.tolist(), before.astype(np.float64), strict=True):
            if id_ not in state:
                state[id_] = [row.copy()]
        grads = rng.standard_normal((48, dim)).astype(np.float32)
        table.apply_gradients(ids, grads)
        for id_ in sorted(set(ids.tolist())):
            g = np.zeros(dim)
            for k in range(len(ids)):  # duplicates summed first, in float64
                if ids[k] == id_:
                    g += grads[k].astype(np.float64)
            ref(state, g, id_, t)
    assert table.global_step == 8
    ids = np.array(sorted(state), dtype=np.int64)
    rows = table.rows(ids).astype(np.float64)
    for i, id_ in enumerate(ids.tolist()):
        expected = np.concatenate(state[id_])
        np.testing.assert_allclose(rows[i], expected, rtol=2e-5, atol=2e-6, err_msg=f"id {id_}")


def test_adam_step_counts_calls_even_without_the_row() -> None:
    t = EmbeddingTable(dim=1, optimizer=Adam(lr=0.1), initializer="zeros")
    t.lookup([1, 2])
    t.apply_gradients([2], [[1.0]])
    t.apply_gradients(np.zeros(0, np.int64), np.zeros((0, 1)))  # still a step
    t.apply_gradients([1], [[1.0]])  # row 1's first update, at global step 3
    # m = 0.1, v = 0.001, lr_t = 0.1 * sqrt(1 - 0.999**3) / (1 - 0.9**3)
    lr_t = 0.1 * math.sqrt(1 - 0.999 ** 3) / (1 - 0.9 ** 3)
    expected = -lr_t * 0.1 / (math.sqrt(0.001) + 1e-8)
    assert t.lookup([1])[0, 0] == pytest.approx(expected, rel=1e-5)


# -- admission and eviction -------------------------------------------------------------------------

def test_min_count_admission() -> None:
    t = EmbeddingTable(dim=2, initializer="zeros", admission=MinCount(3))
    t.lookup([1, 2])
    assert len(t) == 0
    t.lookup([1, 1])  # 1 reaches three lookups within this call: admitted now
    assert 1 in t and 2 not in t and len(t) == 1
    t.apply_gradients([2], np.ones((1, 2)))  # not admitted: dropped, not created
    assert 2 not in t and t.dropped == 1
    t.lookup([2], create=False)  # evaluation reads do not count
    t.lookup([2])
    assert 2 not in t
    t.lookup([2])
    assert 2 in t


def test_probability_admission_is_deterministic() -> None:
    def run() -> list[int]:
        t = EmbeddingTable(dim=1, admission=Probability(0.25), seed=5)
        for step in range(4):
            t.lookup(np.arange(step * 100, step * 100 + 400))
            t.apply_gradients([], np.zeros((0, 1)))
        return t.ids().tolist()

    first = run()
    assert first == run()
    assert 0.2 * 1000 < len(first) < 0.8 * 1000  # some, not all: 1000 ids seen 1-4 times


def test_eviction_by_ttl_and_lru() -> None:
    t = EmbeddingTable(dim=2, initializer="zeros")
    t.lookup([1, 2, 3, 4])
    for _step in range(3):
        t.lookup([1, 2])
        t.apply_gradients([1], np.ones((1, 2)))
    # Steps since last access: 1 and 2 were read at step 2, 3 and 4 at step 0; now step 3.
    assert t.evict(ttl=2).tolist() == [3, 4]
    assert t.ids().tolist() == [1, 2]
    t.lookup([5])
    t.apply_gradients([], np.zeros((0, 2)))
    t.lookup([2])
    assert t.evict(max_rows=2).tolist() == [1]  # 1 is the least recently used
    assert t.ids().tolist() == [2, 5] and t.evicted == 3


# -- checkpoints ------------------------------------------------------------------------------

def train_steps(t: EmbeddingTable, seed: int, steps: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, 300, 64).astype(np.int64)
        t.lookup(ids)
        t.apply_gradients(ids, rng.standard_normal((64, t.dim)).astype(np.float32))
        t.evict()


@pytest.mark.parametrize("incremental", [False, True])
def test_load_then_train_is_bit_identical(tmp_path: Path, incremental: bool) -> None:
    def make() -> EmbeddingTable:
        return EmbeddingTable(dim=6, optimizer=Adam(lr=0.01), initializer="normal", seed=2,
                              admission=MinCount(2), ttl=4)

    straight = make()
    train_steps(straight, 0, 6)
    train_steps(straight, 1, 6)
    train_steps(straight, 2, 6)

    interrupted = make()
    train_steps(interrupted, 0, 6)
    interrupted.save(tmp_path, fsync=False)
    train_steps(interrupted, 1, 6)
    interrupted.save(tmp_path, incremental=incremental, fsync=False)
    restored = EmbeddingTable.load(tmp_path)
    assert restored.global_step == 12 and len(restored) == len(interrupted)
    train_steps(restored, 2, 6)

    assert restored.global_step == straight.global_step == 18
    ids = straight.ids()
    np.testing.assert_array_equal(restored.ids(), ids)
    np.testing.assert_array_equal(restored.rows(ids), straight.rows(ids))  # slots included
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert len(manifest["chain"]) == (2 if incremental else 1)


def test_checkpoint_detects_corruption_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    t = EmbeddingTable(dim=3, optimizer=Ftrl(), initializer="normal")
    t.lookup(np.arange(50))
    t.save(tmp_path, fsync=False)
    entry = json.loads((tmp_path / MANIFEST).read_text())["chain"][0]
    # A save that died before its rename leaves only a temporary directory behind.
    (tmp_path / ".tmp-000002-full-1").mkdir()
    assert EmbeddingTable.load(tmp_path).ids().tolist() == list(range(50))
    matrix = tmp_path / entry / "matrix"
    data = bytearray(matrix.read_bytes())
    data[5] ^= 0xFF
    matrix.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        EmbeddingTable.load(tmp_path)
    with pytest.raises(CheckpointError):
        EmbeddingTable.load(tmp_path / "nothing-here")


def test_a_save_killed_before_its_manifest_does_not_block_the_next_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A shard killed between renaming its new entry into place and replacing the manifest
    # leaves an entry nothing names and a temporary manifest. The restarted shard restores
    # the previous checkpoint and its next save takes the same entry name: it must succeed.
    t = EmbeddingTable(dim=4, optimizer=Adam(lr=0.01), initializer="normal", seed=1)
    train_steps(t, 0, 3)
    t.save(tmp_path, fsync=False)
    saved_ids, saved_rows = t.ids(), t.rows(t.ids())
    train_steps(t, 1, 3)

    def killed(src: object, dst: object) -> None:
        raise KeyboardInterrupt("killed before the manifest")

    (tmp_path / "2024-notes").mkdir()  # not an entry: never removed
    monkeypatch.setattr(checkpoint.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        t.save(tmp_path, incremental=True, fsync=False)
    monkeypatch.undo()
    assert (tmp_path / "000002-incr").is_dir()  # the orphan the test is about

    restored = EmbeddingTable.load(tmp_path)
    np.testing.assert_array_equal(restored.ids(), saved_ids)
    np.testing.assert_array_equal(restored.rows(saved_ids), saved_rows)
    train_steps(restored, 2, 3)
    assert restored.save(tmp_path, incremental=True, fsync=False) == "000002-incr"
    again = EmbeddingTable.load(tmp_path)
    np.testing.assert_array_equal(again.rows(restored.ids()), restored.rows(restored.ids()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000001-full", "000002-incr", "2024-notes",
                                                           MANIFEST]


def test_a_large_checkpoint_written_straight_to_disk_loads_bit_identical(tmp_path: Path) -> None:
    # Rows of 256 float32 (SGD: no slots) in blocks of 8 MiB: 9000 rows are one whole
    # block and part of the next, so the matrix file has page-aligned blocks (written with
    # O_DIRECT where the file system allows it) and an unaligned tail written normally.
    t = EmbeddingTable(dim=256, optimizer=SGD(lr=0.5), initializer="normal", seed=5)
    ids = np.arange(9000, dtype=np.int64) * 7 - 30000
    t.lookup(ids)
    t.apply_gradients(ids[::3], np.ones((3000, 256), dtype=np.float32))
    t.save(tmp_path, fsync=True)
    restored = EmbeddingTable.load(tmp_path)
    np.testing.assert_array_equal(restored.ids(), np.sort(ids))
    np.testing.assert_array_equal(restored.rows(ids), t.rows(ids))


# -- the client's helpers: shard split, row scatter and gather --------------------------------------

@pytest.mark.parametrize("variant", CORES)
def test_shard_split_groups_positions_as_shard_of_does(variant: str) -> None:
    core = native.load(variant)
    rng = np.random.default_rng(3)
    ids = np.concatenate([rng.integers(-2**63, 2**63 - 1, 3000, dtype=np.int64),
                          np.array([0, -1, 2**63 - 1, -2**63], dtype=np.int64)])
    for shards in (1, 2, 3, 8):
        order = np.empty(len(ids), dtype=np.int64)
        bounds = np.empty(shards + 1, dtype=np.int64)
        core.shard_split(ids, shards, SHARD_SALT, order, bounds)
        owner = shard_of(ids, shards)
        assert bounds[0] == 0 and bounds[-1] == len(ids)
        for s in range(shards):  # each shard's positions, in input order
            np.testing.assert_array_equal(order[bounds[s]:bounds[s + 1]], np.flatnonzero(owner == s))
    empty = np.empty(0, dtype=np.int64)
    bounds = np.empty(3, dtype=np.int64)
    core.shard_split(empty, 2, SHARD_SALT, empty.copy(), bounds)
    assert bounds.tolist() == [0, 0, 0]


@pytest.mark.parametrize("variant", CORES)
def test_scatter_and_gather_rows(variant: str) -> None:
    core = native.load(variant)
    rng = np.random.default_rng(4)
    src = rng.standard_normal((500, 7)).astype(np.float32)
    positions = rng.permutation(500)[:321].astype(np.int64)
    picked = np.empty((321, 7), dtype=np.float32)
    core.gather_rows(src, positions, picked)
    np.testing.assert_array_equal(picked, src[positions])
    out = np.zeros((500, 7), dtype=np.float32)
    core.scatter_rows(out, positions, picked)
    expected = np.zeros((500, 7), dtype=np.float32)
    expected[positions] = src[positions]
    np.testing.assert_array_equal(out, expected)
    # The leading columns of wider rows (the embedding of table rows), and no wider.
    first = np.empty((321, 3), dtype=np.float32)
    core.gather_rows(src, positions, first)
    np.testing.assert_array_equal(first, src[positions, :3])
    with pytest.raises(ValueError, match="columns"):
        core.gather_rows(src, positions, np.empty((321, 8), dtype=np.float32))

"""A shard keeps answering pulls while it writes a checkpoint, and the checkpoint is the table
of the moment it was started, whatever changed while its rows were copied."""

from __future__ import annotations

import numpy as np
import pytest

from examples.param_server.optimizers import Adam
from examples.param_server.stall import measure
from examples.param_server.table import EmbeddingTable, RowCopy

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("n,pool_rows", [(300, None), (50_000, None), (50_000, 700)])
def test_a_row_copy_is_the_table_of_its_moment_through_updates_deletions_and_evictions(
        n: int, pool_rows: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if pool_rows is not None:
        monkeypatch.setattr(RowCopy, "POOL_ROWS", pool_rows)  # kept rows over many pool chunks
    rng = np.random.default_rng(1)
    t = EmbeddingTable(8, Adam(), "normal", ttl=3)
    ids = rng.integers(0, 1 << 40, n)
    t.lookup(ids)
    t.apply_gradients(ids[:n // 2], np.ones((n // 2, 8), np.float32))
    t.delete(ids[:5])
    at_start = {int(i): r for i, r in zip(t.ids(), t.rows(t.ids()), strict=True)}
    copy = t.copy_rows()
    rounds = 0
    while not copy.step(1000):
        some = rng.choice(ids, 500)
        t.apply_gradients(some, rng.normal(size=(500, 8)).astype(np.float32))
        t.lookup(rng.integers(0, 1 << 40, 50))   # new rows, some in freed row numbers
        t.delete(rng.choice(ids, 20))
        rounds += 1
        if rounds % 5 == 0:
            t.evict(ttl=1)
    snap = copy.snapshot()
    assert snap.rownum is not None
    got = {int(i): snap.rows[r] for i, r in zip(snap.ids, snap.rownum, strict=True)}
    assert set(got) == set(at_start)
    assert all(np.array_equal(got[i], row) for i, row in at_start.items())
    assert not t._copies  # a finished copy no longer slows the table's writes


@pytest.mark.process
def test_pulls_are_answered_while_a_shard_writes_its_checkpoint(tmp_path) -> None:
    # Not a latency ratio (it moves with the machine's load): a shard that wrote the
    # checkpoint on its event loop would answer no pull between the push that starts it
    # and its manifest; the copy goes a slice of 1024 rows per loop pass, so 60,000 rows
    # leave room for many pulls even on a loaded machine.
    r = measure(60_000, dim=16, ids=256, warm=20, timeout=60, fsync=False, root=str(tmp_path))
    print(r)
    assert r["pulls_during"] >= 3, r

"""A shard keeps answering pulls while it writes a checkpoint, and the checkpoint is the table
of the moment it was started, whatever changed while its rows were copied."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from examples.param_server import server
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
    stamps_at_start = dict(zip(t.ids().tolist(), _stamps(t, t.ids()).tolist(), strict=True))
    copy = t.copy_rows()
    rounds = 0
    while not copy.step(1000):
        t.lookup(rng.choice(ids, 300))   # stamps only: kept until the stamps are copied
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
    assert dict(zip(snap.ids.tolist(), snap.stamps.tolist(), strict=True)) == stamps_at_start
    assert not t._copies  # a finished copy no longer slows the table's writes


def _stamps(t: EmbeddingTable, ids: np.ndarray) -> np.ndarray:
    rows = np.empty(len(ids), dtype=np.int32)
    t._core.find(np.ascontiguousarray(ids, dtype=np.int64), rows)
    return t._meta(rows, "stamp")


def test_a_lookup_keeps_no_row_once_the_stamps_are_copied() -> None:
    # A lookup changes stamps only: it notes the stamps of its rows while they are being
    # copied, and then costs the copy nothing; a push still keeps its rows.
    rng = np.random.default_rng(2)
    t = EmbeddingTable(4, Adam())
    ids = rng.integers(0, 1 << 40, 20_000)
    t.lookup(ids)
    copy = t.copy_rows()
    t.apply_gradients(ids[:10], np.ones((10, 4), np.float32))   # a new stamp for the lookup below
    assert copy.keeps_reads
    t.lookup(ids[:100])
    assert copy._pooled == 10 and sum(len(r) for r, _ in copy._stamp_log) == 110
    while copy.keeps_reads:
        copy.step(256)
    assert copy._stamp_log == []
    t.lookup(ids[100:200])
    assert copy._pooled == 10
    t.apply_gradients(ids[-5:], np.ones((5, 4), np.float32))
    assert copy._pooled == 15


class _Slices:
    """A copy of ``n`` slices that notes whether the loop was busy at each."""

    def __init__(self, n: int, busy: list[bool]) -> None:
        self.left, self.busy, self.seen = n, busy, []

    def step(self, rows: int) -> bool:
        self.seen.append(self.busy[0])
        self.left -= 1
        return self.left <= 0


async def _spin(busy: list[bool], passes: int | None, each: float) -> None:
    """Run ``each`` seconds of CPU per loop pass, ``passes`` times (None: until cancelled)."""
    busy[0] = True
    done = 0
    while passes is None or done < passes:
        end = time.perf_counter() + each
        while time.perf_counter() < end:
            pass
        done += 1
        await asyncio.sleep(0)
    busy[0] = False


def test_a_copy_takes_a_slice_only_when_the_loop_has_nothing_else_to_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "COPY_WAIT", 60.0)

    async def main() -> list[bool]:
        busy = [False]
        spinning = asyncio.ensure_future(_spin(busy, 20, 0.002))
        await asyncio.sleep(0)   # the spinning has begun
        slices = _Slices(5, busy)
        await asyncio.wait_for(server._copy_out([slices]), 60)
        await spinning
        return slices.seen

    assert asyncio.run(main()) == [False] * 5


def test_a_copy_goes_on_under_a_loop_that_is_never_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "COPY_WAIT", 0.005)

    async def main() -> list[bool]:
        busy = [False]
        spinning = asyncio.ensure_future(_spin(busy, None, 0.001))
        await asyncio.sleep(0)
        slices = _Slices(5, busy)
        try:
            await asyncio.wait_for(server._copy_out([slices]), 60)
        finally:
            spinning.cancel()
        return slices.seen

    assert asyncio.run(main()) == [True] * 5


@pytest.mark.process
def test_pulls_are_answered_while_a_shard_writes_its_checkpoint(tmp_path) -> None:
    # Not a latency ratio (it moves with the machine's load): a shard that wrote the
    # checkpoint on its event loop would answer no pull between the push that starts it
    # and its manifest; the copy goes a slice of 256 rows per idle loop pass, so 60,000
    # rows leave room for many pulls even on a loaded machine.
    r = measure(60_000, dim=16, ids=256, warm=20, timeout=60, fsync=False, root=str(tmp_path))
    print(r)
    assert r["pulls_during"] >= 3, r

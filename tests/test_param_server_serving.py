"""The parameter server's serving path: each table's delta stream (rows changed and ids
removed since a version) and the replica that follows every shard by it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import rvz
from examples.param_server import SGD, Adagrad, EmbeddingTable
from examples.param_server.client import PSClient
from examples.param_server.launch import PSConfig, TableSpec, make_tables
from examples.param_server.native import RowTable
from examples.param_server.replica import Replica, ReplicaReader
from examples.param_server.server import ShardServer
from examples.param_server.table import rows_digest

from .conftest import free_ports

# An example or a program, which the choice of hot paths does not change: scripts/test
# runs these in its compiled leg only.
pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parent.parent
TABLES = (TableSpec("user", 3, "adam", 0.05), TableSpec("item", 5, "adagrad", 0.2))


def digest(table: EmbeddingTable) -> str:
    ids = table.ids()
    return rows_digest([("t", ids, table.rows(ids))])


def copy_digest(core: RowTable, width: int) -> str:
    ids = np.empty(core.size, dtype=np.int64)
    core.items(ids, np.empty(core.size, dtype=np.int32))
    ids = np.sort(ids)
    where = np.empty(len(ids), dtype=np.int32)
    core.find(ids, where)
    out = np.empty((len(ids), width), dtype=np.float32)
    core.gather(where, out, 0)
    return rows_digest([("t", ids, out)])


@pytest.mark.parametrize("max_tombstones", [1 << 20, 5])
def test_deltas_rebuild_the_table_exactly_through_updates_deletions_and_evictions(
        max_tombstones: int) -> None:
    table = EmbeddingTable(4, Adagrad(0.1), seed=3, max_rows=30)
    table.max_tombstones = max_tombstones
    rng = np.random.default_rng(0)
    copy = RowTable(table.width, 64)
    version, fulls = -1, 0
    for step in range(60):
        ids = rng.integers(0, 80, 12)
        table.lookup(ids)
        table.apply_gradients(ids, rng.normal(size=(12, 4)).astype(np.float32))
        if step % 7 == 3:
            table.delete(ids[:3])
        if step % 5 == 4:
            table.evict()
            table.lookup(ids[:2])  # an evicted id may come back at once
        if step % 3 == 2:
            ids_, rows, removed, full = table.delta_since(version)
            if full:
                fulls += 1
                copy = RowTable(table.width, 64)
            Replica._apply(copy, ids_, rows, removed, table.version)
            version = table.version
            assert copy_digest(copy, table.width) == digest(table), f"step {step}"
    assert table.evicted > 0 and fulls >= 1
    if max_tombstones == 5:
        assert fulls > 1  # the removal log moved past the copy: every row again
    else:
        assert fulls == 1  # only the first


def test_a_loaded_table_answers_an_older_version_with_every_row(tmp_path: Path) -> None:
    table = EmbeddingTable(2, SGD(0.1))
    table.lookup(np.arange(10))
    table.delete(np.arange(3))
    table.save(tmp_path / "t")
    loaded = EmbeddingTable.load(tmp_path / "t")
    assert loaded.delta_since(0)[3]  # its removals are not known: full
    ids, rows, removed, full = loaded.delta_since(loaded.version)
    assert not full and len(ids) == 0 and len(removed) == 0
    assert loaded.delta_since(loaded.version + 5)[3]  # another table's version: full


@contextlib.asynccontextmanager
async def serving(mode: str, cfg: PSConfig, shards: int, workers: int):  # type: ignore[no-untyped-def]
    ports = free_ports(shards + workers + 1)
    cluster = {"ps": [f"127.0.0.1:{p}" for p in ports[:shards]],
               "worker": [f"127.0.0.1:{p}" for p in ports[shards:shards + workers]],
               "replica": [f"127.0.0.1:{ports[-1]}"]}
    async with contextlib.AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(rvz.Node(cluster, "ps", s, mode=mode, linger=1.0))
                 for s in range(shards)]
        servers = [ShardServer(n, make_tables(cfg), workers, consistency=cfg.consistency, record=True,
                               evict_every=cfg.evict_every, replicas=1) for n in nodes]
        tasks = [asyncio.ensure_future(s.serve()) for s in servers]
        try:
            worker_nodes = [await stack.enter_async_context(
                rvz.Node(cluster, "worker", w, mode=mode, linger=1.0)) for w in range(workers)]
            replica_node = await stack.enter_async_context(
                rvz.Node(cluster, "replica", 0, mode=mode, linger=1.0))
            clients = [PSClient(n, shards, cfg.dims(), timeout=10) for n in worker_nodes]
            yield servers, clients, Replica(replica_node, shards, cfg, timeout=10), tasks
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def train(client: PSClient, steps: int) -> None:
    for clock in range(steps):
        rng = np.random.default_rng([client.worker, clock])
        ids = {"user": rng.integers(0, 40, 8), "item": rng.integers(100, 160, 6)}
        rows = await client.pull(ids, clock)
        await client.push_tables(ids, {n: 0.3 * r for n, r in rows.items()}, clock)
        await asyncio.sleep(0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["recv", "send"])
def test_a_replica_equals_each_shard_at_the_version_of_every_delta(run, mode) -> None:  # type: ignore[no-untyped-def]
    cfg = PSConfig(tables=TABLES, max_rows=12, evict_every=2)

    async def main() -> None:
        async with serving(mode, cfg, shards=2, workers=2) as (servers, clients, replica, tasks):
            training = asyncio.ensure_future(asyncio.gather(*(train(c, 16) for c in clients)))
            checked = 0
            try:
                while not training.done() or checked < 4:
                    answered = await replica.sync()
                    assert all(answered)
                    for shard, server in enumerate(servers):
                        # The copy is the shard as it was when it sent the delta, evictions included.
                        _, versions, expected = server.stats.delta_digests[-1]
                        assert tuple(replica.versions[shard]) == versions
                        assert replica.digest(shard) == expected
                        checked += 1
                    await asyncio.sleep(0.01)
                await training
            finally:
                training.cancel()
                await asyncio.gather(training, return_exceptions=True)
            await replica.sync()
            for shard, server in enumerate(servers):
                assert replica.digest(shard) == server.rows_digest()  # quiet now: the shard itself
            assert sum(s.stats.evicted for s in servers) > 0
            assert replica.full_syncs == 2 * len(TABLES)  # only the first delta of each shard is full
            # Reads from the copy are the shards' reads, absent ids included.
            ids = {"user": np.array([[0, 5], [39, 1000]]), "item": np.arange(95, 165)}
            want = await clients[0].read(ids)
            got = replica.read(ids)
            for name in ids:
                np.testing.assert_array_equal(got[name], want[name])
            # And over rvz, from a worker task: the same rows.
            reads = asyncio.ensure_future(replica.serve_reads(2))
            try:
                reader = ReplicaReader(clients[1].node, 0, cfg.dims(), timeout=10)
                for _ in range(2):
                    remote = await reader.read(ids)
                    for name in ids:
                        np.testing.assert_array_equal(remote[name], want[name])
                await reader.close()
            finally:
                reads.cancel()
                await asyncio.gather(reads, return_exceptions=True)
            await replica.close()
            for client in clients:
                await client.close()
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
            assert all(s.stats.deltas == len(s.stats.delta_digests) for s in servers)

    run(main(), timeout=50)


def test_the_replica_command_follows_the_shards_until_they_end(tmp_path: Path) -> None:
    ports = free_ports(3)
    cluster = json.dumps({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"],
                          "replica": [f"127.0.0.1:{ports[2]}"]})
    common = ["--cluster", cluster, "--dim", "4", "--progress-every", "0", "--log-level", "INFO"]
    argv = [sys.executable, "-m", "examples.param_server"]
    log = tmp_path / "replica.log"
    procs = []
    try:
        procs.append(subprocess.Popen([*argv, "serve", "--job", "ps", "--task", "0", *common],
                                      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        with log.open("w") as err:
            procs.append(subprocess.Popen([*argv, "replica", "--task", "0", "--every", "0.01", *common],
                                          cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True))
        # Training starts once the replica follows the shard: it sees the rows come.
        deadline = time.monotonic() + 30
        while "replica 0: round 1," not in log.read_text():
            assert time.monotonic() < deadline and procs[1].poll() is None, log.read_text()
            time.sleep(0.02)
        procs.append(subprocess.Popen([*argv, "train", "--job", "worker", "--task", "0", "--steps", "100",
                                       "--batch", "16", "--vocab", "200", *common],
                                      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0, 0], (outs, log.read_text())
    summary = json.loads(outs[1].strip().splitlines()[-1])
    assert summary["replica"] == 0 and summary["rounds"] >= 2 and summary["rows"][0] > 0, outs[1]

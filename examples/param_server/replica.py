"""``Replica``: a read-only copy of every PS shard's tables, kept current by delta streams.

A replica is a task of the ``replica`` job. Each ``sync()`` asks every shard for what changed
since the table versions its copy stands at (protocol.py): changed ids with their whole rows
(embedding and optimizer slots), ids removed (deleted or evicted), and the new versions. It
applies each shard's answer at once: removals first, then the rows. After a sync, the copy of
shard s is exactly shard s's tables at the versions it answered with (``digest(s)`` equals
the shard's ``rows_digest`` then). The first ask, or one after the shard restarted (a new
epoch) or after its removal log moved past the copy's version, gets every row instead.

``read`` answers lookups from the copy, as ``PSClient.read`` would at those versions: no
clock, no effect on the shards; an absent id reads as the initial row it would get (zeros
under admission). ``serve_reads`` answers them over rvz for the tasks of a reader job
(``ReplicaReader`` on their side). A shard that has ended its service (or cannot be reached within
``timeout``) is no longer asked; its copy stays as it was last.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import numpy as np

import rvz

from .client import by_table
from .launch import PSConfig, make_tables
from .native import RowTable
from .protocol import (
    DELTA_ASK,
    DELTA_META,
    DELTA_ROWS,
    END,
    PS_JOB,
    REPLICA_JOB,
    REPLICA_READ_IDS,
    REPLICA_READ_ROWS,
    WORKER_JOB,
    edge,
    is_end,
    pack_ids,
    pack_rows,
    replica_edge,
    unpack_delta,
    unpack_pull,
    unpack_rows,
)
from .sparse import as_ids, split_by_shard
from .table import rows_digest

log = logging.getLogger(__name__)

LOST_DIAL_TIMEOUT = 1.0


class Replica:
    """Copies of the ``num_shards`` shards' tables (configured as ``cfg``) on ``node``, a
    task of the replica job."""

    def __init__(self, node: rvz.Node, num_shards: int, cfg: PSConfig, *, timeout: float = 30.0,
                 replica_job: str = REPLICA_JOB) -> None:
        if node.job != replica_job:
            raise ValueError(f"a replica runs on a {replica_job!r} task, not on {node.name}")
        self.node = node
        self.replica = node.task
        self.num_shards = num_shards
        self.timeout = timeout
        self.replica_job = replica_job
        # Empty tables of the service's configuration: what an absent id reads as.
        self._initial = make_tables(cfg)
        self.names = list(self._initial)
        self.session = random.getrandbits(31)  # this process's answers, no earlier one's
        self.seq = [0] * num_shards
        self.epoch: list[int | None] = [None] * num_shards
        self.versions = [[-1] * len(self.names) for _ in range(num_shards)]
        self.copies = [{name: RowTable(t.width, 64) for name, t in self._initial.items()}
                       for _ in range(num_shards)]
        self.ended = [False] * num_shards
        self.syncs = 0
        self.full_syncs = 0

    # -- deltas ---------------------------------------------------------------------------------

    async def sync(self) -> list[bool]:
        """One delta from every shard still serving, applied; for each shard, whether it
        answered."""
        return list(await asyncio.gather(*(self.sync_shard(s) for s in range(self.num_shards))))

    async def sync_shard(self, shard: int) -> bool:
        """Ask ``shard`` for its delta and apply it; False (and the shard is no longer asked)
        when it has ended or does not answer within ``timeout``."""
        if self.ended[shard]:
            return False
        seq = self.seq[shard]
        ask = np.array([self.session, len(self.names), *self.versions[shard]], dtype=np.int64)
        keys = [edge(kind, self.replica, shard, seq, self.session, self.replica_job)
                for kind in (DELTA_META, DELTA_ROWS)]
        try:
            await self.node.send(edge(DELTA_ASK, self.replica, shard, seq, 0, self.replica_job), ask,
                                 timeout=self.timeout)
            meta, rows = await self.node.recv_many(keys, timeout=self.timeout)
        except (rvz.PeerLost, TimeoutError) as exc:
            log.info("replica %d: PS shard %d no longer answers (%s: %s); its copy stays as it is",
                     self.replica, shard, type(exc).__name__, exc)
            self.ended[shard] = True
            return False
        self.seq[shard] = seq + 1
        epoch, parts = unpack_delta(meta, rows)
        reset = self.epoch[shard] is not None and epoch != self.epoch[shard]
        self.epoch[shard] = epoch
        for t, (name, (full, version, ids, block, removed)) in enumerate(zip(self.names, parts, strict=True)):
            if full or reset:
                self.copies[shard][name] = RowTable(self._initial[name].width, max(64, len(ids)))
                self.full_syncs += 1
            self._apply(self.copies[shard][name], ids, block, removed, version)
            self.versions[shard][t] = version
        self.syncs += 1
        return True

    @staticmethod
    def _apply(core: Any, ids: np.ndarray, rows: np.ndarray, removed: np.ndarray, version: int) -> None:
        core.remove(np.ascontiguousarray(removed, dtype=np.int64))
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        where = np.empty(len(ids), dtype=np.int32)
        core.find(ids, where)
        absent = where < 0
        if absent.any():
            fresh = np.empty(int(absent.sum()), dtype=np.int32)
            core.insert(ids[absent], fresh, version)
            where[absent] = fresh
        core.scatter(where, np.ascontiguousarray(rows, dtype=np.float32), 0, version)

    async def follow(self, every: float, syncs: int | None = None) -> int:
        """``sync()`` every ``every`` seconds until every shard has ended (or ``syncs`` rounds
        were done); returns the rounds done."""
        rounds = 0
        while not all(self.ended) and (syncs is None or rounds < syncs):
            answered = await self.sync()
            if rounds == 0 and all(answered):
                # Every shard is up: a dial refused from now on is a shard that has ended; say
                # so within a second, not after rvz's whole start-up allowance.
                self.node.connect_timeout = min(self.node.connect_timeout, LOST_DIAL_TIMEOUT)
            rounds += 1
            log.info("replica %d: round %d, versions %s, rows %s", self.replica, rounds, self.versions,
                     [len(self._ids(s, self.names[0])) for s in range(self.num_shards)])
            if not all(self.ended):
                await asyncio.sleep(every)
        return rounds

    async def close(self) -> None:
        """Tell every shard still serving that this replica is done."""
        for shard in range(self.num_shards):
            if not self.ended[shard]:
                try:
                    await self.node.send(edge(DELTA_ASK, self.replica, shard, self.seq[shard], 0,
                                              self.replica_job), END, timeout=self.timeout)
                except (rvz.RvzError, TimeoutError):
                    pass
                self.ended[shard] = True

    # -- reads ----------------------------------------------------------------------------------

    async def serve_reads(self, readers: int, reader_job: str = WORKER_JOB) -> None:
        """Answer the reads of tasks 0 .. ``readers`` - 1 of ``reader_job`` until each sends END."""
        await asyncio.gather(*(self._serve_reader(r, reader_job) for r in range(readers)))

    async def _serve_reader(self, reader: int, reader_job: str) -> None:
        seq = 0
        while True:
            key = replica_edge(REPLICA_READ_IDS, reader, self.replica, seq, 0, reader_job, self.replica_job)
            try:
                ask = await self.node.recv(key)
            except rvz.PeerLost:
                seq = 0  # a new process of the reader numbers its reads from 0 again
                await asyncio.sleep(0.5)
                continue
            if is_end(ask):
                return
            try:
                if not isinstance(ask, np.ndarray) or ask.dtype != np.int64 or len(ask) < 1:
                    raise ValueError("a read is int64 [session, ids message]")
                session = int(ask[0])
                parts, _ = unpack_pull(ask[1:], len(self.names))
            except ValueError as exc:
                log.warning("replica %d: read %d of %s %d does not decode (%s); ignored", self.replica, seq,
                            reader_job, reader, exc)
                seq += 1
                continue
            rows = self.read(dict(zip(self.names, parts, strict=True)))
            reply = replica_edge(REPLICA_READ_ROWS, reader, self.replica, seq, session, reader_job,
                                 self.replica_job)
            try:
                await self.node.send(reply, pack_rows([rows[n] for n in self.names]), timeout=self.timeout)
            except (rvz.PeerLost, TimeoutError):
                seq = 0
                continue
            seq += 1

    def _ids(self, shard: int, name: str) -> np.ndarray:
        core = self.copies[shard][name]
        ids = np.empty(core.size, dtype=np.int64)
        core.items(ids, np.empty(core.size, dtype=np.int32))
        return np.sort(ids)

    def rows(self, shard: int, name: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Whole rows of ``ids`` in the copy of ``shard`` (zeros where absent), and which were
        present."""
        ids = as_ids(ids)
        where = np.empty(len(ids), dtype=np.int32)
        core = self.copies[shard][name]
        core.find(ids, where)
        out = np.empty((len(ids), self._initial[name].width), dtype=np.float32)
        core.gather(where, out, 0)
        return out, where >= 0

    def digest(self, shard: int) -> str:
        """The copy of ``shard``'s tables, hashed as the shard's ``rows_digest`` hashes them."""
        return rows_digest((name, ids, self.rows(shard, name, ids)[0])
                           for name in self.names for ids in [self._ids(shard, name)])

    def read(self, ids: dict[str, Any]) -> dict[str, np.ndarray]:
        """Embeddings of ``{name: ids}`` (any shape, repeats allowed) from the copy: ``{name:
        rows [..., dim]}``."""
        out = {}
        for name, some in ids.items():
            table = self._initial[name]
            flat = as_ids(np.asarray(some).reshape(-1))
            rows = np.empty((len(flat), table.dim), dtype=np.float32)
            for shard, where in enumerate(split_by_shard(flat, self.num_shards)):
                got, present = self.rows(shard, name, flat[where])
                part = got[:, :table.dim]
                if not present.all():
                    part[~present] = table.peek(flat[where][~present])
                rows[where] = part
            out[name] = rows.reshape(np.asarray(some).shape + (table.dim,))
        return out


class ReplicaReader:
    """Reads from replica ``replica`` on ``node`` (a task of the reader job, the worker job by
    default): ``read({name: ids})`` as ``PSClient.read``, answered from the replica's copy."""

    def __init__(self, node: rvz.Node, replica: int, tables: dict[str, int], *, timeout: float = 30.0,
                 replica_job: str = REPLICA_JOB) -> None:
        self.node = node
        self.replica = replica
        self.dims = dict(tables)
        self.timeout = timeout
        self.replica_job = replica_job
        self.session = random.getrandbits(31)
        self.seq = 0

    async def read(self, ids: dict[str, Any]) -> dict[str, np.ndarray]:
        return await by_table(self.dims, ids, self._read_unique)

    async def _read_unique(self, unique: list[np.ndarray]) -> list[np.ndarray]:
        seq, self.seq = self.seq, self.seq + 1
        job, task, to = self.node.job, self.node.task, self.replica
        ask = np.concatenate([np.array([self.session], dtype=np.int64), pack_ids(unique, create=False)])
        await self.node.send(replica_edge(REPLICA_READ_IDS, task, to, seq, 0, job, self.replica_job),
                             ask, timeout=self.timeout)
        rows = await self.node.recv(replica_edge(REPLICA_READ_ROWS, task, to, seq, self.session, job,
                                                 self.replica_job), timeout=self.timeout)
        return unpack_rows(rows, [len(u) for u in unique], list(self.dims.values()))

    async def close(self) -> None:
        """Tell the replica this reader is done."""
        await self.node.send(replica_edge(REPLICA_READ_IDS, self.node.task, self.replica, self.seq, 0,
                                          self.node.job, self.replica_job), END, timeout=self.timeout)


async def run_replica(cluster: dict[str, Any], index: int, cfg: PSConfig, every: float,
                      timeout: float) -> dict[str, Any]:
    """Replica ``index`` of ``cluster``: follows every shard until each has ended; returns
    what its copy holds."""
    async with rvz.Node(cluster, REPLICA_JOB, index, mode=cfg.mode, **cfg.node_kwargs()) as node:
        replica = Replica(node, len(cluster[PS_JOB]), cfg, timeout=timeout)
        # The workers may read from it (ReplicaReader) while it follows the shards.
        reads = asyncio.ensure_future(replica.serve_reads(len(cluster[cfg.worker_job]), cfg.worker_job))
        try:
            rounds = await replica.follow(every)
        finally:
            reads.cancel()
            await asyncio.gather(reads, return_exceptions=True)
        return {"replica": index, "rounds": rounds, "syncs": replica.syncs, "versions": replica.versions,
                "rows": [sum(int(c.size) for c in copies.values()) for copies in replica.copies],
                "digests": [replica.digest(s) for s in range(replica.num_shards)]}

"""``EmbeddingTable``: sparse rows keyed by int64 id, with their optimizer, admission,
eviction and checkpoints.

The rows live in the native core (``_table.RowTable``, see native.py): one float32 row per
id holds the embedding and the optimizer's slots. This module adds what is policy:

* creation: ``lookup(ids, create=True)`` creates the rows of new ids from the initializer
  (``"zeros"``, ``"normal"``: N(0, ``init_std``) seeded per (seed, id), or a callable
  ``f(ids, dim) -> [len(ids), dim]``), subject to admission; ``create=False`` (evaluation)
  never creates a row, returns zeros for absent ids and does not count as an access.
* admission: ``MinCount(n)`` admits an id once it was looked up ``n`` times (the counts of
  ids not admitted yet are kept, and saved); ``Probability(p)`` admits each lookup of a new
  id with probability ``p``, drawn from a hash of (seed, id, global step), so replaying from
  a checkpoint draws the same. Ids not admitted read as zeros and get no updates.
* updates: ``apply_gradients`` sums duplicate ids, then runs one optimizer step on the rows
  present; the global step counts these calls.
* eviction: ``evict(ttl=..., max_rows=...)`` drops rows not accessed for more than ``ttl``
  steps, then the least recently used beyond ``max_rows`` (ties broken by id, so the choice
  is deterministic).
* deltas: ``delta_since(version)`` gives the rows changed after ``version`` and the ids
  removed (deleted or evicted) since, from a log of removals bounded by ``max_tombstones``
  ids; a version older than what that log still covers gets every live row instead.
* checkpoints: ``save(path)`` (full) and ``save(path, incremental=True)`` (rows changed or
  accessed, and ids deleted, since the previous save), see checkpoint.py; ``load(path)``.
"""

from __future__ import annotations

import hashlib
import mmap
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import checkpoint as ckpt
from .native import RowTable, normal_fill
from .optimizers import SGD, SparseOptimizer, from_config
from .sparse import mix64, normal_levels, normal_salt

Initializer = Callable[[np.ndarray, int], np.ndarray]


@dataclass(frozen=True)
class MinCount:
    """Admit an id once it has been looked up ``count`` times."""

    count: int

    def config(self) -> dict[str, Any]:
        return {"kind": "min_count", "count": self.count}


@dataclass(frozen=True)
class Probability:
    """Admit each lookup of a new id with probability ``p``."""

    p: float

    def config(self) -> dict[str, Any]:
        return {"kind": "probability", "p": self.p}


def admission_from_config(config: dict[str, Any] | None) -> MinCount | Probability | None:
    if config is None:
        return None
    if config["kind"] == "min_count":
        return MinCount(int(config["count"]))
    return Probability(float(config["p"]))


def as_ids(ids: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))


_PROB_SALT = np.uint64(0xA0761D6478BD642F)


class EmbeddingTable:
    """Rows of ``dim`` float32 (plus the optimizer's slots) for int64 ids; see the module doc."""

    def __init__(self, dim: int, optimizer: SparseOptimizer | None = None,
                 initializer: str | Initializer = "normal", seed: int = 0, *,
                 init_std: float = 0.01, admission: MinCount | Probability | None = None,
                 ttl: int | None = None, max_rows: int | None = None,
                 capacity: int = 1024) -> None:
        if dim <= 0:
            raise ValueError("dim must be positive")
        if isinstance(initializer, str) and initializer not in ("zeros", "normal"):
            raise ValueError(f"initializer must be 'zeros', 'normal' or a callable, not {initializer!r}")
        self.dim = int(dim)
        self.optimizer = optimizer if optimizer is not None else SGD()
        self.initializer = initializer
        self.seed = int(seed)
        self.init_std = float(init_std)
        self.admission = admission
        self.ttl = ttl
        self.max_rows = max_rows
        self.width = self.dim * (1 + self.optimizer.num_slots)
        self._core = RowTable(self.width, capacity)
        self._candidates = RowTable(1, 64)  # MinCount: lookups so far of ids not admitted yet
        self.global_step = 0   # apply_gradients calls
        self.version = 0       # bumped by every call that changes rows
        self.saved_version = 0  # version and step of the last save (incremental base)
        self.saved_step = 0
        self._deleted: list[np.ndarray] = []  # ids deleted since the last save
        # Removals as (version, ids), for deltas; ``tomb_floor``: the oldest version a delta
        # can start from (older removals were dropped from the log, or precede a load).
        self._tombs: list[tuple[int, np.ndarray]] = []
        self._tomb_count = 0
        self.tomb_floor = 0
        self.max_tombstones = 1 << 20
        self.created = 0
        self.evicted = 0
        self.dropped = 0       # gradient rows for absent ids, ignored
        self._copies: list[RowCopy] = []  # copies being taken (``copy_rows``)

    # -- size ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self._core.size)

    def __contains__(self, id_: object) -> bool:
        rows = np.empty(1, dtype=np.int32)
        return bool(self._core.find(as_ids([id_]), rows))

    def ids(self) -> np.ndarray:
        """Every live id, sorted."""
        ids, _ = self._items()
        return np.sort(ids)

    def _items(self) -> tuple[np.ndarray, np.ndarray]:
        n = len(self)
        ids = np.empty(n, dtype=np.int64)
        rows = np.empty(n, dtype=np.int32)
        self._core.items(ids, rows)
        return ids, rows

    def _meta(self, rows: np.ndarray, which: str) -> np.ndarray:
        """The access stamps (``"stamp"``) or change versions (``"mver"``) of ``rows``."""
        rows = np.ascontiguousarray(rows, dtype=np.int32)
        out = np.empty(len(rows), dtype=np.uint32)
        if which == "stamp":
            self._core.get_stamps(rows, out)
        else:
            self._core.get_mvers(rows, out)
        return out

    def memory_overhead_per_id(self) -> float:
        """Bytes of index and per-row metadata per live id (the rows themselves excluded)."""
        return self._core.index_bytes() / max(1, len(self))

    # -- rows ------------------------------------------------------------------------------

    def _step_stamp(self) -> int:
        return self.global_step & 0xFFFFFFFF

    def _initial_rows(self, ids: np.ndarray) -> np.ndarray:
        rows = np.empty((len(ids), self.width), dtype=np.float32)
        init = self.initializer
        if init == "zeros":
            rows[:, :self.dim] = 0.0
        elif init == "normal":
            # std x seeded_normal(ids, dim, seed), written into the rows in one compiled pass.
            normal_fill(ids, normal_salt(self.seed), normal_levels(), self.init_std, rows, self.dim)
        else:
            assert callable(init)
            values = np.asarray(init(ids.copy(), self.dim), dtype=np.float32)
            if values.shape != (len(ids), self.dim):
                raise ValueError(f"the initializer returned {values.shape}, expected {(len(ids), self.dim)}")
            rows[:, :self.dim] = values
        rows[:, self.dim:] = self.optimizer.initial_slots(len(ids), self.dim)
        return rows

    def _admit(self, unique: np.ndarray, occurrences: np.ndarray, count: bool) -> np.ndarray:
        """Which of ``unique`` (absent ids) get a row now."""
        policy = self.admission
        if policy is None:
            return np.ones(len(unique), dtype=bool)
        if isinstance(policy, Probability):
            salt = mix64(np.array([self.seed, self.global_step], dtype=np.uint64)).sum(dtype=np.uint64)
            with np.errstate(over="ignore"):
                h = mix64(unique.view(np.uint64) ^ salt ^ _PROB_SALT)
            u = (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
            if count:
                # Each lookup of the id is one draw: admitted if any draw succeeds.
                return bool(policy.p > 0) & (1.0 - (1.0 - policy.p) ** occurrences > u)
            return np.zeros(len(unique), dtype=bool)
        # MinCount: counts of ids not admitted yet live in a small native table of width 1.
        cand = self._candidates
        rows = np.empty(len(unique), dtype=np.int32)
        counts = np.empty((len(unique), 1), dtype=np.float32)
        cand.lookup(unique, counts, rows, 0)
        if not count:
            return counts[:, 0] >= policy.count
        counts[:, 0] += occurrences
        admitted = counts[:, 0] >= policy.count
        new = rows < 0
        if new.any():
            fresh = np.empty(int(new.sum()), dtype=np.int32)
            cand.insert(unique[new], fresh, 0)
            rows[new] = fresh
        cand.scatter(rows, counts, 0, 0)
        if admitted.any():
            cand.remove(unique[admitted])
        return admitted

    def _create(self, ids: np.ndarray, rows: np.ndarray,
                count: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Create rows for the absent ids (``rows < 0``) that are admitted; returns the
        positions that got a row, the new rows' initial values, and which of those each
        position has."""
        pos = np.flatnonzero(rows < 0)
        unique, inverse = np.unique(ids[pos], return_inverse=True)
        inverse = inverse.reshape(-1)
        admitted = self._admit(unique, np.bincount(inverse, minlength=len(unique)), count)
        new_ids = unique[admitted]
        if len(new_ids) == 0:
            return pos[:0], np.zeros((0, self.width), dtype=np.float32), pos[:0]
        new_rows = np.empty(len(new_ids), dtype=np.int32)
        self._core.insert(new_ids, new_rows, self.version)
        init = self._initial_rows(new_ids)
        self._core.scatter(new_rows, init, 0, self.version)
        self._core.touch(new_rows, self._step_stamp())
        self.created += len(new_ids)
        if len(new_ids) == len(unique):  # all admitted (always, without admission)
            rows[pos] = new_rows[inverse]
            return pos, init, inverse
        slot = np.full(len(unique), -1, dtype=np.int64)
        slot[admitted] = np.arange(len(new_ids))
        which = slot[inverse]
        got = which >= 0
        rows[pos[got]] = new_rows[which[got]]
        return pos[got], init, which[got]

    def lookup(self, ids: Any, create: bool = True) -> np.ndarray:
        """Embeddings of ``ids`` (duplicates allowed): float32 ``[len(ids), dim]``, a new
        array. Absent ids are created if ``create`` (and admitted), else read as zeros."""
        ids = as_ids(ids)
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        rows = np.empty(len(ids), dtype=np.int32)
        if create and any(c.keeps_reads for c in self._copies):
            self._core.find(ids, rows)
            for c in self._copies:
                c.keep_stamps(rows)
        # Evaluation reads (create=False) leave the access stamps alone: they neither
        # create rows nor keep rows alive for TTL/LRU eviction.
        missing = self._core.lookup(ids, out, rows, self._step_stamp(), create)
        if missing and create:
            self.version += 1
            pos, init, which = self._create(ids, rows, count=True)
            out[pos] = init[which, :self.dim]  # only the embeddings are copied out
        return out

    def peek(self, ids: Any) -> np.ndarray:
        """Embeddings of ``ids`` as a training lookup would read them, without its side
        effects: no row is created, no access counted (admission, TTL/LRU) and no stamp
        changed. An absent id reads as the initial row it would get, or as zeros under an
        admission policy (what a first training lookup reads for an id not admitted yet)."""
        ids = as_ids(ids)
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        rows = np.empty(len(ids), dtype=np.int32)
        missing = self._core.lookup(ids, out, rows, self._step_stamp(), False)
        if missing and self.admission is None:
            absent = np.flatnonzero(rows < 0)
            out[absent] = self._initial_rows(ids[absent])[:, :self.dim]
        return out

    def rows(self, ids: Any) -> np.ndarray:
        """Whole rows (embedding then slots) of ``ids``, zeros for absent ones; no side effects."""
        ids = as_ids(ids)
        rows = np.empty(len(ids), dtype=np.int32)
        self._core.find(ids, rows)
        out = np.empty((len(ids), self.width), dtype=np.float32)
        self._core.gather(rows, out, 0)
        return out

    def assign(self, ids: Any, values: Any) -> None:
        """Set the embeddings of ``ids`` (created if absent, no admission) and reset their
        optimizer slots. For a repeated id the last value wins."""
        ids = as_ids(ids)
        values = np.asarray(values, dtype=np.float32).reshape(len(ids), self.dim)
        unique, last = np.unique(ids[::-1], return_index=True)
        last = len(ids) - 1 - last
        self.version += 1
        rows = np.empty(len(unique), dtype=np.int32)
        self._core.find(unique, rows)
        self._before_change(rows, unique)
        absent = rows < 0
        if absent.any():
            fresh = np.empty(int(absent.sum()), dtype=np.int32)
            self._core.insert(unique[absent], fresh, self.version)
            rows[absent] = fresh
            self.created += len(fresh)
        full = np.empty((len(unique), self.width), dtype=np.float32)
        full[:, :self.dim] = values[last]
        full[:, self.dim:] = self.optimizer.initial_slots(len(unique), self.dim)
        self._core.scatter(rows, full, 0, self.version)
        self._core.touch(rows, self._step_stamp())

    def apply_gradients(self, ids: Any, grads: Any, create: bool = True) -> int:
        """One optimizer step: duplicate ids are summed first, then each row is updated
        once. Absent ids get a row first if ``create`` (admission permitting, without
        counting as a lookup); otherwise their gradients are dropped. Returns the number of
        rows updated. The global step advances even when nothing is updated."""
        ids = as_ids(ids)
        grads = np.asarray(grads, dtype=np.float32).reshape(len(ids), self.dim)
        self.global_step += 1
        if len(ids) == 0:
            return 0
        self.version += 1
        unique, inverse = np.unique(ids, return_inverse=True)
        inverse = inverse.reshape(-1)
        if len(unique) == len(ids):
            summed = np.empty_like(grads)
            summed[inverse] = grads
        else:
            summed = np.zeros((len(unique), self.dim), dtype=np.float32)
            np.add.at(summed, inverse, grads)  # in input order: deterministic sums
        rows = np.empty(len(unique), dtype=np.int32)
        self._core.find(unique, rows)
        self._before_change(rows, unique)
        if create and (rows < 0).any():
            self._create(unique, rows, count=False)
        present = rows >= 0
        self.dropped += int(len(rows) - present.sum())
        if not present.all():
            rows, summed = rows[present], summed[present]
        full = np.empty((len(rows), self.width), dtype=np.float32)
        self._core.gather(rows, full, 0)
        self.optimizer.apply(full, summed, self.global_step)
        self._core.scatter(rows, full, 0, self.version)
        self._core.touch(rows, self._step_stamp())
        return len(rows)

    def delete(self, ids: Any) -> int:
        """Remove the rows of ``ids`` (absent ids are ignored); returns how many went."""
        ids = np.unique(as_ids(ids))
        rows = np.empty(len(ids), dtype=np.int32)
        self._core.find(ids, rows)
        gone = ids[rows >= 0]
        self._before_change(rows, ids)
        if len(gone):
            self.version += 1
            self._core.remove(gone)
            self._deleted.append(gone)
            self._tombstone(gone)
        return len(gone)

    def evict(self, ttl: int | None = None, max_rows: int | None = None) -> np.ndarray:
        """Drop rows idle for more than ``ttl`` steps, then the least recently used beyond
        ``max_rows`` (defaults: the table's settings). Returns the evicted ids."""
        ttl = self.ttl if ttl is None else ttl
        max_rows = self.max_rows if max_rows is None else max_rows
        if ttl is None and max_rows is None:
            return np.zeros(0, dtype=np.int64)
        ids, rows = self._items()
        stamps = self._meta(rows, "stamp").astype(np.int64)
        drop = np.zeros(len(ids), dtype=bool)
        if ttl is not None:
            drop |= self.global_step - stamps > ttl
        if max_rows is not None and len(ids) - drop.sum() > max_rows:
            keep = np.flatnonzero(~drop)
            order = np.lexsort((ids[keep], stamps[keep]))  # oldest first, ties by id
            drop[keep[order[:len(keep) - max_rows]]] = True
        gone = np.sort(ids[drop])
        self._before_change(rows[drop], ids[drop])
        if len(gone):
            self.version += 1
            self._core.remove(gone)
            self._deleted.append(gone)
            self._tombstone(gone)
            self.evicted += len(gone)
        return gone

    def changed_since(self, version: int, step: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Ids (sorted) and whole rows changed after ``version`` (or accessed at or after
        ``step``): an incremental export."""
        ids, rows = self._items()
        changed = self._meta(rows, "mver") > version
        if step is not None:
            changed |= self._meta(rows, "stamp") >= step
        order = np.argsort(ids[changed], kind="stable")
        ids, rows = ids[changed][order], rows[changed][order]
        out = np.empty((len(ids), self.width), dtype=np.float32)
        self._core.gather(rows, out, 0)
        return ids, out

    def _tombstone(self, gone: np.ndarray) -> None:
        self._tombs.append((self.version, gone))
        self._tomb_count += len(gone)
        while self._tomb_count > self.max_tombstones:
            version, dropped = self._tombs.pop(0)
            self._tomb_count -= len(dropped)
            self.tomb_floor = version  # a delta from before it would miss these removals

    def delta_since(self, version: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """What changed after ``version``: (ids, whole rows, removed ids, full). Applying it
        to a copy of the table at ``version`` (removals first, then the rows) gives the table
        as it is now. ``full``: ``version`` is older than the removal log covers (or newer
        than the table, another table's): the rows are every live row, the removed ids are
        empty, and the copy must be emptied first."""
        if version < self.tomb_floor or version > self.version:
            ids = self.ids()
            return ids, self.rows(ids), np.zeros(0, dtype=np.int64), True
        ids, rows = self.changed_since(version)
        gone = [g for v, g in self._tombs if v > version]
        removed = np.unique(np.concatenate([np.zeros(0, dtype=np.int64), *gone]))
        # An id removed then created again is in both: the copy removes it, then takes its row.
        return ids, rows, removed, False

    def stats(self) -> dict[str, int]:
        return {"live": len(self), "created": self.created, "evicted": self.evicted,
                "dropped": self.dropped, "global_step": self.global_step, "version": self.version}

    # -- checkpoints -------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        init = self.initializer if isinstance(self.initializer, str) else "callable"
        return {"dim": self.dim, "optimizer": self.optimizer.config(), "initializer": init,
                "seed": self.seed, "init_std": self.init_std,
                "admission": self.admission.config() if self.admission else None,
                "ttl": self.ttl, "max_rows": self.max_rows}

    def _state(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "version": self.version, "created": self.created,
                "evicted": self.evicted, "dropped": self.dropped}

    def save(self, path: str | Path, incremental: bool = False, *, fsync: bool = True) -> str:
        """Write a checkpoint entry into directory ``path``: everything (full) or what
        changed since the previous save (incremental). Returns the entry's name."""
        writer = ckpt.EntryWriter(Path(path), "incr" if incremental else "full", fsync=fsync)
        if incremental and writer.manifest is None:
            raise ckpt.CheckpointError(f"no full checkpoint in {path} to add an increment to")
        ids, rows = self._items()
        if incremental:
            ids, values = self.changed_since(self.saved_version, self.saved_step)
            found = np.empty(len(ids), dtype=np.int32)
            self._core.find(ids, found)
            writer.array("ids", ids)
            writer.array("rows", values)
            writer.array("stamps", self._meta(found, "stamp"))
            deleted = np.unique(np.concatenate([np.zeros(0, dtype=np.int64), *self._deleted]))
            writer.array("deleted", deleted)
        else:
            # The row matrix is written as it is, block after block (no gather, no per-row
            # work): ids and row numbers say which rows are live.
            writer.array("ids", ids)
            writer.array("rownum", rows)
            writer.array("stamps", self._meta(rows, "stamp"))
            writer.arrays("matrix", self._core.blocks(), (self._core.next_row, self.width))
        cand_ids, cand_counts = self._candidate_counts()
        writer.array("cand_ids", cand_ids)
        writer.array("cand_counts", cand_counts)
        name = writer.commit({"config": self.config(), "state": self._state()})
        self.saved_version = self.version
        self.saved_step = self.global_step
        self._deleted = []
        return name

    def _before_change(self, rows: np.ndarray, ids: np.ndarray) -> None:
        """Rows about to change (or go): every copy still being taken keeps them as they are."""
        for c in self._copies:
            c.keep(rows, ids)

    def copy_rows(self) -> RowCopy:
        """Start a copy of the table as it is now, taken a few rows at a time (``RowCopy.step``)
        while the table goes on changing: what serving a checkpoint needs, since a copy of
        every row at once holds the shard up for as long as it takes (about 1 s for 1M rows)."""
        copy = RowCopy(self)
        self._copies.append(copy)
        return copy

    def begin_save(self, incremental: bool = False) -> PendingSave:
        """``save`` in two parts: what the entry holds is fixed now (``PendingSave.copy`` takes
        the rows a few at a time, on this thread), and ``PendingSave.write`` writes it, on any
        thread. A full save copies every row; an incremental one the rows it holds, at once."""
        pending = PendingSave(self, incremental)
        self.saved_version = self.version
        self.saved_step = self.global_step
        self._deleted = []
        return pending

    def snapshot(self) -> TableSnapshot:
        """Every live row (embedding and slots), its stamp, the admission counts, the config
        and the counters, copied out: the table may change while ``write_snapshot`` writes
        the copy (in another thread)."""
        ids, rows = self._items()
        values = np.empty((len(ids), self.width), dtype=np.float32)
        self._core.gather(rows, values, 0)
        return TableSnapshot(ids, values, self._meta(rows, "stamp"), *self._candidate_counts(),
                             self.config(), self._state())

    def _candidate_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """The ids admission is counting, and their counts (int64)."""
        cand_ids = np.empty(self._candidates.size, dtype=np.int64)
        cand_rows = np.empty(self._candidates.size, dtype=np.int32)
        self._candidates.items(cand_ids, cand_rows)
        counts = np.empty((len(cand_ids), 1), dtype=np.float32)
        self._candidates.gather(cand_rows, counts, 0)
        return cand_ids, counts[:, 0].astype(np.int64)

    @classmethod
    def load(cls, path: str | Path, *, initializer: Initializer | None = None) -> EmbeddingTable:
        """The table saved in ``path`` (its full entry, then every increment). A table made
        with a callable initializer needs it passed again."""
        root = Path(path)
        manifest = ckpt.read_manifest(root)
        assert manifest is not None
        chain = manifest["chain"]
        entries = manifest["entries"]
        config = entries[chain[0]]["meta"]["config"]
        init: Any = config["initializer"]
        if init == "callable":
            if initializer is None:
                raise ValueError("this table was made with a callable initializer: pass it to load()")
            init = initializer
        table = cls(config["dim"], from_config(config["optimizer"]), init, config["seed"],
                    init_std=config["init_std"], admission=admission_from_config(config["admission"]),
                    ttl=config["ttl"], max_rows=config["max_rows"])
        for name in chain:
            files = entries[name]["files"]

            def arr(key: str, name: str = name, files: dict[str, Any] = files) -> np.ndarray:
                return ckpt.read_array(root, name, key, files[key])

            ids, stamps = arr("ids"), arr("stamps")
            if entries[name]["kind"] == "full":
                values = arr("matrix")[arr("rownum")]
            else:
                values = arr("rows")
                table._core.remove(arr("deleted"))
            rows = np.empty(len(ids), dtype=np.int32)
            table._core.find(ids, rows)
            absent = rows < 0
            if absent.any():
                fresh = np.empty(int(absent.sum()), dtype=np.int32)
                table._core.insert(ids[absent], fresh, 0)
                rows[absent] = fresh
            table._core.scatter(rows, np.ascontiguousarray(values, dtype=np.float32), 0, 0)
            table._core.restamp(rows, stamps)  # exactly as saved: TTL and LRU use them
            state = entries[name]["meta"]["state"]
            cand_ids, cand_counts = arr("cand_ids"), arr("cand_counts")
        table._core.finish()
        table._candidates = RowTable(1, max(64, len(cand_ids)))
        if len(cand_ids):
            crow = np.empty(len(cand_ids), dtype=np.int32)
            table._candidates.insert(cand_ids, crow, 0)
            table._candidates.scatter(crow, cand_counts.astype(np.float32).reshape(-1, 1), 0, 0)
        table.global_step = state["global_step"]
        table.version = state["version"]
        table.created, table.evicted, table.dropped = state["created"], state["evicted"], state["dropped"]
        table.saved_version, table.saved_step = table.version, table.global_step
        table.tomb_floor = table.version  # loaded rows carry no change versions
        return table


def rows_digest(tables: Iterable[tuple[str, np.ndarray, np.ndarray]]) -> str:
    """A hash of (name, sorted ids, their whole rows) of each table: equal digests, identical
    tables (a shard's against a resumed one's, or against a replica's copy)."""
    h = hashlib.sha256()
    for name, ids, rows in tables:
        h.update(name.encode())
        h.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(rows, dtype=np.float32).tobytes())
    return h.hexdigest()[:16]


# Unmaps what a finished row copy used (its pool), so the shard's event loop does not.
_RELEASE = ThreadPoolExecutor(1, thread_name_prefix="row-copy-release")


def _unmapped(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array in an anonymous mapping of its own, none of its pages in place
    yet, with small (4 KiB) pages: numpy asks for 2 MiB pages for any large array, and
    faulting one in may compact memory first (5-17 ms measured on a VM), too long for the
    event loop; 4 KiB pages are faulted in a slice at a time (about 0.4 ms a slice)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype=dtype).reshape(shape)


class RowCopy:
    """A copy of every row of a table at one moment (``EmbeddingTable.copy_rows``), taken a
    slice per ``step`` while the table goes on changing. The access stamps are copied first
    (small), then the rows block slice by block slice; a row about to change or go before
    its slice is copied is kept first (copy on write), so the copy is the table of that
    moment whatever changes meanwhile. Once the stamps are copied a lookup, which changes
    nothing else, keeps no row (``keeps_reads``). Rows free at that moment are left out.

    What runs on the caller's thread (a shard's event loop) stays short and even. Kept rows
    are appended to a pool, and ``step`` puts them in their places when it copies their
    slice: written straight into the copy they would land at random across it, and the
    first pull after the copy started would fault most of it in (100s of ms at 1M rows).
    The live rows' ids, stamps and row numbers are packed to the front as the slices go,
    so the snapshot is views, with nothing left to gather. The copy and the pool use 4 KiB
    pages, faulted in as they are written, in order."""

    POOL_ROWS = 1 << 16   # rows per chunk of the pool

    def __init__(self, table: EmbeddingTable) -> None:
        core = table._core
        core.finish()
        self.table = table
        self.n = n = int(core.next_row)
        self.width = table.width
        self.values = _unmapped((n, table.width), np.float32)
        self.row_ids = _unmapped(n, np.int64)
        self.stamps = _unmapped(n, np.uint32)
        self.rownum = _unmapped(n, np.int32)
        self._dead = np.zeros(n, dtype=bool)  # zero pages: only the free rows are written
        self._dead[core.free_rows()] = True
        self.cand_ids, self.cand_counts = table._candidate_counts()
        self.config, self.state = table.config(), table._state()
        self.size = len(table)
        self._arrays = core.row_arrays()   # views: rows changed meanwhile are kept first
        self._stamped = 0   # stamps copied: rows 0 .. _stamped
        self._cursor = 0    # rows copied
        self._packed = 0    # live rows packed to the front
        # Each row's place in the pool plus one (0: not kept): zero pages, nothing to fill.
        self._where = _unmapped(n, np.int32)
        self._pool: list[tuple[np.ndarray, np.ndarray]] = []
        self._pooled = 0
        self._stamp_log: list[tuple[np.ndarray, np.ndarray]] = []  # (rows, stamps) noted, in order
        self._pool_rows = max(1, min(self.POOL_ROWS, n))
        self.done = n == 0
        if self.done:
            self._finish()

    @property
    def keeps_reads(self) -> bool:
        """Whether a lookup (it changes stamps only) must keep its rows first."""
        return self._stamped < self.n

    def keep_stamps(self, rows: np.ndarray) -> None:
        """Note the stamps of ``rows`` (-1 rows skipped) now unless theirs are copied: what
        a lookup, which changes stamps only, needs kept. Noted in order, without a per-row
        mark (random writes would fault in pages a few at a time)."""
        if self._stamped >= self.n:
            return
        rows = np.asarray(rows)
        r = np.ascontiguousarray(rows[(rows >= self._stamped) & (rows < self.n)], dtype=np.int32)
        if len(r):
            self._stamp_log.append((r, self.table._meta(r, "stamp")))

    def keep(self, rows: np.ndarray, ids: np.ndarray) -> None:
        """Copy ``rows`` (ids ``ids``; -1 rows skipped) now unless their slice is copied."""
        self.keep_stamps(rows)
        rows = np.asarray(rows)
        sel = np.flatnonzero((rows >= self._cursor) & (rows < self.n))
        if len(sel) == 0:
            return
        sel = sel[self._where[rows[sel]] == 0]
        if len(sel) == 0:
            return
        # A row named twice is pooled twice, with the same content: cheaper than a sort.
        r = np.ascontiguousarray(rows[sel], dtype=np.int32)
        out = np.empty((len(r), self.width), dtype=np.float32)
        self.table._core.gather(r, out, 0)
        kept_ids = np.asarray(ids)[sel]
        done = 0
        while done < len(r):
            at = self._pooled % self._pool_rows
            if at == 0:
                size = self._pool_rows
                self._pool.append((_unmapped((size, self.width), np.float32), _unmapped(size, np.int64)))
            values, pool_ids = self._pool[-1]
            k = min(len(r) - done, self._pool_rows - at)
            values[at:at + k] = out[done:done + k]
            pool_ids[at:at + k] = kept_ids[done:done + k]
            self._where[r[done:done + k]] = np.arange(self._pooled + 1, self._pooled + k + 1, dtype=np.int32)
            self._pooled += k
            done += k

    def _slice(self, c: int, k: int) -> tuple[int, int, int]:
        """The block holding row ``c``, ``c``'s offset in it, and the end of a slice of at
        most ``k`` rows from ``c`` within that block."""
        block_rows = self._arrays[0][0].shape[0] if len(self._arrays) == 1 else self.table._core.block_rows
        b, off = divmod(c, block_rows)
        return b, off, min(self.n, c + k, b * block_rows + len(self._arrays[b][0]))

    def _unpool(self, c: int, e: int) -> None:
        """Rows ``c .. e`` that were kept: their kept ids and values into place."""
        where = self._where[c:e]
        kept = np.flatnonzero(where)
        if len(kept) == 0:
            return
        chunk, at = np.divmod(where[kept] - 1, self._pool_rows)
        for ch in np.unique(chunk):
            mine = chunk == ch
            dest, src = c + kept[mine], at[mine]
            values, pool_ids = self._pool[ch]
            self.values[dest] = values[src]
            self.row_ids[dest] = pool_ids[src]

    def step(self, rows: int = 4096) -> bool:
        """Copy the next slice: ``rows`` rows' worth of stamps until every stamp is copied,
        then ``rows`` rows (at most to the end of their block). True once all is copied."""
        if self.done:
            return True
        if self._stamped < self.n:
            c = self._stamped
            b, off, e = self._slice(c, rows * self.width)  # as many bytes as a slice of rows
            self.stamps[c:e] = self._arrays[b][2][off:off + e - c]
            for r, old in reversed(self._stamp_log):  # the first noted, the one before any change
                mine = (r >= c) & (r < e)
                self.stamps[r[mine]] = old[mine]
            self._stamped = e
            if e >= self.n:
                self._stamp_log = []
            return False
        c = self._cursor
        b, off, e = self._slice(c, rows)
        data, ids, _ = self._arrays[b]
        self.values[c:e] = data[off:off + e - c]
        self.row_ids[c:e] = ids[off:off + e - c]
        self._unpool(c, e)
        self._pack(c, e)
        self._cursor = e
        if e >= self.n:
            self._finish()
        return self.done

    def _pack(self, c: int, e: int) -> None:
        """The ids, stamps and row numbers of the live rows among ``c .. e`` to the front
        (after those of earlier slices; never past ``c``, so in place)."""
        o = self._packed
        live = np.flatnonzero(~self._dead[c:e])
        m = len(live)
        if m == e - c:
            if o != c:
                self.row_ids[o:o + m] = self.row_ids[c:e]
                self.stamps[o:o + m] = self.stamps[c:e]
            self.rownum[o:o + m] = np.arange(c, e, dtype=np.int32)
        else:
            self.row_ids[o:o + m] = self.row_ids[c:e][live]
            self.stamps[o:o + m] = self.stamps[c:e][live]
            self.rownum[o:o + m] = live + c
        self._packed = o + m

    def _finish(self) -> None:
        self.done = True
        if self in self.table._copies:
            self.table._copies.remove(self)
        self._arrays = []
        # The pool and the index into it are unmapped by another thread (it takes a while).
        garbage = [self._pool, self._where, self._dead, self._stamp_log]
        self._pool, self._where, self._stamp_log = [], np.zeros(0, dtype=np.int32), []
        self._dead = np.zeros(0, dtype=bool)
        _RELEASE.submit(garbage.clear)

    def cancel(self) -> None:
        self._finish()

    def snapshot(self) -> TableSnapshot:
        """The copy as a ``TableSnapshot`` (the whole row matrix; ``rownum`` says which rows
        are live, as a full save writes it). Views of the copy: nothing is gathered."""
        assert self.done
        o = self._packed
        return TableSnapshot(self.row_ids[:o], self.values, self.stamps[:o], self.cand_ids,
                             self.cand_counts, self.config, self.state, rownum=self.rownum[:o])


class PendingSave:
    """A checkpoint entry whose content is fixed (``EmbeddingTable.begin_save``)."""

    def __init__(self, table: EmbeddingTable, incremental: bool) -> None:
        self.incremental = incremental
        self.copy: RowCopy | None = None
        self.arrays: dict[str, np.ndarray] = {}
        if incremental:
            ids, values = table.changed_since(table.saved_version, table.saved_step)
            found = np.empty(len(ids), dtype=np.int32)
            table._core.find(ids, found)
            deleted = np.unique(np.concatenate([np.zeros(0, dtype=np.int64), *table._deleted]))
            cand_ids, cand_counts = table._candidate_counts()
            self.arrays = {"ids": ids, "rows": values, "stamps": table._meta(found, "stamp"),
                           "deleted": deleted, "cand_ids": cand_ids, "cand_counts": cand_counts}
            self.meta = {"config": table.config(), "state": table._state()}
        else:
            self.copy = table.copy_rows()

    def step(self, rows: int = 4096) -> bool:
        return self.copy is None or self.copy.step(rows)

    def write(self, path: str | Path, *, fsync: bool = True) -> str:
        """Write the entry into directory ``path`` (once ``step`` returned True); its name."""
        writer = ckpt.EntryWriter(Path(path), "incr" if self.incremental else "full", fsync=fsync)
        if self.incremental and writer.manifest is None:
            raise ckpt.CheckpointError(f"no full checkpoint in {path} to add an increment to")
        if self.incremental:
            for name, array in self.arrays.items():
                writer.array(name, array)
            return writer.commit(self.meta)
        assert self.copy is not None and self.copy.done
        snapshot, self.copy = self.copy.snapshot(), None  # unmapped by this thread once written
        return write_snapshot(snapshot, path, fsync=fsync, writer=writer)


@dataclass
class TableSnapshot:
    """A table's content at one moment (``EmbeddingTable.snapshot``)."""

    ids: np.ndarray
    rows: np.ndarray          # [n, width]: embedding, then the optimizer's slots
    stamps: np.ndarray
    cand_ids: np.ndarray      # admission candidates and their counts
    cand_counts: np.ndarray
    config: dict[str, Any]
    state: dict[str, Any]
    rownum: np.ndarray | None = None  # rows' places in ``rows`` (None: one row per id, in order)


def write_snapshot(snap: TableSnapshot, path: str | Path, *, fsync: bool = True,
                   writer: ckpt.EntryWriter | None = None) -> str:
    """Write ``snap`` as a full checkpoint entry into directory ``path`` (what
    ``EmbeddingTable.load`` reads); returns the entry's name."""
    writer = writer or ckpt.EntryWriter(Path(path), "full", fsync=fsync)
    writer.array("ids", snap.ids)
    rownum = snap.rownum if snap.rownum is not None else np.arange(len(snap.ids), dtype=np.int32)
    writer.array("rownum", rownum)
    writer.array("stamps", snap.stamps)
    writer.array("matrix", snap.rows)
    writer.array("cand_ids", snap.cand_ids)
    writer.array("cand_counts", snap.cand_counts)
    return writer.commit({"config": snap.config, "state": snap.state})

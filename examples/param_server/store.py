"""The embedding store of one PS shard: a hash table of rows that grows and shrinks.

Owns the id -> row mapping, the row storage (embedding and optimizer slots side by side, see
optimizers.py), per-row access counts (for frequency eviction) and per-row versions (for
incremental export), and the tombstones of deleted ids.

Rows are created on first lookup (or first update) from a seeded init that depends on the
id only. Storage is one float32 matrix with a free list: it doubles when full and is
compacted to a smaller matrix when eviction leaves it three quarters empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .optimizers import SparseOptimizer
from .sparse import as_ids, seeded_uniform, sum_by_id


@dataclass
class Export:
    """Rows changed (created or updated) and ids deleted after ``since``, as of ``version``.

    ``rows`` are whole rows, ``[embedding | slots]``, in id order: a consumer that only
    serves keeps ``rows[:, :dim]``; one that checkpoints keeps the slots too. ``deleted`` may
    name ids the consumer never saw (created and deleted between two exports): deleting an
    absent id is harmless, while tracking what each consumer holds would not be.
    """

    since: int
    version: int
    ids: np.ndarray
    rows: np.ndarray
    deleted: np.ndarray
    dim: int

    @property
    def embeddings(self) -> np.ndarray:
        return self.rows[:, :self.dim]


class EmbeddingStore:
    """Sparse rows keyed by int64 id; ``dim`` columns of embedding plus the optimizer's slots."""

    def __init__(self, dim: int, optimizer: SparseOptimizer, *, seed: int = 0,
                 init_scale: float = 0.05, capacity: int = 1024) -> None:
        if dim <= 0 or capacity <= 0:
            raise ValueError("dim and capacity must be positive")
        self.dim = dim
        self.optimizer = optimizer
        self.seed = seed
        self.init_scale = init_scale
        self.width = dim * (1 + optimizer.num_slots)
        self.min_capacity = capacity
        self._slot_of: dict[int, int] = {}
        self._data = np.zeros((capacity, self.width), dtype=np.float32)
        self._ids = np.zeros(capacity, dtype=np.int64)
        self._count = np.zeros(capacity, dtype=np.int64)
        self._stamp = np.zeros(capacity, dtype=np.int64)     # version of the row's last change
        self._free = list(range(capacity - 1, -1, -1))      # pop() hands out low slots first
        self._tombstones: dict[int, int] = {}                # deleted id -> version of deletion
        self.version = 0                                     # bumped by every change
        self.created = 0
        self.evicted = 0

    # -- size -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, id_: int) -> bool:
        return int(id_) in self._slot_of

    @property
    def capacity(self) -> int:
        return len(self._data)

    @property
    def global_step(self) -> int:
        return self.optimizer.step

    def ids(self) -> np.ndarray:
        """Every live id, sorted."""
        return np.sort(np.fromiter(self._slot_of.keys(), dtype=np.int64, count=len(self._slot_of)))

    # -- the hash table -------------------------------------------------------------------

    def _slots(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, creating missing rows (one version bump for all of them)."""
        slots = np.empty(len(ids), dtype=np.int64)
        slot_of = self._slot_of
        new_slots: list[int] = []
        new_ids: list[int] = []
        for i, id_ in enumerate(ids.tolist()):
            slot = slot_of.get(id_)
            if slot is None:
                # Registered at once, so a duplicate later in ``ids`` finds this row.
                slot = slot_of[id_] = self._allocate()
                new_slots.append(slot)
                new_ids.append(id_)
            slots[i] = slot
        if new_slots:
            self._init_rows(np.array(new_slots, dtype=np.int64), np.array(new_ids, dtype=np.int64))
        return slots

    def _allocate(self) -> int:
        if not self._free:
            self._grow()
        return self._free.pop()

    def _init_rows(self, slots: np.ndarray, ids: np.ndarray) -> None:
        self.version += 1
        rows = np.empty((len(ids), self.width), dtype=np.float32)
        rows[:, :self.dim] = self.init_scale * seeded_uniform(ids, self.dim, self.seed)
        rows[:, self.dim:] = self.optimizer.initial_slots(len(ids), self.dim)
        self._data[slots] = rows
        self._ids[slots] = ids
        self._count[slots] = 0
        self._stamp[slots] = self.version
        for id_ in ids.tolist():
            self._tombstones.pop(id_, None)
        self.created += len(ids)

    def _grow(self) -> None:
        """Double the matrix; rows keep their slots (slots handed out in this call stay valid)."""
        old = self.capacity
        grown = 2 * old
        self._data = np.concatenate([self._data, np.zeros((old, self.width), dtype=np.float32)])
        self._ids = np.concatenate([self._ids, np.zeros(old, dtype=np.int64)])
        self._count = np.concatenate([self._count, np.zeros(old, dtype=np.int64)])
        self._stamp = np.concatenate([self._stamp, np.zeros(old, dtype=np.int64)])
        self._free.extend(range(grown - 1, old - 1, -1))

    def _compact(self, capacity: int) -> None:
        """Move the live rows to the front of a new, smaller matrix of ``capacity`` rows."""
        live = np.fromiter(self._slot_of.values(), dtype=np.int64, count=len(self._slot_of))
        live.sort()
        n = len(live)
        data = np.zeros((capacity, self.width), dtype=np.float32)
        ids = np.zeros(capacity, dtype=np.int64)
        count = np.zeros(capacity, dtype=np.int64)
        stamp = np.zeros(capacity, dtype=np.int64)
        data[:n] = self._data[live]
        ids[:n] = self._ids[live]
        count[:n] = self._count[live]
        stamp[:n] = self._stamp[live]
        self._data, self._ids, self._count, self._stamp = data, ids, count, stamp
        self._slot_of = {id_: slot for slot, id_ in enumerate(ids[:n].tolist())}
        self._free = list(range(capacity - 1, n - 1, -1))

    # -- reads and writes --------------------------------------------------------------------

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Embeddings (``[len(ids), dim]``, a new array) of ``ids``; missing rows are created."""
        ids = as_ids(ids)
        slots = self._slots(ids)
        np.add.at(self._count, slots, 1)  # add.at: a duplicate id counts twice
        return self._data[slots, :self.dim]

    def peek(self, ids: np.ndarray) -> np.ndarray:
        """Whole rows (embedding and slots) of existing ids, without counting; KeyError if absent."""
        ids = as_ids(ids)
        slots = [self._slot_of[id_] for id_ in ids.tolist()]
        return self._data[np.array(slots, dtype=np.int64)].reshape(len(ids), self.width)

    def apply_gradients(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """One optimizer step on the rows of ``ids`` (duplicates summed, missing rows created).

        The hot state advances even for an empty push: it counts pushes, and every shard
        sees the same pushes.
        """
        grads = np.asarray(grads, dtype=np.float32)
        ids = as_ids(ids)
        if grads.shape != (len(ids), self.dim):
            raise ValueError(f"gradient shape {grads.shape} does not match {len(ids)} ids "
                             f"of dim {self.dim}")
        self.optimizer.begin_step()
        if len(ids) == 0:
            return
        ids, grads = sum_by_id(ids, grads)
        slots = self._slots(ids)
        rows = self._data[slots]  # one gather serves the embedding and all its slots
        self.optimizer.apply(rows, grads)
        self._data[slots] = rows
        self.version += 1
        self._stamp[slots] = self.version

    def delete(self, ids: np.ndarray) -> int:
        """Remove the rows of ``ids`` (absent ids are ignored); returns how many went."""
        gone = []
        for id_ in as_ids(ids).tolist():
            slot = self._slot_of.pop(id_, None)
            if slot is not None:
                self._free.append(slot)
                gone.append(id_)
        if gone:
            self.version += 1
            for id_ in gone:
                self._tombstones[id_] = self.version
            self.evicted += len(gone)
            self._maybe_shrink()
        return len(gone)

    def evict(self, min_count: int) -> int:
        """Frequency eviction: drop rows looked up fewer than ``min_count`` times since the
        last round, then halve the survivors' counts so that "frequent" means recently."""
        if not self._slot_of:
            return 0
        live = np.fromiter(self._slot_of.values(), dtype=np.int64, count=len(self._slot_of))
        rare = live[self._count[live] < min_count]
        gone = self.delete(self._ids[rare])
        survivors = np.fromiter(self._slot_of.values(), dtype=np.int64, count=len(self._slot_of))
        self._count[survivors] //= 2
        return gone

    def _maybe_shrink(self) -> None:
        # Compact only when three quarters are free, and to twice the live rows, so a table
        # that hovers around one size does not copy itself back and forth.
        if self.capacity > self.min_capacity and len(self) <= self.capacity // 4:
            self._compact(max(self.min_capacity, 2 * len(self)))

    # -- online learning ------------------------------------------------------------------------

    def export_since(self, since: int) -> Export:
        """Exactly the rows created or updated, and the ids deleted, after version ``since``.

        Pass the returned ``version`` as the next ``since``. Lookups of existing rows change
        nothing and are not exported.
        """
        live = np.fromiter(self._slot_of.values(), dtype=np.int64, count=len(self._slot_of))
        changed = live[self._stamp[live] > since]
        changed = changed[np.argsort(self._ids[changed], kind="stable")]
        deleted = sorted(id_ for id_, v in self._tombstones.items() if v > since)
        return Export(since=since, version=self.version, ids=self._ids[changed].copy(),
                      rows=self._data[changed].copy(), deleted=np.array(deleted, dtype=np.int64),
                      dim=self.dim)

    def forget_deletions(self, upto: int) -> None:
        """Drop tombstones of deletions at or before version ``upto`` (already exported)."""
        self._tombstones = {i: v for i, v in self._tombstones.items() if v > upto}

    def stats(self) -> dict[str, int]:
        return {"live": len(self), "capacity": self.capacity, "created": self.created,
                "evicted": self.evicted, "version": self.version, "global_step": self.global_step}

"""The Pipeline Dataset and the ExchangeManager: what EG and MG share, keyed by global batch id.

``PipelineDataset`` reads each batch once from its source, gives it the next global batch id,
registers it with the ``ExchangeManager`` and hands out two iterators (one for EG, one for
MG) that yield the same ids in the same order, each at its consumer's own pace.

``ExchangeManager`` owns everything that crosses between EG and MG for a batch: the samples
and the unique-id index (read by either side while the batch lives) and the two hand-offs
(embedding vectors EG -> MG, embedding gradients MG -> EG). Each live batch has its own
``rvz.Rendezvous``, as TensorFlow gives each step its own rendezvous: a hand-off may happen
in either order, and when EG and MG have both called ``done`` the batch's record and its
rendezvous (with anything left in it) are dropped together.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import rvz

SIDES = ("eg", "mg")
EG_DEVICE = "/job:trainer/replica:0/task:0/device:EG:0"
MG_DEVICE = "/job:trainer/replica:0/task:0/device:MG:0"
EMBEDDINGS = "embeddings"
GRADIENTS = "embedding_grads"


def exchange_key(kind: str, batch_id: int) -> rvz.Key:
    """The key of a hand-off: EG -> MG for embeddings, MG -> EG for their gradients."""
    if kind == EMBEDDINGS:
        return rvz.Key(src=EG_DEVICE, dst=MG_DEVICE, name=kind, iter=batch_id)
    if kind == GRADIENTS:
        return rvz.Key(src=MG_DEVICE, dst=EG_DEVICE, name=kind, iter=batch_id)
    raise ValueError(f"unknown hand-off {kind!r}")


@dataclass
class BatchRecord:
    """What the exchange holds for one live batch."""

    samples: Any
    rendezvous: rvz.Rendezvous
    unique: np.ndarray | None = None    # the batch's unique ids (EG's lookup order)
    inverse: np.ndarray | None = None   # position of each id of the batch in ``unique``
    done: set[str] = field(default_factory=set)


class ExchangeManager:
    """Per-batch state between EG and MG; a batch is freed once both sides are done."""

    def __init__(self) -> None:
        self._batches: dict[int, BatchRecord] = {}
        self._abort_cause: BaseException | None = None
        self.opened = 0
        self.freed = 0
        self.leftovers = 0  # hand-offs still queued when their batch was freed

    def _record(self, batch_id: int) -> BatchRecord:
        try:
            return self._batches[batch_id]
        except KeyError:
            raise KeyError(f"batch {batch_id} is not live (never opened, or already freed)") from None

    # -- lifetime ------------------------------------------------------------------------------

    def open(self, batch_id: int, samples: Any) -> None:
        if batch_id in self._batches:
            raise ValueError(f"batch {batch_id} is already open")
        record = BatchRecord(samples=samples, rendezvous=rvz.Rendezvous())
        if self._abort_cause is not None:
            record.rendezvous.abort(self._abort_cause)
        self._batches[batch_id] = record
        self.opened += 1

    def done(self, batch_id: int, side: str) -> bool:
        """``side`` ("eg" or "mg") is finished with the batch; True if that freed it."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, not {side!r}")
        record = self._record(batch_id)
        record.done.add(side)
        if len(record.done) < len(SIDES):
            return False
        del self._batches[batch_id]
        for kind in (EMBEDDINGS, GRADIENTS):
            self.leftovers += record.rendezvous.pending(exchange_key(kind, batch_id))[0]
        self.freed += 1
        return True

    def live(self) -> list[int]:
        """Ids of the batches not yet freed, in order."""
        return sorted(self._batches)

    def abort(self, cause: BaseException) -> None:
        """Fail every pending and later hand-off (EG or MG failed: the other must not hang)."""
        if self._abort_cause is None:
            self._abort_cause = cause
        for record in self._batches.values():
            record.rendezvous.abort(cause)

    # -- shared, read by either side ----------------------------------------------------------

    def samples(self, batch_id: int) -> Any:
        return self._record(batch_id).samples

    def set_index(self, batch_id: int, unique: np.ndarray, inverse: np.ndarray) -> None:
        record = self._record(batch_id)
        record.unique, record.inverse = unique, inverse

    def index(self, batch_id: int) -> tuple[np.ndarray, np.ndarray]:
        record = self._record(batch_id)
        if record.unique is None or record.inverse is None:
            raise KeyError(f"batch {batch_id} has no unique-id index yet")
        return record.unique, record.inverse

    # -- hand-offs -------------------------------------------------------------------------------

    def send(self, kind: str, batch_id: int, value: np.ndarray) -> None:
        """Hand ``value`` over (never blocks); the receiver owns it from now on."""
        self._record(batch_id).rendezvous.send(exchange_key(kind, batch_id), value)

    async def recv(self, kind: str, batch_id: int, timeout: float | None = None) -> np.ndarray:
        record = self._record(batch_id)
        value: np.ndarray = await record.rendezvous.recv(exchange_key(kind, batch_id), timeout=timeout)
        return value

    def pending(self, kind: str, batch_id: int) -> tuple[int, int]:
        """``(queued values, waiting receivers)`` of a live batch's hand-off."""
        return self._record(batch_id).rendezvous.pending(exchange_key(kind, batch_id))


class PipelineDataset:
    """One source of batches, two iterators over the same global batch ids (EG's and MG's).

    A batch is read from the source when the first of the two iterators reaches it and is
    registered with the exchange under its global batch id; it stays there until both sides
    are done with it, however far apart the two iterators are.
    """

    def __init__(self, source: Iterable[Any], exchange: ExchangeManager, first_id: int = 0) -> None:
        self._source = iter(source)
        self.exchange = exchange
        self.first_id = first_id
        self._next_id = first_id     # the id the next batch read from the source gets
        self._exhausted = False
        self._handed_out: set[str] = set()

    def iterator(self, side: str) -> Iterator[int]:
        """The global batch ids, in order, for ``side`` ("eg" or "mg"); one iterator per side."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, not {side!r}")
        if side in self._handed_out:
            raise ValueError(f"the {side} iterator was already handed out")
        self._handed_out.add(side)
        return self._iterate()

    def _iterate(self) -> Iterator[int]:
        batch_id = self.first_id
        while batch_id < self._next_id or self._read_one():
            yield batch_id
            batch_id += 1

    def _read_one(self) -> bool:
        if self._exhausted:
            return False
        try:
            samples = next(self._source)
        except StopIteration:
            self._exhausted = True
            return False
        self.exchange.open(self._next_id, samples)
        self._next_id += 1
        return True

"""The Pipeline Dataset and the ExchangeManager: what EG and MG share, keyed by global batch id.

``PipelineDataset`` reads each batch once from its source, gives it the next global batch id,
registers it with the ``ExchangeManager`` and hands out two iterators (one for EG, one for
MG) that yield the same ids in the same order, each at its consumer's own pace.

``ExchangeManager`` owns everything that crosses between EG and MG for a batch: the samples
and the unique-id index (read by either side while the batch lives) and the hand-offs
(embedding vectors EG -> MG, their gradients MG -> EG, held-out embeddings EG -> MG). A
hand-off is an rvz send/recv on the worker's own node, with keys from the worker's EG device
to its MG device (or back) **in the rvz step of the batch** (``pipeline_step(batch_id)``):
the dense all-reduce of that training step runs in the same rvz step, so ``abort`` (rvz step
clean-up) fails every wait of that batch, here and on every other worker, with a message
that names the step. A batch's record is dropped once EG and MG have both called ``done``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import rvz

SIDES = ("eg", "mg")
EMBEDDINGS = "embeddings"            # EG -> MG: [batch, fields, dim]
GRADIENTS = "embedding_grads"        # MG -> EG: [batch, fields, dim]
EVAL_EMBEDDINGS = "eval_embeddings"  # EG -> MG: rows of the held-out set's unique ids
TO_MG = (EMBEDDINGS, EVAL_EMBEDDINGS)

# rvz step of training step t. The parameter server's own steps (per worker and clock)
# stay below 2**50, so the two never meet.
PIPELINE_STEP_BASE = 1 << 52


def pipeline_step(batch_id: int) -> int:
    return PIPELINE_STEP_BASE + batch_id


def in_training_steps(text: str) -> str:
    """``text`` (an rvz error's) with the rvz step ids of training steps written as the
    training steps they are: rvz names a step by its id, and 4503599627370499 means nothing to
    a reader of the pipeline's errors."""
    def name(match: re.Match[str]) -> str:
        step = int(match.group(1))
        return f"step {step - PIPELINE_STEP_BASE}" if step >= PIPELINE_STEP_BASE else match.group(0)
    return _STEP_ID.sub(name, text)


_STEP_ID = re.compile(r"\bstep (\d+)")


@dataclass
class BatchRecord:
    """What the exchange holds for one live batch."""

    samples: Any
    unique: np.ndarray | None = None    # the batch's unique ids (EG's lookup order)
    inverse: np.ndarray | None = None   # position of each id of the batch in ``unique``
    done: set[str] = field(default_factory=set)


class ExchangeManager:
    """Per-batch state between EG and MG of one worker (``node``, a task of the worker job);
    a batch is freed once both sides are done. ``timeout`` bounds every hand-off wait."""

    def __init__(self, node: rvz.Node, timeout: float | None = 60.0) -> None:
        self.node = node
        self.timeout = timeout
        prefix = f"/job:{node.job}/replica:0/task:{node.task}"
        self.eg_device = f"{prefix}/device:EG:0"
        self.mg_device = f"{prefix}/device:MG:0"
        self._batches: dict[int, BatchRecord] = {}
        self.opened = 0
        self.freed = 0

    def key(self, kind: str, batch_id: int) -> rvz.Key:
        """The key of a hand-off of ``batch_id``: EG -> MG or MG -> EG depending on ``kind``."""
        if kind in TO_MG:
            return rvz.Key(src=self.eg_device, dst=self.mg_device, name=kind, iter=batch_id)
        if kind == GRADIENTS:
            return rvz.Key(src=self.mg_device, dst=self.eg_device, name=kind, iter=batch_id)
        raise ValueError(f"unknown hand-off {kind!r}")

    def _record(self, batch_id: int) -> BatchRecord:
        try:
            return self._batches[batch_id]
        except KeyError:
            raise KeyError(f"batch {batch_id} is not live (never opened, or already freed)") from None

    # -- lifetime ------------------------------------------------------------------------------

    def open(self, batch_id: int, samples: Any) -> None:
        if batch_id in self._batches:
            raise ValueError(f"batch {batch_id} is already open")
        self._batches[batch_id] = BatchRecord(samples=samples)
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
        self.freed += 1
        return True

    def live(self) -> list[int]:
        """Ids of the batches not yet freed, in order."""
        return sorted(self._batches)

    async def abort(self, batch_id: int, message: str) -> None:
        """Abort the batch's step through rvz step clean-up: every wait in it fails, on this
        node and on every node that took part, with ``message``."""
        await self.node.step(pipeline_step(batch_id)).cleanup(message)

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

    async def send(self, kind: str, batch_id: int, value: np.ndarray) -> None:
        """Hand ``value`` over; the receiver owns it from now on (do not modify it)."""
        self._record(batch_id)
        await self.node.send(self.key(kind, batch_id), value, step=pipeline_step(batch_id))

    async def recv(self, kind: str, batch_id: int) -> np.ndarray:
        value: np.ndarray = await self.node.recv(self.key(kind, batch_id), step=pipeline_step(batch_id),
                                                 timeout=self.timeout)
        return value


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

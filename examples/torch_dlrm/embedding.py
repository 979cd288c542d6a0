"""Embedding bags for torch whose tables live on the parameter server.

``PSEmbeddingBagCollection`` is to several PS tables what ``nn.EmbeddingBag`` is to one local
table: each table gets jagged ids (``values`` and ``offsets``, multi-hot, empty bags
allowed) and returns one pooled row per bag, ``mode="sum"`` or ``"mean"``. In training, the
forward pass takes the batch's rows from the ``EmbeddingService`` (pulled ahead at its
staleness) and pools them with torch's own ``embedding_bag``; the backward pass
(``PSEmbeddingBagFunction``) computes torch's own sparse gradient of those rows, sums the
duplicates as ``torch.optim.SparseAdam`` does (``coalesce``), and hands one row per unique
id to the service, which pushes it to the shards. The module has no parameters: the sparse
optimizer runs on the PS, the dense part of a model trains with any ``torch.optim``
optimizer. Outside training (``eval()`` or under ``torch.no_grad()``) the rows are read
from the PS without changing anything.

``LocalEmbeddingBagCollection``: the same interface over ``nn.EmbeddingBag`` tables in this
process, for the reference run that the PS run must reproduce.

Rows cross between numpy (rvz) and torch without a copy: ``torch.from_numpy`` and
``Tensor.numpy()`` share the float32 memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .service import EmbeddingService, SparseBatch

MODES = ("sum", "mean")


class _Step:
    """What the backward pass of one batch needs besides the tensors."""

    def __init__(self, service: EmbeddingService, batch_id: int, indices: list[torch.Tensor],
                 offsets: list[torch.Tensor], mode: str) -> None:
        self.service, self.batch_id = service, batch_id
        self.indices, self.offsets, self.mode = indices, offsets, mode


def row_gradient(indices: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, mode: str,
                 grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``embedding_bag(indices, rows, offsets, mode)`` at ``grad``, one row
    per row of ``rows``: torch's sparse gradient, duplicates summed by ``coalesce`` (the sums
    ``torch.optim.SparseAdam`` makes)."""
    with torch.enable_grad():
        leaf = rows.detach().requires_grad_()
        pooled = F.embedding_bag(indices, leaf, offsets, mode=mode, sparse=True)
        (sparse,) = torch.autograd.grad(pooled, leaf, grad)
    sparse = sparse.coalesce()
    present, values = sparse.indices()[0], sparse.values()
    if len(present) == len(rows):  # every row was looked up (a batch's unique ids): in order
        return values
    out = torch.zeros_like(rows)
    out[present] = values
    return out


class PSEmbeddingBagFunction(torch.autograd.Function):
    """Forward: pool each table's rows; backward: hand the rows' gradients to the service."""

    @staticmethod
    def forward(ctx: Any, step: _Step, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.step = step
        ctx.save_for_backward(*rows)
        return tuple(F.embedding_bag(i, r, o, mode=step.mode)
                     for i, r, o in zip(step.indices, rows, step.offsets, strict=True))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, ...]:
        step: _Step = ctx.step
        rows = ctx.saved_tensors
        out = [row_gradient(i, r, o, step.mode, g).numpy()
               for i, r, o, g in zip(step.indices, rows, step.offsets, grads, strict=True)]
        step.service.give(step.batch_id, out)
        # The PS applies the update: no gradient is kept in this process.
        return (None,) * (1 + len(rows))


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    return mode


def bags(features: dict[str, tuple[Any, Any]], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Table ``name``'s ``(values, offsets)`` as int64 tensors (numpy arrays shared, not copied)."""
    values, offsets = features[name]
    return torch.as_tensor(values, dtype=torch.int64), torch.as_tensor(offsets, dtype=torch.int64)


class PSEmbeddingBagCollection(nn.Module):
    """Several PS tables as embedding bags. ``forward(batch)`` takes a ``SparseBatch`` (its
    ``features``: ``{table: (values, offsets)}``) and returns the pooled rows of each table,
    in the service's table order: a tuple of ``[batch, dim]`` tensors."""

    def __init__(self, service: EmbeddingService, mode: str = "sum") -> None:
        super().__init__()
        self.service = service
        self.mode = _check_mode(mode)
        self.names = list(service.names)
        self.dims = [service.dims[n] for n in self.names]

    def forward(self, batch: SparseBatch) -> tuple[torch.Tensor, ...]:
        if self.training and torch.is_grad_enabled():
            if batch.batch_id is None:
                raise ValueError("in training, the batches come from EmbeddingService.batches()")
            return self._train(batch)
        return self._read(batch)

    def _train(self, batch: SparseBatch) -> tuple[torch.Tensor, ...]:
        assert batch.batch_id is not None
        _, inverses, rows = self.service.take(batch)
        offsets = [bags(batch.features, n)[1] for n in self.names]
        indices = [torch.from_numpy(i) for i in inverses]
        step = _Step(self.service, batch.batch_id, indices, offsets, self.mode)
        leaves = [torch.from_numpy(r).requires_grad_() for r in rows]
        out: tuple[torch.Tensor, ...] = PSEmbeddingBagFunction.apply(step, *leaves)
        return out

    def _read(self, batch: SparseBatch) -> tuple[torch.Tensor, ...]:
        uniques, inverses = {}, {}
        for name in self.names:
            ids = np.asarray(batch.features[name][0])
            uniques[name], inverses[name] = np.unique(ids, return_inverse=True)
        rows = self.service.read(uniques)
        return tuple(F.embedding_bag(torch.from_numpy(inverses[n].reshape(-1)), torch.from_numpy(rows[n]),
                                     bags(batch.features, n)[1], mode=self.mode) for n in self.names)


class LocalEmbeddingBagCollection(nn.Module):
    """The same tables as ``nn.EmbeddingBag`` modules in this process (``sparse=True``, for
    ``torch.optim.SparseAdam``). ``vocab[t]``: table t's ids, sorted; ``weights[t]``: their
    initial rows. Ids are mapped to row numbers by binary search (an id outside the vocabulary
    is an error)."""

    def __init__(self, names: Sequence[str], vocab: Sequence[np.ndarray], weights: Sequence[np.ndarray],
                 mode: str = "sum") -> None:
        super().__init__()
        self.mode = _check_mode(mode)
        self.names = list(names)
        self.vocab = [np.asarray(v, dtype=np.int64) for v in vocab]
        self.bags = nn.ModuleList()
        for w in weights:
            bag = nn.EmbeddingBag(w.shape[0], w.shape[1], mode=mode, sparse=True)
            with torch.no_grad():
                bag.weight.copy_(torch.from_numpy(np.asarray(w, dtype=np.float32)))
            self.bags.append(bag)

    def forward(self, batch: SparseBatch) -> tuple[torch.Tensor, ...]:
        out = []
        for name, vocab, bag in zip(self.names, self.vocab, self.bags, strict=True):
            values, offsets = batch.features[name]
            index = np.searchsorted(vocab, np.asarray(values))
            if len(index) and (index.max() >= len(vocab) or not np.array_equal(vocab[index], values)):
                raise KeyError(f"table {name}: ids outside the vocabulary")
            out.append(bag(torch.from_numpy(index), bags(batch.features, name)[1]))
        return tuple(out)

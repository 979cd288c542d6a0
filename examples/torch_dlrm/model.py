"""A small DLRM: dense features through a bottom MLP, the categorical features through an
embedding-bag collection (on the PS or local), their pairwise dot products (or a plain
concatenation), and a top MLP to one logit.

The dense layers are made from ``torch.manual_seed(seed)`` in a fixed order and the
embeddings hold no torch parameter drawn at random, so a model over the PS and one over
local ``nn.EmbeddingBag`` tables with the same initial rows start from the same bits.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from .service import SparseBatch

INTERACTIONS = ("dot", "cat")
# torch's default generator is the process's: two models made at once on two threads (the
# workers of an in-process run) would draw from it in turn, and start from other bits.
_SEEDING = threading.Lock()


def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """``forward(batch) -> logits [batch]``. ``embeddings(batch)`` gives one ``[batch, dim]``
    tensor per table (every table ``dim`` wide)."""

    def __init__(self, embeddings: nn.Module, num_tables: int, dim: int, num_dense: int = 13,
                 bottom: tuple[int, ...] = (64,), top: tuple[int, ...] = (64, 32),
                 interaction: str = "dot", seed: int = 0) -> None:
        super().__init__()
        if interaction not in INTERACTIONS:
            raise ValueError(f"interaction must be one of {INTERACTIONS}, not {interaction!r}")
        self.embeddings = embeddings
        self.interaction = interaction
        vectors = num_tables + 1
        width = dim + (vectors * (vectors - 1) // 2 if interaction == "dot" else num_tables * dim)
        with _SEEDING:
            torch.manual_seed(seed)
            self.bottom = mlp([num_dense, *bottom, dim], last_relu=True)
            self.top = mlp([width, *top, 1], last_relu=False)
        rows, cols = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pairs", rows * vectors + cols, persistent=False)

    def forward(self, batch: SparseBatch) -> torch.Tensor:
        x = self.bottom(torch.as_tensor(batch.dense))
        pooled = self.embeddings(batch)
        if self.interaction == "dot":
            z = torch.stack([x, *pooled], dim=1)                  # [batch, tables + 1, dim]
            dots = torch.bmm(z, z.transpose(1, 2)).flatten(1)     # every pair's dot product
            features = torch.cat([x, dots[:, self.pairs]], dim=1)
        else:
            features = torch.cat([x, *pooled], dim=1)
        return self.top(features).squeeze(1)

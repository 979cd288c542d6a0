"""Sparse optimizers whose slots live in the embedding row (sparse-domain aggregation).

A row of the store is ``[embedding | slot 0 | slot 1 ...]``, each part ``dim`` wide, so one
hash lookup finds a row and all its optimizer state: no second table per slot, no second
lookup. Each optimizer also keeps the small "hot" state of the update (the global step, Adam's
beta powers). Every PS shard keeps its own replica of it instead of asking one shard
that would then be hot: all shards see one push per worker step (empty pushes included),
so the replicas stay equal.
"""

from __future__ import annotations

import numpy as np


class SparseOptimizer:
    """Base: ``num_slots`` slot columns of width ``dim`` after the embedding."""

    name = "base"
    num_slots = 0

    def __init__(self, lr: float) -> None:
        self.lr = float(lr)
        self.step = 0  # replicated hot state: the updates this shard has applied

    def begin_step(self) -> None:
        """Advance the hot state once per push (before applying it)."""
        self.step += 1

    def initial_slots(self, n: int, dim: int) -> np.ndarray:
        return np.zeros((n, self.num_slots * dim), dtype=np.float32)

    def apply(self, rows: np.ndarray, grads: np.ndarray) -> None:
        """Update ``rows`` (``[n, (1 + num_slots) * dim]``, float32) in place."""
        raise NotImplementedError

    def hot_state(self) -> dict[str, float]:
        return {"step": self.step}


class Adagrad(SparseOptimizer):
    """TF's Adagrad: ``acc += g**2``, ``w -= lr * g / sqrt(acc)``, acc starting at 0.1."""

    name = "adagrad"
    num_slots = 1

    def __init__(self, lr: float = 0.1, initial_accumulator: float = 0.1) -> None:
        super().__init__(lr)
        self.initial_accumulator = float(initial_accumulator)

    def initial_slots(self, n: int, dim: int) -> np.ndarray:
        return np.full((n, dim), self.initial_accumulator, dtype=np.float32)

    def apply(self, rows: np.ndarray, grads: np.ndarray) -> None:
        dim = grads.shape[1]
        emb, acc = rows[:, :dim], rows[:, dim:2 * dim]
        acc += grads * grads
        emb -= self.lr * grads / np.sqrt(acc)


class Adam(SparseOptimizer):
    """TF's Adam, applied lazily (only to the rows in the push).

    ``lr_t = lr * sqrt(1 - beta2**t) / (1 - beta1**t)`` uses the shard's replicated beta powers.
    """

    name = "adam"
    num_slots = 2

    def __init__(self, lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8) -> None:
        super().__init__(lr)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.epsilon = float(epsilon)
        self.beta1_power = 1.0
        self.beta2_power = 1.0

    def begin_step(self) -> None:
        super().begin_step()
        self.beta1_power *= self.beta1
        self.beta2_power *= self.beta2

    def apply(self, rows: np.ndarray, grads: np.ndarray) -> None:
        dim = grads.shape[1]
        emb, m, v = rows[:, :dim], rows[:, dim:2 * dim], rows[:, 2 * dim:3 * dim]
        m *= self.beta1
        m += (1.0 - self.beta1) * grads
        v *= self.beta2
        v += (1.0 - self.beta2) * grads * grads
        lr_t = self.lr * np.sqrt(1.0 - self.beta2_power) / (1.0 - self.beta1_power)
        emb -= (lr_t * m / (np.sqrt(v) + self.epsilon)).astype(np.float32)

    def hot_state(self) -> dict[str, float]:
        return {"step": self.step, "beta1_power": self.beta1_power, "beta2_power": self.beta2_power}


def make_optimizer(name: str, lr: float | None = None) -> SparseOptimizer:
    """``"adagrad"`` or ``"adam"``, with that optimizer's default learning rate unless given."""
    if name == "adagrad":
        return Adagrad() if lr is None else Adagrad(lr)
    if name == "adam":
        return Adam() if lr is None else Adam(lr)
    raise ValueError(f"optimizer must be 'adagrad' or 'adam', not {name!r}")

"""Sparse optimizers whose slots live in the embedding row (sparse-domain aggregation).

A row of a table is ``[embedding | slot 0 | slot 1 ...]``, each part ``dim`` wide, so one
hash lookup finds a row and all its optimizer state. ``apply`` updates a batch of whole rows
in place, in float32, given the gradient of each row (duplicate ids already summed) and the
table's global step ``t`` (the number of ``apply_gradients`` calls, this one included).

The update rules are the published ones:

* ``SGD``: ``w -= lr * g``.
* ``Adagrad`` (PyTorch and TF): ``acc += g*g; w -= lr * g / (sqrt(acc) + eps)``.
* ``Adam``, lazy (PyTorch's ``SparseAdam``, TF's ``LazyAdam``): only the rows present are
  touched; ``m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
  w -= lr * sqrt(1-b2**t) / (1-b1**t) * m / (sqrt(v) + eps)``.
* ``Ftrl`` (TF's FTRL-Proximal, ``lr_power`` -0.5 by default): ``n' = n + g*g;
  z += g - (n'**-p - n**-p) / lr * w; w = (sign(z)*l1 - z) / (n'**-p / lr + 2*l2)`` if
  ``|z| > l1`` else 0, with ``p = lr_power``.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class SparseOptimizer:
    """Base: ``num_slots`` slot columns of width ``dim`` after the embedding."""

    name = "base"
    num_slots = 0

    def __init__(self, lr: float) -> None:
        self.lr = float(lr)

    def initial_slots(self, n: int, dim: int) -> np.ndarray:
        """Slot values of ``n`` new rows: ``[n, num_slots * dim]`` float32."""
        return np.zeros((n, self.num_slots * dim), dtype=np.float32)

    def apply(self, rows: np.ndarray, grads: np.ndarray, t: int) -> None:
        """Update ``rows`` (``[n, (1 + num_slots) * dim]`` float32) in place."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """Everything needed to build the same optimizer again (saved in checkpoints)."""
        return {"name": self.name, "lr": self.lr}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"


class SGD(SparseOptimizer):
    name = "sgd"
    num_slots = 0

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__(lr)

    def apply(self, rows: np.ndarray, grads: np.ndarray, t: int) -> None:
        rows[:, :grads.shape[1]] -= np.float32(self.lr) * grads


class Adagrad(SparseOptimizer):
    name = "adagrad"
    num_slots = 1

    def __init__(self, lr: float = 0.01, initial_accumulator_value: float = 0.1,
                 eps: float = 1e-10) -> None:
        super().__init__(lr)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.eps = float(eps)

    def initial_slots(self, n: int, dim: int) -> np.ndarray:
        return np.full((n, dim), self.initial_accumulator_value, dtype=np.float32)

    def apply(self, rows: np.ndarray, grads: np.ndarray, t: int) -> None:
        dim = grads.shape[1]
        w, acc = rows[:, :dim], rows[:, dim:2 * dim]
        acc += grads * grads
        w -= np.float32(self.lr) * grads / (np.sqrt(acc) + np.float32(self.eps))

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr,
                "initial_accumulator_value": self.initial_accumulator_value, "eps": self.eps}


class Adam(SparseOptimizer):
    name = "adam"
    num_slots = 2

    def __init__(self, lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8) -> None:
        super().__init__(lr)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.eps = float(eps)

    def apply(self, rows: np.ndarray, grads: np.ndarray, t: int) -> None:
        dim = grads.shape[1]
        w, m, v = rows[:, :dim], rows[:, dim:2 * dim], rows[:, 2 * dim:3 * dim]
        b1, b2 = np.float32(self.beta1), np.float32(self.beta2)
        m *= b1
        m += (np.float32(1.0) - b1) * grads
        v *= b2
        v += (np.float32(1.0) - b2) * grads * grads
        # The step size in float64 from the exact powers, then one float32 multiply.
        step = self.lr * np.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        w -= np.float32(step) * m / (np.sqrt(v) + np.float32(self.eps))

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr, "beta1": self.beta1, "beta2": self.beta2,
                "eps": self.eps}


class Ftrl(SparseOptimizer):
    name = "ftrl"
    num_slots = 2  # accumulator n, linear z

    def __init__(self, lr: float = 0.01, lr_power: float = -0.5,
                 initial_accumulator_value: float = 0.1, l1: float = 0.0, l2: float = 0.0) -> None:
        super().__init__(lr)
        if lr_power > 0:
            raise ValueError("lr_power must be <= 0")
        self.lr_power = float(lr_power)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.l1 = float(l1)
        self.l2 = float(l2)

    def initial_slots(self, n: int, dim: int) -> np.ndarray:
        slots = np.zeros((n, 2 * dim), dtype=np.float32)
        slots[:, :dim] = self.initial_accumulator_value
        return slots

    def _power(self, x: np.ndarray) -> np.ndarray:
        return np.sqrt(x) if self.lr_power == -0.5 else np.power(x, np.float32(-self.lr_power))

    def apply(self, rows: np.ndarray, grads: np.ndarray, t: int) -> None:
        dim = grads.shape[1]
        w, acc, lin = rows[:, :dim], rows[:, dim:2 * dim], rows[:, 2 * dim:3 * dim]
        lr = np.float32(self.lr)
        new_acc = acc + grads * grads
        new_pow = self._power(new_acc)
        lin += grads - (new_pow - self._power(acc)) / lr * w
        quadratic = new_pow / lr + np.float32(2.0 * self.l2)
        l1 = np.float32(self.l1)
        w[:] = np.where(np.abs(lin) > l1, (np.sign(lin) * l1 - lin) / quadratic, np.float32(0.0))
        acc[:] = new_acc

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr, "lr_power": self.lr_power,
                "initial_accumulator_value": self.initial_accumulator_value,
                "l1": self.l1, "l2": self.l2}


OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    cls.name: cls for cls in (SGD, Adagrad, Adam, Ftrl)}


def from_config(config: dict[str, Any]) -> SparseOptimizer:
    config = dict(config)
    return OPTIMIZERS[config.pop("name")](**config)


def make_optimizer(name: str, lr: float | None = None) -> SparseOptimizer:
    """``"sgd"``, ``"adagrad"``, ``"adam"`` or ``"ftrl"``, with its default lr unless given."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, not {name!r}")
    cls = OPTIMIZERS[name]
    return cls() if lr is None else cls(lr)  # type: ignore[call-arg]

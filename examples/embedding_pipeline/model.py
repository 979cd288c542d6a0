"""The Main Graph's dense model: pooled embeddings -> one hidden ReLU layer -> logistic output.

Plain numpy with a hand-written backward pass (checked against finite differences in the
tests) and Adam on the dense parameters, which MG owns and updates itself. ``train_step``
returns the loss and the gradient with respect to the embedding input: what MG hands back
to EG.
"""

from __future__ import annotations

import numpy as np


class DenseModel:
    """``x [batch, fields, dim] -> relu(x W1 + b1) w2 + b2 -> sigmoid``, binary cross-entropy."""

    def __init__(self, in_dim: int, hidden: int, *, lr: float = 1e-3, seed: int = 0,
                 dtype: type = np.float32) -> None:
        rng = np.random.default_rng(seed)
        self.dtype = dtype
        self.params = {
            "W1": (rng.standard_normal((in_dim, hidden)) * np.sqrt(2.0 / in_dim)).astype(dtype),
            "b1": np.zeros(hidden, dtype=dtype),
            "w2": (rng.standard_normal(hidden) * np.sqrt(1.0 / hidden)).astype(dtype),
            "b2": np.zeros((), dtype=dtype),
        }
        self.lr = lr
        self.beta1, self.beta2, self.epsilon = 0.9, 0.999, 1e-8
        self.m = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.steps = 0

    def loss_and_grads(self, x: np.ndarray,
                       labels: np.ndarray) -> tuple[float, np.ndarray, dict[str, np.ndarray]]:
        """Mean BCE loss, its gradient w.r.t. ``x`` (shape of ``x``), and the parameter gradients."""
        p = self.params
        batch = x.shape[0]
        flat: np.ndarray = x.reshape(batch, -1).astype(self.dtype, copy=False)
        pre = flat @ p["W1"] + p["b1"]
        hidden = np.maximum(pre, 0)
        logit = hidden @ p["w2"] + p["b2"]
        # log(1 + e^z) - y z, written so large |z| neither overflows nor loses precision.
        loss = float(np.mean(np.logaddexp(0, logit) - labels * logit))
        dlogit = ((1.0 / (1.0 + np.exp(-logit))) - labels) / batch
        dlogit = dlogit.astype(self.dtype, copy=False)
        dpre = np.outer(dlogit, p["w2"]) * (pre > 0)
        grads = {"W1": flat.T @ dpre, "b1": dpre.sum(axis=0), "w2": hidden.T @ dlogit,
                 "b2": np.asarray(dlogit.sum(), dtype=self.dtype)}
        dx = (dpre @ p["W1"].T).reshape(x.shape)
        return loss, dx, grads

    def train_step(self, x: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
        """Forward, backward and one Adam step on the dense parameters: ``(loss, dL/dx)``."""
        loss, dx, grads = self.loss_and_grads(x, labels)
        self.steps += 1
        correction = np.sqrt(1 - self.beta2 ** self.steps) / (1 - self.beta1 ** self.steps)
        for name, g in grads.items():
            m, v = self.m[name], self.v[name]
            m *= self.beta1
            m += (1 - self.beta1) * g
            v *= self.beta2
            v += (1 - self.beta2) * g * g
            self.params[name] -= (self.lr * correction * m / (np.sqrt(v) + self.epsilon)).astype(self.dtype)
        return loss, dx

"""The Main Graph's dense model: an MLP on [embeddings | dense features], logistic output.

Plain numpy, float32, with a hand-written backward pass (checked against finite differences
in the tests) and Adam on the dense parameters, which MG owns. ``forward_backward`` works on
one worker's share of a global batch: its loss and gradients are *sums over its samples
divided by the global batch size*, so summing them over the workers (the all-reduce) gives
the gradient of the global batch's mean loss, and one worker with the whole batch computes
exactly that too.
"""

from __future__ import annotations

import numpy as np

BETA1, BETA2, EPSILON = 0.9, 0.999, 1e-8


class MLP:
    """``x [n, in_dim] -> (relu(x W_i + b_i))... -> logit``; parameters in a fixed order."""

    def __init__(self, in_dim: int, hidden: list[int], *, lr: float = 1e-3, seed: int = 0) -> None:
        rng = np.random.default_rng([seed, 3])
        sizes = [in_dim, *hidden, 1]
        self.params: list[np.ndarray] = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
            scale = np.sqrt(2.0 / fan_in) if fan_out > 1 else np.sqrt(1.0 / fan_in)
            self.params.append((rng.standard_normal((fan_in, fan_out)) * scale).astype(np.float32))
            self.params.append(np.zeros(fan_out, dtype=np.float32))
        self.lr = lr
        self.m = [np.zeros_like(p) for p in self.params]
        self.v = [np.zeros_like(p) for p in self.params]
        self.steps = 0

    @property
    def size(self) -> int:
        return sum(p.size for p in self.params)

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Forward only: ``[n]`` float32 logits."""
        a = x
        layers = len(self.params) // 2
        for i in range(layers):
            z = a @ self.params[2 * i] + self.params[2 * i + 1]
            a = np.maximum(z, 0) if i < layers - 1 else z
        return a.reshape(-1)

    def forward_backward(self, x: np.ndarray, labels: np.ndarray,
                         global_batch: int) -> tuple[float, np.ndarray, list[np.ndarray]]:
        """``(loss share, dL/dx, parameter gradients)`` for these samples, where
        ``L = sum of per-sample BCE over the global batch / global_batch``."""
        layers = len(self.params) // 2
        inputs = [x]
        pre = []
        a = x
        for i in range(layers):
            z = a @ self.params[2 * i] + self.params[2 * i + 1]
            pre.append(z)
            a = np.maximum(z, 0) if i < layers - 1 else z
            inputs.append(a)
        logit = a.reshape(-1)
        # log(1 + e^z) - y z, written so large |z| neither overflows nor loses precision.
        loss = float(np.sum(np.logaddexp(0, logit) - labels * logit, dtype=np.float64) / global_batch)
        dz = ((1.0 / (1.0 + np.exp(-logit)) - labels) / global_batch).astype(logit.dtype).reshape(-1, 1)
        grads: list[np.ndarray] = [np.empty(0)] * len(self.params)
        for i in reversed(range(layers)):
            grads[2 * i] = inputs[i].T @ dz
            grads[2 * i + 1] = dz.sum(axis=0)
            da = dz @ self.params[2 * i].T
            dz = da * (pre[i - 1] > 0) if i > 0 else da
        return loss, dz, grads

    def apply(self, grads: list[np.ndarray]) -> None:
        """One Adam step on every parameter (gradients in ``params`` order)."""
        self.steps += 1
        correction = np.sqrt(1 - BETA2 ** self.steps) / (1 - BETA1 ** self.steps)
        for p, m, v, g in zip(self.params, self.m, self.v, grads, strict=True):
            m *= BETA1
            m += (1 - BETA1) * g
            v *= BETA2
            v += (1 - BETA2) * g * g
            p -= (self.lr * correction) * m / (np.sqrt(v) + EPSILON)

    # The all-reduce moves one flat float32 vector: every gradient, then the loss share.

    def flatten(self, grads: list[np.ndarray], loss: float) -> np.ndarray:
        return np.concatenate([*(g.reshape(-1) for g in grads), np.array([loss], dtype=np.float32)])

    def unflatten(self, flat: np.ndarray) -> tuple[list[np.ndarray], float]:
        out, start = [], 0
        for p in self.params:
            out.append(flat[start:start + p.size].reshape(p.shape))
            start += p.size
        return out, float(flat[start])

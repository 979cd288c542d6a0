"""``sparse_adam``: the PS optimizer that updates rows exactly as ``torch.optim.SparseAdam`` does.

The parameter server's ``Adam`` is the same algorithm written the usual way
(``m = b1*m + (1-b1)*g``, step size folded into the numerator), which rounds differently in
float32. This one follows torch's operation order and float32 constants:

    dm = (g - m) * f32(1 - b1);       m += dm;   numer = dm + m_old
    dv = (g*g - v) * f32(1 - b2);     v += dv;   denom = sqrt(dv + v_old) + f32(eps)
    w += f32(-lr * sqrt(1 - b2**t) / (1 - b1**t)) * (numer / denom)

The square root is torch's own (``torch.sqrt`` on the array, shared, not copied): torch's
float32 square root can differ from numpy's in the last bit (it does on AVX-512 machines),
and over a long run such bits grow. Every other operation rounds alike in numpy and torch.
``t`` is the table's global step: SparseAdam's per-parameter step count, which advances once
per ``step()`` whether or not a given row is present, as the table's does per push.
``register()`` adds it to the parameter server's optimizer names (in every process that
builds tables: the PS shards and the reference).
"""

from __future__ import annotations

import math

import numpy as np

from ..param_server import optimizers

NAME = "sparse_adam"


class SparseAdam(optimizers.Adam):
    """The parameter server's lazy Adam (same slots, settings and defaults), rounded as torch
    rounds it."""

    name = NAME

    def apply(self, rows: np.ndarray, grads: np.ndarray, t: int) -> None:
        dim = grads.shape[1]
        w, m, v = rows[:, :dim], rows[:, dim:2 * dim], rows[:, 2 * dim:3 * dim]
        dm = (grads - m) * np.float32(1.0 - self.beta1)
        numer = dm + m
        m += dm
        dv = (grads * grads - v) * np.float32(1.0 - self.beta2)
        denom = torch_sqrt(dv + v)
        denom += np.float32(self.eps)
        v += dv
        step = self.lr * math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        w += np.float32(-step) * (numer / denom)


def torch_sqrt(x: np.ndarray) -> np.ndarray:
    """``x`` replaced by its square root, computed by torch (imported here: only the processes
    that run this optimizer need it)."""
    import torch

    torch.from_numpy(x).sqrt_()
    return x


def register() -> None:
    """Make ``"sparse_adam"`` a name the parameter server's tables accept (idempotent)."""
    optimizers.OPTIMIZERS.setdefault(NAME, SparseAdam)

"""Synthetic click data in the Criteo format, drawn from a planted model.

``Planted(seed)`` fixes the model; ``write(path, n, sample_seed)`` draws ``n`` samples from
it and writes them as Criteo lines (gzip if ``path`` ends in ``.gz``). Because the label of
each sample is drawn from a known probability ``p``, the best any model can do is to rank by
``p``: ``write`` returns that oracle's AUC and logloss on the very samples it wrote.

The planted model, on the raw values (the learner sees only the encoded lines):

* categorical field f has ``vocab[f]`` values, drawn with Zipf-like frequencies, and is empty
  with probability ``missing[f]``; each value (and "empty") has a weight (first order) and a
  small vector (second order: dot products between a few fixed field pairs);
* integer feature j is a rounded log-normal count (column 1 has small negatives, as the
  published data does), empty with some probability; the logit gets a linear term in
  ``log(1 + x)`` and a nonlinear term in two of them;
* ``logit = bias + first order + pairs + integer terms``, ``p = sigmoid(logit)``.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass

import numpy as np

from .criteo import NUM_CAT, NUM_INT, mix64
from .metrics import auc, logloss

VOCABS = (4, 12, 40, 150, 600, 2500, 10_000, 40_000, 120_000)
PAIR_DIM = 4


@dataclass(frozen=True)
class Oracle:
    samples: int
    positives: int
    auc: float
    logloss: float


class Planted:
    """The planted model of one seed (the same for a training and a held-out file)."""

    def __init__(self, seed: int = 0, *, zipf: float = 1.1, first_order: float = 0.45,
                 pair_scale: float = 0.35, bias: float = -1.6) -> None:
        rng = np.random.default_rng([seed, 1])
        self.seed = seed
        self.zipf = zipf
        self.bias = bias
        self.vocab = [VOCABS[f % len(VOCABS)] for f in range(NUM_CAT)]
        self.missing = np.where(np.arange(NUM_CAT) % 5 == 3, 0.3, 0.02)
        self.cdf = []
        self.weights = []   # per field: [vocab + 1] (the last entry is "empty")
        self.vectors = []   # per field: [vocab + 1, PAIR_DIM]
        for v in self.vocab:
            w = 1.0 / np.arange(1, v + 1, dtype=np.float64) ** zipf
            self.cdf.append(np.cumsum(w / w.sum()))
            self.weights.append(rng.normal(0.0, first_order, v + 1))
            self.vectors.append(rng.normal(0.0, pair_scale, (v + 1, PAIR_DIM)))
        self.pairs = [(f, (f * 7 + 3) % NUM_CAT) for f in range(0, NUM_CAT, 2)]
        self.int_scale = rng.uniform(0.5, 4.0, NUM_INT)           # log-normal location
        self.int_missing = np.where(np.arange(NUM_INT) % 4 == 2, 0.4, 0.05)
        self.int_weights = rng.normal(0.0, 0.25, NUM_INT)
        # Raw hex value of (field, rank): a fixed scramble, 32 bits like the published data.
        self.hex_values = [
            (mix64((np.uint64(f + 1) << np.uint64(40)) + np.arange(v + 1, dtype=np.uint64)
                   + np.uint64(seed) * np.uint64(0x10001)) & np.uint64(0xFFFFFFFF))
            for f, v in enumerate(self.vocab)]

    def sample(self, n: int, sample_seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(ranks [n, 26] (vocab = empty), ints [n, 13] float (NaN = empty), p [n], labels [n])``."""
        rng = np.random.default_rng([self.seed, 2, sample_seed])
        ranks = np.empty((n, NUM_CAT), dtype=np.int64)
        logit = np.full(n, self.bias)
        for f in range(NUM_CAT):
            r = np.minimum(np.searchsorted(self.cdf[f], rng.random(n), side="right"), self.vocab[f] - 1)
            r[rng.random(n) < self.missing[f]] = self.vocab[f]
            ranks[:, f] = r
            logit += self.weights[f][r]
        for f, g in self.pairs:
            logit += np.einsum("nd,nd->n", self.vectors[f][ranks[:, f]], self.vectors[g][ranks[:, g]])
        ints = np.round(np.exp(rng.normal(self.int_scale, 1.0, (n, NUM_INT)))) - 1.0
        ints[:, 1] = np.where(rng.random(n) < 0.1, -rng.integers(1, 4, n), ints[:, 1])
        ints[rng.random((n, NUM_INT)) < self.int_missing] = np.nan
        t = np.nan_to_num(np.sign(ints) * np.log1p(np.abs(ints)), nan=0.0)
        centred = t - self.int_scale
        logit += centred @ self.int_weights
        logit += 0.8 * np.sin(1.5 * t[:, 0]) * np.tanh(t[:, 3] - t[:, 4])
        p = 1.0 / (1.0 + np.exp(-logit))
        labels = (rng.random(n) < p).astype(np.int64)
        return ranks, ints, p, labels

    def lines(self, ranks: np.ndarray, ints: np.ndarray, labels: np.ndarray) -> list[str]:
        cols: list[list[str]] = [[str(v) for v in labels.tolist()]]
        for j in range(NUM_INT):
            col = ints[:, j]
            cols.append(["" if v != v else str(int(v)) for v in col.tolist()])
        for f in range(NUM_CAT):
            table = [f"{int(v):08x}" for v in self.hex_values[f].tolist()]
            table[self.vocab[f]] = ""  # the empty value
            cols.append([table[r] for r in ranks[:, f].tolist()])
        return ["\t".join(row) for row in zip(*cols, strict=True)]

    def write(self, path: str | os.PathLike[str], n: int, sample_seed: int, *,
              block: int = 100_000) -> Oracle:
        """Write ``n`` samples to ``path`` (gzip if it ends in ``.gz``); the oracle's scores."""
        opener = (lambda: gzip.open(path, "wt", compresslevel=1)) if os.fspath(path).endswith(".gz") \
            else (lambda: open(path, "w"))
        ps, ys = [], []
        with opener() as f:
            for start in range(0, n, block):
                ranks, ints, p, labels = self.sample(min(block, n - start), sample_seed * 1_000_003 + start)
                f.write("\n".join(self.lines(ranks, ints, labels)))
                f.write("\n")
                ps.append(p)
                ys.append(labels)
        p_all = np.concatenate(ps) if ps else np.zeros(0)
        y_all = np.concatenate(ys) if ys else np.zeros(0, dtype=np.int64)
        logits = np.log(p_all) - np.log1p(-p_all)
        return Oracle(samples=n, positives=int(y_all.sum()),
                      auc=auc(p_all, y_all) if n else float("nan"),
                      logloss=logloss(logits, y_all) if n else float("nan"))

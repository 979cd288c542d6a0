"""A seeded synthetic click-through task: multi-field sparse ids in, a binary label out.

Each sample has ``fields`` feature fields, each a bag of ``bag`` ids drawn from a per-field
Zipf law. A hidden teacher scores a sample from fixed per-id vectors (pooled per field, then
weighted per field) and the label is that score's sign after noise. A student made of
embeddings, per-field mean pooling and an MLP can learn it, so its loss visibly drops.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..param_server.sparse import seeded_uniform
from ..param_server.workload import ZipfIds


@dataclass(frozen=True)
class TaskSpec:
    batch_size: int = 256
    fields: int = 4
    bag: int = 3
    vocab: int = 5000           # distinct ids per field
    zipf: float = 1.05
    teacher_dim: int = 4
    noise: float = 0.3          # label noise, in units of the teacher score's spread
    seed: int = 0


@dataclass
class Batch:
    """One batch of samples: ``ids`` int64 ``[batch, fields, bag]``, ``labels`` float32 ``[batch]``."""

    ids: np.ndarray
    labels: np.ndarray


def synthetic_batches(spec: TaskSpec, num_batches: int) -> Iterator[Batch]:
    """``num_batches`` batches of the task; the same spec always yields the same batches."""
    rng = np.random.default_rng(spec.seed)
    samplers = [ZipfIds(spec.vocab, spec.zipf, salt=spec.seed * 1000 + f) for f in range(spec.fields)]
    field_weights = rng.standard_normal((spec.fields, spec.teacher_dim))
    # Scale so the teacher's score has unit spread: mean of ``bag`` uniforms has variance
    # 1/(3 bag) per component, summed over teacher_dim components and the fields.
    scale = 1.0 / np.sqrt(spec.fields * spec.teacher_dim / (3.0 * spec.bag))
    for _ in range(num_batches):
        ids = np.stack([s.sample(rng, (spec.batch_size, spec.bag)) for s in samplers], axis=1)
        hidden = seeded_uniform(ids.reshape(-1), spec.teacher_dim, spec.seed + 7919)
        pooled = hidden.reshape(spec.batch_size, spec.fields, spec.bag, -1).mean(axis=2)
        score = scale * np.einsum("bfd,fd->b", pooled, field_weights)
        noisy = 3.0 * score + spec.noise * 3.0 * rng.standard_normal(spec.batch_size)
        yield Batch(ids=ids, labels=(noisy > 0).astype(np.float32))

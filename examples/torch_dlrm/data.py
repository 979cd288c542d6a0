"""Criteo columns (the embedding pipeline's cache) as batches for the DLRM: 13 dense
features and 26 jagged categorical features, one PS table each.

A categorical value becomes a one-id bag of its field's table; an empty value (the
loader's per-field "missing" id) becomes an empty bag, so the offsets are truly jagged; an
empty bag pools to zeros in either mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..embedding_pipeline.criteo import MISSING, NUM_CAT, Chunk, hash_categorical
from .service import SparseBatch

TABLES = tuple(f"C{i + 1}" for i in range(NUM_CAT))

# The id the loader gives an empty value of each field.
MISSING_IDS = hash_categorical(np.full((1, NUM_CAT), MISSING, dtype=np.uint64))[0]


def jagged(ids: np.ndarray, keep_missing: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``ids [n, 26]`` -> ``{table: (values, offsets)}``; empty values dropped unless
    ``keep_missing``."""
    n = len(ids)
    out = {}
    for f, name in enumerate(TABLES):
        column = np.ascontiguousarray(ids[:, f])
        if keep_missing:
            out[name] = (column, np.arange(n, dtype=np.int64))
            continue
        present = column != MISSING_IDS[f]
        offsets = np.zeros(n, dtype=np.int64)
        np.cumsum(present[:-1], out=offsets[1:])
        out[name] = (column[present], offsets)
    return out


def to_batch(chunk: Chunk, keep_missing: bool = False) -> SparseBatch:
    return SparseBatch(jagged(chunk.ids, keep_missing), dense=np.ascontiguousarray(chunk.dense),
                       labels=np.ascontiguousarray(chunk.labels))


def batches(data: Any, batch_size: int, steps: int, keep_missing: bool = False, *, worker: int = 0,
            workers: int = 1) -> Iterator[SparseBatch]:
    """Worker ``worker``'s share (of ``workers`` equal ones) of each of the first ``steps``
    batches of ``data`` (anything with ``rows``, e.g. ``Columns``)."""
    share = batch_size // workers
    for t in range(steps):
        start = t * batch_size + worker * share
        yield to_batch(data.rows(start, start + share), keep_missing)


def vocabulary(*datasets: Any, keep_missing: bool = False) -> list[np.ndarray]:
    """Each table's ids over ``datasets`` (whole ``Columns``), sorted: the rows a local
    reference model needs."""
    out = []
    for f in range(NUM_CAT):
        ids = np.unique(np.concatenate([np.asarray(d.ids[:, f]) for d in datasets]))
        out.append(ids if keep_missing else ids[ids != MISSING_IDS[f]])
    return out

"""The sequential reference: one process, one table, no rvz, no overlap.

Step t: look up the batch's unique ids, dense forward/backward, dense Adam step, sparse
update. This is what staleness 0 with one worker must reproduce bit for bit
(``--reference`` in the CLI compares the loss digests). The tests check the same property
against their own, separately written loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..param_server import SGD, Adagrad, Adam, EmbeddingTable, Ftrl
from ..param_server.launch import PSConfig
from .criteo import NUM_CAT
from .model import MLP
from .trainer import RunResult, TrainConfig, num_steps, sum_by_unique

OPTIMIZERS = {"sgd": SGD, "adagrad": Adagrad, "adam": Adam, "ftrl": Ftrl}


def reference_table(ps: PSConfig) -> EmbeddingTable:
    opt = OPTIMIZERS[ps.optimizer]
    return EmbeddingTable(ps.dim, opt() if ps.lr is None else opt(ps.lr), ps.initializer, ps.seed,
                          init_std=ps.init_std)


def sequential(data: Any, cfg: TrainConfig, ps: PSConfig) -> RunResult:
    """Train on ``data`` (anything with ``rows``) one step after the other."""
    table = reference_table(ps)
    model = MLP(NUM_CAT * ps.dim + data.dense.shape[1], list(cfg.hidden), lr=cfg.dense_lr, seed=cfg.seed)
    result = RunResult(worker=0, staleness=0, workers=1)
    for t in range(num_steps(len(data), cfg)):
        batch = data.rows(t * cfg.global_batch, (t + 1) * cfg.global_batch)
        unique, inverse = np.unique(batch.ids.reshape(-1), return_inverse=True)
        emb = table.lookup(unique)[inverse.reshape(batch.ids.shape)]
        x = np.concatenate([emb.reshape(len(emb), -1), batch.dense], axis=1)
        loss, dx, grads = model.forward_backward(x, batch.labels, cfg.global_batch)
        grads, loss = model.unflatten(model.flatten(grads, loss))
        model.apply(grads)
        demb = dx[:, :NUM_CAT * ps.dim].reshape(emb.shape)
        table.apply_gradients(unique, sum_by_unique(demb, inverse, len(unique)))
        result.losses.append(loss)
    result.steps = len(result.losses)
    return result

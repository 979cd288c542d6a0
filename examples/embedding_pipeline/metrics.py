"""Held-out metrics: exact AUC by ranks (ties share their average rank) and logloss."""

from __future__ import annotations

import numpy as np


def average_ranks(scores: np.ndarray) -> np.ndarray:
    """1-based ranks of ``scores``; tied scores all get the mean of the ranks they span."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # Start of each run of equal scores, in sorted order.
    starts = np.flatnonzero(np.concatenate([[True], sorted_scores[1:] != sorted_scores[:-1]]))
    ends = np.concatenate([starts[1:], [len(scores)]])
    mean_rank = (starts + 1 + ends) / 2.0          # mean of ranks starts+1 .. ends
    run_of = np.repeat(np.arange(len(starts)), ends - starts)
    ranks = np.empty(len(scores), dtype=np.float64)
    ranks[order] = mean_rank[run_of]
    return ranks


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve, exactly: the probability that a random positive scores above
    a random negative, ties counting one half (Mann-Whitney U / (P N))."""
    labels = np.asarray(labels).reshape(-1) > 0.5
    pos = int(labels.sum())
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    ranks = average_ranks(scores)
    u = float(ranks[labels].sum()) - pos * (pos + 1) / 2.0
    return u / (pos * neg)


def logloss(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of ``sigmoid(logits)`` against ``labels``, computed from the
    logits so that confident predictions neither overflow nor round to log(0)."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    return float(np.mean(np.logaddexp(0.0, z) - y * z))

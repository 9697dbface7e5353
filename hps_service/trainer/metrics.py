"""Ranking and calibration metrics in NumPy: AUC with tied scores, log-loss, and the expected AUC of a probability."""

from __future__ import annotations

import numpy as np

from hps_service.errors import InvalidArgumentError


def _average_ranks(scores: np.ndarray) -> np.ndarray:
    """1-based ranks of ``scores`` with tied values sharing their mean rank."""
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], sorted_scores.size]
    mean_rank = 0.5 * (starts + ends + 1)  # mean of 1-based ranks starts+1 .. ends
    group = np.repeat(np.arange(starts.size), ends - starts)
    ranks = np.empty(scores.size, dtype=np.float64)
    ranks[order] = mean_rank[group]
    return ranks


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U), ties counted as one half."""
    scores = np.asarray(scores, dtype=np.float64).ravel()
    labels = np.asarray(labels).ravel()
    if scores.shape != labels.shape:
        raise InvalidArgumentError(f"auc: {scores.size} scores but {labels.size} labels")
    positive = labels > 0.5
    n_pos = int(positive.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise InvalidArgumentError("auc needs both positive and negative labels")
    ranks = _average_ranks(scores)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(prob: np.ndarray, labels: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities ``prob`` against 0/1 ``labels``."""
    p = np.clip(np.asarray(prob, dtype=np.float64).ravel(), eps, 1.0 - eps)
    y = np.asarray(labels, dtype=np.float64).ravel()
    if p.shape != y.shape:
        raise InvalidArgumentError(f"log_loss: {p.size} probabilities but {y.size} labels")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log(1.0 - p)))


def expected_auc(prob: np.ndarray) -> float:
    """AUC that scoring by ``prob`` achieves in expectation when labels are drawn from ``prob`` itself."""
    p = np.sort(np.asarray(prob, dtype=np.float64).ravel())
    neg = 1.0 - p
    neg_below = np.cumsum(neg) - neg
    pairs = p.sum() * neg.sum() - np.sum(p * neg)
    return float(np.sum(p * neg_below) / pairs)

"""Progressive validation: every batch is scored before the model trains on it, and the scores are the metric.

This is how online CTR models are judged (McMahan et al., "Ad Click Prediction: a View from the Trenches"): no
sample is scored by a model that has seen it, and the score tracks the model as the data moves. Reported: rolling
AUC and log-loss over the last ``window`` samples (exact, from a ring buffer), the AUC and log-loss over every
sample scored (from 2^16 bins of the logit, so a run without an end holds bounded memory; the binned AUC is
within about 1e-4 of the exact one), per day when the samples carry a time, and the same for the oracle's
probabilities where the data has them (the planted teacher).
"""

from __future__ import annotations

from typing import Any, TypedDict

import numpy as np

from hps_service.trainer.metrics import auc, log_loss

_BINS = 1 << 16
_LOGIT_RANGE = 16.0
_EPS = 1e-7


class Rolling(TypedDict):
    """Quality over the last ``window`` samples (None where it is not defined yet, or the data has no oracle)."""

    samples: int
    auc: float | None
    log_loss: float | None
    oracle_auc: float | None
    oracle_log_loss: float | None


def _bin(prob: np.ndarray) -> np.ndarray:
    p = np.clip(prob.astype(np.float64), _EPS, 1.0 - _EPS)
    logit = np.log(p) - np.log1p(-p)
    scaled = (logit + _LOGIT_RANGE) * (_BINS / (2 * _LOGIT_RANGE))
    return np.clip(scaled.astype(np.int64), 0, _BINS - 1)


class BinnedAUC:
    """AUC and log-loss of a stream of (probability, label) pairs in bounded memory."""

    def __init__(self) -> None:
        self.pos = np.zeros(_BINS, dtype=np.int64)
        self.neg = np.zeros(_BINS, dtype=np.int64)
        self.loss_sum = 0.0
        self.count = 0

    def add(self, prob: np.ndarray, labels: np.ndarray) -> None:
        bins = _bin(prob)
        positive = labels > 0.5
        self.pos += np.bincount(bins[positive], minlength=_BINS)
        self.neg += np.bincount(bins[~positive], minlength=_BINS)
        p = np.clip(prob.astype(np.float64), _EPS, 1.0 - _EPS)
        self.loss_sum += float(-np.sum(np.where(positive, np.log(p), np.log1p(-p))))
        self.count += int(prob.size)

    def auc(self) -> float | None:
        """Mann-Whitney over the bins (pairs in one bin count one half); None without both labels."""
        n_pos, n_neg = int(self.pos.sum()), int(self.neg.sum())
        if not n_pos or not n_neg:
            return None
        neg_below = np.cumsum(self.neg) - self.neg
        wins = np.sum(self.pos * (neg_below + 0.5 * self.neg))
        return float(wins / (n_pos * n_neg))

    def log_loss(self) -> float | None:
        return self.loss_sum / self.count if self.count else None


class ProgressiveMetrics:
    """Scores of samples taken before training on them: rolling, overall, per day, and the oracle's alike."""

    def __init__(self, window: int = 100_000) -> None:
        self.window = window
        self._prob = np.zeros(window, dtype=np.float64)
        self._labels = np.zeros(window, dtype=np.float32)
        self._oracle = np.full(window, np.nan)
        self._filled = 0
        self._at = 0
        self.overall = BinnedAUC()
        self.oracle_overall = BinnedAUC()
        self.days: dict[str, BinnedAUC] = {}

    @property
    def samples(self) -> int:
        return self.overall.count

    def add(self, prob: np.ndarray, labels: np.ndarray, oracle: np.ndarray | None = None,
            time: np.ndarray | None = None) -> None:
        """Record one batch's scores (taken before its training step) with its labels."""
        prob = np.asarray(prob, dtype=np.float64).ravel()
        labels = np.asarray(labels, dtype=np.float32).ravel()
        self.overall.add(prob, labels)
        if oracle is not None:
            self.oracle_overall.add(oracle, labels)
        if time is not None:
            day = np.asarray(time, dtype="datetime64[s]").astype("datetime64[D]")
            for d in np.unique(day):
                mask = day == d
                self.days.setdefault(str(d), BinnedAUC()).add(prob[mask], labels[mask])
        take = min(prob.size, self.window)
        idx = (self._at + np.arange(take)) % self.window
        self._prob[idx], self._labels[idx] = prob[-take:], labels[-take:]
        self._oracle[idx] = np.nan if oracle is None else np.asarray(oracle, dtype=np.float64).ravel()[-take:]
        self._at = int((self._at + take) % self.window)
        self._filled = min(self.window, self._filled + take)

    def rolling(self) -> Rolling:
        """AUC and log-loss over the last ``window`` samples, and the oracle's on the same samples."""
        prob, labels, oracle = self._prob[: self._filled], self._labels[: self._filled], self._oracle[: self._filled]
        both = self._filled and 0 < labels.sum() < self._filled
        has_oracle = both and not np.isnan(oracle).any()
        return {
            "samples": int(self._filled),
            "auc": auc(prob, labels) if both else None,
            "log_loss": log_loss(prob, labels) if self._filled else None,
            "oracle_auc": auc(oracle, labels) if has_oracle else None,
            "oracle_log_loss": log_loss(oracle, labels) if has_oracle else None,
        }

    def report(self) -> dict[str, Any]:
        """Everything, as the metrics JSON carries it."""
        return {
            "window": self.window,
            "rolling": self.rolling(),
            "overall": {"samples": self.overall.count, "auc": self.overall.auc(), "log_loss": self.overall.log_loss(),
                        "oracle_auc": self.oracle_overall.auc(), "oracle_log_loss": self.oracle_overall.log_loss()},
            "per_day": {d: {"samples": m.count, "auc": m.auc(), "log_loss": m.log_loss()}
                        for d, m in sorted(self.days.items())},
        }

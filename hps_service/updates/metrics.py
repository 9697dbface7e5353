"""Freshness and ingest metrics of the update consumer: Prometheus series plus an in-process view for /v1/stats."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

UPDATE_LAG = Histogram(
    "hps_update_lag_seconds",
    "End-to-end update lag: time the rows were applied to every tier minus the producer's timestamp, per model",
    ["model"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
APPLIED_ROWS = Counter(
    "hps_updates_applied_rows_total", "Rows (puts and deletes) applied from the update topic", ["model", "table"]
)
MALFORMED = Counter("hps_updates_malformed_total", "Update messages sent to the dead-letter topic", ["model"])
CONSUMER_LAG = Gauge(
    "hps_consumer_lag_messages", "Messages in the partition not yet applied (high watermark - position)",
    ["topic", "partition"],
)
LAST_VERSION = Gauge("hps_update_last_version", "Highest row version applied", ["model", "table"])
UPDATE_STALLED = Gauge(
    "hps_update_stalled", "1 while messages wait on the topic and none was applied for updates.stall_after_s",
    ["topic"],
)
SINCE_LAST_APPLIED = Gauge(
    "hps_update_since_last_applied_seconds",
    "Seconds since the partition's last applied message while messages wait on it (0 when caught up)",
    ["topic", "partition"],
)


class FreshnessStats:
    """What one consumer has applied: lag samples (percentiles), rows/s, last versions, malformed counts."""

    def __init__(self, window: int = 65536, rate_window_s: float = 10.0) -> None:
        self._lock = threading.Lock()
        self._lags = np.zeros(window, dtype=np.float64)
        self._n_lags = 0
        self._rate_window_s = rate_window_s
        self._applied: deque[tuple[float, int]] = deque()
        self.rows_total = 0
        self.rows_received = 0
        self.messages_total = 0
        self.batches_total = 0
        self.malformed: dict[str, int] = {}
        self.last_version: dict[str, int] = {}
        self.consumer_lag: dict[str, int] = {}
        self.commit_failures = 0
        self.apply_failures = 0
        self.reconnects = 0

    @staticmethod
    def expect(models: Sequence[str]) -> None:
        """Export the per-model counters at 0 for ``models`` before anything happens to them, so a dashboard's
        rate() sees their first increment and shows 0, not No data, while nothing is malformed."""
        for model in models:
            MALFORMED.labels(model)

    def record_lags(self, lags_s: np.ndarray, model: str) -> None:
        """Record end-to-end lag samples (seconds) of ``model``, one per applied message."""
        histogram = UPDATE_LAG.labels(model)
        for lag in lags_s:
            histogram.observe(float(lag))
        with self._lock:
            size = self._lags.shape[0]
            lags = lags_s[-size:]
            pos = self._n_lags % size
            end = pos + lags.shape[0]
            if end <= size:
                self._lags[pos:end] = lags
            else:
                first = size - pos
                self._lags[pos:] = lags[:first]
                self._lags[: end - size] = lags[first:]
            self._n_lags += lags.shape[0]

    def record_applied(self, model: str, table: str, rows: int, received: int, max_version: int | None) -> None:
        """Count rows applied to one table (after keeping the latest per key of a batch) and remember its
        highest version; ``received`` counts every row and tombstone the batch carried."""
        APPLIED_ROWS.labels(model, table).inc(rows)
        key = f"{model}.{table}"
        with self._lock:
            self.rows_total += rows
            self.rows_received += received
            now = time.monotonic()
            self._applied.append((now, rows))
            while self._applied[0][0] < now - self._rate_window_s:  # bounded without /v1/stats being read
                self._applied.popleft()
            if max_version is not None and max_version > self.last_version.get(key, -1):
                self.last_version[key] = max_version
                LAST_VERSION.labels(model, table).set(max_version)

    def record_malformed(self, model: str) -> None:
        MALFORMED.labels(model).inc()
        with self._lock:
            self.malformed[model] = self.malformed.get(model, 0) + 1

    def record_consumer_lag(self, topic: str, partition: int, lag: int) -> None:
        CONSUMER_LAG.labels(topic, str(partition)).set(lag)
        with self._lock:
            self.consumer_lag[f"{topic}[{partition}]"] = lag

    def forget_partitions(self, partitions: list[tuple[str, int]]) -> None:
        """Drop the lag of ``(topic, partition)`` pairs no longer consumed (their model was unloaded)."""
        with self._lock:
            for topic, partition in partitions:
                if self.consumer_lag.pop(f"{topic}[{partition}]", None) is not None:
                    CONSUMER_LAG.remove(topic, str(partition))

    def lag_percentiles(self, qs: tuple[float, ...] = (50, 90, 99)) -> dict[str, float | None]:
        """Percentiles (seconds) of the most recent lag samples; None before any sample."""
        with self._lock:
            n = min(self._n_lags, self._lags.shape[0])
            sample = self._lags[:n].copy()
        if n == 0:
            return {f"p{q:g}": None for q in qs}
        values = np.percentile(sample, qs)
        return {f"p{q:g}": float(v) for q, v in zip(qs, values)}

    def rows_per_second(self) -> float:
        """Rows applied per second over the last ``rate_window_s`` seconds."""
        now = time.monotonic()
        with self._lock:
            while self._applied and self._applied[0][0] < now - self._rate_window_s:
                self._applied.popleft()
            rows = sum(r for _, r in self._applied)
        return rows / self._rate_window_s

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready view for /v1/stats."""
        lag = self.lag_percentiles()
        rate = self.rows_per_second()
        with self._lock:
            return {
                "rows_applied": self.rows_total,
                "rows_received": self.rows_received,
                "messages_applied": self.messages_total,
                "batches_applied": self.batches_total,
                "malformed": dict(self.malformed),
                "last_version": dict(self.last_version),
                "consumer_lag": dict(self.consumer_lag),
                "lag_samples": min(self._n_lags, self._lags.shape[0]),
                "commit_failures": self.commit_failures,
                "apply_failures": self.apply_failures,
                "reconnects": self.reconnects,
                "end_to_end_lag_s": lag,
                "rows_per_s": rate,
            }

"""Polls the server's ``GET /v1/stats`` during a run and turns the counters into hit rates per tier: over the
measured window, and per polling interval (the hit rate over time)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

TIERS = ("cache", "volatile", "persistent")


def fetch_stats(http_target: str, timeout: float = 5.0) -> dict[str, Any] | None:
    """The ``/v1/stats`` document of ``host:port``, or None when it cannot be had."""
    try:
        with urllib.request.urlopen(f"http://{http_target}/v1/stats", timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def tier_counters(stats: dict[str, Any], model: str, tables: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """(hits, misses) per tier, summed over ``tables`` of ``model``; tiers that are disabled are left out."""
    out: dict[str, tuple[int, int]] = {}
    model_stats = stats.get("models", {}).get(model, {}).get("tables", {})
    for tier in TIERS:
        hits = misses = 0
        enabled = False
        for table in tables:
            entry = model_stats.get(table, {}).get(tier)
            if entry is None or entry.get("enabled") is False:
                continue
            enabled = True
            hits += int(entry.get("hits", 0))
            misses += int(entry.get("misses", 0))
        if enabled:
            out[tier] = (hits, misses)
    return out


def hit_rates(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, float | None]:
    """Hit rate per tier between two counter snapshots (None where the tier saw no lookups)."""
    rates: dict[str, float | None] = {}
    for tier, (hits, misses) in after.items():
        h0, m0 = before.get(tier, (0, 0))
        dh, dm = hits - h0, misses - m0
        rates[tier] = dh / (dh + dm) if dh + dm > 0 else None
    return rates


@dataclass
class StatsPoller:
    """Background thread sampling the tier counters every ``interval_s`` (monotonic time, counters)."""

    http_target: str
    model: str
    tables: tuple[str, ...]
    interval_s: float = 0.5
    samples: list[tuple[float, dict[str, tuple[int, int]]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _sample(self) -> None:
        stats = fetch_stats(self.http_target)
        if stats is not None:
            self.samples.append((time.monotonic(), tier_counters(stats, self.model, self.tables)))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> StatsPoller:
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="stats-poller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    @property
    def reachable(self) -> bool:
        return bool(self.samples)

    def window(self, t_from: float, t_to: float) -> dict[str, float | None] | None:
        """Hit rate per tier between the last sample at or before ``t_from`` and the first at or after ``t_to``."""
        if len(self.samples) < 2:
            return None
        before = next((s for s in reversed(self.samples) if s[0] <= t_from), self.samples[0])
        after = next((s for s in self.samples if s[0] >= t_to), self.samples[-1])
        return hit_rates(before[1], after[1])

    def timeline(self, t0: float) -> list[dict[str, Any]]:
        """Per polling interval: its end (s after ``t0``) and the hit rate per tier within it."""
        return [
            {"t": round(b[0] - t0, 3), "hit_rate": hit_rates(a[1], b[1])}
            for a, b in zip(self.samples, self.samples[1:])
        ]

"""Per-thread hit/miss counters: lock-free readers each add to their own, a scrape sums them.

Concurrent lookups incrementing one shared ``int`` lose counts (``+=`` is a read and a write); a lock on
the hit path would serialise readers. Each thread gets its own two-element list the first time it counts,
registered once under a lock; the sum over all lists is exact once the counting threads are done.
"""

from __future__ import annotations

import threading


class PerThreadCounts:
    """Hits and misses of lookups, each reading thread counting into its own slot."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[list[int]] = []

    def add(self, hits: int, misses: int) -> None:
        """Count one lookup's hits and misses for the calling thread."""
        try:
            counts = self._local.counts
        except AttributeError:
            counts = [0, 0]
            self._local.counts = counts
            with self._lock:
                self._all.append(counts)
        counts[0] += hits
        counts[1] += misses

    def totals(self) -> tuple[int, int]:
        """(hits, misses) summed over every thread that counted."""
        with self._lock:
            return sum(c[0] for c in self._all), sum(c[1] for c in self._all)

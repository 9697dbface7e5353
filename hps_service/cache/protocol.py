"""The seam between the lookup engine and the L1 embedding cache of one table.

The engine asks the L1 first, then the lower tiers for what it missed, and hands the rows it fetched
back with :meth:`TableCache.admit`; where and when they are inserted is the cache's decision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

#: Reads true rows for keys from the tiers below L1: ``fetch(keys) -> (n, dim) float32``.
FetchBelow = Callable[[np.ndarray], np.ndarray]


@runtime_checkable
class TableCache(Protocol):
    """L1 cache of one table, safe to call from many threads at once."""

    dim: int
    capacity: int

    def lookup(self, keys: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy cached rows of ``keys`` into ``out[i]`` where hit; return the (n,) bool hit mask."""

    def generation(self) -> int:
        """A change counter; read it before fetching below and pass it to :meth:`admit` as ``fetched_at``."""

    def admit(
        self, keys: np.ndarray, vectors: np.ndarray, batch_hit_rate: float, *, fetched_at: int | None = None
    ) -> None:
        """Offer rows fetched from lower tiers (unique keys); inline or deferred per hit_rate_threshold, and once
        the cache is full only for keys that have missed often enough lately (admit_after_misses).

        Rows of keys updated or deleted since ``fetched_at`` are left out, so L1 never keeps a stale row.
        """

    def update(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Online update: overwrite rows of keys that are cached, leave the others out."""

    def invalidate(self, keys: np.ndarray) -> None:
        """Drop keys from the cache (deletes)."""

    def clear(self) -> None:
        """Drop everything."""

    def stats(self) -> dict[str, float]:
        """At least: rows, capacity, evictions (hits and misses are counted by the engine)."""

    def close(self) -> None:
        """Stop background work; persist what warm start needs."""

"""The seam between the lookup engine and the L1 embedding cache of one table.

The engine asks the L1 first, then the lower tiers for what it missed, and hands the rows it fetched
back with :meth:`TableCache.admit`; where and when they are inserted is the cache's decision. Rows carry
their versions, and L1 never replaces a row with an older version (as L2 and L3 do not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from hps_service.cache.layout import CacheArrays

#: Reads true rows for keys from the tiers below L1: ``fetch(keys) -> ((n, dim) float32 rows, (n,) int64
#: versions, (n,) bool stored)``; rows not stored anywhere (``stored`` False) are the table default and are
#: never cached.
FetchBelow = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class HostShare:
    """A cache whose arrays are in host memory that other processes of a node map: the arrays, and how it keeps a
    shared integer at its change generation for them."""

    arrays: CacheArrays
    publish_generation_to: Callable[[np.ndarray, int], None]


@runtime_checkable
class TableCache(Protocol):
    """L1 cache of one table, safe to call from many threads at once."""

    dim: int
    capacity: int

    def lookup(self, keys: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy cached rows of ``keys`` into ``out[i]`` where hit; return the (n,) bool hit mask. Rows of misses
        are unspecified (the caller fills them)."""

    def generation(self) -> int:
        """A change counter; read it before fetching below and pass it to :meth:`admit` as ``fetched_at``."""

    def admit(
        self, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray, batch_hit_rate: float, *,
        fetched_at: int | None = None,
    ) -> None:
        """Offer rows fetched from lower tiers (unique keys) with their stored versions; inline or deferred per
        hit_rate_threshold, and once the cache is full only for keys that have missed often enough lately.

        Rows of keys updated or deleted since ``fetched_at`` are left out, and a cached row newer than the
        offered one is kept, so L1 never keeps a stale row.
        """

    def update(self, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray) -> None:
        """Online update: overwrite rows of keys that are cached and whose cached version is not newer."""

    def invalidate(self, keys: np.ndarray, versions: np.ndarray | None = None) -> None:
        """Deletes: with ``versions``, drop cached rows not newer than the delete; with None, drop the keys."""

    def clear(self) -> None:
        """Drop everything."""

    def stats(self) -> dict[str, float | str]:
        """At least: rows, capacity, evictions, backend, memory_bytes (from counters, never a scan)."""

    def close(self) -> None:
        """Stop background work; persist what warm start needs."""

    def hottest_keys(self) -> np.ndarray:
        """The cached keys, hottest first: what a warm start of this table, or of a new version of it, reads."""

    def host_share(self) -> HostShare | None:
        """What a node's workers map of this cache; None when they cannot (its arrays are in device memory, or this
        process only reads them)."""

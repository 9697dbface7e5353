"""One served table: its config, its L1 cache, its per-level counters and its log of admin deletes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hps_service.cache.change_log import ChangeLog
from hps_service.cache.protocol import TableCache
from hps_service.config import DefaultSpec
from hps_service.engine.levels import LEVELS
from hps_service.tiers.base import table_id


@dataclass
class TableCounters:
    """Hits and misses per level of one table (updated under the table's lock)."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LEVELS, 0))
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LEVELS, 0))
    defaults: int = 0


@dataclass
class ServedTable:
    """One table of a loaded model, with its L1 cache and counters."""

    model: str
    name: str
    dim: int
    default: DefaultSpec
    cache: TableCache | None = None
    counters: TableCounters = field(default_factory=TableCounters)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Keys of admin deletes (no version, so no tombstone), guarding L2 writes of rows read from L3 before them.
    unversioned_deletes: ChangeLog = field(default_factory=ChangeLog)

    @property
    def id(self) -> str:
        return table_id(self.model, self.name)

    def deleted_since(self, generation: int, keys: np.ndarray) -> np.ndarray:
        """Mask of ``keys`` removed by an admin delete after ``generation`` (all of them if the log forgot)."""
        with self.lock:
            changed = self.unversioned_deletes.changed_since(generation, keys)
        return np.ones(keys.shape[0], dtype=bool) if changed is None else changed

    def record_unversioned_delete(self, keys: np.ndarray) -> None:
        """Note an admin delete of ``keys`` (before any tier forgets them, so a read made earlier sees it)."""
        with self.lock:
            self.unversioned_deletes.record(keys)

    def count(self, level: str, hits: int, misses: int) -> None:
        with self.lock:
            self.counters.hits[level] += hits
            self.counters.misses[level] += misses

    def count_defaults(self, n: int) -> None:
        with self.lock:
            self.counters.defaults += n


#: Builds the L1 cache of a table, or None: ``factory(table, fetch_below, warm_keys)``.
CacheFactory = Callable[
    [ServedTable, Callable[[np.ndarray], np.ndarray], Callable[[int], np.ndarray] | None], TableCache | None
]

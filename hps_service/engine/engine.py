"""``LookupEngine``: the facade the server, the update consumer and the jobs call; it wires the registry, the read
and write paths, the preload and the outage repair together and owns their lifecycle."""

from __future__ import annotations

import logging

import numpy as np

from hps_service.config import ModelConfig
from hps_service.engine.levels import DEFAULT, LookupResult
from hps_service.engine.preload import Preloader
from hps_service.engine.read import Reader
from hps_service.engine.registry import ModelRegistry, close_tables, make_table
from hps_service.engine.repair import VolatileRepair
from hps_service.engine.stats import table_stats
from hps_service.engine.table import CacheFactory, ServedTable
from hps_service.engine.write import Writer
from hps_service.tiers.base import Tier

log = logging.getLogger(__name__)


class LookupEngine:
    """Answers batched lookups through the tier hierarchy and applies writes to every tier."""

    def __init__(
        self,
        volatile: Tier | None,
        persistent: Tier | None,
        cache_factory: CacheFactory | None = None,
        max_batch_keys: int = 65536,
        repair_interval_s: float = 0.5,
    ) -> None:
        self.volatile = volatile
        self.persistent = persistent
        self.cache_factory = cache_factory
        self.max_batch_keys = max_batch_keys
        self.registry = ModelRegistry()
        self.reader = Reader(volatile, persistent, max_batch_keys)
        self.writer = Writer(volatile, persistent)
        self.preloader = Preloader(volatile, persistent, self.registry.is_served)
        self.repairer: VolatileRepair | None = None
        if volatile is not None and persistent is not None:
            self.repairer = VolatileRepair(volatile, persistent, self._served_tables)
            self.repairer.start(repair_interval_s)

    # ---- models -------------------------------------------------------------------------------
    def register_model(self, model: ModelConfig) -> None:
        """Create the model's tables in every tier and build their L1 caches (replaces a loaded model)."""
        tiers = [tier for tier in (self.volatile, self.persistent) if tier is not None]
        tables = {
            tc.name: make_table(model.name, tc, tiers, self.cache_factory, self._fetch_for_cache, self.persistent)
            for tc in model.tables
        }
        old = self.registry.put(model, tables)
        if old:
            close_tables(old.values())
        log.info("model %s loaded: %s", model.name, ", ".join(f"{t.name}(dim {t.dim})" for t in model.tables))
        for t in tables.values():
            self.preloader.start(t)

    def unregister_model(self, name: str) -> None:
        """Stop serving a model (its stored rows stay in the tiers)."""
        close_tables(self.registry.remove(name).values())

    def models(self) -> list[ModelConfig]:
        return self.registry.models()

    def model(self, name: str) -> ModelConfig:
        return self.registry.model(name)

    def table(self, model: str, table: str) -> ServedTable:
        """The served table, or NotFoundError naming what is missing."""
        return self.registry.table(model, table)

    def _served_tables(self) -> list[ServedTable]:
        return [t for tables in self.registry.tables().values() for t in tables.values()]

    def _fetch_for_cache(self, t: ServedTable, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The L1's own reads below it (refresh, warm start): rows, versions and the stored mask (the cache's
        ``FetchBelow``), not counted as lookups."""
        got = self.reader.fetch_below(t, keys, count=False)
        return got.vectors, got.versions, got.sources != DEFAULT

    # ---- reads and writes ---------------------------------------------------------------------
    def lookup(self, model: str, table: str, keys: np.ndarray) -> LookupResult:
        """Rows of ``keys`` in request order (duplicates included) and the level that answered each."""
        return self.reader.lookup(self.table(model, table), keys)

    def apply_updates(
        self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray | int
    ) -> int:
        """Write rows to persistent (durable) -> volatile -> rows present in L1. Returns rows written.

        A stored row with a newer version is never replaced, so replays and lagging writers are harmless.
        """
        return self.writer.apply_updates(self.table(model, table), keys, vectors, versions)

    def apply_deletes(self, model: str, table: str, keys: np.ndarray, versions: np.ndarray | int | None = None) -> int:
        """Delete keys from every tier and the L1 cache. Returns how many live rows the lowest enabled tier held
        (see :meth:`Writer.apply_deletes` for versioned and admin deletes)."""
        return self.writer.apply_deletes(self.table(model, table), keys, versions)

    def purge_tombstones(self, model: str, table: str, below_version: int) -> dict[str, int]:
        """Remove the tombstones older than ``below_version`` from every tier; returns how many, per level."""
        return self.writer.purge_tombstones(self.table(model, table), below_version)

    def repair_volatile(self) -> int:
        """Rewrite from L3 the L2 rows whose writes missed a store node (see :class:`VolatileRepair`)."""
        assert self.repairer is not None
        return self.repairer.repair()

    # ---- stats and lifecycle ------------------------------------------------------------------
    def table_stats(self, model: str, table: str) -> dict[str, dict[str, float | int | None]]:
        """Per level: hits, misses, hit_rate, rows, capacity, evictions (+ errors for lower tiers)."""
        return table_stats(self.table(model, table), self.volatile, self.persistent)

    def stats(self) -> dict:
        """The ``/v1/stats`` shape: ``{"models": {M: {"tables": {T: {level: {...}}}}}}``."""
        return {
            "models": {
                m: {"tables": {name: table_stats(t, self.volatile, self.persistent) for name, t in tables.items()}}
                for m, tables in self.registry.tables().items()
            }
        }

    def healthy(self) -> dict[str, bool]:
        """Reachability of each enabled tier."""
        out = {}
        if self.volatile is not None:
            out["volatile"] = self.volatile.healthy()
        if self.persistent is not None:
            out["persistent"] = self.persistent.healthy()
        return out

    def close(self) -> None:
        """Stop the repair and preload threads and the caches (saving warm-start snapshots), then close the tiers."""
        if self.repairer is not None:
            self.repairer.stop()
        self.preloader.stop()
        close_tables(self.registry.clear())
        for tier in (self.volatile, self.persistent):
            if tier is not None:
                tier.close()

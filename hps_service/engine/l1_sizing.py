"""How large a table's L1 cache is made and where its hot-key snapshot lives: one rule for every engine.

The rows are what the lower tiers hold when the table loads (a fractional ``cache.capacity`` never gives fewer than
``cache.min_rows``); the snapshot sits beside the RocksDB directory, as ``<persistent.path>.l1/<table>.hot.npy``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hps_service.cache import FetchBelow, TableCache, build_table_cache
from hps_service.cache.table_cache import WarmKeys
from hps_service.config import HPSConfig
from hps_service.engine.l1_choice import l1_enabled
from hps_service.engine.table import CacheFactory, ServedTable
from hps_service.tiers.base import Tier


@dataclass(frozen=True)
class L1Plan:
    """The rows a table's L1 is sized from and the file its hot keys are saved to (None without a persistent tier)."""

    rows: int
    snapshot: Path | None


def plan_l1(config: HPSConfig, table_id: str, tiers: Sequence[Tier | None], has_persistent: bool) -> L1Plan:
    """The L1 plan of table ``table_id`` given the tiers below it."""
    rows = max((tier.count(table_id) for tier in tiers if tier is not None), default=0)
    if isinstance(config.cache.capacity, float):
        rows = max(rows, int(np.ceil(config.cache.min_rows / config.cache.capacity)))
    snapshot = Path(f"{config.persistent.path}.l1") / f"{table_id}.hot.npy" if has_persistent else None
    return L1Plan(rows, snapshot)


def l1_cache_factory(config: HPSConfig, volatile: Tier | None, persistent: Tier | None) -> CacheFactory | None:
    """Builds each table's L1 cache in process memory (None where :func:`l1_enabled` says no L1)."""
    if not l1_enabled(config.cache, config.volatile):
        return None

    def factory(t: ServedTable, fetch_below: FetchBelow, warm_keys: WarmKeys | None) -> TableCache | None:
        plan = plan_l1(config, t.id, (volatile, persistent), persistent is not None)
        return build_table_cache(config.cache, t.format.words, plan.rows, fetch_below, warm_keys, plan.snapshot)

    return factory

"""Build the L1 cache of one table from the ``cache`` config section."""

from __future__ import annotations

import math
from pathlib import Path

from hps_service.cache.backend import resolve_backend
from hps_service.cache.protocol import FetchBelow, TableCache
from hps_service.cache.set_assoc import SetAssociativeCache, warm_up_kernels
from hps_service.cache.table_cache import SetAssocTableCache, WarmKeys
from hps_service.config import CacheConfig
from hps_service.errors import InvalidArgumentError


def capacity_rows(cfg: CacheConfig, table_rows: int) -> int:
    """Rows the cache holds: a float capacity is a fraction of ``table_rows``, an int a row count;
    rounded up to whole sets of ``cfg.ways`` (0 stays 0)."""
    if table_rows < 0:
        raise InvalidArgumentError(f"table_rows must be >= 0, got {table_rows}")
    rows = int(cfg.capacity * table_rows) if isinstance(cfg.capacity, float) else int(cfg.capacity)
    if rows <= 0:
        return 0
    return math.ceil(rows / cfg.ways) * cfg.ways


def build_table_cache(
    cfg: CacheConfig,
    dim: int,
    table_rows: int,
    fetch_below: FetchBelow,
    warm_keys: WarmKeys | None,
    snapshot_path: Path | None,
) -> TableCache | None:
    """The L1 cache of one table, or None when the cache is disabled or its capacity comes to 0 rows."""
    if not cfg.enabled:
        return None
    rows = capacity_rows(cfg, table_rows)
    if rows == 0:
        return None
    backend = resolve_backend(cfg.backend)
    if backend == "cuda":
        from hps_service.cache.device import DeviceCache

        cache: SetAssociativeCache | DeviceCache = DeviceCache(rows, dim, ways=cfg.ways, policy=cfg.policy)
        cache.warm_up()  # compiles the device kernels while the table loads, before the server says ready
    else:
        warm_up_kernels()
        cache = SetAssociativeCache(rows, dim, ways=cfg.ways, policy=cfg.policy)
    return SetAssocTableCache(
        cache,
        fetch_below,
        hit_rate_threshold=cfg.hit_rate_threshold,
        refresh_interval_s=cfg.refresh_interval_s,
        refresh_fraction=cfg.refresh_fraction,
        warm_keys=warm_keys if cfg.warm_start else None,
        snapshot_path=snapshot_path,
        warm_start=cfg.warm_start,
        admit_after_misses=cfg.admit_after_misses,
    )

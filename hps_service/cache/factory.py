"""Build the L1 cache of one table from the ``cache`` config section."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from hps_service.cache.backend import resolve_backend
from hps_service.cache.layout import Allocator, numpy_zeros
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
    alloc: Allocator = numpy_zeros,
) -> TableCache | None:
    """The L1 cache of one table, or None when the cache is disabled (``enabled: false``; the caller decides
    ``auto``: see :mod:`hps_service.cache.enabled`) or its capacity comes to 0 rows. ``alloc`` places the host
    cache's arrays (the node's shared store, for its worker processes to read)."""
    if cfg.enabled is False:
        return None
    rows = capacity_rows(cfg, table_rows)
    if rows == 0:
        return None
    backend = resolve_backend(cfg.backend)
    if backend == "cuda":
        from hps_service.cache.device import DeviceCache

        device = DeviceCache(rows, dim, ways=cfg.ways, policy=cfg.policy)
        device.warm_up()  # compiles the device kernels while the table loads, before the server says ready
        cache: SetAssociativeCache | DeviceCache = device
    else:
        warm_up_kernels()
        cache = SetAssociativeCache(rows, dim, ways=cfg.ways, policy=cfg.policy, alloc=alloc)
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


def _nothing_below(dim: int) -> FetchBelow:
    """A fetch from below that stores nothing: every row the default (zeros), version 0, not stored."""

    def fetch(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = keys.shape[0]
        return np.zeros((n, dim), np.float32), np.zeros(n, np.int64), np.zeros(n, np.bool_)

    return fetch


def warm_up_table_cache() -> None:
    """Compile (or load) what a table's NumPy L1 runs on the serving paths, with the argument types those pass:
    lookups of read-only keys (gRPC requests), admission into a full cache (the miss sketch), updates and deletes
    with read-only arrays (Kafka messages) and writable ones (REST); LRU and LFU. See hps_service.jit.warmup."""
    from hps_service.jit.warmup import read_only

    dim = 2
    for policy in ("lru", "lfu"):
        cfg = CacheConfig(backend="numpy", capacity=64, ways=8, policy=policy, admit_after_misses=2,
                          hit_rate_threshold=1.0, warm_start=False)
        cache = build_table_cache(cfg, dim, 0, _nothing_below(dim), None, None)
        assert cache is not None
        try:
            keys = np.arange(256, dtype=np.int64)
            rows = np.ones((256, dim), np.float32)
            versions = np.ones(256, np.int64)
            for _ in range(3):  # the third offer finds the cache full: admission by the miss sketch
                cache.admit(keys, rows, versions, 0.0)
            for variant in (np.asarray, read_only):
                cache.lookup(variant(keys), np.empty((256, dim), np.float32))
                cache.update(variant(keys), variant(rows), variant(versions + 1))
                cache.invalidate(variant(keys[:8]), variant(versions[:8] + 2))
                cache.invalidate(variant(keys[8:16]))
        finally:
            cache.close()

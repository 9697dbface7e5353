"""Build the configured tiers (imports are lazy so an unused backend costs nothing)."""

from __future__ import annotations

from hps_service.config import PersistentConfig, VolatileConfig
from hps_service.tiers.base import Tier


def build_volatile(cfg: VolatileConfig) -> Tier | None:
    """The L2 tier named by ``volatile.type``, or None when disabled."""
    if cfg.type == "hashmap":
        from hps_service.tiers.hashmap import HashMapTier

        return HashMapTier(
            capacity_rows=cfg.capacity_rows,
            overflow_policy=cfg.overflow_policy,
            evict_fraction=cfg.overflow_evict_fraction,
        )
    if cfg.type == "redis_cluster":
        from hps_service.tiers.redis_cluster import RedisClusterTier

        return RedisClusterTier(
            nodes=cfg.nodes,
            partitions=cfg.partitions,
            password=cfg.password.get_secret_value() if cfg.password else None,
            socket_timeout_s=cfg.socket_timeout_s,
            node_retry_after_s=cfg.node_retry_after_s,
        )
    return None


def build_persistent(cfg: PersistentConfig) -> Tier | None:
    """The L3 tier (RocksDB), or None when disabled."""
    if cfg.type == "rocksdb":
        from hps_service.tiers.rocksdb import RocksDBTier

        return RocksDBTier(
            path=cfg.path, read_only=cfg.read_only, block_cache_mb=cfg.block_cache_mb, sync_writes=cfg.sync_writes
        )
    return None

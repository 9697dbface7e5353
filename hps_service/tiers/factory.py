"""Build the configured tiers (imports are lazy so an unused backend costs nothing)."""

from __future__ import annotations

import logging
from typing import Any

from hps_service.config import PersistentConfig, VolatileConfig
from hps_service.errors import UnavailableError
from hps_service.tiers.base import Tier

log = logging.getLogger(__name__)


def build_volatile(cfg: VolatileConfig, placement: tuple[Any, Any] | None = None) -> Tier | None:
    """The L2 tier named by ``volatile.type``, or None when disabled. ``placement``: (allocator, release) for the
    hash map's arrays (the node's shared store), else private memory."""
    if cfg.type == "hashmap":
        from hps_service.tiers.hashmap.tier import HashMapTier

        extra = {"allocator": placement[0], "release": placement[1]} if placement is not None else {}
        return HashMapTier(
            capacity_rows=cfg.capacity_rows,
            capacity_bytes=cfg.capacity_mb << 20 if cfg.capacity_mb is not None else None,
            overflow_policy=cfg.overflow_policy,
            evict_fraction=cfg.overflow_evict_fraction,
            **extra,
        )
    if cfg.type == "redis_cluster":
        return _redis_cluster(cfg)
    return None


def _redis_cluster(cfg: VolatileConfig) -> Tier:
    """The Redis Cluster tier; when no node answers at start, a DeferredTier that connects in the background."""
    from redis.exceptions import RedisClusterException, RedisError

    from hps_service.tiers.deferred import DeferredTier
    from hps_service.tiers.redis import RedisClusterTier

    def connect() -> Tier:
        return RedisClusterTier(
            nodes=cfg.nodes,
            partitions=cfg.partitions,
            password=cfg.password.get_secret_value() if cfg.password else None,
            socket_timeout_s=cfg.socket_timeout_s,
            node_retry_after_s=cfg.node_retry_after_s,
            **redis_security_options(cfg),
        )

    try:
        return connect()
    except (UnavailableError, RedisClusterException, RedisError) as exc:
        log.warning("volatile tier starts degraded (lookups fall through to the persistent tier): %s", exc)
        what = f"Redis Cluster at {', '.join(cfg.nodes)}"
        return DeferredTier(connect, kind="volatile", what=what, retry_after_s=max(cfg.node_retry_after_s, 0.1))


def redis_security_options(cfg: VolatileConfig) -> dict[str, Any]:
    """AUTH user and TLS settings for RedisClusterTier (only those that are set, so defaults stay redis-py's)."""
    options: dict[str, Any] = {}
    if cfg.username:
        options["username"] = cfg.username
    if cfg.tls:
        options["ssl"] = True
        if cfg.ca_file is not None:
            options["ssl_ca_certs"] = str(cfg.ca_file)
    return options


def build_persistent(cfg: PersistentConfig, on_write: Any | None = None, file_events: Any | None = None
                     ) -> Tier | None:
    """The L3 tier (RocksDB), or None when disabled; ``on_write(table, keys)`` after each write batch,
    ``file_events`` around the file changes its readers' secondary instances must know of."""
    if cfg.type == "rocksdb":
        from hps_service.tiers.rocksdb.tier import RocksDBTier

        return RocksDBTier(
            path=cfg.path, read_only=cfg.read_only, block_cache_mb=cfg.block_cache_mb, sync_writes=cfg.sync_writes,
            max_total_wal_mb=cfg.max_total_wal_mb, write_buffer_mb=cfg.write_buffer_mb, on_write=on_write,
            file_events=file_events,
        )
    return None


def open_tiers(volatile: VolatileConfig, persistent: PersistentConfig, placement: tuple[Any, Any] | None = None,
               on_write: Any | None = None, file_events: Any | None = None) -> tuple[Tier | None, Tier | None]:
    """Both configured tiers, volatile first; a persistent tier that fails to open closes the volatile one."""
    l2 = build_volatile(volatile, placement)
    try:
        l3 = build_persistent(persistent, on_write=on_write, file_events=file_events)
    except Exception:
        if l2 is not None:
            l2.close()
        raise
    return l2, l3

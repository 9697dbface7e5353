"""The storage backends by config type (Feast's registry of online stores): one table that every process opens its
tiers from, the owner and a node's workers alike. A backend is its package under ``tiers/``, its config model in
:mod:`hps_service.config.tiers` and one line here. Imports are lazy: an unused backend costs nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hps_service.config.tiers import (
    HashMapVolatile,
    PersistentConfig,
    RedisClusterVolatile,
    VolatileConfig,
)
from hps_service.errors import UnavailableError
from hps_service.tiers.base import Tier
from hps_service.tiers.placement import Placement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VolatileBackend:
    """How a volatile backend opens, and where its rows live.

    ``open(config, placement)`` gives the tier of the process that writes it; ``placement`` (the node's shared store,
    for a backend whose rows are ``shared``) places its arrays where the node's workers map them. A ``shared``
    backend's rows are in this node's memory: a worker reads the owner's (lock-free) instead of opening its own. A
    backend that is not shared (a remote store) is opened by each worker with ``open`` too: its own client."""

    open: Callable[[Any, Placement | None], Tier]
    shared: bool


def _hashmap(cfg: HashMapVolatile, placement: Placement | None) -> Tier:
    from hps_service.tiers.hashmap.tier import HashMapTier

    capacity_bytes = cfg.capacity_mb << 20 if cfg.capacity_mb is not None else None
    if placement is None:
        return HashMapTier(cfg.capacity_rows, cfg.overflow_policy, cfg.overflow_evict_fraction,
                           capacity_bytes=capacity_bytes)
    placement.lfu = cfg.overflow_policy == "lfu"
    return HashMapTier(cfg.capacity_rows, cfg.overflow_policy, cfg.overflow_evict_fraction, placement.alloc,
                       placement.release, capacity_bytes)


def _redis_cluster(cfg: RedisClusterVolatile, placement: Placement | None) -> Tier:
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


def redis_security_options(cfg: RedisClusterVolatile) -> dict[str, Any]:
    """AUTH user and TLS settings for RedisClusterTier (only those that are set, so defaults stay redis-py's)."""
    options: dict[str, Any] = {}
    if cfg.username:
        options["username"] = cfg.username
    if cfg.tls:
        options["ssl"] = True
        if cfg.ca_file is not None:
            options["ssl_ca_certs"] = str(cfg.ca_file)
    return options


#: ``volatile.type`` -> its backend (``disabled``: none).
VOLATILE: dict[str, VolatileBackend] = {
    "hashmap": VolatileBackend(_hashmap, shared=True),
    "redis_cluster": VolatileBackend(_redis_cluster, shared=False),
}


def volatile_backend(cfg: VolatileConfig) -> VolatileBackend | None:
    """The backend ``volatile.type`` names (None: disabled)."""
    return VOLATILE.get(cfg.type)


def build_volatile(cfg: VolatileConfig, placement: Placement | None = None) -> Tier | None:
    """The L2 tier named by ``volatile.type``, or None when disabled."""
    backend = volatile_backend(cfg)
    return backend.open(cfg, placement) if backend is not None else None


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


def open_tiers(volatile: VolatileConfig, persistent: PersistentConfig, placement: Placement | None = None,
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

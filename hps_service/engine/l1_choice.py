"""Whether tables get an L1 cache: ``cache.enabled`` true or false as set; ``auto`` decides from where L1 would sit.

On the CPU, L1 in front of this node's hash map is a second host copy of the same rows in the same memory: every
miss probes twice, its rows are handed to the owner to admit, and each admission makes lock-free readers read again.
``auto`` turns it off there (as HugeCTR's HPS, whose CPU lookups go straight to its volatile database) and keeps it
where it is the only fast copy: on a GPU, or in front of a remote volatile tier (Redis Cluster) or none.
"""

from __future__ import annotations

import logging

from hps_service.cache.backend import resolve_backend
from hps_service.config import CacheConfig, VolatileConfig
from hps_service.tiers.registry import volatile_backend

log = logging.getLogger(__name__)


def l1_enabled(cache: CacheConfig, volatile: VolatileConfig) -> bool:
    """Whether each table gets an L1 (``auto``: see the module docstring; the choice is logged)."""
    if cache.enabled != "auto":
        return bool(cache.enabled)
    backend = volatile_backend(volatile)
    if backend is None or not backend.shared:
        log.info("cache.enabled auto: L1 on, in front of %s", "the persistent tier" if backend is None else
                 f"the remote volatile tier ({volatile.type})")
        return True
    if resolve_backend(cache.backend) == "cuda":
        log.info("cache.enabled auto: L1 on, in device memory in front of the hash map")
        return True
    log.info("cache.enabled auto: no L1 (it would be a second host copy of the hash map's rows): lookups read the "
             "hash map in one compiled pass; set cache.enabled true to keep one")
    return False

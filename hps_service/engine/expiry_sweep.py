"""The owner's sweeper of expired rows (``tables[].ttl_s``): removes rows older than their table's TTL from every
tier and L1.

Lookups already answer an expired row with the default (see :mod:`hps_service.engine.ttl`); the sweeper frees its
storage. Every ``SWEEP_INTERVAL_S`` it scans each TTL table's RocksDB column family a stretch at a time, each stretch
under the table's write lock (as a conversion copies one: :mod:`hps_service.engine.convert`), and deletes the
expired rows with *versioned* deletes at each row's own version (``Writer.apply_deletes``), so a write with a newer
version, whenever it lands, wins, and a replay of the expired write (same version) cannot bring it back. The
deletes leave tombstones at those versions, removed like any others by ``purge_tombstones``; a put of the key at the
same or an older version is refused until then.

This stands in for a RocksDB compaction filter, which would drop expired rows as compaction rewrites them at no
extra read: rocksdict (0.3.x) exposes none (its ``Options`` has no compaction-filter setter), and its
``AccessType.with_ttl`` is RocksDB's TTL database, which times a row by the local clock when it was put (a replica's
apply time, not the update message's) and covers the whole database, metadata included; neither fits.

Without RocksDB (the hash map or Redis alone) nothing is swept: expired rows stay until they are evicted, deleted or
written again, and lookups answer them as expired meanwhile.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import numpy as np

from hps_service.engine import ttl
from hps_service.engine.table import ServedTable
from hps_service.errors import HPSError
from hps_service.tiers.base import Tier, TierCapability, tier_can

if TYPE_CHECKING:
    from hps_service.engine.engine import LookupEngine

log = logging.getLogger(__name__)

#: Seconds between sweeps of every TTL table.
SWEEP_INTERVAL_S = 60.0
#: Entries read per stretch: one stretch holds the table's write lock for a few milliseconds.
STRETCH_ENTRIES = 2048


def sweepable(persistent: Tier | None) -> bool:
    """Whether ``persistent`` can be swept: it scans its entries in order and takes writes (RocksDB, writable)."""
    return tier_can(persistent, TierCapability.SCAN) and tier_can(persistent, TierCapability.WRITES)


class ExpirySweeper:
    """Sweeps the TTL tables of ``engine`` on a background thread (see the module docstring)."""

    def __init__(self, engine: LookupEngine) -> None:
        self.engine = engine
        self.removed = 0  # rows removed since start
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, interval_s: float = SWEEP_INTERVAL_S) -> None:
        """Sweep every ``interval_s`` seconds until :meth:`stop` (nothing without a sweepable persistent tier)."""
        if not sweepable(self.engine.persistent) or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="hps-expiry-sweep", daemon=True)
        self._thread.start()

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.sweep()
            except Exception:  # the next round retries; serving never depends on this thread
                log.warning("the sweep of expired rows failed", exc_info=True)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """End the thread (a stretch in progress finishes first); False if it still runs after ``timeout_s``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def sweep(self) -> int:
        """Sweep every served TTL table once; returns the rows removed."""
        removed = 0
        for tables in self.engine.registry.tables().values():
            for t in tables.values():
                if t.ttl_s is not None and not self._stop.is_set():
                    removed += self.sweep_table(t)
        return removed

    def sweep_table(self, t: ServedTable) -> int:
        """Delete ``t``'s expired rows from every tier and L1, a stretch of its RocksDB entries at a time; returns
        the rows removed. Stops early when the table is replaced or the engine closes."""
        tier = self.engine.persistent
        if tier is None or t.ttl_s is None or not sweepable(tier):
            return 0
        after: int | None = None
        removed = 0
        while not self._stop.is_set():
            try:
                with self.engine.writing(t.model, t.name) as current:
                    if current is not t:
                        break  # registered again (a conversion, a reload): the next sweep reads the new table
                    entries = tier.scan(t.id, after, STRETCH_ENTRIES)
                    rows = entries.vectors[entries.live]
                    if rows.shape[0]:
                        expired = ttl.expired_mask(t, rows)
                        if expired.any():
                            keys = entries.keys[entries.live][expired]
                            versions = np.ascontiguousarray(entries.versions[entries.live][expired])
                            removed += self.engine.writer.apply_deletes(t, keys, versions)
            except HPSError:  # the engine closed or the table is no longer served
                break
            n = int(entries.keys.shape[0])
            if n < STRETCH_ENTRIES:
                break
            after = int(entries.keys[-1])
        if removed:
            log.info("%d expired rows of %s removed (ttl_s %d)", removed, t.id, t.ttl_s)
        self.removed += removed
        return removed

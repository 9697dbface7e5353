"""Rewriting from L3 the L2 rows whose writes missed a store node (a Redis outage), in a background thread, so an
outage leaves no stale row behind."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from hps_service.engine.promote import copy_stored_rows
from hps_service.engine.table import ServedTable
from hps_service.tiers.base import Tier

log = logging.getLogger(__name__)

#: Keys per L3 read when rewriting L2 rows after an outage.
REPAIR_CHUNK = 65536


class VolatileRepair:
    """Takes the keys the volatile tier reports as missed writes and rewrites them from the persistent tier."""

    def __init__(self, volatile: Tier, persistent: Tier, tables: Callable[[], Iterable[ServedTable]]) -> None:
        self.volatile = volatile
        self.persistent = persistent
        self._tables = tables
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def repair(self) -> int:
        """Keys L3 holds get their current row (a versioned put, so a newer row written meanwhile wins); keys it
        does not hold are removed from L2. Writes that miss again are reported again and retried later."""
        repaired = 0
        for t in self._tables():
            keys = self.volatile.take_missed_writes(t.id)
            for start in range(0, keys.shape[0], REPAIR_CHUNK):
                chunk = keys[start : start + REPAIR_CHUNK]
                found = copy_stored_rows(self.volatile, self.persistent, t, chunk)
                if not found.all():
                    self.volatile.delete(t.id, chunk[~found])
                repaired += int(chunk.shape[0])
        if repaired:
            log.info("rewrote %d volatile-tier rows whose writes had missed a node", repaired)
        return repaired

    def start(self, interval_s: float) -> None:
        """Repair every ``interval_s`` seconds on a background thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="hps-l2-repair", daemon=True)
        self._thread.start()

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.repair()
            except Exception:  # the next round retries; serving never depends on this thread
                log.warning("volatile-tier repair failed", exc_info=True)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """End the thread; False if it is still running after ``timeout_s`` (the tiers must not close under it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

"""Filling an in-process volatile tier from RocksDB in the background when a model loads, for tables whose stored
rows all fit: after a start, lookups no longer read RocksDB until each row was asked for once (HugeCTR's HPS loads
its volatile database the same way)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from hps_service.engine.promote import copy_stored_rows, put_read_rows
from hps_service.engine.table import ServedTable
from hps_service.tiers.base import Tier, TierCapability

log = logging.getLogger(__name__)

#: Keys per L3 read when filling an in-process volatile tier at load.
PRELOAD_CHUNK = 65536
#: Entries per scan of a store that scans (each read holds the interpreter for a few milliseconds).
SCAN_CHUNK = 4096


class Preloader:
    """One background thread per table being preloaded; :meth:`stop` ends them all before the tiers close."""

    def __init__(self, volatile: Tier | None, persistent: Tier | None, is_served: Callable[[ServedTable], bool]) -> None:
        self.volatile = volatile
        self.persistent = persistent
        self._is_served = is_served
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        #: When the preload of each table (by tier id) ended (wall clock): a version is ready from then on.
        self.finished_at: dict[str, float] = {}

    def start(self, t: ServedTable) -> None:
        """Preload ``t`` in the background when the volatile tier is in process and the stored rows all fit; once
        every stored row is in, the table is complete (:mod:`hps_service.tiers.hashmap.complete`) unless something
        lost that meanwhile."""
        if self.volatile is None or self.persistent is None or not self.volatile.in_process:
            return
        token = self.volatile.complete_token(t.id)  # before any stored row is read
        stored = self.persistent.count(t.id)
        capacity = self.volatile.stats(t.id).capacity
        if stored == 0:
            self._complete(t, token)
            return
        if capacity is not None and stored > capacity:
            log.info("%s: %d stored rows exceed the volatile tier's %d; its rows load on demand", t.id, stored,
                     capacity)
            return
        if self.volatile.count(t.id) >= stored:  # filled as its rows were imported (a repository version's)
            self._complete(t, token)
            self.finished_at = {**self.finished_at, t.id: time.time()}
            return
        thread = threading.Thread(target=self._run, args=(t, stored, token), name=f"hps-preload-{t.id}",
                                  daemon=True)
        with self._lock:
            self._threads = [th for th in self._threads if th.is_alive()] + [thread]
        thread.start()

    def loading(self, table_id: str) -> bool:
        """Whether the preload of the table stored as ``table_id`` is still running."""
        with self._lock:
            return any(th.is_alive() and th.name == f"hps-preload-{table_id}" for th in self._threads)

    def _complete(self, t: ServedTable, token: int) -> None:
        """Mark ``t`` complete in the volatile tier, given the token taken before its stored rows were read, while
        no write of it runs and the tier holds at least as many live rows as the persistent tier."""
        assert self.volatile is not None and self.persistent is not None
        with t.guard.lock:
            if not self._is_served(t) or self.volatile.count(t.id) < self.persistent.count(t.id):
                return
            if self.volatile.mark_complete(t.id, token):
                log.info("%s is complete in the volatile tier: a key it does not hold answers the default without "
                         "a persistent read", t.id)

    def _run(self, t: ServedTable, stored: int, token: int) -> None:
        try:
            self._preload(t, stored, token)
        finally:
            self.finished_at = {**self.finished_at, t.id: time.time()}

    def _preload(self, t: ServedTable, stored: int, token: int) -> None:
        assert self.volatile is not None and self.persistent is not None
        started = time.monotonic()
        loaded = 0
        try:
            if TierCapability.SCAN in self.persistent.capabilities:
                loaded = self._scan(t)
                if self._stop.is_set() or not self._is_served(t):
                    return
            else:
                keys = self.persistent.scan_keys(t.id, stored)
                for lo in range(0, keys.shape[0], PRELOAD_CHUNK):
                    if self._stop.is_set() or not self._is_served(t):
                        return
                    found = copy_stored_rows(self.volatile, self.persistent, t, keys[lo : lo + PRELOAD_CHUNK])
                    loaded += int(np.count_nonzero(found))
        except Exception:  # rows then load on demand, as without a preload
            log.warning("preloading %s into the volatile tier stopped after %d rows", t.id, loaded, exc_info=True)
            return
        log.info("preloaded %d rows of %s into the volatile tier in %.1f s", loaded, t.id, time.monotonic() - started)
        if not self._stop.is_set():
            self._complete(t, token)

    def _scan(self, t: ServedTable) -> int:
        """Copy the stored rows into L2 a stretch of the store at a time, as the scan reads them (one read per row,
        and no call that holds the interpreter for the whole table while lookups are served); rows copied."""
        assert self.volatile is not None and self.persistent is not None
        after: int | None = None
        loaded = 0
        while not self._stop.is_set() and self._is_served(t):
            read_at = t.guard.generation
            entries = self.persistent.scan(t.id, after, SCAN_CHUNK)
            live = entries.live
            if live.any():
                put_read_rows(self.volatile, t, entries.keys[live], entries.vectors[live], entries.versions[live],
                              read_at, wait=True)
                loaded += int(np.count_nonzero(live))
            if entries.keys.shape[0] < SCAN_CHUNK:
                break
            after = int(entries.keys[-1])
        return loaded

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop every preload and wait for it (one chunk at most); False if one is still running after ``timeout_s``
        (the tiers must not close under it)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

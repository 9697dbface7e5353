"""The lookup engine of a gRPC worker process: the engine's read path over the node's shared store.

A worker answers lookups itself, with the same :class:`hps_service.engine.read.Reader` as the owner, from L1 and the
hash map in shared memory (lock-free) and RocksDB through a secondary instance (or Redis with its own client). It
never writes a tier: rows it found in L3 (promotions) and rows it offers to L1 (admissions) go to the owner through
its shared-memory queue. It counts into its own rows of the shared counters, which the owner sums for /v1/stats
and /metrics. The served models follow the owner's manifest, checked at every lookup (one shared integer).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from hps_service.config import HPSConfig, ModelConfig
from hps_service.engine.api import ReadEngine
from hps_service.engine.bags import BagReader, Bags
from hps_service.engine.levels import LookupResult
from hps_service.engine.read import Reader
from hps_service.engine.registry import find_table, not_loaded
from hps_service.engine.table import ServedTable
from hps_service.engine.versions import Labels, resolve
from hps_service.errors import NotFoundError, UnavailableError
from hps_service.node.reader_tiers import CaughtUpSecondary, SharedVolatile
from hps_service.node.shared_tables import StoreTable, table_over_store
from hps_service.node.store import layout
from hps_service.node.store.l3_events import l3_events
from hps_service.node.store.node_store import W_MANIFEST
from hps_service.node.store.view import StoreView, TableView
from hps_service.shm.changes import ChangeRing
from hps_service.shm.queue import record_bytes
from hps_service.tiers.base import ReadTier, TierCapability, tier_can, tier_health, tier_memory
from hps_service.tiers.registry import volatile_backend

log = logging.getLogger(__name__)

KIND_ADMIT, KIND_PROMOTE = 1, 2


class WorkerEngine(ReadEngine):
    """Lookups of one worker process over the shared store (see the module docstring)."""

    def __init__(self, config: HPSConfig, view: StoreView, worker: int, wake: Any | None = None) -> None:
        """``worker``: this worker's index (its counter rows are ``worker + 1``; the owner's are 0); ``wake``: a
        semaphore released when this worker's queue goes from empty to not empty."""
        self.config = config
        self.view = view
        self.worker = worker
        self.process = worker + 1
        self.max_batch_keys = config.server.max_batch_keys
        self._wake = wake
        self._ring = view.queue(worker)
        self._ring_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self.dropped = 0
        self._ring_by_table: dict[str, ChangeRing] = {}
        self._status = view.workers()[worker] if view.writable else None  # this worker's status row
        self._loaded = -1  # the manifest generation self._tables were built from
        backend = volatile_backend(config.volatile)
        # the owner's rows in this node's memory are read where they are; a remote store through a client of our own
        self.volatile: ReadTier | None = (None if backend is None else SharedVolatile(lambda: self.view)
                                          if backend.shared else backend.open(config.volatile, None))
        self.persistent: CaughtUpSecondary | None = None
        if config.persistent.type == "rocksdb":
            share = max(8, config.persistent.block_cache_mb // max(1, config.server.worker_processes()))
            self.persistent = CaughtUpSecondary(config.persistent, self._rings, share,
                                                epochs=lambda: l3_events(self.view.header))
        self._bags = BagReader()
        self.reader = Reader(self.volatile, self.persistent, self.max_batch_keys, promote=self._promote)
        self._models: dict[str, ModelConfig] = {}
        self._tables: dict[str, dict[str, StoreTable]] = {}
        self._labels = Labels()
        self._views: dict[int, TableView] = {}  # serial -> the table's arrays in the store
        self._load()

    # ---- the manifest -------------------------------------------------------------------------
    def _rings(self) -> dict[str, ChangeRing]:
        return self._ring_by_table

    def sync(self) -> None:
        """Follow the owner's manifest if it changed (models registered or unloaded). Compared with the manifest
        the tables were built from (not the one last read): a lookup while another thread loads waits for it."""
        if int(self.view.header[layout.H_MANIFEST]) != self._loaded:
            with self._sync_lock:
                while int(self.view.header[layout.H_MANIFEST]) != self._loaded:
                    try:
                        self._load()
                    except (FileNotFoundError, UnavailableError) as exc:
                        # the manifest read was superseded while its tables were mapped: a table it lists was freed
                        # (after a newer manifest left it out); the newer one is there to load
                        if int(self.view.header[layout.H_MANIFEST]) == self.view.manifest_gen:
                            raise UnavailableError(f"the store's manifest names a table whose arrays are gone: "
                                                   f"{exc}") from None

    def _load(self) -> None:
        view = self.view
        view.reload()
        manifest = view.manifest
        models = {mc.served_name: mc for mc in (ModelConfig.model_validate(m) for m in manifest["models"])}
        labels = Labels(manifest.get("labels", {}))
        tables: dict[str, dict[str, StoreTable]] = {}
        views: dict[int, TableView] = {}
        rings: dict[str, ChangeRing] = {}
        for name, mc in models.items():
            tables[name] = {}
            for tc in mc.tables:
                serial = view.served(name, tc.name)
                if serial is None:
                    continue
                old = self._tables.get(name, {}).get(tc.name)
                if old is not None and old.serial == serial:
                    t, tv = old, self._views[serial]
                else:
                    tv = view.table(serial)
                    t = table_over_store(view, serial, touch=True, offer=self._offer, process=self.process)
                    if self.volatile is not None and tier_can(self.volatile, TierCapability.WRITES):
                        self.volatile.create_table(t.id, t.format.words)  # this worker's own Redis client (not the hash map)
                tables[name][tc.name] = t
                views[serial] = tv
                rings[t.id] = tv.changes
        self._views = views
        self._ring_by_table = rings
        if self.persistent is not None and any(tid not in self.persistent.tables() for tid in rings):
            self.persistent.reopen()
        self._models, self._tables, self._labels = models, tables, labels
        self._loaded = view.manifest_gen
        if self._status is not None:
            self._status[W_MANIFEST] = self._loaded  # the owner waits for it before a registration returns

    # ---- lookups ------------------------------------------------------------------------------
    def table(self, model: str, table: str) -> StoreTable:
        """The served table, as the owner's manifest has it now (NotFoundError naming what is missing)."""
        self.sync()
        return find_table(self._tables, model, table)

    def lookup(self, model: str, table: str, keys: np.ndarray, out: np.ndarray | None = None,
               sources: np.ndarray | None = None, stored: bool = False) -> LookupResult:
        """Rows of ``keys`` in request order and the level that answered each (as ``LookupEngine.lookup``, which
        also reads a table again that a conversion moved while this read it)."""
        t = self.table(model, table)
        try:
            return self.reader.lookup(t, keys, out, sources, stored)
        except NotFoundError:
            current = self.table(model, table)
            if current is t:
                raise
            return self.reader.lookup(current, keys, out, sources, stored)

    def lookup_bags(self, model: str, table: str, keys: np.ndarray, bags: Bags, out: np.ndarray | None = None,
                    sources: np.ndarray | None = None) -> LookupResult:
        """One row per bag of ``keys``: their unique keys looked up as :meth:`lookup` does, then pooled (see
        :mod:`hps_service.engine.bags`)."""
        return self._bags.pool_table(self, model, table, keys, bags, out, sources)

    def resolve(self, model: str, version: int | None = None, label: str = "") -> tuple[str, int]:
        """The served name and version a lookup reads, by the labels of the owner's manifest now."""
        self.sync()
        return resolve(self._labels.current(), self._tables, model, version, label)

    def model(self, name: str) -> ModelConfig:
        self.sync()
        try:
            return self._models[name]
        except KeyError:
            raise not_loaded(name) from None

    def models(self) -> list[ModelConfig]:
        """The loaded models as clients name them (not their versions)."""
        self.sync()
        return [m for m in self._models.values() if not m.version]

    def memory_bytes(self) -> dict[str, int]:
        """This worker's RocksDB secondary's memtables and block cache, in bytes (zeros without RocksDB)."""
        return tier_memory(self.persistent)

    def healthy(self) -> dict[str, bool]:
        """Reachability of each enabled tier."""
        return tier_health(self.volatile, self.persistent)

    # ---- hand-offs to the owner ---------------------------------------------------------------
    def _push(self, kind: int, serial: int, generation: int, hit_rate: float, keys: np.ndarray,
              versions: np.ndarray, rows: np.ndarray) -> None:
        """Hand rows to the owner in records of at most a quarter of the queue each (the queue refuses a record
        of more than half its size, which would drop every row of a large batch); a full queue drops the rest."""
        per_record = max(1, (self._ring.size // 4 - record_bytes(0, 0)) // (16 + 4 * rows.shape[1]))
        with self._ring_lock:
            for lo in range(0, keys.shape[0], per_record):
                hi = lo + per_record
                was_empty = self._ring.empty()
                if not self._ring.push(kind, serial, generation, hit_rate, keys[lo:hi], versions[lo:hi], rows[lo:hi]):
                    self.dropped += 1
                    return
                if was_empty and self._wake is not None:
                    self._wake.release()  # the owner drains the first records while the next are written

    def _promote(self, t: ServedTable, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray,
                 read_at: int) -> None:
        """Rows this worker found in L3 go to the owner, which writes them into L2 as the engine does."""
        assert isinstance(t, StoreTable)
        if keys.shape[0]:
            self._push(KIND_PROMOTE, t.serial, read_at, 0.0, keys, versions, vectors)

    def _offer(self, t: StoreTable) -> Any:
        def offer(keys: np.ndarray, versions: np.ndarray, vectors: np.ndarray, hit_rate: float,
                  fetched_at: int) -> None:
            self._push(KIND_ADMIT, t.serial, fetched_at, hit_rate, keys, versions, vectors)

        return offer

    def close(self) -> None:
        for tier in (self.volatile, self.persistent):
            if tier is not None:
                tier.close()

"""``LookupEngine``: the facade the server, the update consumer and the jobs call; it wires the registry, the read
and write paths, the preload and the outage repair together and owns their lifecycle."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from hps_service.config import ModelConfig, TableConfig
from hps_service.config.base import served_name
from hps_service.engine import version_drop
from hps_service.engine.api import Engine
from hps_service.engine.bags import BagReader, Bags
from hps_service.engine.convert import ConvertProgress, check_conversion, convert_table
from hps_service.engine.expiry_sweep import ExpirySweeper
from hps_service.engine.ingest_admission import keep_counts
from hps_service.engine.levels import DEFAULT, LookupResult
from hps_service.engine.preload import Preloader
from hps_service.engine.promote import promoter
from hps_service.engine.read import Reader
from hps_service.engine.registry import (
    ModelRegistry,
    close_tables,
    described,
    drop_stored,
    drop_stored_ids,
    make_table,
    served_config,
)
from hps_service.engine.repair import VolatileRepair
from hps_service.engine.stats import TableStats, table_stats
from hps_service.engine.stored_tables import TableNames
from hps_service.engine.table import CacheFactory, ServedTable
from hps_service.engine.version_states import TableView, VersionStates, VersionView, view_of
from hps_service.engine.versions import Labels, check_label, load_labels, resolve, save_label, to_drop
from hps_service.engine.write import PreparedChange, PutCounts, TableChange, Writer, prepare_change
from hps_service.errors import (
    FailedPreconditionError,
    HPSError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from hps_service.tiers.base import Positions, Tier, WriteResult, tier_health, tier_memory

log = logging.getLogger(__name__)


class LookupEngine(Engine):
    """Answers batched lookups through the tier hierarchy and applies writes to every tier."""

    def __init__(
        self,
        volatile: Tier | None,
        persistent: Tier | None,
        cache_factory: CacheFactory | None = None,
        max_batch_keys: int = 65536,
        repair_interval_s: float = 0.5,
    ) -> None:
        self.volatile = volatile
        self.persistent = persistent
        self.cache_factory = cache_factory
        self.max_batch_keys = max_batch_keys
        self.registry = ModelRegistry()
        #: The tier id of each table, never reused (see :mod:`hps_service.engine.stored_tables`).
        self.names = TableNames(persistent)
        self.labels = Labels(load_labels(persistent))
        #: What each version is doing beyond its registration (importing, failed, draining) and where it came from.
        self.states = VersionStates(persistent)
        self.reader = Reader(volatile, persistent, max_batch_keys,
                             promoter(volatile) if volatile is not None else None)
        self.writer = Writer(volatile, persistent)
        self._bags = BagReader()
        self.preloader = Preloader(volatile, persistent, self.registry.is_served)
        self._closed = False
        self.repairer: VolatileRepair | None = None
        if volatile is not None and persistent is not None:
            self.repairer = VolatileRepair(volatile, persistent, self._served_tables)
            self.repairer.start(repair_interval_s)
        self.sweeper = ExpirySweeper(self)  # started by the first table with ttl_s
        #: Held across a label switch's or a version drop's check and act, so that neither sees the other half-done
        #: (a label pointed at a version being dropped).
        self._lifecycle = threading.RLock()

    # ---- models -------------------------------------------------------------------------------
    def register_model(self, model: ModelConfig) -> None:
        """Create the model's tables in every tier and build their L1 caches (replaces a loaded model).

        The write locks of the model's tables are held from before the new L1 caches exist until the new tables are
        served and every reader knows it (:meth:`_announce`), so every write lands entirely before (and is read by the
        caches' warm start) or entirely after (and reaches the new caches, whose change logs keep the rows read before
        it out, and which every reader reads).
        """
        tiers = [tier for tier in (self.volatile, self.persistent) if tier is not None]
        served = model.served_name
        guards = {tc.name: self.registry.guard(served, tc.name) for tc in model.tables}
        warm_from = self._serving_tables(model)
        old: dict[str, ServedTable] | None = None
        try:
            with ExitStack() as held:
                for name in sorted(guards):
                    held.enter_context(guards[name].lock)
                tables = {
                    tc.name: make_table(served, tc, guards[tc.name], tiers, self.cache_factory, self._fetch_for_cache,
                                        self.persistent, self.names, warm_from.get(tc.name))
                    for tc in model.tables
                }
                keep_counts(self.registry.tables().get(model.name, {}), tables)
                model = served_config(model, tables)
                old = self.registry.put(model, tables)
                self._announce(served)
        finally:
            if old:
                close_tables(old.values())
        if model.version:
            self.states.served(served, "")
        log.info("%s loaded: %s", described(served), ", ".join(f"{t.name}(dim {t.dim})" for t in model.tables))
        for t in tables.values():
            self.preloader.start(t)
        if any(t.ttl_s is not None for t in tables.values()):
            self.sweeper.start()

    def _announce(self, served: str) -> None:
        """Tell every other reader of the tiers that ``served``'s tables are new, before a write reaches them: called
        with their write locks held (nothing to tell in a single process; a node's owner tells its workers)."""

    def _serving_tables(self, model: ModelConfig) -> dict[str, ServedTable]:
        """For a new version: the tables of the version a request naming none reads now, by name, where they match
        (same dim), so that the new version's L1 warms from their hot keys. Empty for anything else."""
        try:
            current = self.registry.tables().get(self.resolve(model.name)[0], {}) if model.version else {}
        except NotFoundError:
            return {}
        return {tc.name: current[tc.name] for tc in model.tables
                if tc.name in current and current[tc.name].dim == tc.dim and current[tc.name].model != model.served_name}

    def unregister_model(self, name: str) -> None:
        """Stop serving a model or version (a served name; its stored rows stay in the tiers)."""
        close_tables(self.registry.remove(name).values())

    def drop_version(self, model: str, version: int) -> dict[str, int]:
        """Stop serving a version of ``model`` and free its rows in every tier (the rows it held, per table);
        FailedPreconditionError while a label names it."""
        name = served_name(model, version)
        with self._lifecycle:
            if version in self.labels.labelled(model):
                names = ", ".join(sorted(k for k, v in self.labels.of(model).items() if v == version))
                raise FailedPreconditionError(f"version {version} of model '{model}' is labelled ({names}): point the "
                                              "label elsewhere first")
            tables = self.registry.tables().get(name)
            if tables is None:
                raise NotFoundError(f"model '{model}' has no version {version} loaded")
            version_drop.mark(self.persistent, name, {t.name: t.id for t in tables.values()})  # cleared with its registration
            self.states.draining(name)
            try:
                self.unregister_model(name)
                return drop_stored(self.volatile, self.persistent, tables.values(), self.names)
            finally:
                self.states.forget(name)

    def finish_drop(self, name: str, tables: dict[str, str]) -> dict[str, int]:
        """Free what is left of the tables (name -> tier id) of a served name whose drop a crash interrupted (see
        :mod:`hps_service.engine.version_drop`); it is not served."""
        if name in self.registry.tables():
            raise FailedPreconditionError(f"{described(name)} is served: its drop is not pending")
        return drop_stored_ids(self.volatile, self.persistent, tables, self.names)

    def add_version(self, model: ModelConfig, source: str = "") -> list[int]:
        """Serve version ``model.version`` (from ``source``: where its rows come from) beside the model, then drop the
        older unlabelled versions beyond ``model.keep_versions`` (the new one counts among them); returns the versions
        dropped."""
        if not model.version:
            raise InvalidArgumentError("a version of a model is numbered from 1")
        self.register_model(model)
        self.states.served(model.served_name, source)
        with self._lifecycle:
            keep = self.labels.labelled(model.name) | {model.version}
            older = [v for v in self.versions(model.name) if v.version != model.version]
            dropped = [v.version for v in to_drop(older, keep, model.keep_versions - 1)]
            for version in dropped:
                self.drop_version(model.name, version)
                log.info("version %d of model %s dropped: models[].keep_versions is %d", version, model.name,
                         model.keep_versions)
        return dropped

    def models(self) -> list[ModelConfig]:
        """The loaded models as clients name them (versions: :meth:`versions`)."""
        return self.registry.models()

    def served_models(self) -> list[ModelConfig]:
        """Every loaded model and version."""
        return self.registry.served()

    def versions(self, model: str) -> list[ModelConfig]:
        """The loaded versions of ``model``, oldest first."""
        return self.registry.versions(model)

    def resolve(self, model: str, version: int | None = None, label: str = "") -> tuple[str, int]:
        """The served name and version a lookup of ``model`` naming ``version`` or ``label`` reads (see
        :func:`hps_service.engine.versions.resolve`)."""
        return resolve(self.labels.current(), self.registry.tables(), model, version, label)

    def not_switchable(self, model: str, version: int, allow_empty: bool = False) -> list[str]:
        """Why a label cannot point at ``version`` of ``model`` yet (empty: it can): not loaded here (being
        imported, or failed), a table whose hash map is still being filled from RocksDB, or (unless
        ``allow_empty``) a table that holds no rows."""
        name = served_name(model, version)
        tables = self.registry.tables().get(name)
        if tables is None:
            record = self.states.record(name)
            if record is not None and record.phase == "importing":
                return [record.loading_reason(described(name))]
            if record is not None and record.phase == "failed":
                return [f"{described(name)} failed to load from {record.source}: {record.reason}"]
            return [f"model '{model}' has no version {version} loaded"]
        out = [f"table {t.name} of {described(t.model)} is still preloading" for t in tables.values()
               if self.preloader.loading(t.id)]
        if not allow_empty:
            out += [f"table {t.name} of {described(t.model)} holds no rows (allow_empty: true points a label at it "
                    "all the same)" for t in tables.values() if self.stored_rows(t) == 0]
        return out

    def stored_rows(self, t: ServedTable) -> int | None:
        """The rows of ``t`` this replica stores: the persistent tier's count, else the volatile tier's (None:
        neither tier is enabled, or it cannot say now)."""
        tier = self.persistent if self.persistent is not None else self.volatile
        if tier is None:
            return None
        try:
            return tier.count(t.id)
        except HPSError:
            return None

    def version_states(self, model: str) -> list[VersionView]:
        """Every version of ``model`` this replica knows of, served or not (see
        :mod:`hps_service.engine.version_states`), oldest first."""
        base = self.registry.model(model)
        labels = self.labels.of(model)
        views = {}
        for version, record in self.states.unserved(model).items():
            views[version] = view_of(model, version, record, [], self._table_views(base.tables, {}), [], None)
        served = self.registry.tables()
        for config in self.versions(model):
            tables = served.get(config.served_name, {})
            named = sorted(k for k, v in labels.items() if v == config.version)
            preloading = sorted(t.name for t in tables.values() if self.preloader.loading(t.id))
            ended = [self.preloader.finished_at.get(t.id) for t in tables.values()]
            views[config.version] = view_of(model, config.version, self.states.record(config.served_name), named,
                                            self._table_views(config.tables, tables), preloading,
                                            max((e for e in ended if e is not None), default=None))
        return [views[v] for v in sorted(views)]

    def _table_views(self, configs: Sequence[TableConfig], tables: dict[str, ServedTable]) -> list[TableView]:
        out = []
        for tc in configs:
            t = tables.get(tc.name)
            rows = self.stored_rows(t) if t is not None else None
            width = t.format.words * 4 if t is not None else None
            out.append(TableView(tc.name, tc.dim, t.storage if t is not None else tc.storage, rows,
                                 rows * width if rows is not None and width is not None else None))
        return out

    def set_label(self, model: str, label: str, version: int | None) -> int | None:
        """Point ``label`` of ``model`` at a loaded ``version`` (None: remove it), persisted; returns the version it
        named before. NotFoundError for a version that is not loaded."""
        check_label(label)
        with self._lifecycle:
            self.registry.model(model)
            if version is not None and served_name(model, version) not in self.registry.tables():
                raise NotFoundError(f"model '{model}' has no version {version} loaded")
            save_label(self.persistent, model, label, version)
            return self.labels.point(model, label, version)

    def model(self, name: str) -> ModelConfig:
        return self.registry.model(name)

    def table(self, model: str, table: str) -> ServedTable:
        """The served table, or NotFoundError naming what is missing."""
        return self.registry.table(model, table)

    def _served_tables(self) -> list[ServedTable]:
        return [t for tables in self.registry.tables().values() for t in tables.values()]

    def _fetch_for_cache(self, t: ServedTable, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The L1's own reads below it (refresh, warm start): rows, versions and the stored mask (the cache's
        ``FetchBelow``), not counted as lookups."""
        got = self.reader.fetch_below(t, keys, count=False)
        return got.stored, got.versions, got.sources != DEFAULT

    @contextmanager
    def writing(self, model: str, table: str) -> Iterator[ServedTable]:
        """The served table, with its write lock held: writes of one table never interleave across the tiers. A
        table replaced while this waited for the lock is looked up again, so the write reaches the new one."""
        while True:
            t = self.table(model, table)
            with t.guard.lock:
                if self._closed:
                    raise UnavailableError("the lookup engine is closed")
                if self.registry.is_served(t):
                    yield t
                    return

    # ---- reads and writes ---------------------------------------------------------------------
    def lookup(self, model: str, table: str, keys: np.ndarray, out: np.ndarray | None = None,
               sources: np.ndarray | None = None, stored: bool = False) -> LookupResult:
        """Rows of ``keys`` in request order (duplicates included) and the level that answered each (into ``out``
        and ``sources`` when given: see :meth:`Reader.lookup`). A table that a conversion moved while this read it
        (its old rows dropped) is read again where it is now."""
        t = self.table(model, table)
        try:
            return self.reader.lookup(t, keys, out, sources, stored)
        except NotFoundError:
            if self.registry.is_served(t):
                raise
            return self.reader.lookup(self.table(model, table), keys, out, sources, stored)

    def lookup_bags(self, model: str, table: str, keys: np.ndarray, bags: Bags, out: np.ndarray | None = None,
                    sources: np.ndarray | None = None) -> LookupResult:
        """One row per bag of ``keys``: their unique keys looked up as :meth:`lookup` does, then pooled (see
        :mod:`hps_service.engine.bags`)."""
        return self._bags.pool_table(self, model, table, keys, bags, out, sources)

    def apply_updates(
        self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray | int,
        written_s: np.ndarray | None = None,
    ) -> int:
        """Write rows to persistent (durable) -> volatile -> rows present in L1. Returns rows written.

        A stored row with a newer version is never replaced, so replays and lagging writers are harmless.
        ``written_s``: the rows' write times, kept by a table with ``ttl_s`` (None: now).
        """
        with self.writing(model, table) as t:
            return self.writer.apply_updates(t, keys, vectors, versions, written_s)

    def put_rows(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray | int,
                 strict: bool = False) -> PutCounts:
        """:meth:`apply_updates` saying rows written and rows stale (see :meth:`Writer.put`)."""
        with self.writing(model, table) as t:
            return self.writer.put(t, keys, vectors, versions, strict=strict)

    def apply_deletes(self, model: str, table: str, keys: np.ndarray, versions: np.ndarray | int | None = None) -> int:
        """Delete keys from every tier and the L1 cache. Returns how many live rows the lowest enabled tier held
        (see :meth:`Writer.apply_deletes` for versioned and admin deletes)."""
        with self.writing(model, table) as t:
            return self.writer.apply_deletes(t, keys, versions)

    def import_rows(
        self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray, version: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Bulk-load rows into the persistent tier, then drop their keys from L2 and L1, as one write of the table
        (no promotion, preload or L1 admission of a row read before it lands after it). Returns rows written."""
        with self.writing(model, table) as t:
            return self.writer.import_rows(t, keys, vectors, version, progress)

    def check_change(self, change: TableChange) -> PreparedChange:
        """``change`` checked before anything of it is written (InvalidArgumentError or NotFoundError: unknown table,
        wrong dim, rows not finite), handed back ready for :meth:`apply_changes`."""
        return prepare_change(self.table(change.model, change.table), change)

    def apply_changes(self, changes: Sequence[TableChange | PreparedChange],
                      positions: Positions | None = None) -> list[WriteResult]:
        """Apply the rows and versioned deletes of several tables (checked ones as :meth:`check_change` handed them
        back), each key's newest change winning, and store ``positions`` (opaque ``(source, partition) -> next
        offset``) in the same atomic persistent write, so the positions a store holds never run ahead of its rows.
        Then the volatile tier and L1."""
        with ExitStack() as held:  # every table's write lock, in one order, for the whole write
            tables = {key: held.enter_context(self.writing(*key))
                      for key in sorted({(c.model, c.table) for c in changes})}
            writes = [(t, c.write(t, self.writer.admitted)) for c in changes for t in [tables[(c.model, c.table)]]]
            return self.writer.apply_changes(writes, positions)

    def positions(self) -> dict[tuple[str, int], int]:
        """The positions stored by :meth:`apply_changes` (empty without a persistent tier that keeps them)."""
        return self.persistent.positions() if self.persistent is not None else {}

    @property
    def stores_positions(self) -> bool:
        """Whether positions survive a restart (they live in the persistent tier)."""
        return self.persistent is not None and self.persistent.stores_positions

    def purge_tombstones(self, model: str, table: str, below_version: int) -> dict[str, int]:
        """Remove the tombstones older than ``below_version`` from every tier; returns how many, per level."""
        with self.writing(model, table) as t:
            return self.writer.purge_tombstones(t, below_version)

    def check_conversion(self, model: str, table: str, storage: str) -> None:
        """Raise the error that says why ``model.table`` cannot be converted to ``storage`` now, if it cannot."""
        check_conversion(self, model, table, storage)

    def convert_table(self, model: str, table: str, storage: str,
                      progress: ConvertProgress | None = None) -> dict[str, Any]:
        """Re-encode a table's rows as ``storage`` while it is served, then serve them so (see
        :mod:`hps_service.engine.convert`); returns what was done."""
        return convert_table(self, model, table, storage, progress)

    # ---- stats and lifecycle ------------------------------------------------------------------
    def table_stats(self, model: str, table: str) -> TableStats:
        """Per level: hits, misses, hit_rate, rows, capacity, evictions (+ errors for lower tiers)."""
        return table_stats(self.table(model, table), self.volatile, self.persistent)

    def stats(self) -> dict[str, Any]:
        """The ``/v1/stats`` shape: ``{"models": {M: {"tables": {T: {level: {...}}}}}}``."""
        models: dict[str, Any] = {}
        for m, tables in self.registry.tables().items():
            shown = models[m] = {"tables": {}}
            for name, t in tables.items():
                try:
                    shown["tables"][name] = self.table_stats(m, name)
                except NotFoundError:  # dropped since the tables were listed: gone, not an error of the stats
                    if self.registry.tables().get(m, {}).get(name) is t:
                        raise
        return {"models": models}

    def healthy(self) -> dict[str, bool]:
        """Reachability of each enabled tier."""
        return tier_health(self.volatile, self.persistent)

    def memory_bytes(self) -> dict[str, int]:
        """The persistent tier's memtables and block cache, in bytes (zeros without one)."""
        return tier_memory(self.persistent)

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop the repair and preload threads and the caches (saving warm-start snapshots), then close the tiers.

        Writes in progress finish first (their tables' write locks are taken) and later ones are refused, so no
        tier closes under a writer. If a background thread or a write does not end within ``timeout_s``, the tiers
        are left open (the process is exiting; RocksDB recovers from its WAL) and False is returned.
        """
        deadline = time.monotonic() + timeout_s
        stopped = self.sweeper.stop(timeout_s)
        if self.repairer is not None:
            stopped &= self.repairer.stop(timeout_s)
        stopped &= self.preloader.stop(max(0.0, deadline - time.monotonic()))
        with ExitStack() as held:
            for guard in self.registry.guards():
                if not guard.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    stopped = False
                    break
                held.callback(guard.lock.release)
            self._closed = True
            if not stopped:
                log.error("a write or a background thread of the engine did not end within %.0f s; the tiers are "
                          "left open", timeout_s)
                return False
            close_tables(self.registry.clear())
            for tier in (self.volatile, self.persistent):
                if tier is not None:
                    tier.close()
        return True

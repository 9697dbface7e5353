"""The lookup hierarchy: L1 cache -> volatile tier -> persistent tier -> default vector.

The engine knows nothing of gRPC or HTTP. It dedupes what the cache missed, asks each tier only for
what is still missing, promotes rows found lower into the tiers above, and answers in request order
with, per key, the level that answered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from hps_service.cache.change_log import ChangeLog
from hps_service.cache.protocol import TableCache
from hps_service.config import DefaultSpec, ModelConfig, TableConfig
from hps_service.defaults import default_rows
from hps_service.errors import InvalidArgumentError, NotFoundError
from hps_service.keys import as_keys, unique_with_inverse
from hps_service.tiers.base import Tier, delete_versions, max_version_per_key, table_id

log = logging.getLogger(__name__)


class Source(IntEnum):
    """Which level answered a key; the values are those of the ``hps.v1.Source`` protobuf enum."""

    CACHE = 1
    VOLATILE = 2
    PERSISTENT = 3
    DEFAULT = 4


#: The Source codes as plain ints for array operations (NumPy converts an IntEnum member through its slow path).
_CACHE, _VOLATILE, _PERSISTENT, _DEFAULT = (int(s) for s in (Source.CACHE, Source.VOLATILE, Source.PERSISTENT,
                                                             Source.DEFAULT))
LEVELS = ("cache", "volatile", "persistent")
#: Keys per L3 read when rewriting L2 rows after an outage.
REPAIR_CHUNK = 65536
#: Keys per L3 read when filling an in-process volatile tier at load.
PRELOAD_CHUNK = 65536


@dataclass(slots=True)
class LookupResult:
    vectors: np.ndarray  # (n, dim) float32, in the order asked
    sources: np.ndarray  # (n,) uint8 Source values


@dataclass
class _Counters:
    """Hits and misses per level of one table (updated under the table's lock)."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LEVELS, 0))
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LEVELS, 0))
    defaults: int = 0


@dataclass
class ServedTable:
    """One table of a loaded model, with its L1 cache and counters."""

    model: str
    name: str
    dim: int
    default: DefaultSpec
    cache: TableCache | None = None
    counters: _Counters = field(default_factory=_Counters)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Keys of admin deletes (no version, so no tombstone), guarding L2 writes of rows read from L3 before them.
    unversioned_deletes: ChangeLog = field(default_factory=ChangeLog)

    @property
    def id(self) -> str:
        return table_id(self.model, self.name)

    def deleted_since(self, generation: int, keys: np.ndarray) -> np.ndarray:
        """Mask of ``keys`` removed by an admin delete after ``generation`` (all of them if the log forgot)."""
        with self.lock:
            changed = self.unversioned_deletes.changed_since(generation, keys)
        return np.ones(keys.shape[0], dtype=bool) if changed is None else changed

    def count(self, level: str, hits: int, misses: int) -> None:
        with self.lock:
            self.counters.hits[level] += hits
            self.counters.misses[level] += misses


#: Builds the L1 cache of a table, or None: ``factory(table, fetch_below, warm_keys)``.
CacheFactory = Callable[[ServedTable, Callable[[np.ndarray], np.ndarray], Callable[[int], np.ndarray] | None], TableCache | None]


def as_rows(vectors: np.ndarray, n: int, dim: int, what: str) -> np.ndarray:
    """Validate rows for ``n`` keys of width ``dim``: float32, finite."""
    arr = np.asarray(vectors, dtype=np.float32)
    if arr.shape != (n, dim):
        raise InvalidArgumentError(f"{what}: expected rows of shape ({n}, {dim}), got {arr.shape}")
    if not np.isfinite(arr).all():
        raise InvalidArgumentError(f"{what}: rows contain NaN or infinite values")
    return arr


def latest_per_key(keys: np.ndarray, versions: np.ndarray) -> np.ndarray:
    """Indices that keep one entry per key: the highest version, the last one among equals."""
    order = np.lexsort((np.arange(keys.shape[0]), versions, keys))
    sorted_keys = keys[order]
    last = np.ones(order.shape[0], dtype=bool)
    last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
    return order[last]


class LookupEngine:
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
        self._models: dict[str, dict[str, ServedTable]] = {}
        self._configs: dict[str, ModelConfig] = {}
        self._registry_lock = threading.Lock()
        self._repair_stop = threading.Event()
        self._preload_stop = threading.Event()
        self._preload_threads: list[threading.Thread] = []
        self._repair_thread: threading.Thread | None = None
        if volatile is not None and persistent is not None:
            self._repair_thread = threading.Thread(
                target=self._repair_loop, args=(repair_interval_s,), name="hps-l2-repair", daemon=True
            )
            self._repair_thread.start()

    # ---- models -------------------------------------------------------------------------------
    def register_model(self, model: ModelConfig) -> None:
        """Create the model's tables in every tier and build their L1 caches (replaces a loaded model)."""
        tables: dict[str, ServedTable] = {}
        for tc in model.tables:
            tables[tc.name] = self._make_table(model.name, tc)
        with self._registry_lock:
            old = self._models.get(model.name)
            self._models = {**self._models, model.name: tables}
            self._configs = {**self._configs, model.name: model}
        if old:
            self._close_tables(old.values())
        log.info("model %s loaded: %s", model.name, ", ".join(f"{t.name}(dim {t.dim})" for t in model.tables))
        for t in tables.values():
            self._start_preload(t)

    def unregister_model(self, name: str) -> None:
        """Stop serving a model (its stored rows stay in the tiers)."""
        with self._registry_lock:
            if name not in self._models:
                raise NotFoundError(f"model '{name}' is not loaded")
            old = self._models[name]
            self._models = {k: v for k, v in self._models.items() if k != name}
            self._configs = {k: v for k, v in self._configs.items() if k != name}
        self._close_tables(old.values())

    def models(self) -> list[ModelConfig]:
        return list(self._configs.values())

    def model(self, name: str) -> ModelConfig:
        try:
            return self._configs[name]
        except KeyError:
            raise NotFoundError(f"model '{name}' is not loaded") from None

    def table(self, model: str, table: str) -> ServedTable:
        """The served table, or NotFoundError naming what is missing."""
        tables = self._models.get(model)
        if tables is None:
            raise NotFoundError(f"model '{model}' is not loaded")
        t = tables.get(table)
        if t is None:
            raise NotFoundError(f"model '{model}' has no table '{table}'")
        return t

    def _make_table(self, model: str, tc: TableConfig) -> ServedTable:
        t = ServedTable(model=model, name=tc.name, dim=tc.dim, default=tc.default)
        for tier in (self.volatile, self.persistent):
            if tier is not None:
                tier.create_table(t.id, tc.dim)
        if self.cache_factory is not None:
            persistent = self.persistent

            def fetch_below(keys: np.ndarray) -> np.ndarray:
                return self._fetch_below_cache(t, keys, count=False)[0]

            def warm_keys(limit: int) -> np.ndarray:
                assert persistent is not None
                return persistent.scan_keys(t.id, limit)

            t.cache = self.cache_factory(t, fetch_below, warm_keys if persistent is not None else None)
        return t

    def _close_tables(self, tables: Iterable[ServedTable]) -> None:
        for t in tables:
            if t.cache is not None:
                t.cache.close()

    def _start_preload(self, t: ServedTable) -> None:
        """Fill an in-process volatile tier with the table's stored rows in the background when they all fit, so
        lookups after a start or restart are answered from memory instead of each row's first one reading
        RocksDB (HugeCTR's HPS loads its volatile database the same way)."""
        if self.volatile is None or self.persistent is None or not self.volatile.in_process:
            return
        stored = self.persistent.count(t.id)
        capacity = self.volatile.stats(t.id).capacity
        if stored == 0:
            return
        if capacity is not None and stored > capacity:
            log.info("%s: %d stored rows exceed the volatile tier's %d; its rows load on demand", t.id, stored,
                     capacity)
            return
        thread = threading.Thread(target=self._preload, args=(t, stored), name=f"hps-preload-{t.id}", daemon=True)
        with self._registry_lock:
            self._preload_threads = [th for th in self._preload_threads if th.is_alive()] + [thread]
        thread.start()

    def _preload(self, t: ServedTable, stored: int) -> None:
        assert self.persistent is not None
        started = time.monotonic()
        loaded = 0
        try:
            keys = self.persistent.scan_keys(t.id, stored)
            for lo in range(0, keys.shape[0], PRELOAD_CHUNK):
                if self._preload_stop.is_set() or self._models.get(t.model, {}).get(t.name) is not t:
                    return
                loaded += int(np.count_nonzero(self._copy_stored_rows_to_volatile(t, keys[lo : lo + PRELOAD_CHUNK])))
        except Exception:  # rows then load on demand, as without a preload
            log.warning("preloading %s into the volatile tier stopped after %d rows", t.id, loaded, exc_info=True)
            return
        log.info("preloaded %d rows of %s into the volatile tier in %.1f s", loaded, t.id, time.monotonic() - started)

    # ---- reads --------------------------------------------------------------------------------
    def lookup(self, model: str, table: str, keys: np.ndarray) -> LookupResult:
        """Rows of ``keys`` in request order (duplicates included) and the level that answered each."""
        t = self.table(model, table)
        keys = as_keys(keys, self.max_batch_keys)
        n = keys.shape[0]
        out = np.empty((n, t.dim), dtype=np.float32)
        sources = np.empty(n, dtype=np.uint8)
        if t.cache is not None and n:
            fetched_at = t.cache.generation()
            hit = t.cache.lookup(keys, out)
            n_hit = int(np.count_nonzero(hit))
            t.count("cache", n_hit, n - n_hit)
            sources.fill(_CACHE)
            if n_hit == n:
                return LookupResult(out, sources)
            miss_idx = np.flatnonzero(~hit)
            batch_hit_rate = n_hit / n
        else:
            miss_idx = None
            batch_hit_rate = 0.0
        miss_keys = keys if miss_idx is None else keys[miss_idx]
        if miss_keys.shape[0] == 0:
            return LookupResult(out, sources)
        uniq, inverse = unique_with_inverse(miss_keys)
        rows, src = self._fetch_below_cache(t, uniq)
        if miss_idx is None:
            np.take(rows, inverse, axis=0, out=out)
            np.take(src, inverse, out=sources)
        else:
            out[miss_idx] = rows[inverse]
            sources[miss_idx] = src[inverse]
        if t.cache is not None:
            stored = src != _DEFAULT
            if stored.all():
                t.cache.admit(uniq, rows, batch_hit_rate, fetched_at=fetched_at)
            elif stored.any():
                t.cache.admit(uniq[stored], rows[stored], batch_hit_rate, fetched_at=fetched_at)
        return LookupResult(out, sources)

    def _fetch_below_cache(self, t: ServedTable, keys: np.ndarray, count: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Rows of unique ``keys`` from volatile, then persistent, then the default; promotes L3 hits to L2."""
        read_at = t.unversioned_deletes.generation
        m = keys.shape[0]
        rows: np.ndarray | None = None
        src = np.empty(m, dtype=np.uint8)
        src.fill(_DEFAULT)
        pending: np.ndarray | None = None  # indices still unanswered; None: all of them
        for level, code, tier in (
            ("volatile", _VOLATILE, self.volatile),
            ("persistent", _PERSISTENT, self.persistent),
        ):
            if tier is None:
                continue
            asked = keys if pending is None else keys[pending]
            got = tier.get(t.id, asked)
            n_found = int(np.count_nonzero(got.found))
            if count:
                t.count(level, n_found, asked.shape[0] - n_found)
            if n_found == 0:
                continue
            if pending is None and n_found == m:  # the common case: one tier holds every key asked
                rows = got.vectors
                src.fill(code)
            else:
                if rows is None:
                    rows = np.empty((m, t.dim), dtype=np.float32)
                hit_idx = np.flatnonzero(got.found) if pending is None else pending[got.found]
                rows[hit_idx] = got.vectors[got.found]
                src[hit_idx] = code
            if code == _PERSISTENT and self.volatile is not None:
                self._promote(t, asked[got.found], got.vectors[got.found], got.versions[got.found], read_at)
            pending = np.flatnonzero(~got.found) if pending is None else pending[~got.found]
            if pending.shape[0] == 0:
                break
        if rows is None:
            rows = np.empty((m, t.dim), dtype=np.float32)
        if pending is None or pending.shape[0]:
            missing = slice(None) if pending is None else pending
            rows[missing] = default_rows(t.default, keys[missing], t.dim)
            n_default = m if pending is None else int(pending.shape[0])
            if count:
                with t.lock:
                    t.counters.defaults += n_default
        return rows, src

    def _promote(
        self, t: ServedTable, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray, read_at: int
    ) -> None:
        """Copy rows found in L3 into L2 (see :meth:`_put_read_rows`); a failure only costs a later L3 read."""
        try:
            self._put_read_rows(t, keys, vectors, versions, read_at)
        except Exception:
            log.warning("promotion of %d rows of %s into the volatile tier failed", keys.shape[0], t.id, exc_info=True)

    def _copy_stored_rows_to_volatile(self, t: ServedTable, keys: np.ndarray) -> np.ndarray:
        """Read ``keys`` from L3 and write the rows it holds into L2 (see :meth:`_put_read_rows`); the found mask."""
        assert self.volatile is not None and self.persistent is not None
        read_at = t.unversioned_deletes.generation
        got = self.persistent.get(t.id, keys)
        if got.found.any():
            self._put_read_rows(t, keys[got.found], got.vectors[got.found], got.versions[got.found], read_at)
        return got.found

    def _put_read_rows(
        self, t: ServedTable, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray, read_at: int
    ) -> None:
        """Write rows read from L3 into L2. Versioned puts keep a newer row written meanwhile; rows an admin delete
        removed after ``read_at`` (the delete generation before the read) are left out, or taken back out when the
        delete ran between that check and the put."""
        assert self.volatile is not None
        keep = ~t.deleted_since(read_at, keys)
        if not keep.all():
            keys, vectors, versions = keys[keep], vectors[keep], versions[keep]
        self.volatile.put(t.id, keys, vectors, versions)
        resurrected = t.deleted_since(read_at, keys)
        if resurrected.any():
            self.volatile.delete(t.id, keys[resurrected])

    # ---- writes -------------------------------------------------------------------------------
    def apply_updates(
        self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray | int
    ) -> int:
        """Write rows to persistent (durable) -> volatile -> rows present in L1. Returns rows written.

        A stored row with a newer version is never replaced, so replays and lagging writers are harmless.
        """
        t = self.table(model, table)
        keys = as_keys(keys)
        n = keys.shape[0]
        vectors = as_rows(vectors, n, t.dim, f"update of {t.id}")
        versions = np.broadcast_to(np.asarray(versions, dtype=np.int64), (n,))
        if n == 0:
            return 0
        keep = latest_per_key(keys, versions)
        if keep.shape[0] != n:
            keys, vectors, versions = keys[keep], vectors[keep], versions[keep]
        else:
            versions = np.ascontiguousarray(versions)
        written = np.ones(keys.shape[0], dtype=bool)
        if self.persistent is not None:
            written = self.persistent.put(t.id, keys, vectors, versions)
        if self.volatile is not None:
            if self.persistent is None:
                written = self.volatile.put(t.id, keys, vectors, versions)
            elif written.any():
                # only rows L3 accepted: an older replay must not reach L2 where an evicted tombstone left a gap
                self.volatile.put(t.id, keys[written], vectors[written], versions[written])
        if t.cache is not None and written.any():
            t.cache.update(keys[written], vectors[written])
        return int(np.count_nonzero(written))

    def purge_tombstones(self, model: str, table: str, below_version: int) -> dict[str, int]:
        """Remove the tombstones older than ``below_version`` from every tier; returns how many, per level.

        A tombstone only stops a put older than itself, so ``below_version`` must be older than any update the
        log can still deliver (for example the version of the oldest message the topic retains).
        """
        t = self.table(model, table)
        if below_version < 0:
            raise InvalidArgumentError(f"below_version must be >= 0, got {below_version}")
        return {level: tier.purge_tombstones(t.id, below_version)
                for level, tier in (("volatile", self.volatile), ("persistent", self.persistent)) if tier is not None}

    def apply_deletes(self, model: str, table: str, keys: np.ndarray, versions: np.ndarray | int | None = None) -> int:
        """Delete keys from every tier and the L1 cache. Returns how many live rows the lowest enabled tier held.

        With ``versions`` (update tombstones), a tier removes only rows not newer than the delete and keeps a
        tombstone, so a replayed older put or a late promotion cannot bring the row back; without (admin
        deletes), the keys are forgotten whatever their version.
        """
        t = self.table(model, table)
        keys = as_keys(keys)
        tomb_versions = delete_versions(versions, keys.shape[0])
        if keys.shape[0] == 0:
            return 0
        if tomb_versions is None:
            keys = np.unique(keys)
            with t.lock:  # before any tier forgets them, so a promotion read earlier sees it (see _promote)
                t.unversioned_deletes.record(keys)
        else:
            keys, tomb_versions = max_version_per_key(keys, tomb_versions)
        removed = 0
        if self.persistent is not None:
            removed = self.persistent.delete(t.id, keys, tomb_versions)
        if self.volatile is not None:
            n = self.volatile.delete(t.id, keys, tomb_versions)
            if self.persistent is None:
                removed = n
        if t.cache is not None:
            t.cache.invalidate(keys)
        return removed

    def repair_volatile(self) -> int:
        """Rewrite from L3 the L2 rows whose writes missed a store node, so an outage leaves no stale row behind.

        Keys L3 holds get their current row (a versioned put, so a newer row written meanwhile wins); keys it does
        not hold are removed from L2. Writes that miss again are reported again by the tier and retried later.
        """
        assert self.volatile is not None and self.persistent is not None
        repaired = 0
        for tables in list(self._models.values()):
            for t in tables.values():
                keys = self.volatile.take_missed_writes(t.id)
                for start in range(0, keys.shape[0], REPAIR_CHUNK):
                    chunk = keys[start : start + REPAIR_CHUNK]
                    found = self._copy_stored_rows_to_volatile(t, chunk)
                    if not found.all():
                        self.volatile.delete(t.id, chunk[~found])
                    repaired += int(chunk.shape[0])
        if repaired:
            log.info("rewrote %d volatile-tier rows whose writes had missed a node", repaired)
        return repaired

    def _repair_loop(self, interval_s: float) -> None:
        while not self._repair_stop.wait(interval_s):
            try:
                self.repair_volatile()
            except Exception:  # the next round retries; serving never depends on this thread
                log.warning("volatile-tier repair failed", exc_info=True)

    # ---- stats and lifecycle ------------------------------------------------------------------
    def table_stats(self, model: str, table: str) -> dict[str, dict[str, float | int | None]]:
        """Per level: hits, misses, hit_rate, rows, capacity, evictions (+ errors for lower tiers)."""
        t = self.table(model, table)
        with t.lock:
            hits = dict(t.counters.hits)
            misses = dict(t.counters.misses)
            defaults = t.counters.defaults
        out: dict[str, dict[str, float | int | None]] = {}
        for level in LEVELS:
            h, m = hits[level], misses[level]
            entry: dict[str, float | int | None] = {
                "hits": h,
                "misses": m,
                "hit_rate": (h / (h + m)) if (h + m) else 0.0,
                "rows": 0,
                "capacity": 0,
                "evictions": 0,
            }
            if level == "cache":
                entry["enabled"] = t.cache is not None
                if t.cache is not None:
                    cs = t.cache.stats()
                    entry.update({k: v for k, v in cs.items() if k not in ("hits", "misses", "hit_rate")})
            else:
                tier = self.volatile if level == "volatile" else self.persistent
                entry["enabled"] = tier is not None
                if tier is not None:
                    ts = tier.stats(t.id)
                    entry.update(rows=ts.rows, capacity=ts.capacity, evictions=ts.evictions, errors=ts.errors)
                    entry.update(ts.extra)
            out[level] = entry
        out["default"] = {"hits": defaults}
        return out

    def stats(self) -> dict:
        """The ``/v1/stats`` shape: ``{"models": {M: {"tables": {T: {level: {...}}}}}}``."""
        return {
            "models": {
                m: {"tables": {name: self.table_stats(m, name) for name in tables}}
                for m, tables in self._models.items()
            }
        }

    def healthy(self) -> dict[str, bool]:
        """Reachability of each enabled tier."""
        out = {}
        if self.volatile is not None:
            out["volatile"] = self.volatile.healthy()
        if self.persistent is not None:
            out["persistent"] = self.persistent.healthy()
        return out

    def close(self) -> None:
        """Stop caches (saving warm-start snapshots), the repair and preload threads, then close the tiers."""
        self._repair_stop.set()
        self._preload_stop.set()
        if self._repair_thread is not None:
            self._repair_thread.join(5)
        for thread in self._preload_threads:
            thread.join(30)  # one chunk at most: the tiers must not close under it
        with self._registry_lock:
            models, self._models, self._configs = self._models, {}, {}
        for tables in models.values():
            self._close_tables(tables.values())
        for tier in (self.volatile, self.persistent):
            if tier is not None:
                tier.close()

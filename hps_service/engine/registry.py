"""The loaded models and their tables: what lookups and writes resolve ``(model, table)`` against.

Readers never lock: a registration swaps in new dicts whole, so a reader sees the old set or the new one. The write
guard of a ``(model, table)`` name outlives the served table: a replaced or reloaded table gets the same one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar, cast

import numpy as np

from hps_service.config import ModelConfig, TableConfig
from hps_service.config.base import Storage, split_served
from hps_service.engine.ingest_admission import ingest_filter
from hps_service.engine.stored_tables import TableNames, drop_abandoned
from hps_service.engine.table import CacheFactory, ServedTable
from hps_service.engine.ttl import check_stamping
from hps_service.engine.write_guard import WriteGuard
from hps_service.errors import InvalidArgumentError, NotFoundError
from hps_service.rows import storage_key
from hps_service.tiers.base import Tier, TierCapability

log = logging.getLogger(__name__)
T = TypeVar("T")


def find_table(models: Mapping[str, Mapping[str, T]], model: str, table: str) -> T:
    """``models[model][table]``, or NotFoundError naming what is missing (the owner's and the workers' registries)."""
    tables = models.get(model)
    if tables is None:
        raise not_loaded(model)
    t = tables.get(table)
    if t is None:
        raise NotFoundError(f"{described(model)} has no table '{table}'")
    return t


def described(name: str) -> str:
    """A served name as a message says it: ``model 'ctr'`` or ``version 13 of model 'ctr'``."""
    model, version = split_served(name)
    return f"version {version} of model '{model}'" if version else f"model '{model}'"


def not_loaded(name: str) -> NotFoundError:
    """The error for a served name that is not loaded."""
    return NotFoundError(f"{described(name)} is not loaded")


class ModelRegistry:
    """Models by name, each with its served tables, replaced copy-on-write."""

    def __init__(self) -> None:
        self._models: dict[str, dict[str, ServedTable]] = {}
        self._configs: dict[str, ModelConfig] = {}
        self._guards: dict[tuple[str, str], WriteGuard] = {}
        self._lock = threading.Lock()

    def guard(self, model: str, table: str) -> WriteGuard:
        """The write guard of a table name (created on first use, kept across replacements)."""
        with self._lock:
            return self._guards.setdefault((model, table), WriteGuard())

    def guards(self) -> list[WriteGuard]:
        """Every write guard handed out so far."""
        with self._lock:
            return list(self._guards.values())

    def put(self, model: ModelConfig, tables: dict[str, ServedTable]) -> dict[str, ServedTable] | None:
        """Serve ``tables`` as ``model`` (under its served name: a version beside the model); returns the tables it
        replaces, if any."""
        name = model.served_name
        with self._lock:
            old = self._models.get(name)
            self._models = {**self._models, name: tables}
            self._configs = {**self._configs, name: model}
        return old

    def remove(self, name: str) -> dict[str, ServedTable]:
        """Stop serving ``name`` (a served name); returns its tables (NotFoundError if it is not loaded)."""
        with self._lock:
            if name not in self._models:
                raise not_loaded(name)
            old = self._models[name]
            self._models = {k: v for k, v in self._models.items() if k != name}
            self._configs = {k: v for k, v in self._configs.items() if k != name}
        return old

    def clear(self) -> list[ServedTable]:
        """Forget every model; returns all their tables."""
        with self._lock:
            models, self._models, self._configs = self._models, {}, {}
        return [t for tables in models.values() for t in tables.values()]

    def models(self) -> list[ModelConfig]:
        """The loaded models as clients name them (their versions are :meth:`versions`)."""
        return [m for m in self._configs.values() if not m.version]

    def served(self) -> list[ModelConfig]:
        """Every loaded model and version."""
        return list(self._configs.values())

    def versions(self, name: str) -> list[ModelConfig]:
        """The loaded versions of model ``name``, oldest first."""
        return sorted((m for m in self._configs.values() if m.version and m.name == name), key=lambda m: m.version)

    def model(self, name: str) -> ModelConfig:
        """The config of a served name (``model`` or ``model#vN``)."""
        try:
            return self._configs[name]
        except KeyError:
            raise not_loaded(name) from None

    def table(self, model: str, table: str) -> ServedTable:
        """The served table, or NotFoundError naming what is missing."""
        return find_table(self._models, model, table)

    def is_served(self, t: ServedTable) -> bool:
        """Whether ``t`` is still the table served under its name (not unloaded or replaced)."""
        return self._models.get(t.model, {}).get(t.name) is t

    def tables(self) -> dict[str, dict[str, ServedTable]]:
        """Model -> table name -> served table, as of now."""
        return self._models


def record_storage(tier: Tier, table: str, storage: str) -> None:
    """Record ``table``'s row storage in ``tier`` (where it keeps metadata); InvalidArgumentError if the tier holds
    rows of the table stored otherwise (a table without a record was written before formats existed: fp32)."""
    if TierCapability.WRITES not in tier.capabilities:
        return
    key = storage_key(table)
    held = tier.metadata(key).get(key)
    if held is not None and held.decode() == storage:
        return
    try:
        rows = tier.count(table)
    except Exception:  # the tier holds no such table yet
        rows = 0
    was = "fp32" if held is None else held.decode()
    if rows and was != storage:
        if held is None and not tier.set_metadata(key, b"fp32"):
            return  # a tier that keeps no metadata (Redis, the hash map): nothing tells how its rows were stored
        raise InvalidArgumentError(f"table {table} holds {rows} rows stored as {was}, not {storage}: serve it as "
                                   f"{was} and convert it (POST /v1/models/{{model}}/tables/{{table}}:convert), or "
                                   "import it again into an empty store")
    tier.set_metadata(key, storage.encode())


def served_config(model: ModelConfig, tables: Mapping[str, ServedTable]) -> ModelConfig:
    """``model`` as its tables are served: each table's storage as its rows are stored (a conversion changes it)."""
    if all(tables[tc.name].storage == tc.storage for tc in model.tables):
        return model
    return model.model_copy(update={"tables": [tc.model_copy(update={"storage": tables[tc.name].storage})
                                               for tc in model.tables]})


def make_table(
    model: str,
    tc: TableConfig,
    guard: WriteGuard,
    tiers: Iterable[Tier],
    cache_factory: CacheFactory | None,
    fetch_below: Callable[[ServedTable, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]],
    warm_source: Tier | None,
    names: TableNames,
    warm_from: ServedTable | None = None,
) -> ServedTable:
    """Create a table in every tier and build its L1 cache, which reads misses through ``fetch_below`` and warms
    from the keys hottest in ``warm_from``'s L1 (the table of the version served now, for a new version), else
    from the first keys ``warm_source`` (the persistent tier) holds. A table that a conversion moved is served
    where and as it was converted, and a table registered again after a drop under an id of its own (``names``:
    see :mod:`hps_service.engine.stored_tables`), whatever ``tc.storage`` says."""
    drop_abandoned(warm_source, model, tc.name)
    stored = names.claim(model, tc.name)
    storage = cast(Storage, stored.serving_storage(tc.storage))
    if storage != tc.storage:
        log.warning("table %s.%s was converted to %s: serving it as %s (tables[].storage says %s)", model, tc.name,
                    storage, storage, tc.storage)
    t = ServedTable(model=model, name=tc.name, dim=tc.dim, default=tc.default, guard=guard, storage=storage,
                    stored_as=stored.id if stored.converted else "", ingest=ingest_filter(tc.admit_after_writes),
                    ttl_s=tc.ttl_s)
    for tier in tiers:
        record_storage(tier, t.id, t.storage)
        check_stamping(tier, t)
        tier.create_table(t.id, t.format.words)
    if cache_factory is not None:

        def fetch(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return fetch_below(t, keys)

        warm_keys = None
        if warm_source is not None:
            source = warm_source

            def warm_keys(limit: int) -> np.ndarray:
                if warm_from is not None and warm_from.cache is not None:
                    hot = warm_from.cache.hottest_keys()[:limit]
                    if hot.shape[0]:
                        return hot
                return source.scan_keys(t.id, limit)

        t.cache = cache_factory(t, fetch, warm_keys)
    return t


def close_tables(tables: Iterable[ServedTable]) -> None:
    """Stop the L1 caches of ``tables`` (saving their warm-start snapshots)."""
    for t in tables:
        if t.cache is not None:
            t.cache.close()


def drop_stored(volatile: Tier | None, persistent: Tier | None, tables: Iterable[ServedTable],
                names: TableNames) -> dict[str, int]:
    """Free the stored rows of ``tables`` (no longer served) in the tiers that can drop tables: RocksDB column
    families, hash-map tables, Redis keys; their ids are retired in ``names`` first, never to be used again. Returns
    the rows each held in its lowest tier."""
    return drop_stored_ids(volatile, persistent, {t.name: t.id for t in tables}, names)


def drop_stored_ids(volatile: Tier | None, persistent: Tier | None, tables: dict[str, str],
                    names: TableNames) -> dict[str, int]:
    """:func:`drop_stored` of tables by name -> tier id (a table already dropped is skipped)."""
    freed = {}
    for name, tid in tables.items():
        names.retire(tid)
        rows = 0
        for tier in (volatile, persistent):
            if tier is None or TierCapability.WRITES not in tier.capabilities:
                continue
            try:
                rows = tier.count(tid)
                tier.drop_table(tid)
            except NotFoundError:
                continue
        if persistent is not None and TierCapability.WRITES in persistent.capabilities:
            persistent.set_metadata(storage_key(tid), None)
        freed[name] = rows
    return freed

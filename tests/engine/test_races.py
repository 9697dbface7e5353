"""The races of issue 14 (defect 3) and the lock-free lookup (defect 7), each made deterministic: one side is
stopped inside its window at a seam (:mod:`tests.engine.seams`) while the other runs, then released.

Real tiers: the in-process hash map (small, so it evicts) and RocksDB files; the NumPy L1 cache.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from hps_service.admin.jobs import Job, import_job
from hps_service.cache import build_table_cache
from hps_service.config import CacheConfig, ModelConfig, TableConfig
from hps_service.engine import LookupEngine, Source
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier
from tests.engine.seams import PATIENCE_S, Pause, Side, finished_or_blocked

DIM = 8
MODEL = ModelConfig(name="m", tables=[TableConfig(name="t", dim=DIM, default={"constant": -1.0})])


def rows_for(keys: np.ndarray, version: int) -> np.ndarray:
    """Rows that encode key and version, so a served row tells which write it came from."""
    return (np.asarray(keys)[:, None] * 10 + np.arange(DIM)[None, :] + version * 1000).astype(np.float32)


def make_engine(path: Path, *, l2_rows: int = 10_000, warm_start: bool = False, register: bool = True) -> LookupEngine:
    cfg = CacheConfig(backend="numpy", capacity=256, ways=8, hit_rate_threshold=1.0, admit_after_misses=1,
                      warm_start=warm_start)
    eng = LookupEngine(
        volatile=HashMapTier(capacity_rows=l2_rows),
        persistent=RocksDBTier(path),
        cache_factory=lambda t, fetch, warm: build_table_cache(cfg, t.dim, 0, fetch, warm, None),
    )
    if register:
        eng.register_model(MODEL)
    return eng


@pytest.fixture()
def engine(tmp_path: Path):
    eng = make_engine(tmp_path / "db")
    yield eng
    eng.close()


def served_versions(engine: LookupEngine, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(version encoded in each served row, -1 for the default; sources)."""
    got = engine.lookup("m", "t", keys)
    versions = np.where(got.sources == Source.DEFAULT, -1, np.round((got.vectors[:, 0] - keys * 10) / 1000))
    return versions.astype(np.int64), got.sources


def test_admin_delete_between_a_puts_l3_and_l2_writes_is_not_undone(engine: LookupEngine) -> None:
    """The put reached L3; an admin delete runs before its L2 write. The delete was acknowledged last, so no tier
    may hold the row afterwards (before: the put's L2 write brought it back, served from L2 for good)."""
    keys = np.arange(10, dtype=np.int64)
    l2_write = Pause(engine.volatile, "put", thread="consumer", after=False)
    consumer = Side("consumer", lambda: engine.apply_updates("m", "t", keys, rows_for(keys, 5), 5))
    consumer.start()
    l2_write.wait_reached()
    admin = Side("admin", lambda: engine.apply_deletes("m", "t", keys))
    admin.start()
    finished_or_blocked(admin)
    l2_write.release()
    consumer.finish()
    admin.finish()
    for tier in (engine.volatile, engine.persistent):
        assert not tier.get("m.t", keys).found.any(), tier.kind
    versions, sources = served_versions(engine, keys)
    assert (sources == Source.DEFAULT).all(), versions


def test_promotion_read_before_a_versioned_delete_stays_out_after_l2_evicted_the_tombstone(tmp_path: Path) -> None:
    """A lookup read the row from L3; a versioned delete lands; the hash map evicts its tombstone (overflow);
    then the lookup promotes what it read. Before: the deleted row came back into L2 and was served."""
    engine = make_engine(tmp_path / "db", l2_rows=64)
    try:
        keys = np.arange(10, dtype=np.int64)
        engine.persistent.put("m.t", keys, rows_for(keys, 1), np.ones(10, np.int64))
        l3_read = Pause(engine.persistent, "get", thread="reader")
        reader = Side("reader", lambda: engine.lookup("m", "t", keys))
        reader.start()
        l3_read.wait_reached()
        engine.apply_deletes("m", "t", keys, 2)
        for lo in range(1000, 1400, 40):  # newer rows overflow the 64-row hash map: the tombstones go first
            filler = np.arange(lo, lo + 40, dtype=np.int64)
            engine.apply_updates("m", "t", filler, rows_for(filler, 1), 1)
        assert engine.volatile.stats("m.t").evictions > 0
        l3_read.release()
        reader.finish()
        assert not engine.volatile.get("m.t", keys).found.any()
        versions, sources = served_versions(engine, keys)
        assert (sources == Source.DEFAULT).all(), versions
    finally:
        engine.close()


@pytest.mark.parametrize("reader", ["promotion", "preload"])
def test_import_racing_a_read_of_the_old_rows_leaves_no_old_row_in_l2(tmp_path: Path, reader: str) -> None:
    """A lookup's promotion (or the load-time preload) read the old rows from L3; an import job replaces them and
    invalidates L2 and L1; then the reader writes what it read into L2. Before: the old rows stayed in L2 and were
    served, although the import had been acknowledged."""
    keys = np.arange(50, dtype=np.int64)
    store = RocksDBTier(tmp_path / "db")
    store.create_table("m.t", DIM)
    store.bulk_import("m.t", keys, rows_for(keys, 1), version=1)
    store.close()
    source = tmp_path / "v2.npz"
    np.savez(source, keys=keys, vectors=rows_for(keys, 2))
    # promotion: a hash map smaller than the table, so it is not preloaded and the lookup reads L3
    engine = make_engine(tmp_path / "db", register=False, l2_rows=10_000 if reader == "preload" else 32)
    try:
        if reader == "preload":
            l3_read = Pause(engine.persistent, "scan", thread="hps-preload-m.t")  # its read of a stretch
            engine.register_model(MODEL)
            side = None
        else:
            engine.register_model(MODEL)
            l3_read = Pause(engine.persistent, "get", thread="reader")
            side = Side("reader", lambda: engine.lookup("m", "t", keys))
            side.start()
        l3_read.wait_reached()
        job = Job(id="import", kind="import", target={})
        result = import_job(engine, "m", "t", source, 2)(job)
        assert result["rows_written"] == 50
        l3_read.release()
        if side is not None:
            side.finish()
        engine.preloader.stop()
        l2 = engine.volatile.get("m.t", keys)
        assert (l2.versions[l2.found] == 2).all(), l2.versions[l2.found]
        versions, _ = served_versions(engine, keys)
        assert (versions == 2).all(), versions
    finally:
        engine.close()


def test_model_replaced_while_its_new_cache_warms_never_serves_an_older_row(tmp_path: Path) -> None:
    """register_model(replace): the new table's L1 warms from the tiers; an update is applied while the model is being
    replaced. Before: the update went to the old table (and its L1's change log) while the new L1 inserted the row it
    had read before the update, and served that older row for good."""
    keys = np.arange(20, dtype=np.int64)
    engine = make_engine(tmp_path / "db", warm_start=True)
    try:
        engine.apply_updates("m", "t", keys, rows_for(keys, 1), 1)
        first = engine.table("m", "t").cache
        assert first is not None and first.wait_warm(PATIENCE_S)
        warm_read = Pause(engine.reader, "fetch_below", thread="l1-warm")
        swap = Pause(engine.registry, "put", thread="register", after=False)
        register = Side("register", lambda: engine.register_model(MODEL))
        register.start()
        warm_read.wait_reached()
        swap.wait_reached()
        update = Side("update", lambda: engine.apply_updates("m", "t", keys, rows_for(keys, 2), 2))
        update.start()
        finished_or_blocked(update)
        swap.release()
        register.finish()
        update.finish()
        warm_read.release()
        cache = engine.table("m", "t").cache
        assert cache is not None and cache is not first and cache.wait_warm(PATIENCE_S)
        versions, sources = served_versions(engine, keys)
        assert (versions == 2).all(), (versions, sources)
    finally:
        engine.close()


def test_lookups_take_no_table_lock(engine: LookupEngine) -> None:
    """docs/concepts.md: L1 reads take no lock. A lookup answered from L1 and L2 completes while another thread holds the
    table's lock (before: every lookup took it to add to the hit counters)."""
    keys = np.arange(64, dtype=np.int64)
    engine.apply_updates("m", "t", keys, rows_for(keys, 1), 1)
    t = engine.table("m", "t")
    with ThreadPoolExecutor(1) as pool:
        pool.submit(engine.lookup, "m", "t", keys[:32]).result()  # admitted to L1 inline
        with t.lock:
            got = pool.submit(engine.lookup, "m", "t", keys).result(timeout=PATIENCE_S)
    assert set(got.sources[:32]) == {Source.CACHE} and set(got.sources[32:]) == {Source.VOLATILE}
    stats = engine.table_stats("m", "t")
    assert stats["cache"]["hits"] == 32 and stats["cache"]["misses"] == 32 + 32
    assert stats["volatile"]["hits"] == 64


def test_stats_taken_while_a_model_is_dropped_leave_it_out(engine: LookupEngine,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The stats list the tables, then a drop frees one before its figures are read: /v1/stats answers without it
    (it answered 404 for the whole node while a version was dropped)."""
    engine.register_model(ModelConfig(name="gone", tables=[TableConfig(name="t", dim=DIM)]))
    listed = engine.registry.tables()
    engine.unregister_model("gone")
    current = engine.registry.tables
    calls = iter([listed])
    monkeypatch.setattr(engine.registry, "tables", lambda: next(calls, None) or current())
    stats = engine.stats()
    assert stats["models"]["gone"]["tables"] == {} and "t" in stats["models"]["m"]["tables"]

"""LookupEngine over real tiers (in-process hash map + RocksDB files): hierarchy, promotion, defaults, writes."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hps_service.config import ConstantDefault, ModelConfig, TableConfig
from hps_service.engine import NO_ROW_VERSION, LookupEngine, ServedTable, Source, latest_per_key
from hps_service.engine.defaults import default_rows, hashed_random_rows
from hps_service.engine.promote import promote
from hps_service.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from hps_service.tiers.base import Rows
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier

DIM = 8


@pytest.fixture()
def engine(tmp_path: Path):
    eng = LookupEngine(
        volatile=HashMapTier(capacity_rows=1000),
        persistent=RocksDBTier(tmp_path / "db"),
        max_batch_keys=10_000,
    )
    eng.register_model(ModelConfig(name="m", tables=[
        TableConfig(name="t", dim=DIM, default=ConstantDefault(constant=-1.0)),
        TableConfig(name="u", dim=4, default="hashed_random"),
    ]))
    yield eng
    eng.close()


def rows_for(keys: np.ndarray, dim: int = DIM, version: int = 1) -> np.ndarray:
    return (keys[:, None] * 10 + np.arange(dim)[None, :] + version * 1000).astype(np.float32)


def test_levels_answer_in_order_with_duplicates(engine: LookupEngine) -> None:
    keys = np.arange(0, 200, dtype=np.int64)
    engine.volatile.lose_complete("m.t")  # rows written into RocksDB behind the engine: the hash map may lack some
    engine.persistent.bulk_import("m.t", keys, rows_for(keys), version=1)
    query = np.array([5, 5, 1_000_000, 7, 5, -3], dtype=np.int64)
    first = engine.lookup("m", "t", query)
    np.testing.assert_array_equal(first.vectors[[0, 1, 3, 4]], rows_for(query[[0, 1, 3, 4]]))
    np.testing.assert_array_equal(first.vectors[[2, 5]], -1.0)
    assert list(first.sources) == [Source.PERSISTENT, Source.PERSISTENT, Source.DEFAULT, Source.PERSISTENT,
                                   Source.PERSISTENT, Source.DEFAULT]
    second = engine.lookup("m", "t", query)  # promoted into the volatile tier
    np.testing.assert_array_equal(second.vectors, first.vectors)
    assert list(second.sources) == [Source.VOLATILE] * 2 + [Source.DEFAULT, Source.VOLATILE, Source.VOLATILE,
                                                            Source.DEFAULT]
    stats = engine.table_stats("m", "t")
    # the hash map's compiled pass counts every key asked (as L1 does: 6 a lookup); RocksDB is asked only for the
    # unique keys still missing (4, then 2)
    assert stats["volatile"]["hits"] == 4 and stats["volatile"]["misses"] == 6 + 2
    assert stats["persistent"]["hits"] == 2 and stats["persistent"]["misses"] == 2 + 2
    assert stats["default"]["hits"] == 4
    assert stats["volatile"]["rows"] == 2 and stats["persistent"]["rows"] == 200


def test_hashed_random_default_is_deterministic(engine: LookupEngine) -> None:
    keys = np.array([1, 2, 3, 1], dtype=np.int64)
    a = engine.lookup("m", "u", keys).vectors
    np.testing.assert_array_equal(a, hashed_random_rows(keys, 4))
    np.testing.assert_array_equal(a[0], a[3])
    assert not np.array_equal(a[0], a[1])
    assert np.abs(a).max() <= 0.5


def test_updates_reach_every_tier_and_never_go_back(engine: LookupEngine) -> None:
    keys = np.array([1, 2, 3], dtype=np.int64)
    assert engine.apply_updates("m", "t", keys, rows_for(keys, version=5), 5) == 3
    assert engine.apply_updates("m", "t", keys, rows_for(keys, version=4), 4) == 0  # older: ignored
    got = engine.lookup("m", "t", keys)
    np.testing.assert_array_equal(got.vectors, rows_for(keys, version=5))
    assert set(got.sources) == {Source.VOLATILE}
    np.testing.assert_array_equal(engine.persistent.get("m.t", keys).vectors, rows_for(keys, version=5))
    # duplicates in one batch: the highest version wins
    dup = np.array([9, 9, 9], dtype=np.int64)
    vecs = np.stack([np.full(DIM, v, np.float32) for v in (7, 9, 8)])
    engine.apply_updates("m", "t", dup, vecs, np.array([7, 9, 8]))
    np.testing.assert_array_equal(engine.lookup("m", "t", np.array([9])).vectors[0], 9.0)


def test_deletes_fall_back_to_default(engine: LookupEngine) -> None:
    keys = np.array([1, 2], dtype=np.int64)
    engine.apply_updates("m", "t", keys, rows_for(keys), 1)
    assert engine.apply_deletes("m", "t", np.array([1, 1, 77])) == 1
    got = engine.lookup("m", "t", keys)
    assert list(got.sources) == [Source.DEFAULT, Source.VOLATILE]
    np.testing.assert_array_equal(got.vectors[0], -1.0)


def test_bad_input(engine: LookupEngine) -> None:
    with pytest.raises(NotFoundError, match="model 'x'"):
        engine.lookup("x", "t", np.array([1]))
    with pytest.raises(NotFoundError, match="no table 'x'"):
        engine.lookup("m", "x", np.array([1]))
    with pytest.raises(ResourceExhaustedError, match="max_batch_keys=10000"):
        engine.lookup("m", "t", np.arange(10_001))
    with pytest.raises(InvalidArgumentError, match="1-D"):
        engine.lookup("m", "t", np.zeros((2, 2), np.int64))
    with pytest.raises(InvalidArgumentError, match="integers"):
        engine.lookup("m", "t", np.array([1.5]))
    with pytest.raises(InvalidArgumentError, match="shape"):
        engine.apply_updates("m", "t", np.array([1]), np.zeros((1, DIM + 1)), 1)
    with pytest.raises(InvalidArgumentError, match="NaN"):
        engine.apply_updates("m", "t", np.array([1]), np.full((1, DIM), np.nan), 1)


def test_register_and_unregister(engine: LookupEngine) -> None:
    engine.register_model(ModelConfig(name="n", tables=[TableConfig(name="t", dim=2)]))
    assert {m.name for m in engine.models()} == {"m", "n"}
    np.testing.assert_array_equal(engine.lookup("n", "t", np.array([1])).vectors, [[0, 0]])
    engine.unregister_model("n")
    with pytest.raises(NotFoundError):
        engine.lookup("n", "t", np.array([1]))
    assert set(engine.stats()["models"]) == {"m"}


def test_without_volatile_and_persistent(tmp_path: Path) -> None:
    eng = LookupEngine(volatile=None, persistent=RocksDBTier(tmp_path / "db"))
    eng.register_model(ModelConfig(name="m", tables=[TableConfig(name="t", dim=2)]))
    eng.apply_updates("m", "t", np.array([4]), np.ones((1, 2)), 1)
    assert list(eng.lookup("m", "t", np.array([4, 5])).sources) == [Source.PERSISTENT, Source.DEFAULT]
    eng.close()
    only_defaults = LookupEngine(volatile=None, persistent=None)
    only_defaults.register_model(ModelConfig(name="m", tables=[TableConfig(name="t", dim=2)]))
    assert list(only_defaults.lookup("m", "t", np.array([4])).sources) == [Source.DEFAULT]


def test_latest_per_key() -> None:
    keys = np.array([3, 1, 3, 1, 2])
    versions = np.array([5, 1, 5, 2, 0])
    idx = latest_per_key(keys, versions)
    assert sorted(idx.tolist()) == [2, 3, 4]


def test_default_rows_constant() -> None:
    np.testing.assert_array_equal(default_rows(ConstantDefault(constant=0.1), np.array([1, 2]), 3),
                                  np.full((2, 3), 0.1, np.float32))


@pytest.fixture()
def cached_engine(tmp_path: Path):
    from hps_service.cache import build_table_cache
    from hps_service.config import CacheConfig

    cfg = CacheConfig(backend="numpy", capacity=256, ways=8, hit_rate_threshold=1.0, warm_start=False)
    eng = LookupEngine(
        volatile=HashMapTier(capacity_rows=1000),
        persistent=RocksDBTier(tmp_path / "db"),
        cache_factory=lambda t, fetch, warm: build_table_cache(cfg, t.dim, 0, fetch, None, None),
    )
    eng.register_model(ModelConfig(name="m", tables=[TableConfig(name="t", dim=DIM)]))
    yield eng
    eng.close()


def test_cache_serves_repeats_and_follows_updates_and_deletes(cached_engine: LookupEngine) -> None:
    eng = cached_engine
    keys = np.arange(100, dtype=np.int64)
    eng.persistent.bulk_import("m.t", keys, rows_for(keys), version=1)
    first = eng.lookup("m", "t", keys)
    assert set(first.sources) == {Source.PERSISTENT}
    second = eng.lookup("m", "t", keys)
    assert set(second.sources) == {Source.CACHE}
    np.testing.assert_array_equal(second.vectors, rows_for(keys))
    eng.apply_updates("m", "t", keys[:10], rows_for(keys[:10], version=2), 2)
    third = eng.lookup("m", "t", keys[:20])
    assert set(third.sources) == {Source.CACHE}
    np.testing.assert_array_equal(third.vectors[:10], rows_for(keys[:10], version=2))
    np.testing.assert_array_equal(third.vectors[10:], rows_for(keys[10:20]))
    eng.apply_deletes("m", "t", keys[:5])
    fourth = eng.lookup("m", "t", keys[:6])
    assert list(fourth.sources) == [Source.DEFAULT] * 5 + [Source.CACHE]
    stats = eng.table_stats("m", "t")["cache"]
    assert stats["enabled"] and stats["hits"] == 100 + 20 + 1 and stats["capacity"] == 256


def test_versioned_delete_refuses_older_puts_in_every_tier(cached_engine: LookupEngine) -> None:
    eng = cached_engine
    keys = np.arange(50, dtype=np.int64)
    eng.apply_updates("m", "t", keys, rows_for(keys, version=3), 3)
    assert set(eng.lookup("m", "t", keys).sources) == {Source.VOLATILE}
    assert set(eng.lookup("m", "t", keys).sources) == {Source.CACHE}
    assert eng.apply_deletes("m", "t", keys, np.full(50, 2)) == 0  # a lagging delete: the rows stay
    np.testing.assert_array_equal(eng.lookup("m", "t", keys).vectors, rows_for(keys, version=3))
    assert eng.apply_deletes("m", "t", keys, 5) == 50
    assert eng.apply_updates("m", "t", keys, rows_for(keys, version=4), 4) == 0  # a replay older than the delete
    for tier in (eng.volatile, eng.persistent):
        assert not tier.get("m.t", keys).found.any() and tier.count("m.t") == 0
        assert not tier.put("m.t", keys, rows_for(keys, version=4), np.full(50, 4)).any()
    got = eng.lookup("m", "t", keys)
    assert set(got.sources) == {Source.DEFAULT}
    assert eng.apply_updates("m", "t", keys, rows_for(keys, version=6), 6) == 50
    got = eng.lookup("m", "t", keys)
    np.testing.assert_array_equal(got.vectors, rows_for(keys, version=6))
    assert Source.DEFAULT not in got.sources
    for tier in (eng.volatile, eng.persistent):
        np.testing.assert_array_equal(tier.get("m.t", keys).versions, 6)


def _read_from_l3_before_a_delete(engine: LookupEngine) -> tuple[np.ndarray, ServedTable, int, Rows]:
    """20 stored rows read from L3 the way a lookup that missed L2 reads them: (keys, table, write generation
    before the read, rows read)."""
    keys = np.arange(20, dtype=np.int64)
    engine.persistent.put("m.t", keys, rows_for(keys, version=1), np.ones(20, np.int64))
    table = engine.table("m", "t")
    read_at = table.guard.generation
    return keys, table, read_at, engine.persistent.get("m.t", keys)


def test_promotion_of_a_row_read_before_a_delete_is_refused(engine: LookupEngine) -> None:
    keys, table, read_at, read_before = _read_from_l3_before_a_delete(engine)  # a lookup read L3 (L2 missed) ...
    engine.apply_deletes("m", "t", keys, 2)  # ... the delete lands in both tiers ...
    promote(engine.volatile, table, keys, read_before.vectors, read_before.versions, read_at)  # ... then the lookup promotes
    assert not engine.volatile.get("m.t", keys).found.any()
    assert set(engine.lookup("m", "t", keys).sources) == {Source.DEFAULT}


def test_promotion_of_a_row_read_before_an_admin_delete_is_left_out(engine: LookupEngine) -> None:
    """An admin delete carries no version and leaves no tombstone: the write guard keeps the read row out of L2."""
    keys, table, read_at, read_before = _read_from_l3_before_a_delete(engine)
    engine.apply_deletes("m", "t", keys[:10])
    promote(engine.volatile, table, keys, read_before.vectors, read_before.versions, read_at)
    assert engine.volatile.get("m.t", keys).found.tolist() == [False] * 10 + [True] * 10
    assert set(engine.lookup("m", "t", keys[:10]).sources) == {Source.DEFAULT}


def test_a_delete_never_lands_between_the_check_and_the_promotion(engine: LookupEngine) -> None:
    """The promotion checks the write guard and puts under the table's write lock: a delete that comes while it puts
    waits for it, then removes the promoted rows; a promotion while a write holds the lock is skipped."""
    import threading

    keys, table, read_at, read_before = _read_from_l3_before_a_delete(engine)
    put = engine.volatile.put
    deleting: list[threading.Thread] = []

    def put_while_a_delete_comes(table_id: str, *args: np.ndarray) -> np.ndarray:
        deleting.append(threading.Thread(target=engine.apply_deletes, args=("m", "t", keys[:5])))
        deleting[0].start()
        deleting[0].join(0.3)
        assert deleting[0].is_alive(), "the delete did not wait for the promotion's put"
        return put(table_id, *args)

    engine.volatile.put = put_while_a_delete_comes  # type: ignore[method-assign]
    promote(engine.volatile, table, keys, read_before.vectors, read_before.versions, read_at)
    engine.volatile.put = put  # type: ignore[method-assign]
    deleting[0].join(10)
    assert engine.volatile.get("m.t", keys).found.tolist() == [False] * 5 + [True] * 15
    assert set(engine.lookup("m", "t", keys[:5]).sources) == {Source.DEFAULT}
    engine.volatile.delete("m.t", keys)
    with table.guard.lock:  # a write holds the table
        promote(engine.volatile, table, keys, read_before.vectors, read_before.versions, table.guard.generation)
    assert not engine.volatile.get("m.t", keys).found.any()


def test_admin_delete_without_versions_forgets_tombstones(engine: LookupEngine) -> None:
    keys = np.array([1, 2], dtype=np.int64)
    engine.apply_deletes("m", "t", keys, np.array([9, 9]))
    assert engine.apply_updates("m", "t", keys, rows_for(keys), 1) == 0
    assert engine.apply_deletes("m", "t", keys) == 0
    assert engine.apply_updates("m", "t", keys, rows_for(keys), 1) == 2
    with pytest.raises(InvalidArgumentError, match="versions"):
        engine.apply_deletes("m", "t", keys, np.array([1, 2, 3]))


def _wait_for(condition, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_in_process_volatile_tier_is_filled_from_rocksdb_at_load(tmp_path: Path) -> None:
    """A restart over stored rows: the hash map is filled in the background, then lookups never read RocksDB."""
    keys = np.arange(5000, dtype=np.int64) * 3
    store = RocksDBTier(tmp_path / "db")
    store.create_table("m.t", DIM)
    store.bulk_import("m.t", keys, rows_for(keys), version=4)
    store.delete("m.t", keys[:100], np.full(100, 5))  # tombstones are not loaded
    store.close()
    eng = LookupEngine(HashMapTier(capacity_rows=10_000), RocksDBTier(tmp_path / "db"))
    try:
        eng.register_model(ModelConfig(name="m", tables=[TableConfig(name="t", dim=DIM)]))
        _wait_for(lambda: eng.volatile.count("m.t") == 4900)
        answer = eng.lookup("m", "t", keys[100:])
        assert set(answer.sources) == {Source.VOLATILE}
        np.testing.assert_array_equal(answer.vectors, rows_for(keys[100:]))
        assert eng.volatile.get("m.t", keys[100:]).versions.tolist() == [4] * 4900
        assert eng.table_stats("m", "t")["persistent"]["hits"] == 0
    finally:
        eng.close()


def test_table_larger_than_the_volatile_tier_is_not_preloaded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = np.arange(2000, dtype=np.int64)
    store = RocksDBTier(tmp_path / "db")
    store.create_table("m.t", DIM)
    store.bulk_import("m.t", keys, rows_for(keys), version=1)
    store.close()
    eng = LookupEngine(HashMapTier(capacity_rows=1000), RocksDBTier(tmp_path / "db"))
    try:
        with caplog.at_level(logging.INFO, logger="hps_service.engine.preload"):
            eng.register_model(ModelConfig(name="m", tables=[TableConfig(name="t", dim=DIM)]))
        assert "exceed the volatile tier's 1000" in caplog.text
        assert not [th for th in threading.enumerate() if th.name == "hps-preload-m.t"]
        assert eng.volatile.count("m.t") == 0
    finally:
        eng.close()


def test_reads_below_l1_carry_the_rows_versions(engine: LookupEngine) -> None:
    """L2 and L3 rows come with their stored versions (what L1 admission needs); defaults with NO_ROW_VERSION."""
    engine.apply_updates("m", "t", np.array([1, 2]), rows_for(np.array([1, 2])), np.array([7, 9]))
    engine.persistent.put("m.t", np.array([3]), rows_for(np.array([3])), np.array([11]))
    got = engine.reader.fetch_below(engine.table("m", "t"), np.array([1, 2, 3, 4], dtype=np.int64))
    assert got.versions.tolist() == [7, 9, 11, NO_ROW_VERSION]
    assert got.sources.tolist() == [Source.VOLATILE, Source.VOLATILE, Source.PERSISTENT, Source.DEFAULT]
    np.testing.assert_array_equal(got.vectors[:3], rows_for(np.array([1, 2, 3])))

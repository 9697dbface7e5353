"""Admission at ingest (``tables[].admit_after_writes``): the count-min sketch, and the engine's write paths with a
real RocksDB and the in-process hash map (a new key is stored by its N-th write; stored keys, deletes and imports
always pass)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hps_service.cache import build_table_cache
from hps_service.config import CacheConfig, ConstantDefault, ModelConfig, TableConfig
from hps_service.engine import LookupEngine, Source
from hps_service.engine.ingest_admission import MAX_COUNT, IngestFilter, WriteSketch
from hps_service.engine.write import TableChange
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier

DIM = 8
EMPTY = np.zeros(0, np.int64)


# ---- the sketch -----------------------------------------------------------------------------------------------------
def test_counts_never_underestimate_even_when_counters_collide() -> None:
    rng = np.random.default_rng(7)
    sketch = WriteSketch(width_bits=6)  # 64 counters a row for 2000 keys: every counter is shared
    keys = rng.integers(-(2**63), 2**63 - 1, 2000, dtype=np.int64)
    writes = np.repeat(keys, rng.integers(1, 6, keys.shape[0]))
    rng.shuffle(writes)
    for batch in np.array_split(writes, 7):
        sketch.add(batch)
    uniq, true = np.unique(writes, return_counts=True)
    est = sketch.estimate(uniq).astype(np.int64)
    assert (est >= true).all()
    assert (est > true).any(), "the collisions this test relies on happen"


def test_a_wide_sketch_counts_exactly_and_add_returns_the_count_after_each_write() -> None:
    sketch = WriteSketch()
    got = sketch.add(np.array([5, 9, 5, 5, -1, 9], np.int64))
    np.testing.assert_array_equal(got, [1, 1, 2, 3, 1, 2])
    np.testing.assert_array_equal(sketch.add(np.array([5], np.int64)), [4])
    np.testing.assert_array_equal(sketch.estimate(np.array([5, 9, -1, 42], np.int64)), [4, 2, 1, 0])


def test_duplicates_in_one_batch_count_as_separate_writes() -> None:
    one, many = WriteSketch(), WriteSketch()
    keys = np.array([3, 3, 3, 8, 3, 8], np.int64)
    for k in keys:
        one.add(np.array([k]))
    many.add(keys)
    np.testing.assert_array_equal(one.counters, many.counters)
    np.testing.assert_array_equal(many.estimate(np.array([3, 8], np.int64)), [4, 2])


def test_counters_saturate_instead_of_wrapping() -> None:
    sketch = WriteSketch(width_bits=1)
    got = sketch.add(np.full(MAX_COUNT + 10, 11, np.int64))
    assert got[MAX_COUNT - 1] == MAX_COUNT and (got[MAX_COUNT:] == MAX_COUNT).all()
    assert (np.diff(got.astype(np.int64)) >= 0).all()
    sketch.add(np.arange(100, dtype=np.int64))  # other keys on the same saturated counters
    assert sketch.estimate(np.array([11], np.int64))[0] == MAX_COUNT
    assert sketch.counters.max() == MAX_COUNT


def test_a_filter_refuses_a_threshold_out_of_range() -> None:
    with pytest.raises(ValueError):
        IngestFilter(0)
    with pytest.raises(ValueError):
        IngestFilter(MAX_COUNT + 1)


# ---- the engine -----------------------------------------------------------------------------------------------------
def model(after: int) -> ModelConfig:
    return ModelConfig(name="m", tables=[TableConfig(name="t", dim=DIM, default=ConstantDefault(constant=-1.0),
                                                     admit_after_writes=after)])


def engine_for(path: Path | None, after: int, volatile: HashMapTier | None = None) -> LookupEngine:
    cfg = CacheConfig(backend="numpy", capacity=512, ways=8, hit_rate_threshold=0.0, warm_start=False)
    eng = LookupEngine(
        volatile=volatile if volatile is not None else HashMapTier(capacity_rows=10_000),
        persistent=RocksDBTier(path) if path is not None else None,
        cache_factory=lambda t, fetch, warm: build_table_cache(cfg, t.format.words, 0, fetch, None, None),
    )
    eng.register_model(model(after))
    return eng


def row(value: float) -> np.ndarray:
    return np.full((1, DIM), value, np.float32)


def put(eng: LookupEngine, key: int, value: float, version: int) -> int:
    return eng.apply_updates("m", "t", np.array([key], np.int64), row(value), version)


def answer(eng: LookupEngine, key: int) -> tuple[float, Source]:
    got = eng.lookup("m", "t", np.array([key], np.int64))
    assert (got.vectors[0] == got.vectors[0, 0]).all()
    return float(got.vectors[0, 0]), Source(got.sources[0])


def rows_held(eng: LookupEngine) -> dict[str, int]:
    stats = eng.table_stats("m", "t")
    return {level: int(stats[level]["rows"] or 0) for level in ("volatile", "persistent")}


def dropped(eng: LookupEngine) -> int:
    return int(eng.table_stats("m", "t")["admission"]["dropped"] or 0)


def test_a_new_key_is_stored_by_its_nth_write_with_that_writes_row(tmp_path: Path) -> None:
    eng = engine_for(tmp_path / "db", after=3)
    try:
        for version in (1, 2):
            assert put(eng, 7, float(version), version) == 0
            assert answer(eng, 7) == (-1.0, Source.DEFAULT)
        assert put(eng, 9, 9.0, 1) == 0
        assert rows_held(eng) == {"volatile": 0, "persistent": 0}
        assert eng.table_stats("m", "t")["admission"] == {"after_writes": 3, "dropped": 3}
        assert put(eng, 7, 3.0, 3) == 1
        assert answer(eng, 7)[0] == 3.0
        assert put(eng, 7, 4.0, 4) == 1  # every later write too
        assert answer(eng, 7)[0] == 4.0
        assert answer(eng, 9) == (-1.0, Source.DEFAULT)
        assert rows_held(eng) == {"volatile": 1, "persistent": 1}
        assert eng.persistent is not None and eng.persistent.count("m.t") == 1
        assert dropped(eng) == 3
    finally:
        eng.close()


def test_duplicates_in_one_batch_count_and_the_nth_write_wins(tmp_path: Path) -> None:
    eng = engine_for(tmp_path / "db", after=3)
    try:
        keys = np.array([1, 2, 1, 1, 2], np.int64)
        vectors = np.concatenate([row(v) for v in (10.0, 20.0, 11.0, 12.0, 21.0)])
        assert eng.apply_updates("m", "t", keys, vectors, 5) == 1  # one version for all: the last write of 1 wins
        assert answer(eng, 1)[0] == 12.0
        assert answer(eng, 2) == (-1.0, Source.DEFAULT)
        assert dropped(eng) == 4  # two writes of 1, both of 2
        # the earlier writes of a batch are dropped even where their version is newer: the N-th write's row is stored
        keys, versions = np.array([3, 3, 3], np.int64), np.array([9, 8, 7], np.int64)
        assert eng.apply_updates("m", "t", keys, np.concatenate([row(30.0), row(31.0), row(32.0)]), versions) == 1
        assert answer(eng, 3)[0] == 32.0
    finally:
        eng.close()


def test_an_imported_key_is_updated_by_its_first_write_and_deletes_pass(tmp_path: Path) -> None:
    eng = engine_for(tmp_path / "db", after=5)
    try:
        imported = np.arange(100, 110, dtype=np.int64)
        assert eng.import_rows("m", "t", imported, np.ones((10, DIM), np.float32), version=1) == 10  # not filtered
        assert put(eng, 103, 2.0, 2) == 1
        assert answer(eng, 103)[0] == 2.0
        assert dropped(eng) == 0
        assert eng.apply_deletes("m", "t", np.array([104, 105], np.int64), 3) == 2
        assert answer(eng, 104) == (-1.0, Source.DEFAULT)
        assert rows_held(eng)["persistent"] == 8
        # a write of a key whose row was deleted is counted like a new key's
        assert put(eng, 104, 4.0, 4) == 0
        assert answer(eng, 104) == (-1.0, Source.DEFAULT)
    finally:
        eng.close()


def test_the_update_log_path_filters_puts_and_passes_deletes(tmp_path: Path) -> None:
    eng = engine_for(tmp_path / "db", after=2)
    try:
        eng.import_rows("m", "t", np.array([50], np.int64), row(1.0), version=1)

        def change(keys: list[int], version: int, deletes: tuple[int, ...] = ()) -> TableChange:
            k = np.array(keys, np.int64)
            return TableChange("m", "t", k, np.full((k.shape[0], DIM), float(version), np.float32),
                               np.full(k.shape[0], version, np.int64), np.array(deletes, np.int64),
                               np.full(len(deletes), version, np.int64))

        for _ in range(3):
            eng.check_change(change([1], 2))  # a check counts nothing
        results = eng.apply_changes([change([1, 2, 50], 2)], {("topic", 0): 10})
        assert results[0].written.tolist() == [True]  # the imported key alone: 1 and 2 are dropped
        assert answer(eng, 50)[0] == 2.0 and answer(eng, 1) == (-1.0, Source.DEFAULT)
        assert eng.positions() == {("topic", 0): 10}
        results = eng.apply_changes([change([1], 3, deletes=(50,))], {("topic", 0): 11})
        assert results[0].written.tolist() == [True] and results[0].removed == 1
        assert answer(eng, 1)[0] == 3.0
        assert answer(eng, 50) == (-1.0, Source.DEFAULT)
        assert answer(eng, 2) == (-1.0, Source.DEFAULT)
        assert eng.table_stats("m", "t")["admission"] == {"after_writes": 2, "dropped": 2}
        assert rows_held(eng) == {"volatile": 1, "persistent": 1}
    finally:
        eng.close()


def test_after_one_write_stores_everything_without_a_filter(tmp_path: Path) -> None:
    eng = engine_for(tmp_path / "db", after=1)
    try:
        assert eng.table("m", "t").ingest is None
        assert put(eng, 7, 1.0, 1) == 1
        eng.apply_changes([TableChange("m", "t", np.array([8], np.int64), row(2.0), np.array([1]), EMPTY, EMPTY)])
        assert answer(eng, 7)[0] == 1.0 and answer(eng, 8)[0] == 2.0
        assert "admission" not in eng.table_stats("m", "t")
    finally:
        eng.close()


def test_counts_start_again_after_a_restart_but_a_stored_key_passes(tmp_path: Path) -> None:
    eng = engine_for(tmp_path / "db", after=2)
    put(eng, 1, 1.0, 1)
    put(eng, 1, 2.0, 2)
    put(eng, 5, 5.0, 1)
    assert eng.close()
    eng = engine_for(tmp_path / "db", after=2)
    try:
        assert answer(eng, 1)[0] == 2.0
        assert put(eng, 1, 3.0, 3) == 1  # stored in RocksDB: admitted with a fresh count
        assert put(eng, 5, 6.0, 2) == 0  # counted once before the restart, once after
        assert answer(eng, 1)[0] == 3.0 and answer(eng, 5) == (-1.0, Source.DEFAULT)
    finally:
        eng.close()


def test_counts_survive_a_reload_of_the_model(tmp_path: Path) -> None:
    eng = engine_for(tmp_path / "db", after=3)
    try:
        put(eng, 1, 1.0, 1)
        put(eng, 1, 2.0, 2)
        before = eng.table("m", "t")
        eng.register_model(model(3))
        assert eng.table("m", "t") is not before
        assert put(eng, 1, 3.0, 3) == 1
        assert answer(eng, 1)[0] == 3.0 and dropped(eng) == 2
    finally:
        eng.close()


def test_without_a_persistent_tier_a_key_the_volatile_tier_holds_passes() -> None:
    volatile = HashMapTier(capacity_rows=1000)
    eng = engine_for(None, after=2, volatile=volatile)
    try:
        volatile.put("m.t", np.array([4], np.int64), row(1.0), np.array([1], np.int64))  # stored before this engine
        assert put(eng, 4, 2.0, 2) == 1
        assert put(eng, 6, 6.0, 1) == 0
        eng.apply_changes([TableChange("m", "t", np.array([6, 7], np.int64), np.concatenate([row(7.0), row(7.0)]),
                                       np.array([2, 2]), EMPTY, EMPTY)])
        assert answer(eng, 4)[0] == 2.0 and answer(eng, 6)[0] == 7.0
        assert answer(eng, 7) == (-1.0, Source.DEFAULT)
        assert volatile.count("m.t") == 2 and dropped(eng) == 2
    finally:
        eng.close()

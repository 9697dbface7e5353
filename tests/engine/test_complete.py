"""The complete state of a hash-map table (:mod:`hps_service.tiers.hashmap.complete`) through every event that sets or
loses it, on a real engine over RocksDB: set once the preload ends (a restart starts without it), kept by writes,
promotions racing them and an import that fit, lost by an eviction, a put refused for room, an import that does not
fit and a conversion. While it is set a key the hash map does not hold answers the default with
no RocksDB read (a row written into RocksDB behind the engine's back proves it); once lost, RocksDB answers again."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from hps_service.config import ConstantDefault, ModelConfig, TableConfig
from hps_service.engine import LookupEngine
from hps_service.engine import convert as convert_module
from hps_service.engine.levels import DEFAULT, PERSISTENT, VOLATILE
from hps_service.engine.promote import put_read_rows
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier

DIM, DEFAULT_VALUE, ID = 4, -1.0, "m.t"
MODEL = ModelConfig(name="m", tables=[TableConfig(name="t", dim=DIM, default=ConstantDefault(constant=DEFAULT_VALUE))])


def _rows(keys: np.ndarray, version: int) -> np.ndarray:
    return np.repeat(((keys % 1000) * 10 + version).astype(np.float32)[:, None], DIM, axis=1)


def _engine(db: Path, capacity: int) -> LookupEngine:
    engine = LookupEngine(volatile=HashMapTier(capacity_rows=capacity, evict_fraction=0.1),
                          persistent=RocksDBTier(db))
    engine.register_model(MODEL)
    return engine


def _complete(engine: LookupEngine, table_id: str = ID) -> bool:
    assert engine.volatile is not None
    return engine.volatile.is_complete(table_id)


def _wait_complete(engine: LookupEngine, table_id: str = ID, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not _complete(engine, table_id):
        assert time.monotonic() < deadline, "the table never became complete"
        time.sleep(0.01)


def _behind_the_back(engine: LookupEngine, key: int, table_id: str = ID) -> None:
    """A row in RocksDB that the hash map does not hold (no engine write does that while the table is complete)."""
    assert engine.persistent is not None
    engine.persistent.put(table_id, np.array([key], np.int64), _rows(np.array([key]), 9), np.array([9], np.int64))


def _source(engine: LookupEngine, key: int) -> int:
    return int(engine.lookup("m", "t", np.array([key], np.int64)).sources[0])


@pytest.fixture
def engine(tmp_path: Path):  # noqa: ANN201
    eng = _engine(tmp_path / "db", capacity=1000)
    keys = np.arange(1, 801, dtype=np.int64)
    eng.apply_updates("m", "t", keys, _rows(keys, 1), 1)
    assert _complete(eng)  # empty at load, every write since reached the hash map
    yield eng
    eng.close()


def test_while_complete_a_miss_reads_no_rocksdb(engine: LookupEngine) -> None:
    _behind_the_back(engine, 5000)
    assert _source(engine, 5000) == DEFAULT
    engine.volatile.lose_complete(ID)
    assert _source(engine, 5000) == PERSISTENT


def test_an_eviction_loses_it(engine: LookupEngine) -> None:
    fresh = np.arange(2000, 2300, dtype=np.int64)
    engine.apply_updates("m", "t", fresh, _rows(fresh, 1), 1)  # 1100 rows in 1000: an eviction
    assert not _complete(engine)
    assert engine.table_stats("m", "t")["volatile"]["complete_lost"] >= 1
    got = engine.lookup("m", "t", np.arange(1, 801, dtype=np.int64))
    np.testing.assert_array_equal(got.vectors, _rows(np.arange(1, 801), 1))  # the evicted rows from RocksDB
    assert PERSISTENT in got.sources


def test_a_put_refused_for_room_loses_it(tmp_path: Path) -> None:
    engine = _engine(tmp_path / "db", capacity=100)
    try:
        held = np.arange(1, 101, dtype=np.int64)
        engine.apply_updates("m", "t", held, _rows(held, 1), 1)
        assert _complete(engine)
        batch = np.arange(1, 111, dtype=np.int64)  # every row held is in the batch: nothing to evict, 10 refused
        engine.apply_updates("m", "t", batch, _rows(batch, 2), 2)
        assert not _complete(engine)
        got = engine.lookup("m", "t", batch)
        np.testing.assert_array_equal(got.vectors, _rows(batch, 2))
        assert (got.sources[100:] == PERSISTENT).all()
    finally:
        engine.close()


def test_an_import_that_fits_keeps_it_and_one_that_does_not_loses_it(engine: LookupEngine) -> None:
    fits = np.arange(700, 900, dtype=np.int64)  # 100 rows replaced, 100 new: 900 of 1000
    engine.import_rows("m", "t", fits, _rows(fits, 2), version=2)
    assert _complete(engine)
    got = engine.lookup("m", "t", fits)
    np.testing.assert_array_equal(got.vectors, _rows(fits, 2))
    assert (got.sources == VOLATILE).all()
    _behind_the_back(engine, 5000)
    assert _source(engine, 5000) == DEFAULT
    too_many = np.arange(3000, 3300, dtype=np.int64)
    engine.import_rows("m", "t", too_many, _rows(too_many, 3), version=3)
    assert not _complete(engine)
    got = engine.lookup("m", "t", np.concatenate([too_many, [5000]]))
    np.testing.assert_array_equal(got.vectors[:-1], _rows(too_many, 3))
    assert got.sources[-1] == PERSISTENT


def test_a_promotion_racing_a_write_keeps_it(engine: LookupEngine) -> None:
    """A promotion (or preload) puts under the table's write lock, so a write never lands between its check and its
    put: it never takes a row back out of L2, and the table stays complete whatever the order."""
    import threading

    assert engine.volatile is not None
    t = engine.table("m", "t")
    keys = np.array([1, 2], np.int64)
    read_at = t.guard.generation
    engine.apply_updates("m", "t", keys, _rows(keys, 5), 5)
    assert put_read_rows(engine.volatile, t, keys, _rows(keys, 1), np.ones(2, np.int64), read_at)
    read_at = t.guard.generation
    with t.guard.lock:  # a write runs: a promotion does not wait for it, a preload does
        assert not put_read_rows(engine.volatile, t, keys, _rows(keys, 1), np.ones(2, np.int64), read_at)
        waiting = threading.Thread(target=put_read_rows, args=(engine.volatile, t, keys, _rows(keys, 1),
                                                               np.ones(2, np.int64), read_at, True))
        waiting.start()
        engine.writer.apply_updates(t, keys, _rows(keys, 6), 6)
    waiting.join(10)
    assert _complete(engine)
    got = engine.lookup("m", "t", keys)
    np.testing.assert_array_equal(got.vectors, _rows(keys, 6))
    assert (got.sources == VOLATILE).all()


def test_a_restart_is_not_complete_until_its_preload_ends(tmp_path: Path) -> None:
    db = tmp_path / "db"
    first = _engine(db, capacity=400_000)
    keys = np.arange(1, 300_001, dtype=np.int64)
    first.import_rows("m", "t", keys, _rows(keys, 1), version=1)
    first.close()
    engine = _engine(db, capacity=400_000)
    try:
        assert engine.preloader.loading(ID) and not _complete(engine)
        _wait_complete(engine)
        assert not engine.preloader.loading(ID)
        got = engine.lookup("m", "t", np.array([1, 300_000, 300_001], np.int64))
        assert got.sources.tolist() == [VOLATILE, VOLATILE, DEFAULT]
    finally:
        engine.close()
    small = _engine(db, capacity=1000)  # more stored rows than the hash map takes: never complete
    try:
        time.sleep(0.2)
        assert not _complete(small) and not small.preloader.loading(ID)
    finally:
        small.close()


def test_a_conversion_loses_it_and_the_converted_table_is_complete_after_its_preload(
        engine: LookupEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert_module, "DROP_GRACE_S", 0.0)
    old = engine.table("m", "t")
    engine.convert_table("m", "t", "fp16")
    new = engine.table("m", "t")
    assert new.id != old.id and new.storage == "fp16"
    _wait_complete(engine, new.id)
    got = engine.lookup("m", "t", np.arange(1, 802, dtype=np.int64))
    np.testing.assert_allclose(got.vectors[:800], _rows(np.arange(1, 801), 1), rtol=1e-3)
    assert got.sources[-1] == DEFAULT


def test_the_old_table_of_a_conversion_loses_it_at_the_switch(engine: LookupEngine,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    old = engine.table("m", "t")
    lost: list[bool] = []
    switch = convert_module._switch

    def record(eng: LookupEngine, tier: object, t: object, conv: object) -> None:
        switch(eng, tier, t, conv)  # type: ignore[arg-type]
        lost.append(not _complete(eng, old.id))

    monkeypatch.setattr(convert_module, "_switch", record)
    monkeypatch.setattr(convert_module, "DROP_GRACE_S", 0.0)
    engine.convert_table("m", "t", "bf16")
    assert lost == [True]

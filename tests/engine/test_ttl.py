"""Row TTL (``tables[].ttl_s``) in the engine, with a real RocksDB, the in-process hash map and L1: a row is
answered until ``ttl_s`` seconds after its write time and with the default and EXPIRED after; the write time comes
from the update message, is stored with the row (a restart, a conversion, a snapshot restore keep it), and the
sweeper removes expired rows without touching a row written again. Time moves by replacing ``ttl.clock``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from hps_service.cache import build_table_cache
from hps_service.config import CacheConfig, ConstantDefault, ModelConfig, TableConfig
from hps_service.engine import LookupEngine, Source, ttl
from hps_service.engine import convert as convert_module
from hps_service.engine.write import TableChange
from hps_service.errors import InvalidArgumentError
from hps_service.proto.hps.v1.update_pb2 import EmbeddingUpdate
from hps_service.rows import STORAGES, row_format
from hps_service.tiers.base import table_id
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier
from hps_service.updates.batch import TableBatch, table_change
from hps_service.updates.message import decode_update, encode_update

DIM, TTL = 6, 100
T0 = 1_790_000_000  # a write time (2026)
EMPTY = np.zeros(0, np.int64)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock(T0)
    monkeypatch.setattr(ttl, "clock", c)
    return c


def model(storage: str = "fp32", ttl_s: int | None = TTL) -> ModelConfig:
    return ModelConfig(name="m", tables=[TableConfig(name="t", dim=DIM, storage=storage, ttl_s=ttl_s,
                                                     default=ConstantDefault(constant=-1.0))])


def engine_for(path: Path, storage: str = "fp32", volatile: bool = True, cache: bool = True) -> LookupEngine:
    cfg = CacheConfig(backend="numpy", capacity=512, ways=8, hit_rate_threshold=1.0, warm_start=False)
    eng = LookupEngine(
        volatile=HashMapTier(capacity_rows=10_000) if volatile else None,
        persistent=RocksDBTier(path),
        cache_factory=(lambda t, fetch, warm: build_table_cache(cfg, t.format.words, 0, fetch, None, None))
        if cache else None,
    )
    eng.register_model(model(storage))
    return eng


def rows_of(keys: np.ndarray, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-2, 2, (keys.shape[0], DIM)).astype(np.float32)


def expected(storage: str, rows: np.ndarray) -> np.ndarray:
    fmt = row_format(storage, DIM)
    return fmt.decoded(fmt.encode(rows))


def assert_live(eng: LookupEngine, keys: np.ndarray, rows: np.ndarray, storage: str, source: Source) -> None:
    got = eng.lookup("m", "t", keys)
    assert (got.sources == source).all(), got.sources
    np.testing.assert_array_equal(got.vectors, expected(storage, rows))


def assert_expired(eng: LookupEngine, keys: np.ndarray) -> None:
    got = eng.lookup("m", "t", keys)
    assert (got.sources == Source.EXPIRED).all(), got.sources
    assert (got.vectors == -1.0).all()


# ---- every tier answers a row until its TTL, the default and EXPIRED after ------------------------------------------
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("level", ["cache", "volatile", "persistent"])
def test_a_row_is_answered_until_its_ttl_and_expired_after_at_every_level(tmp_path: Path, clock: Clock,
                                                                          storage: str, level: str) -> None:
    eng = engine_for(tmp_path / "db", storage, volatile=level != "persistent", cache=level == "cache")
    keys = np.arange(10, 20, dtype=np.int64)
    rows = rows_of(keys, 1)
    try:
        assert eng.apply_updates("m", "t", keys, rows, 1) == keys.shape[0]
        source = {"cache": Source.CACHE, "volatile": Source.VOLATILE, "persistent": Source.PERSISTENT}[level]
        clock.now = T0 + TTL - 1
        if level == "cache":
            assert_live(eng, keys, rows, storage, Source.VOLATILE)  # read through, then admitted to L1
        assert_live(eng, keys, rows, storage, source)
        clock.now = T0 + TTL + 1
        assert_expired(eng, keys)
        missing = eng.lookup("m", "t", np.array([999], np.int64))  # a key never written is a plain default
        assert missing.sources.tolist() == [Source.DEFAULT] and (missing.vectors == -1.0).all()
        mixed = np.array([11, 999, 12], np.int64)  # an expired row, a default and another expired row
        got = eng.lookup("m", "t", mixed)
        assert got.sources.tolist() == [Source.EXPIRED, Source.DEFAULT, Source.EXPIRED]
        clock.now = T0 + TTL - 1  # the stored row was never changed: earlier clocks still see it
        assert_live(eng, keys, rows, storage, source)
    finally:
        eng.close()


@pytest.mark.parametrize("storage", ["fp32", "int8"])
def test_write_times_survive_a_restart(tmp_path: Path, clock: Clock, storage: str) -> None:
    keys = np.arange(5, dtype=np.int64)
    rows = rows_of(keys, 2)
    eng = engine_for(tmp_path / "db", storage)
    eng.apply_updates("m", "t", keys, rows, 1)
    eng.close()
    clock.now = T0 + 50  # the restart does not stamp the rows again
    eng = engine_for(tmp_path / "db", storage, volatile=False, cache=False)
    try:
        clock.now = T0 + TTL - 1
        assert_live(eng, keys, rows, storage, Source.PERSISTENT)
        clock.now = T0 + TTL + 1
        assert_expired(eng, keys)
    finally:
        eng.close()


def test_a_table_without_ttl_stores_unstamped_rows_and_never_expires(tmp_path: Path, clock: Clock) -> None:
    eng = LookupEngine(volatile=None, persistent=RocksDBTier(tmp_path / "db"))
    eng.register_model(model(ttl_s=None))
    try:
        keys = np.arange(3, dtype=np.int64)
        eng.apply_updates("m", "t", keys, rows_of(keys, 3), 1)
        assert eng.table("m", "t").format.words == DIM
        clock.now = T0 + 10 * 365 * 86400
        assert (eng.lookup("m", "t", keys).sources == Source.PERSISTENT).all()
    finally:
        eng.close()


def test_ttl_cannot_be_set_on_or_removed_from_a_stored_table(tmp_path: Path, clock: Clock) -> None:
    eng = LookupEngine(volatile=None, persistent=RocksDBTier(tmp_path / "db"))
    eng.register_model(model(ttl_s=None))
    eng.apply_updates("m", "t", np.arange(3, dtype=np.int64), rows_of(np.arange(3), 1), 1)
    with pytest.raises(InvalidArgumentError, match="ttl_s cannot be set on a table"):
        eng.register_model(model())
    eng.close()
    eng = LookupEngine(volatile=None, persistent=RocksDBTier(tmp_path / "db2"))
    eng.register_model(model())
    with pytest.raises(InvalidArgumentError, match="ttl_s cannot be removed from a table"):
        eng.register_model(model(ttl_s=None))
    eng.register_model(model(ttl_s=TTL * 2))  # another TTL: the rows are the same
    assert eng.table("m", "t").ttl_s == TTL * 2
    eng.close()


def test_an_offline_import_stamps_its_rows_with_the_time_of_the_import(tmp_path: Path, clock: Clock) -> None:
    import time

    from hps_service.admin.importer import write_hugectr_dir
    from tests.helpers import run_hps, write_config

    keys = np.arange(40, dtype=np.int64)
    rows = rows_of(keys, 14)
    write_hugectr_dir(tmp_path / "model", keys, rows)
    cfg = write_config(tmp_path / "hps.yaml", {
        "volatile": {"type": "disabled"}, "persistent": {"type": "rocksdb", "path": str(tmp_path / "db")},
        "models": [model("int8").model_dump(mode="json")]})
    started = time.time()
    done = run_hps("import", "--config", str(cfg), "--model", "m", "--table", "t", str(tmp_path / "model"))
    assert done.returncode == 0, done.stderr
    eng = engine_for(tmp_path / "db", "int8", volatile=False, cache=False)
    try:
        clock.now = started + TTL - 1  # stamped during the import (at or after started, by the real clock)
        assert_live(eng, keys, rows, "int8", Source.PERSISTENT)
        clock.now = time.time() + TTL + 1
        assert_expired(eng, keys)
    finally:
        eng.close()


# ---- the write time is the update message's --------------------------------------------------------------------------
def test_a_change_carries_its_rows_write_times(tmp_path: Path, clock: Clock) -> None:
    eng = engine_for(tmp_path / "db")
    try:
        keys = np.array([1, 2, 3], np.int64)
        rows = rows_of(keys, 4)
        written = np.array([T0 - TTL + 1, T0 - TTL - 1, T0], np.int64)  # applied now, produced earlier
        eng.apply_changes([TableChange("m", "t", keys, rows, np.full(3, 7, np.int64), EMPTY, EMPTY, written)])
        got = eng.lookup("m", "t", keys)
        assert got.sources.tolist() == [Source.VOLATILE, Source.EXPIRED, Source.VOLATILE]
        np.testing.assert_array_equal(got.vectors[[0, 2]], rows[[0, 2]])
        clock.now = T0 + 2  # the first row is older than the TTL now, the last is not
        got = eng.lookup("m", "t", keys)
        assert got.sources.tolist() == [Source.EXPIRED, Source.EXPIRED, Source.CACHE]  # admitted by the first
        np.testing.assert_array_equal(got.vectors[2], rows[2])
    finally:
        eng.close()


def test_update_messages_stamp_their_rows_with_produced_at(tmp_path: Path, clock: Clock) -> None:
    """Two messages decoded as the consumer decodes them, one produced 2 TTLs ago and one just now, batched into
    one change: each row keeps its own message's time, whatever the clock when it is applied."""
    eng = engine_for(tmp_path / "db", "fp16")
    try:
        batch = TableBatch()
        for key, produced_s in ((1, T0 - 2 * TTL), (2, T0 - 1)):
            msg = EmbeddingUpdate()
            msg.ParseFromString(encode_update("m", "t", np.array([key], np.int64), rows_of(np.array([key]), key),
                                              np.array([key], np.int64)))
            msg.produced_at_ns = produced_s * 1_000_000_000 + 999_999_999
            batch.add(decode_update(msg.SerializeToString()), None)  # type: ignore[arg-type]  # no broker message
        change = table_change("m", "t", [batch], DIM)
        assert change.written_s is not None and change.written_s.tolist() == [T0 - 2 * TTL, T0 - 1]
        clock.now = T0 + 1000  # applied late: the stamps are the messages', not the apply time
        eng.apply_changes([change])
        clock.now = T0
        assert eng.lookup("m", "t", np.array([1, 2], np.int64)).sources.tolist() == [Source.EXPIRED,
                                                                                    Source.VOLATILE]
    finally:
        eng.close()


# ---- the sweeper --------------------------------------------------------------------------------------------------
def test_the_sweeper_removes_expired_rows_and_keeps_rows_written_again(tmp_path: Path, clock: Clock) -> None:
    eng = engine_for(tmp_path / "db")
    try:
        keys = np.arange(100, 110, dtype=np.int64)
        eng.apply_updates("m", "t", keys, rows_of(keys, 5), 1)
        eng.lookup("m", "t", keys)
        eng.lookup("m", "t", keys)  # in L1 too
        clock.now = T0 + TTL + 50  # expired; three keys written again (a newer version) after they expired
        again = keys[:3]
        eng.apply_updates("m", "t", again, rows_of(again, 6), 2)
        clock.now = T0 + TTL + 60
        tid = table_id("m", "t")
        assert eng.persistent is not None and eng.volatile is not None
        assert eng.persistent.count(tid) == 10
        assert eng.sweeper.sweep() == 7
        assert eng.persistent.count(tid) == 3 and eng.volatile.count(tid) == 3
        assert eng.sweeper.sweep() == 0
        assert_live(eng, again, rows_of(again, 6), "fp32", Source.CACHE)
        rest = keys[3:]
        got = eng.lookup("m", "t", rest)  # gone from every tier and L1: a plain default now
        assert (got.sources == Source.DEFAULT).all()
        # the deletes are versioned at the rows' own version: a replay of the expired write stays out
        assert eng.apply_updates("m", "t", rest[:1], rows_of(rest[:1], 5), 1) == 0
        assert eng.apply_updates("m", "t", rest[:1], rows_of(rest[:1], 7), 3) == 1
        assert eng.persistent.count(tid) == 4
    finally:
        eng.close()


def test_the_sweeper_reads_the_table_a_stretch_at_a_time(tmp_path: Path, clock: Clock,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from hps_service.engine import expiry_sweep

    monkeypatch.setattr(expiry_sweep, "STRETCH_ENTRIES", 16)
    eng = engine_for(tmp_path / "db", "int8", volatile=False, cache=False)
    try:
        keys = np.arange(-50, 50, dtype=np.int64)
        eng.apply_updates("m", "t", keys, rows_of(keys, 8), 1)
        fresh = keys[::3]
        clock.now = T0 + 60
        eng.apply_updates("m", "t", fresh, rows_of(fresh, 9), 2)
        clock.now = T0 + TTL + 30
        assert eng.sweeper.sweep() == keys.shape[0] - fresh.shape[0]
        assert eng.persistent is not None and eng.persistent.count(table_id("m", "t")) == fresh.shape[0]
        assert_live(eng, fresh, rows_of(fresh, 9), "int8", Source.PERSISTENT)
    finally:
        eng.close()


# ---- stored precision, conversions, restores ---------------------------------------------------------------------
def test_stored_precision_is_refused_on_a_ttl_table(tmp_path: Path, clock: Clock) -> None:
    eng = engine_for(tmp_path / "db", "int8")
    try:
        with pytest.raises(InvalidArgumentError, match="ttl_s"):
            eng.lookup("m", "t", np.array([1], np.int64), stored=True)
    finally:
        eng.close()


def test_a_conversion_keeps_the_write_times(tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert_module, "DROP_GRACE_S", 0.0)
    eng = engine_for(tmp_path / "db")
    try:
        keys = np.arange(20, dtype=np.int64)
        rows = rows_of(keys, 10)
        eng.apply_updates("m", "t", keys, rows, 1)
        clock.now = T0 + 40  # converted later: the copy keeps the rows' own write times
        eng.convert_table("m", "t", "int8")
        assert eng.table("m", "t").format == row_format("int8", DIM, stamped=True)
        clock.now = T0 + TTL - 1
        got = eng.lookup("m", "t", keys)
        assert (got.sources != Source.EXPIRED).all()
        np.testing.assert_array_equal(got.vectors, expected("int8", rows))
        clock.now = T0 + TTL + 1
        assert_expired(eng, keys)
    finally:
        eng.close()


def test_a_snapshot_restore_keeps_the_write_times(tmp_path: Path, clock: Clock) -> None:
    from hps_service.admin.checkpoints import DirectoryStore
    from hps_service.admin.jobs import Job
    from hps_service.admin.snapshots import Snapshots

    eng = engine_for(tmp_path / "db", "bf16")
    try:
        snapshots = Snapshots(eng, DirectoryStore(tmp_path / "snapshots"))
        keys = np.arange(30, dtype=np.int64)
        rows = rows_of(keys, 11)
        eng.apply_updates("m", "t", keys, rows, 1)
        snap = snapshots.create("m")
        clock.now = T0 + 20
        eng.apply_updates("m", "t", keys, rows_of(keys, 12), 2)
        clock.now = T0 + 80  # restored late: the restored rows keep their write time T0
        result = snapshots.restore("m", snap["id"], Job(id="j", kind="restore", target={}))
        assert result["tables"]["t"]["rows_restored"] == keys.shape[0]
        clock.now = T0 + TTL - 1
        assert_live(eng, keys, rows, "bf16", Source.VOLATILE)
        clock.now = T0 + TTL + 1
        assert_expired(eng, keys)
    finally:
        eng.close()


# ---- the config -------------------------------------------------------------------------------------------------
def test_the_config_refuses_a_ttl_the_table_cannot_hold() -> None:
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        TableConfig(name="t", dim=4, ttl_s=0)
    with pytest.raises(ValidationError, match="less than or equal to"):
        TableConfig(name="t", dim=4, ttl_s=10 * 365 * 86400 + 1)
    with pytest.raises(ValidationError, match="ttl_s stores one more word per row"):
        TableConfig(name="t", dim=16384, ttl_s=60)  # fp32 rows already as wide as a tier holds
    assert TableConfig(name="t", dim=16384, storage="fp16", ttl_s=60).ttl_s == 60
    assert TableConfig(name="t", dim=16383, ttl_s=60).ttl_s == 60


def test_stamped_formats_strip_the_stamp_before_decoding() -> None:
    """int8 keeps its scale and bias in its last two words: the stamp after them is never read as either."""
    for storage in STORAGES:
        plain, stamped = row_format(storage, DIM), row_format(storage, DIM, stamped=True)
        rows = rows_of(np.arange(4), 13)
        encoded = stamped.encode(rows, np.array([T0, T0 + 1, 0, 2**32 - 1]))
        assert encoded.shape == (4, plain.words + 1)
        assert stamped.stamps(encoded).tolist() == [T0, T0 + 1, 0, 2**32 - 1]
        np.testing.assert_array_equal(encoded[:, :-1], plain.encode(rows))
        np.testing.assert_array_equal(stamped.decoded(encoded), plain.decoded(plain.encode(rows)))
        with pytest.raises(ValueError, match="write time"):
            stamped.encode(rows)

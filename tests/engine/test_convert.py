"""A table converted to another row format while it is served: the copy converges to the table under concurrent
writes (rows, versioned deletes, stale replays), lookups never fail or answer a row nobody wrote, the old rows are
freed, and a restart serves the converted format whatever the config says."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from hps_service.cache import build_table_cache
from hps_service.config import CacheConfig, ConstantDefault, ModelConfig, TableConfig
from hps_service.engine import LookupEngine, Source, TableChange
from hps_service.engine import convert as convert_module
from hps_service.engine.stored_tables import converting_key, stored_table
from hps_service.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.rows import row_format, storage_key
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier

DIM = 16
DEFAULT = -1.0


@pytest.fixture(autouse=True)
def _short_stretches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert_module, "STRETCH_ENTRIES", 64)  # many stretches, writes between them
    monkeypatch.setattr(convert_module, "DROP_GRACE_S", 0.0)


def engine_for(path: Path, storage: str = "fp32", volatile: bool = True) -> LookupEngine:
    cfg = CacheConfig(backend="numpy", capacity=256, ways=8, hit_rate_threshold=1.0, warm_start=False)
    eng = LookupEngine(
        volatile=HashMapTier(capacity_rows=100_000) if volatile else None,
        persistent=RocksDBTier(path),
        cache_factory=lambda t, fetch, warm: build_table_cache(cfg, t.format.words, 0, fetch, None, None),
    )
    eng.register_model(ModelConfig(name="m", tables=[
        TableConfig(name="t", dim=DIM, storage=storage, default=ConstantDefault(constant=DEFAULT)),
        TableConfig(name="u", dim=4)]))
    return eng


def rows_of(keys: np.ndarray, version: int) -> np.ndarray:
    """A deterministic row per (key, version), so that any answer names the write it came from."""
    rng = np.random.default_rng(version)
    base = rng.standard_normal((1, DIM)).astype(np.float32)
    return (base + (keys.astype(np.float32) % 997)[:, None] / 100).astype(np.float32)


def test_a_table_is_converted_and_stays_converted_across_a_restart(tmp_path: Path) -> None:
    eng = engine_for(tmp_path / "db")
    keys = np.concatenate((np.arange(1000, dtype=np.int64), np.array([-1, -(2**63), 2**63 - 1], np.int64)))
    eng.apply_updates("m", "t", keys, rows_of(keys, 1), 1)
    eng.apply_deletes("m", "t", keys[:10], 2)  # tombstones travel too: a replay older than them stays out
    eng.apply_updates("m", "u", np.arange(5, dtype=np.int64), np.ones((5, 4), np.float32), 1)
    result = eng.convert_table("m", "t", "int8")
    assert result["to"] == "int8" and result["stored_as"] == "m.t@1"
    assert result["entries_copied"] == keys.shape[0]
    t = eng.table("m", "t")
    assert (t.storage, t.id) == ("int8", "m.t@1")
    assert next(tc for tc in eng.model("m").tables if tc.name == "t").storage == "int8"
    fmt = row_format("int8", DIM)
    want = fmt.decoded(fmt.encode(rows_of(keys[10:], 1)))
    np.testing.assert_array_equal(eng.lookup("m", "t", keys[10:]).vectors, want)
    gone = eng.lookup("m", "t", keys[:10])
    assert (gone.sources == Source.DEFAULT).all()
    assert eng.apply_updates("m", "t", keys[:10], rows_of(keys[:10], 1), 1) == 0  # the tombstones refuse it
    assert "m.t" not in eng.persistent.tables() and "m.t@1" in eng.persistent.tables()
    with pytest.raises(NotFoundError):  # the hash map freed the old rows
        eng.volatile.stats("m.t")
    assert eng.persistent.count("m.t@1") == keys.shape[0] - 10
    eng.close()

    eng = engine_for(tmp_path / "db")  # the config still says fp32: the store says int8
    t = eng.table("m", "t")
    assert (t.storage, t.id) == ("int8", "m.t@1")
    np.testing.assert_array_equal(eng.lookup("m", "t", keys[10:]).vectors, want)
    np.testing.assert_array_equal(eng.lookup("m", "u", np.arange(5, dtype=np.int64)).vectors, 1.0)
    again = eng.convert_table("m", "t", "fp32")  # back: the int8 rows, exactly, as float32
    assert again["stored_as"] == "m.t@2"
    np.testing.assert_array_equal(eng.lookup("m", "t", keys[10:]).vectors, want)
    assert set(eng.persistent.tables()) == {"m.t@2", "m.u"}
    eng.close()


def test_writes_during_a_conversion_reach_the_converted_table(tmp_path: Path) -> None:
    """Rows, versioned deletes and stale replays from the log keep coming while the table is copied; lookups keep
    being answered, each with a row some write wrote (in either format) or the default; the converted table ends
    holding each key's newest write."""
    eng = engine_for(tmp_path / "db")
    keys = np.arange(3000, dtype=np.int64) * 7919 - 10_000
    eng.apply_updates("m", "t", keys, rows_of(keys, 1), 1)
    rng = np.random.default_rng(0)
    newest: dict[int, int] = dict.fromkeys(keys.tolist(), 1)  # key -> version of its newest put; 0: deleted
    stop = threading.Event()
    errors: list[BaseException] = []
    versions_written = [1]
    history: dict[int, list[int]] = {k: [1] for k in keys.tolist()}  # key -> versions put, in order

    def writer() -> None:
        version = 1
        try:
            while not stop.is_set():
                version += 1
                batch = rng.choice(keys, 200, replace=False)
                puts, dels = batch[:150], batch[150:]
                stale = rng.choice(keys, 20, replace=False)  # a replay older than what is stored
                for k in puts.tolist():
                    history[k].append(version)  # before the write: a reader may see it from now on
                eng.apply_changes([TableChange("m", "t", np.concatenate((puts, stale)),
                                               np.concatenate((rows_of(puts, version), rows_of(stale, 0))),
                                               np.concatenate((np.full(150, version), np.zeros(20, np.int64))),
                                               dels, np.full(50, version))])
                for k in puts.tolist():
                    newest[k] = version
                for k in dels.tolist():
                    newest[k] = 0
                versions_written.append(version)
        except BaseException as exc:  # noqa: BLE001  # reported by the test
            errors.append(exc)

    def reader() -> None:
        try:
            while not stop.is_set():
                ask = rng.choice(keys, 256)
                got = eng.lookup("m", "t", ask)
                served = got.sources != Source.DEFAULT
                assert (got.vectors[~served] == DEFAULT).all()
                int8 = row_format("int8", DIM)
                for k, row in zip(ask[served][:8].tolist(), got.vectors[served][:8]):
                    candidates = [rows_of(np.array([k]), v)[0] for v in list(history[k])]
                    assert any(np.array_equal(row, c) or np.array_equal(row, int8.decoded(int8.encode(c[None]))[0])
                               for c in candidates), f"key {k} answered a row nobody wrote: {history[k]}"
        except BaseException as exc:  # noqa: BLE001  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for th in threads:
        th.start()
    try:
        result = eng.convert_table("m", "t", "int8")
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not errors, errors
    assert len(versions_written) > 3, "the writer must have written during the conversion"
    assert result["entries_copied"] >= keys.shape[0]
    fmt = row_format("int8", DIM)
    got = eng.lookup("m", "t", keys)
    for i, k in enumerate(keys.tolist()):
        v = newest[k]
        if v == 0:
            assert got.sources[i] == Source.DEFAULT, f"deleted key {k} answered a row"
        else:
            want = fmt.decoded(fmt.encode(rows_of(np.array([k]), v)))[0]
            np.testing.assert_array_equal(got.vectors[i], want, err_msg=f"key {k} version {v}")
    eng.close()


def test_a_write_the_new_format_cannot_hold_stops_the_conversion_not_the_write(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine_for(tmp_path / "db")
    keys = np.arange(500, dtype=np.int64)
    eng.apply_updates("m", "t", keys, rows_of(keys, 1), 1)
    real_copy = convert_module._copy

    def copy_with_a_big_write(*args: object) -> int:
        big = np.full((1, DIM), 1e6, np.float32)  # beyond fp16's range
        assert eng.apply_updates("m", "t", np.array([7], np.int64), big, 5) == 1
        return real_copy(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(convert_module, "_copy", copy_with_a_big_write)
    with pytest.raises(FailedPreconditionError, match="fp16"):
        eng.convert_table("m", "t", "fp16")
    t = eng.table("m", "t")
    assert (t.storage, t.id, t.converting) == ("fp32", "m.t", None)
    assert eng.lookup("m", "t", np.array([7], np.int64)).vectors[0, 0] == 1e6
    assert set(eng.persistent.tables()) == {"m.t", "m.u"}
    assert not eng.persistent.metadata("converting/")
    eng.close()


def test_conversions_that_cannot_run_say_why(tmp_path: Path) -> None:
    eng = engine_for(tmp_path / "db", storage="fp16")
    with pytest.raises(FailedPreconditionError, match="already stored as fp16"):
        eng.convert_table("m", "t", "fp16")
    with pytest.raises(InvalidArgumentError, match="unknown row storage"):
        eng.convert_table("m", "t", "fp8")
    eng.close()
    memory_only = LookupEngine(volatile=HashMapTier(capacity_rows=10), persistent=None)
    memory_only.register_model(ModelConfig(name="m", tables=[TableConfig(name="t", dim=DIM)]))
    with pytest.raises(UnavailableError, match="persistent.type rocksdb"):
        memory_only.convert_table("m", "t", "int8")
    memory_only.close()


def test_a_start_drops_the_copy_an_interrupted_conversion_left(tmp_path: Path) -> None:
    eng = engine_for(tmp_path / "db")
    keys = np.arange(100, dtype=np.int64)
    eng.apply_updates("m", "t", keys, rows_of(keys, 1), 1)
    eng.close()
    store = RocksDBTier(tmp_path / "db")  # what a stop in the middle of a copy leaves
    store.set_metadata(converting_key("m.t"), b"m.t@1")
    store.create_table("m.t@1", row_format("int8", DIM).words)
    store.set_metadata(storage_key("m.t@1"), b"int8")
    store.close()
    eng = engine_for(tmp_path / "db")
    assert set(eng.persistent.tables()) == {"m.t", "m.u"}
    assert stored_table(eng.persistent, "m", "t").id == "m.t"
    np.testing.assert_array_equal(eng.lookup("m", "t", keys).vectors, rows_of(keys, 1))
    assert eng.convert_table("m", "t", "bf16")["stored_as"] == "m.t@1"
    eng.close()


def test_snapshots_before_and_after_a_conversion_restore_into_the_converted_table(tmp_path: Path) -> None:
    from hps_service.admin.checkpoints import DirectoryStore
    from hps_service.admin.jobs import Job
    from hps_service.admin.snapshots import Snapshots

    eng = engine_for(tmp_path / "db")
    snapshots = Snapshots(eng, DirectoryStore(tmp_path / "snapshots"))
    keys = np.arange(-200, 300, dtype=np.int64)
    eng.apply_updates("m", "t", keys, rows_of(keys, 1), 1)
    before = snapshots.create("m")  # fp32 rows under m.t
    eng.convert_table("m", "t", "int8")
    eng.apply_updates("m", "t", keys, rows_of(keys, 2), 2)
    after = snapshots.create("m")  # int8 rows under m.t@1
    eng.apply_updates("m", "t", keys, rows_of(keys, 3), 3)
    int8 = row_format("int8", DIM)
    for snap, version in ((before, 1), (after, 2)):
        result = snapshots.restore("m", snap["id"], Job(id="j", kind="restore", target={}))
        assert result["tables"]["t"]["rows_restored"] == keys.shape[0]
        np.testing.assert_array_equal(eng.lookup("m", "t", keys).vectors,
                                      int8.decoded(int8.encode(rows_of(keys, version))))
    eng.close()


def test_a_lookup_that_resolved_the_old_table_reads_the_converted_one(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup slower than the grace period finds the old rows dropped: it reads the table where it is now, and
    never answers NOT_FOUND for a table that is served."""
    eng = engine_for(tmp_path / "db", volatile=False)
    keys = np.arange(2000, dtype=np.int64)  # more than the L1 holds: the old table's read reaches RocksDB
    eng.apply_updates("m", "t", keys, rows_of(keys, 1), 1)
    old = eng.table("m", "t")
    eng.convert_table("m", "t", "int8")
    with pytest.raises(NotFoundError, match="m.t does not exist"):
        eng.reader.lookup(old, keys)
    current = eng.table
    resolved: list[str] = []

    def stale_first(model: str, table: str):  # noqa: ANN202
        resolved.append(table)
        return old if len(resolved) == 1 else current(model, table)

    monkeypatch.setattr(eng, "table", stale_first)
    int8 = row_format("int8", DIM)
    np.testing.assert_array_equal(eng.lookup("m", "t", keys).vectors, int8.decoded(int8.encode(rows_of(keys, 1))))
    assert len(resolved) == 2
    eng.close()

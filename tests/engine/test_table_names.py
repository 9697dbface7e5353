"""Tier ids are never used twice: a table registered again after a drop, and each conversion's copy, get an id no
table of that name had, kept in RocksDB's metadata across restarts (in memory without a persistent tier)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hps_service.config import ModelConfig, TableConfig
from hps_service.engine import LookupEngine
from hps_service.engine.stored_tables import TableNames
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier


def versioned_model(version: int) -> ModelConfig:
    return ModelConfig(name="m", version=version, tables=[TableConfig(name="item", dim=4)])


def test_a_name_dropped_and_claimed_again_gets_a_fresh_id_and_keeps_it(tmp_path: Path) -> None:
    tier = RocksDBTier(tmp_path / "db")
    names = TableNames(tier)
    first = names.claim("m#v2", "item")
    assert (first.id, first.converted) == ("m#v2.item", False)
    names.retire(first.id)
    second = names.claim("m#v2", "item")
    assert (second.id, second.converted) == ("m#v2.item@1", True)
    assert names.claim("m#v2", "item").id == "m#v2.item@1"  # a replace keeps the table where it is
    copy = names.new_id("m#v2.item", second.id)  # a conversion's copy, abandoned: never handed out again
    assert copy == "m#v2.item@2"
    assert names.new_id("m#v2.item", second.id) == "m#v2.item@3"
    names.retire(second.id)
    tier.close()
    reopened = RocksDBTier(tmp_path / "db")
    assert TableNames(reopened).claim("m#v2", "item").id == "m#v2.item@4"
    assert TableNames(reopened).claim("m#v1", "item").id == "m#v1.item"  # names never dropped stay as they are
    reopened.close()


def test_without_a_persistent_tier_ids_are_fresh_for_the_process_life() -> None:
    names = TableNames(None)
    assert names.claim("m", "t").id == "m.t"
    names.retire("m.t")
    assert names.claim("m", "t").id == "m.t@1"
    names.retire("m.t@1")
    assert names.claim("m", "t").id == "m.t@2"


def test_a_read_only_store_serves_where_its_writer_recorded(tmp_path: Path) -> None:
    tier = RocksDBTier(tmp_path / "db")
    names = TableNames(tier)
    names.retire(names.claim("m", "t").id)
    assert names.claim("m", "t").id == "m.t@1"
    tier.close()
    ro = RocksDBTier(tmp_path / "db", read_only=True)
    assert TableNames(ro).claim("m", "t").id == "m.t@1"
    ro.close()


def test_an_engine_version_dropped_and_added_again_starts_empty_under_a_new_id(tmp_path: Path) -> None:
    """Through the engine: the re-added version's rows live under a new column family and hash-map table; the old
    ones are gone, and a restart serves the new id."""
    def engine() -> LookupEngine:
        return LookupEngine(HashMapTier(10_000), RocksDBTier(tmp_path / "db"))

    eng = engine()
    base = versioned_model(0)
    eng.register_model(base)
    eng.add_version(versioned_model(2))
    keys = np.arange(1, 9, dtype=np.int64)
    eng.apply_updates("m#v2", "item", keys, np.ones((8, 4), np.float32), 1)
    old_id = eng.table("m#v2", "item").id
    eng.drop_version("m", 2)
    eng.add_version(versioned_model(2))
    t = eng.table("m#v2", "item")
    assert t.id != old_id and old_id not in eng.persistent.tables()  # type: ignore[union-attr]
    assert (eng.lookup("m#v2", "item", keys).vectors == 0).all()
    eng.apply_updates("m#v2", "item", keys, np.full((8, 4), 2, np.float32), 2)
    new_id = t.id
    eng.close()
    again = engine()
    again.register_model(base)
    again.register_model(versioned_model(2))
    assert again.table("m#v2", "item").id == new_id
    assert (again.lookup("m#v2", "item", keys).vectors == 2).all()
    again.close()


def test_a_label_switch_and_a_drop_of_its_version_never_leave_the_label_naming_a_dropped_version(
        tmp_path: Path) -> None:
    """Run side by side, either the switch or the drop wins: the label names a loaded version, or the drop was
    refused because the label named its version."""
    import threading

    from hps_service.errors import FailedPreconditionError, NotFoundError

    eng = LookupEngine(HashMapTier(10_000), RocksDBTier(tmp_path / "db"))
    eng.register_model(versioned_model(0))
    for version in range(1, 41):
        eng.add_version(versioned_model(version).model_copy(update={"keep_versions": 100}))
        start = threading.Barrier(2)

        def switch(v: int = version, start: threading.Barrier = start) -> None:
            start.wait()
            try:
                eng.set_label("m", "production", v)
            except NotFoundError:
                pass

        def drop(v: int = version, start: threading.Barrier = start) -> None:
            start.wait()
            try:
                eng.drop_version("m", v)
            except FailedPreconditionError:
                pass

        threads = [threading.Thread(target=switch), threading.Thread(target=drop)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        named = eng.labels.of("m").get("production")
        assert named is None or named in {v.version for v in eng.versions("m")} | {0}, (version, named)
    eng.close()

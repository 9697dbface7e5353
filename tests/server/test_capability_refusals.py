"""Imports, snapshots and restores ask the persistent tier's capabilities, and refuse with the messages they always
gave: a disabled tier, one without the capability (the hash map) and a read-only RocksDB."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hps_service.admin.checkpoints import DirectoryStore
from hps_service.admin.jobs import Job, import_tier
from hps_service.admin.snapshots import Snapshots
from hps_service.config import ModelConfig, TableConfig
from hps_service.engine import LookupEngine
from hps_service.errors import UnavailableError
from hps_service.fleet.bucket import SnapshotBucket
from hps_service.fleet.snapshots import BucketStore
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier

NOT_ROCKSDB = "persistent.type rocksdb"
READ_ONLY = "needs a writable persistent tier, but persistent.read_only is true"


def _engine(persistent: str, tmp_path: Path) -> LookupEngine:
    if persistent == "disabled":
        tier = None
    elif persistent == "hashmap":
        tier = HashMapTier(capacity_rows=64)
    else:
        writable = RocksDBTier(tmp_path / "db", block_cache_mb=8)
        writable.create_table("m.t", 2)
        writable.close()
        tier = RocksDBTier(tmp_path / "db", read_only=True, block_cache_mb=8)
    engine = LookupEngine(None, tier)
    engine.register_model(ModelConfig(name="m", tables=[TableConfig(name="t", dim=2)]))
    return engine


@pytest.fixture(params=["disabled", "hashmap"])
def without(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LookupEngine]:
    engine = _engine(request.param, tmp_path)
    yield engine
    engine.close()


def test_import_refuses_a_tier_that_cannot_bulk_load(without: LookupEngine) -> None:
    with pytest.raises(UnavailableError, match=f"^import needs {NOT_ROCKSDB}$"):
        import_tier(without)
    with pytest.raises(UnavailableError, match=r"^import needs a persistent tier that bulk-loads \(persistent.type"):
        without.import_rows("m", "t", np.arange(2, dtype=np.int64), np.ones((2, 2), np.float32))


def test_snapshots_refuse_a_tier_that_cannot_checkpoint_or_export(without: LookupEngine, tmp_path: Path) -> None:
    store = Snapshots(without, DirectoryStore(tmp_path / "snapshots"))
    with pytest.raises(UnavailableError, match=f"^snapshots need {NOT_ROCKSDB}$"):
        store.create("m")
    (tmp_path / "snapshots").mkdir()
    (tmp_path / "snapshots" / "s1").mkdir()
    (tmp_path / "snapshots" / "s1.json").write_text('{"model": "m", "tables": {}}')
    with pytest.raises(UnavailableError, match=f"^restore needs {NOT_ROCKSDB}$"):
        store.restore("m", "s1", Job(id="j", kind="restore", target={}))
    fleet = Snapshots(without, BucketStore(SnapshotBucket("s3://never-reached/snapshots"), tmp_path / "work", lambda m: []))
    with pytest.raises(UnavailableError, match=f"^snapshots need {NOT_ROCKSDB}$"):
        fleet.take("m")


def test_a_read_only_rocksdb_refuses_imports_and_restores_but_checkpoints(tmp_path: Path) -> None:
    engine = _engine("read_only", tmp_path)
    try:
        with pytest.raises(UnavailableError, match=f"^import {READ_ONLY}$"):
            import_tier(engine)
        store = Snapshots(engine, DirectoryStore(tmp_path / "snapshots"))
        meta = store.create("m")
        with pytest.raises(UnavailableError, match=f"^restore {READ_ONLY}$"):
            store.restore("m", meta["id"], Job(id="j", kind="restore", target={}))
    finally:
        engine.close()

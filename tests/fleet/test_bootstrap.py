"""Bootstrap of an empty RocksDB from the snapshot store (SeaweedFS), without a server: the newest complete snapshot
is restored with its positions; a corrupt one is skipped for the next newest; a store holding data is left alone;
snapshots of several models merge into one store."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from hps_service.fleet.bootstrap import BootstrapProgress, bootstrap
from hps_service.fleet.store import SnapshotBucket
from hps_service.tiers.base import TableWrite
from hps_service.tiers.rocksdb import RocksDBTier

DIM = 4


def _snapshot(bucket: SnapshotBucket, tmp: Path, model: str, rows: int, offset: int) -> dict:
    """A store holding ``rows`` rows of ``model.t`` applied up to ``offset``, uploaded as a snapshot."""
    db = RocksDBTier(tmp / f"src-{model}-{rows}")
    tid = f"{model}.t"
    db.create_table(tid, DIM)
    keys = np.arange(rows, dtype=np.int64)
    db.write([TableWrite(tid, keys, np.full((rows, DIM), rows, np.float32), np.ones(rows, np.int64),
                         np.empty(0, np.int64), None)], {(f"hps.{model}", 0): offset, ("hps.other", 0): 99})
    info = db.export(tmp / f"exp-{model}-{rows}", [tid], {f"hps.{model}"})
    db.close()
    return bucket.upload(model, tmp / f"exp-{model}-{rows}", {"tables": {"t": info["tables"][tid]},
                                                               "positions": []})


def test_newest_complete_snapshot_restored_and_corrupt_one_skipped(bucket, tmp_path, caplog) -> None:
    old = _snapshot(bucket, tmp_path, "m", 100, 7)
    new = _snapshot(bucket, tmp_path, "m", 200, 9)
    sst = next(e["name"] for e in new["files"] if e["name"].endswith(".sst"))
    bucket.client.put_object(Bucket=bucket.bucket, Key=bucket._key("m", new["id"], "files", sst), Body=b"garbage")
    progress = BootstrapProgress()
    with caplog.at_level(logging.WARNING):
        assert bootstrap(tmp_path / "db", bucket, ["m"], progress) == {"m": old["id"]}
    assert f"skipping snapshot {new['id']}" in caplog.text
    assert progress.state == "done" and progress.bytes_done == progress.bytes_total == old["bytes"]
    db = RocksDBTier(tmp_path / "db")
    assert db.count("m.t") == 100 and db.positions() == {("hps.m", 0): 7}  # only the model's own positions
    db.close()
    again = BootstrapProgress()
    assert bootstrap(tmp_path / "db", bucket, ["m"], again) == {} and again.state == "not_needed"


def test_snapshots_of_two_models_merge_and_a_model_without_one_starts_empty(bucket, tmp_path) -> None:
    a = _snapshot(bucket, tmp_path, "a", 50, 3)
    b = _snapshot(bucket, tmp_path, "b", 70, 4)
    assert bootstrap(tmp_path / "db", bucket, ["a", "b", "c"], BootstrapProgress()) == {
        "a": a["id"], "b": b["id"], "c": None}
    db = RocksDBTier(tmp_path / "db")
    assert db.count("a.t") == 50 and db.count("b.t") == 70
    assert db.positions() == {("hps.a", 0): 3, ("hps.b", 0): 4}
    assert np.array_equal(db.get("b.t", np.array([69])).vectors, np.full((1, DIM), 70, np.float32))
    db.close()

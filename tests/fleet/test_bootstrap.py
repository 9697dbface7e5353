"""Bootstrap of an empty RocksDB from the snapshot store (SeaweedFS), without a server: the newest complete snapshot
is restored with its positions; a corrupt one is skipped for the next newest; a store holding data is left alone;
snapshots of several models merge into one store; a bootstrap killed part-way finishes its unfinished models on the next
start."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from hps_service.fleet.bootstrap import BootstrapProgress, bootstrap, bootstrap_states
from hps_service.fleet.bucket import SnapshotBucket
from hps_service.tiers.base import TableWrite
from hps_service.tiers.rocksdb.tier import RocksDBTier

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


class _Killed(BaseException):
    """What a SIGKILL does to a bootstrap, at a seam: nothing after it runs (no handler catches it)."""


def test_a_bootstrap_killed_part_way_finishes_the_unfinished_models_on_the_next_start(
        bucket, tmp_path, monkeypatch) -> None:
    """Three models, the third without a snapshot; the process dies while the second one's tables are being
    adopted (one table created and a few rows in it). The next start bootstraps that model again (its partial
    table dropped first) and the third, and leaves the first alone (issue 27, defect 5). Before: the store held
    data, so the next start did no bootstrap at all and served the second model empty, and ready."""
    ids = {m: _snapshot(bucket, tmp_path, m, rows, offset)["id"] for m, rows, offset in
           (("a", 50, 3), ("b", 70, 4))}
    real_adopt = RocksDBTier.adopt

    def killed_mid_adopt(tier: RocksDBTier, src: Path) -> list[str]:
        snapshot = RocksDBTier(src, read_only=True, block_cache_mb=8)
        second = "b.t" in snapshot.tables()
        snapshot.close()
        if second:
            tier.create_table("b.t", DIM)
            tier.write([TableWrite("b.t", np.arange(5, dtype=np.int64), np.zeros((5, DIM), np.float32),
                                   np.ones(5, np.int64), np.empty(0, np.int64), None)])
            raise _Killed
        return real_adopt(tier, src)

    monkeypatch.setattr(RocksDBTier, "adopt", killed_mid_adopt)
    with pytest.raises(_Killed):
        bootstrap(tmp_path / "db", bucket, ["a", "b", "c"], BootstrapProgress())
    monkeypatch.setattr(RocksDBTier, "adopt", real_adopt)
    assert bootstrap_states(tmp_path / "db") == {"a": "done", "b": "pending", "c": "pending"}

    again = BootstrapProgress()
    assert bootstrap(tmp_path / "db", bucket, ["a", "b", "c"], again) == {"b": ids["b"], "c": None}
    assert bootstrap_states(tmp_path / "db") == {"a": "done", "b": "done", "c": "none"}
    db = RocksDBTier(tmp_path / "db")
    assert {t: db.count(t) for t in db.tables()} == {"a.t": 50, "b.t": 70}
    assert db.positions() == {("hps.a", 0): 3, ("hps.b", 0): 4}
    assert np.array_equal(db.get("b.t", np.array([3])).vectors, np.full((1, DIM), 70, np.float32))
    db.close()
    assert bootstrap(tmp_path / "db", bucket, ["a", "b", "c"], BootstrapProgress()) == {}  # nothing unfinished



@pytest.mark.parametrize("how", ["configured", "converted"])
def test_a_quantised_table_bootstraps_in_its_format(bucket, tmp_path, monkeypatch, how: str) -> None:
    """A snapshot carries how each table is stored (its format record, and where a conversion moved it), so a
    replica bootstrapped from it serves the same int8 rows, whatever its config says."""
    from hps_service.admin.snapshots import Snapshots
    from hps_service.config import ModelConfig, TableConfig
    from hps_service.engine import LookupEngine
    from hps_service.engine import convert as convert_module
    from hps_service.fleet.snapshots import BucketStore
    from hps_service.rows import row_format

    monkeypatch.setattr(convert_module, "DROP_GRACE_S", 0.0)
    dim = 24

    def engine(path: Path, storage: str) -> LookupEngine:
        eng = LookupEngine(None, RocksDBTier(path))
        eng.register_model(ModelConfig(name="q", tables=[TableConfig(name="t", dim=dim, storage=storage)]))
        return eng

    keys = np.arange(-500, 500, dtype=np.int64)
    vectors = np.random.default_rng(4).standard_normal((keys.size, dim)).astype(np.float32)
    src = engine(tmp_path / "src", "int8" if how == "configured" else "fp32")
    src.apply_updates("q", "t", keys, vectors, 3)
    if how == "converted":
        src.convert_table("q", "t", "int8")
    manifest = Snapshots(src, BucketStore(bucket, tmp_path / "work", lambda m: [])).take("q")
    assert manifest["tables"]["t"]["dim"] == dim and manifest["tables"]["t"]["storage"] == "int8"
    src.close()
    assert bootstrap(tmp_path / "replica", bucket, ["q"], BootstrapProgress()) == {"q": manifest["id"]}
    replica = engine(tmp_path / "replica", "int8" if how == "configured" else "fp32")
    assert replica.table("q", "t").storage == "int8"
    int8 = row_format("int8", dim)
    np.testing.assert_array_equal(replica.lookup("q", "t", keys).vectors, int8.decoded(int8.encode(vectors)))
    replica.close()


def test_a_snapshot_that_a_conversion_overtook_is_refused(bucket, tmp_path, monkeypatch) -> None:
    """A conversion that switches while a bucket snapshot exports the table would leave a snapshot of the old rows
    named as the new: the snapshot is refused (taken again later), never uploaded."""
    from hps_service.admin.snapshots import Snapshots
    from hps_service.config import ModelConfig, TableConfig
    from hps_service.engine import LookupEngine
    from hps_service.engine import convert as convert_module
    from hps_service.errors import UnavailableError
    from hps_service.fleet.snapshots import BucketStore

    monkeypatch.setattr(convert_module, "DROP_GRACE_S", 0.0)
    eng = LookupEngine(None, RocksDBTier(tmp_path / "src"))
    eng.register_model(ModelConfig(name="r", tables=[TableConfig(name="t", dim=8)]))
    eng.apply_updates("r", "t", np.arange(10, dtype=np.int64), np.ones((10, 8), np.float32), 1)
    tier = eng.persistent
    export = tier.export

    def export_then_convert(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        info = export(*args, **kwargs)
        eng.convert_table("r", "t", "fp16")
        return info

    monkeypatch.setattr(tier, "export", export_then_convert)
    with pytest.raises(UnavailableError, match="converted while it was exported"):
        Snapshots(eng, BucketStore(bucket, tmp_path / "work", lambda m: [])).take("r")
    assert bucket.list("r") == []
    eng.close()


def test_a_snapshot_carries_the_models_versions_and_labels(bucket, tmp_path) -> None:
    """A bucket snapshot of a model holds its versions (their tables and registrations) and its labels, so a
    replica bootstrapped from it serves every version, and the one its label production names, as the source did."""
    from hps_service.admin.snapshots import Snapshots
    from hps_service.config import ModelConfig, TableConfig
    from hps_service.engine import LookupEngine
    from hps_service.fleet.registrations import serve_registered, sync_registrations
    from hps_service.fleet.snapshots import BucketStore

    model = ModelConfig(name="v", tables=[TableConfig(name="t", dim=DIM)])
    keys = np.arange(100, dtype=np.int64)
    src = LookupEngine(None, RocksDBTier(tmp_path / "src"))
    src.register_model(model)
    src.apply_updates("v", "t", keys, np.full((keys.size, DIM), 1.0, np.float32), 1)
    for version in (1, 2):
        src.add_version(model.model_copy(update={"version": version}))
        src.apply_updates(f"v#v{version}", "t", keys, np.full((keys.size, DIM), 1.0 + version, np.float32), 1)
    src.set_label("v", "production", 2)
    sync_registrations(src.persistent, {"v"}, src.served_models())  # what the server does after a registration
    manifest = Snapshots(src, BucketStore(bucket, tmp_path / "work", lambda m: [])).take("v")
    assert manifest["versions"]["2"]["t"]["rows"] == keys.size and set(manifest["versions"]) == {"1", "2"}
    src.close()
    assert bootstrap(tmp_path / "replica", bucket, ["v"], BootstrapProgress()) == {"v": manifest["id"]}
    replica = LookupEngine(None, RocksDBTier(tmp_path / "replica"))
    replica.register_model(model)
    serve_registered(replica, {"v"})  # what a start does with the stored registrations
    assert [m.version for m in replica.versions("v")] == [1, 2]
    assert replica.resolve("v") == ("v#v2", 2)
    for version in (0, 1, 2):
        name = f"v#v{version}" if version else "v"
        assert (replica.lookup(name, "t", keys).vectors == 1.0 + version).all()
    replica.close()

"""Versions in the engine: a new version's L1 warms from the keys hot in the version served now, and retention's
arithmetic (the new version counted, labelled ones never dropped)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hps_service.config import HPSConfig, ModelConfig, TableConfig
from hps_service.engine.versions import resolve, to_drop
from hps_service.serve.build import build_engine

DIM = 8


def test_a_new_versions_l1_warms_from_the_hot_keys_of_the_version_served_now(tmp_path: Path) -> None:
    model = ModelConfig(name="m", tables=[TableConfig(name="item", dim=DIM)])
    engine = build_engine(HPSConfig(
        cache={"enabled": True, "backend": "numpy", "capacity": 256, "warm_start": True},
        volatile={"type": "hashmap", "capacity_rows": 50_000},
        persistent={"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        models=[model],
    ))
    try:
        rng = np.random.default_rng(4)
        keys = rng.choice(2**40, 20_000, replace=False).astype(np.int64)
        rows = rng.standard_normal((keys.size, DIM)).astype(np.float32)
        engine.import_rows("m", "item", keys, rows, version=1)
        hot = keys[rng.choice(keys.size, 128, replace=False)]
        for _ in range(4):  # hot in the model's L1
            engine.lookup("m", "item", hot)
        base = engine.table("m", "item").cache
        assert base is not None
        base.flush()
        assert base.lookup(hot, np.empty((hot.size, DIM), np.float32)).all()
        tier = engine.persistent
        assert tier is not None
        tier.create_table("m#v1.item", DIM)  # version 1's rows, imported before it is added (hps import)
        tier.bulk_import("m#v1.item", keys, rows * 2, version=1)
        engine.add_version(model.model_copy(update={"version": 1}))
        cache = engine.table("m#v1", "item").cache
        assert cache is not None and cache.wait_warm(30)
        out = np.empty((hot.size, DIM), np.float32)
        hit = cache.lookup(hot, out)
        assert hit.mean() > 0.9, hit.mean()  # not the first keys in RocksDB's order: the hot ones
        row_of = {int(k): i for i, k in enumerate(keys.tolist())}
        np.testing.assert_array_equal(out[hit], (rows * 2)[[row_of[int(k)] for k in hot]][hit])  # version 1's rows
    finally:
        engine.close()


def test_retention_and_resolution_rules() -> None:
    versions = [ModelConfig(name="m", version=v, tables=[TableConfig(name="t", dim=1)]) for v in (1, 2, 3, 4, 5)]
    assert [v.version for v in to_drop(versions, {2}, 2)] == [1, 3]
    assert [v.version for v in to_drop(versions, set(), 5)] == []
    assert [v.version for v in to_drop(versions, {1, 2, 3, 4, 5}, 1)] == []
    served = {"m", "m#v3"}
    assert resolve({}, served, "m") == ("m", 0)
    assert resolve({"m": {"production": 3}}, served, "m") == ("m#v3", 3)
    assert resolve({"m": {"production": 3, "old": 0}}, served, "m", label="old") == ("m", 0)
    assert resolve({}, served, "m", version=3) == ("m#v3", 3)

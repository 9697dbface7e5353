"""Quantised tables through the whole hierarchy (L1, hash map, RocksDB files): every level answers the same
decoded row, within the format's bound of the written one, and a store refuses to be read as another format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hps_service.cache import build_table_cache
from hps_service.config import CacheConfig, ConstantDefault, ModelConfig, TableConfig
from hps_service.engine import LookupEngine, Source
from hps_service.errors import InvalidArgumentError
from hps_service.rows import STORAGES, row_format
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier

DIM = 64


def engine_for(path: Path, storage: str, cache: bool = True) -> LookupEngine:
    cfg = CacheConfig(backend="numpy", capacity=512, ways=8, hit_rate_threshold=1.0, warm_start=False)
    eng = LookupEngine(
        volatile=HashMapTier(capacity_rows=10_000),
        persistent=RocksDBTier(path),
        cache_factory=(lambda t, fetch, warm: build_table_cache(cfg, t.format.words, 0, fetch, None, None))
        if cache else None,
    )
    eng.register_model(ModelConfig(name="m", tables=[
        TableConfig(name="t", dim=DIM, storage=storage, default=ConstantDefault(constant=-1.0))]))
    return eng


def rows(keys: np.ndarray, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((keys.shape[0], DIM)).astype(np.float32) * 2


@pytest.mark.parametrize("storage", STORAGES)
def test_every_level_answers_the_decoded_row(tmp_path: Path, storage: str) -> None:
    fmt = row_format(storage, DIM)
    eng = engine_for(tmp_path / "db", storage)
    keys = np.array([0, 1, -1, 2**63 - 1, -(2**63), 77, 12345], dtype=np.int64)
    written = rows(keys, 1)
    eng.apply_updates("m", "t", keys, written, 1)
    want = fmt.decoded(fmt.encode(written))
    query = np.concatenate((keys, keys[:3], np.array([999], np.int64)))
    seen = set()
    for _ in range(3):  # L1 after the write, then (dropped from L1 and L2) L3, then L2 and L1 again
        got = eng.lookup("m", "t", query)
        np.testing.assert_array_equal(got.vectors[:-1], np.concatenate((want, want[:3])))
        np.testing.assert_array_equal(got.vectors[-1], -1.0)
        assert got.sources[-1] == Source.DEFAULT
        seen |= set(got.sources[:-1].tolist())
        t = eng.table("m", "t")
        assert t.cache is not None
        t.cache.invalidate(keys)
        eng.volatile.delete("m.t", keys)
    assert {Source.PERSISTENT} <= seen
    err = np.abs(want - written).max()
    assert err == 0 if storage == "fp32" else 0 < err < 0.05
    newer = rows(keys[:2], 2)
    eng.apply_updates("m", "t", keys[:2], newer, 2)
    np.testing.assert_array_equal(eng.lookup("m", "t", keys[:2]).vectors, fmt.decoded(fmt.encode(newer)))
    eng.close()


@pytest.mark.parametrize("storage", ["fp16", "int8"])
def test_stored_bytes_shrink_and_a_reopened_store_keeps_its_format(tmp_path: Path, storage: str) -> None:
    keys = np.arange(1000, dtype=np.int64)
    written = rows(keys, 3)
    for s in ("fp32", storage):
        eng = engine_for(tmp_path / s, s, cache=False)
        eng.import_rows("m", "t", keys, written, version=1)
        eng.close()
    eng = engine_for(tmp_path / storage, storage, cache=False)
    fmt = row_format(storage, DIM)
    np.testing.assert_array_equal(eng.lookup("m", "t", keys).vectors, fmt.decoded(fmt.encode(written)))
    assert eng.volatile.memory_bytes()  # the hash map holds the stored rows it promoted
    eng.close()
    other = "bf16" if storage == "fp16" else "fp32"
    with pytest.raises(InvalidArgumentError, match=f"stored as {storage}, not {other}"):
        engine_for(tmp_path / storage, other, cache=False)


def test_fp16_refuses_an_update_beyond_its_range(tmp_path: Path) -> None:
    eng = engine_for(tmp_path / "db", "fp16")
    with pytest.raises(InvalidArgumentError, match="fp16's range"):
        eng.apply_updates("m", "t", np.array([1], np.int64), np.full((1, DIM), 1e6, np.float32), 1)
    assert eng.lookup("m", "t", np.array([1], np.int64)).sources[0] == Source.DEFAULT
    eng.close()


@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_a_redis_cluster_holds_and_answers_the_stored_rows(tmp_path: Path, redis_cluster_clean, storage: str
                                                           ) -> None:
    from hps_service.tiers.redis.tier import RedisClusterTier

    fmt = row_format(storage, DIM)
    eng = LookupEngine(volatile=RedisClusterTier(redis_cluster_clean.nodes, partitions=16),
                       persistent=RocksDBTier(tmp_path / "db"))
    eng.register_model(ModelConfig(name="m", tables=[TableConfig(name="t", dim=DIM, storage=storage)]))
    keys = np.arange(-50, 50, dtype=np.int64)
    written = rows(keys, 4)
    eng.apply_updates("m", "t", keys, written, 1)
    got = eng.lookup("m", "t", keys)
    assert set(got.sources.tolist()) == {Source.VOLATILE}
    np.testing.assert_array_equal(got.vectors, fmt.decoded(fmt.encode(written)))
    eng.close()

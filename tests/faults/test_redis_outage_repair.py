"""A Redis master that misses updates while it hangs comes back with old rows: the engine rewrites them from
RocksDB, so no stale row is served once the node answers again (real 3-master cluster, real RocksDB)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from hps_service.config import ModelConfig, TableConfig
from hps_service.engine import LookupEngine, Source
from hps_service.tiers.redis_cluster import RedisClusterTier
from hps_service.tiers.rocksdb.tier import RocksDBTier

DIM = 4


def rows(keys: np.ndarray, version: int) -> np.ndarray:
    return np.repeat((keys * 10 + version).astype(np.float32)[:, None], DIM, axis=1)


def test_rows_missed_during_a_hang_are_rewritten(redis_cluster_clean, tmp_path: Path) -> None:
    cluster = redis_cluster_clean
    volatile = RedisClusterTier(cluster.nodes, partitions=16, socket_timeout_s=0.3, node_retry_after_s=0.5)
    engine = LookupEngine(volatile, RocksDBTier(tmp_path / "db"), repair_interval_s=0.2)
    engine.register_model(ModelConfig(name="m", tables=[TableConfig(name="t", dim=DIM)]))
    keys = np.arange(1, 901, dtype=np.int64)
    try:
        engine.apply_updates("m", "t", keys, rows(keys, 1), 1)
        assert set(engine.lookup("m", "t", keys).sources) == {Source.VOLATILE}
        cluster.pause(1)
        try:
            engine.apply_updates("m", "t", keys, rows(keys, 2), 2)  # the hung node's third misses version 2
            engine.apply_deletes("m", "t", keys[:30], versions=3)
            during = engine.lookup("m", "t", keys)  # its keys come from RocksDB meanwhile: fresh
            np.testing.assert_array_equal(during.vectors[30:], rows(keys[30:], 2))
        finally:
            cluster.resume(1)
        # the node is back holding version 1 of its keys; within a few repair rounds they are rewritten
        deadline = time.monotonic() + 30
        while True:
            got = engine.lookup("m", "t", keys)
            fresh = np.array_equal(got.vectors[30:], rows(keys[30:], 2)) and set(got.sources[:30]) == {Source.DEFAULT}
            if fresh and set(got.sources[30:]) == {Source.VOLATILE}:
                break
            assert time.monotonic() < deadline, "stale rows still served 30 s after the node came back"
            time.sleep(0.1)
        assert volatile.stats("m.t").extra["node_failures"] >= 1
    finally:
        engine.close()

"""Admission at ingest through the update consumer: a real broker, the server's engine (hash map L2 + RocksDB L3)."""

from __future__ import annotations

import numpy as np

from hps_service.config import HPSConfig, ModelConfig, TableConfig
from hps_service.engine import Source
from hps_service.serve.build import build_engine
from hps_service.updates import Publisher, UpdateConsumer, make_version
from tests.updates.conftest import DIM, TABLE, rows_for, served, wait_until


def test_the_consumer_stores_a_new_key_on_its_third_write(kafka_broker, updates_cfg, tmp_path, model_name) -> None:
    engine = build_engine(HPSConfig(
        cache={"backend": "numpy", "capacity": 10_000, "warm_start": False},
        volatile={"type": "hashmap", "capacity_rows": 10_000},
        persistent={"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        models=[ModelConfig(name=model_name, tables=[TableConfig(name=TABLE, dim=DIM, admit_after_writes=3)])],
    ))
    consumer = UpdateConsumer(updates_cfg, engine, [model_name], "pod-0", partitions=4)
    try:
        imported = np.array([1000], np.int64)
        engine.import_rows(model_name, TABLE, imported, rows_for(imported, 1), version=1)
        consumer.start()
        assert consumer.wait_ready(30), consumer.stats()
        pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
        often, twice = np.array([7, 8], np.int64), np.array([9], np.int64)
        for i in (1, 2, 3):
            version = make_version(1, i)
            keys = np.concatenate((often, twice, imported)) if i < 3 else often
            pub.publish(TABLE, keys, rows_for(keys, version), version)
            pub.flush()
        third = make_version(1, 3)
        assert wait_until(lambda: np.array_equal(served(engine, model_name, often)[0], rows_for(often, third)),
                          timeout=60), consumer.stats()
        assert wait_until(lambda: set(consumer.stats()["consumer_lag"].values()) == {0}, timeout=30), consumer.stats()
        vectors, sources = served(engine, model_name, np.concatenate((twice, imported)))
        assert sources[0] == Source.DEFAULT  # written twice: never stored
        np.testing.assert_array_equal(vectors[1], rows_for(imported, make_version(1, 2))[0])  # imported: updated
        stats = engine.table_stats(model_name, TABLE)
        assert stats["admission"] == {"after_writes": 3, "dropped": 6}  # 7 and 8 twice each, 9 twice
        assert stats["persistent"]["rows"] == 3
    finally:
        consumer.stop()
        engine.close()

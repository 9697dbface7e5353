"""Updates of model versions through the update consumer (a real broker): a message's model_version routes its rows
to that version only, and rows of a version that is not loaded are dead-lettered without holding up the partition."""

from __future__ import annotations

import numpy as np

from hps_service.config import HPSConfig, ModelConfig, TableConfig
from hps_service.engine import Source
from hps_service.serve.build import build_engine
from hps_service.updates import Publisher, UpdateConsumer, make_version
from tests.updates.conftest import DIM, TABLE, rows_for, served, wait_until


def test_a_version_gets_its_own_updates_only(kafka_broker, updates_cfg, tmp_path, model_name) -> None:
    model = ModelConfig(name=model_name, tables=[TableConfig(name=TABLE, dim=DIM)])
    engine = build_engine(HPSConfig(
        cache={"backend": "numpy", "capacity": 10_000, "warm_start": False},
        volatile={"type": "hashmap", "capacity_rows": 10_000},
        persistent={"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        models=[model],
    ))
    engine.add_version(model.model_copy(update={"version": 3}))
    consumer = UpdateConsumer(updates_cfg, engine, [model_name], "pod-0", partitions=4)
    try:
        consumer.start()
        assert consumer.wait_ready(30), consumer.stats()
        base, v3, v9 = (Publisher(kafka_broker.bootstrap, model_name, partitions=4, model_version=v) for v in (0, 3, 9))
        keys = np.arange(1, 41, dtype=np.int64)
        one, two = make_version(1, 1), make_version(1, 2)
        v3.publish(TABLE, keys, rows_for(keys, two), two)
        v3.flush()
        v9.publish(TABLE, keys, rows_for(keys, two), two)  # version 9 is not loaded: dead-lettered
        v9.flush()
        base.publish(TABLE, keys, rows_for(keys, one), one)  # after version 9's rows on every partition
        base.flush()
        version3 = f"{model_name}#v3"
        assert wait_until(lambda: np.array_equal(served(engine, model_name, keys)[0], rows_for(keys, one)),
                          timeout=60), consumer.stats()
        np.testing.assert_array_equal(served(engine, version3, keys)[0], rows_for(keys, two))
        assert engine.persistent.count(f"{version3}.{TABLE}") == len(keys)
        assert engine.persistent.count(f"{model_name}.{TABLE}") == len(keys)
        malformed = consumer.stats()["malformed"]
        assert sum(malformed.values()) >= 1, malformed  # version 9's messages, refused one by one
        # a version added later reads nothing of the rows once published for it
        engine.add_version(model.model_copy(update={"version": 9}))
        assert (served(engine, f"{model_name}#v9", keys)[1] == Source.DEFAULT).all()
    finally:
        consumer.stop()
        engine.close()

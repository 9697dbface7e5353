"""Row TTL through the update consumer (a real broker, the server's engine): a row's write time is its message's
``produced_at_ns``, not the clock of the replica when it applies the message."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hps_service.config import HPSConfig, ModelConfig, TableConfig
from hps_service.engine import Source, ttl
from hps_service.serve.build import build_engine
from hps_service.updates import Publisher, UpdateConsumer, make_version
from tests.updates.conftest import DIM, TABLE, rows_for, served, wait_until

TTL = 3600


def test_rows_expire_by_their_messages_time(kafka_broker, updates_cfg, tmp_path, model_name,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build_engine(HPSConfig(
        cache={"backend": "numpy", "capacity": 10_000, "warm_start": False},
        volatile={"type": "hashmap", "capacity_rows": 10_000},
        persistent={"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        models=[ModelConfig(name=model_name, tables=[TableConfig(name=TABLE, dim=DIM, ttl_s=TTL)])],
    ))
    consumer = UpdateConsumer(updates_cfg, engine, [model_name], "pod-0", partitions=4)
    applied_at = [time.time() + 10 * TTL]  # the replica's clock while it applies: far ahead of the messages'
    monkeypatch.setattr(ttl, "clock", lambda: applied_at[0])
    try:
        consumer.start()
        assert consumer.wait_ready(30), consumer.stats()
        keys = np.arange(1, 9, dtype=np.int64)
        version = make_version(1, 1)
        before = time.time()
        pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
        pub.publish(TABLE, keys, rows_for(keys, version), version)
        pub.flush()
        after = time.time()
        applied_at[0] = before + TTL - 1
        assert wait_until(lambda: np.array_equal(served(engine, model_name, keys)[0], rows_for(keys, version)),
                          timeout=60), consumer.stats()
        vectors, sources = served(engine, model_name, keys)
        assert not (sources == Source.EXPIRED).any()
        applied_at[0] = after + TTL + 2  # a TTL after the messages were produced (the apply time was later)
        vectors, sources = served(engine, model_name, keys)
        assert (sources == Source.EXPIRED).all() and (vectors == 0).all()
    finally:
        consumer.stop()
        engine.close()

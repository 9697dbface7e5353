"""Trainer -> Publisher -> broker (tansu) -> UpdateConsumer -> the server's engine: served rows are the trainer's."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

pytest.importorskip("torch")

from hps_service.config import HPSConfig, ModelConfig, TableConfig, UpdatesConfig
from hps_service.server.app import build_engine
from hps_service.trainer.data import PlantedTeacherData, TeacherConfig
from hps_service.trainer.model import DLRM, DLRMConfig, TableSpec, predict_from_rows
from hps_service.trainer.moe import MoEConfig
from hps_service.trainer.sources import SyntheticSource
from hps_service.trainer.train import TrainConfig, Trainer, make_version
from hps_service.updates import Publisher, UpdateConsumer

DIMS = {"user": 8, "item": 8, "category": 4}
TEACHER = TeacherConfig(cardinalities=(300, 40, 10), bag_size=2, seed=4)


def _all_served(engine, model: str, dlrm: DLRM, keys: np.ndarray) -> bool:
    return all(np.array_equal(engine.lookup(model, name, keys).vectors, dlrm.table_rows(name, keys))
               for name in DIMS)


def test_served_rows_equal_the_trainers_including_unseen_and_evicted_keys(kafka_broker, tmp_path) -> None:
    model_name = f"t{uuid.uuid4().hex[:10]}"
    config = HPSConfig(
        cache={"backend": "numpy", "capacity": 100_000, "warm_start": False},
        volatile={"type": "hashmap", "capacity_rows": 100_000},
        persistent={"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        models=[ModelConfig(name=model_name, tables=[TableConfig(name=n, dim=d, default="hashed_random")
                                                     for n, d in DIMS.items()])],
    )
    engine = build_engine(config)
    updates = UpdatesConfig(type="kafka", brokers=kafka_broker.bootstrap, topic_prefix="hps")
    consumer = UpdateConsumer(updates, engine, [model_name], "pod-0", partitions=4)
    publisher = Publisher(kafka_broker.bootstrap, model_name, "hps", partitions=4)
    try:
        consumer.start()
        assert consumer.wait_ready(30), consumer.stats()
        moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden=16, shared_expert_hidden=8)
        dlrm = DLRM(DLRMConfig(tables=tuple(TableSpec(n, d) for n, d in DIMS.items()), num_dense=TEACHER.num_dense,
                               moe=moe, moe_hidden=16), max_rows_per_table=150)
        data = SyntheticSource(PlantedTeacherData(TEACHER))
        cfg = TrainConfig(steps=40, batch_size=128, publish_every_steps=10, eval_every=40, holdout_size=2000,
                          generation=2)
        metrics = Trainer(dlrm, data, cfg, publisher=publisher).run()
        assert metrics["publishing"]["rows_deleted"] > 0  # 300 user ids through a 150-row table
        keys = np.concatenate([np.arange(300, dtype=np.int64), [2**62, -5]])  # trained, evicted, never seen
        deadline = time.monotonic() + 60
        while not _all_served(engine, model_name, dlrm, keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _all_served(engine, model_name, dlrm, keys), consumer.stats()
        batch = data.holdout(3000, 40)
        rows = {n: engine.lookup(model_name, n, batch.sparse[n].ravel()).vectors for n in DIMS}
        got = predict_from_rows(dlrm.tower, rows, batch)
        assert float(np.max(np.abs(got - dlrm.predict(batch)))) <= 1e-5
        assert metrics["publishing"]["last_version"] == make_version(2, 40)
    finally:
        consumer.stop()
        publisher.close()
        engine.close()

"""Trainer -> Publisher -> broker (tansu) -> UpdateConsumer -> the server's engine: served rows reproduce the model."""

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
from hps_service.trainer.train import TrainConfig, Trainer, make_version
from hps_service.updates import Publisher, UpdateConsumer

DIMS = {"user": 8, "item": 8, "category": 4}
TEACHER = TeacherConfig(cardinalities=(40, 40, 10), bag_size=2, seed=4)


def _all_served(engine, model: str, dlrm: DLRM) -> bool:
    for spec in dlrm.config.tables:
        keys = np.arange(spec.cardinality, dtype=np.int64)
        if not np.array_equal(engine.lookup(model, spec.name, keys).vectors, dlrm.table_rows(spec.name, keys)):
            return False
    return True


def test_rows_served_after_publishing_reproduce_the_trainers_predictions(kafka_broker, tmp_path) -> None:
    model_name = f"t{uuid.uuid4().hex[:10]}"
    config = HPSConfig(
        cache={"backend": "numpy", "capacity": 100_000, "warm_start": False},
        volatile={"type": "hashmap", "capacity_rows": 100_000},
        persistent={"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        models=[ModelConfig(name=model_name, tables=[TableConfig(name=n, dim=d) for n, d in DIMS.items()])],
    )
    engine = build_engine(config)
    updates = UpdatesConfig(type="kafka", brokers=kafka_broker.bootstrap, topic_prefix="hps")
    consumer = UpdateConsumer(updates, engine, [model_name], "pod-0", partitions=4)
    publisher = Publisher(kafka_broker.bootstrap, model_name, "hps", partitions=4)
    try:
        consumer.start()
        assert consumer.wait_ready(30), consumer.stats()
        tables = tuple(TableSpec(n, DIMS[n], c) for n, c in zip(TEACHER.fields, TEACHER.cardinalities))
        moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden=16, expert_bias=True, shared_expert_hidden=8)
        dlrm = DLRM(DLRMConfig(tables=tables, num_dense=TEACHER.num_dense, moe=moe, moe_hidden=16))
        data = PlantedTeacherData(TEACHER)
        cfg = TrainConfig(steps=40, batch_size=256, publish_every_steps=10, eval_every=40, holdout_size=2000,
                          generation=2)
        metrics = Trainer(dlrm, data, cfg, publisher=publisher).run()
        assert metrics["publishing"]["rows_published"] > sum(TEACHER.cardinalities)
        deadline = time.monotonic() + 60
        while not _all_served(engine, model_name, dlrm) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _all_served(engine, model_name, dlrm), consumer.stats()
        batch = data.holdout(3000)
        rows = {n: engine.lookup(model_name, n, batch.sparse[n].ravel()).vectors for n in DIMS}
        got = predict_from_rows(dlrm.tower, rows, batch)
        assert float(np.max(np.abs(got - dlrm.predict(batch)))) <= 1e-5
        assert metrics["publishing"]["last_version"] == make_version(2, 40)
    finally:
        consumer.stop()
        publisher.close()
        engine.close()

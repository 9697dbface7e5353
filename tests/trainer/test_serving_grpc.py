"""The online loop over real ports: trainer -> tansu -> `hps serve` -> HPSClient; and `hps demo` end to end."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from rich.console import Console

from hps_service.client import HPSClient
from hps_service.config import ModelConfig, TableConfig
from hps_service.demo import DemoSettings, run_demo
from hps_service.trainer.factory import RunSpec, build_run
from hps_service.trainer.model import predict_from_rows
from hps_service.trainer.train import TrainConfig, Trainer
from hps_service.updates import Publisher
from tests.e2e.test_updates_serve import wait_ready
from tests.helpers import ServerProcess, free_port, write_config

DIMS = {"user": 8, "item": 8, "category": 4}
CARDINALITY = 60


def test_predictions_from_rows_served_over_grpc_match_the_trainer(kafka_broker, tmp_path: Path) -> None:
    model = f"g{uuid.uuid4().hex[:8]}"
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port},
        "cache": {"backend": "numpy", "capacity": 64, "ways": 8},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db")},
        "updates": {"type": "kafka", "brokers": kafka_broker.bootstrap, "topic_prefix": "hps", "group": "pod-0"},
        "models": [{"name": model, "tables": [{"name": n, "dim": d} for n, d in DIMS.items()]}],
    })
    model_cfg = ModelConfig(name=model, tables=[TableConfig(name=n, dim=d) for n, d in DIMS.items()])
    dlrm, data = build_run(model_cfg, RunSpec(cardinality=CARDINALITY, experts=4, top_k=2, seed=3))
    publisher = Publisher(kafka_broker.bootstrap, model, "hps")
    with ServerProcess(cfg, grpc_port) as srv, HPSClient(srv.target) as client:
        wait_ready(f"http://127.0.0.1:{http_port}/readyz")
        Trainer(dlrm, data, TrainConfig(steps=30, batch_size=256, publish_every_steps=10, eval_every=30,
                                        holdout_size=1000), publisher).run()
        publisher.flush()
        keys = np.arange(CARDINALITY, dtype=np.int64)

        def served_equals_model() -> bool:
            got = client.lookup_many(model, {n: keys for n in DIMS})
            return all(np.array_equal(got[n].vectors, dlrm.table_rows(n, keys)) for n in DIMS)

        deadline = time.monotonic() + 60
        while not served_equals_model():
            assert time.monotonic() < deadline, "published rows not served within 60 s"
            time.sleep(0.05)
        batch = data.holdout(2000)
        answers = client.lookup_many(model, {n: ids.ravel() for n, ids in batch.sparse.items()})
        served = predict_from_rows(dlrm.tower, {n: a.vectors for n, a in answers.items()}, batch)
        assert float(np.max(np.abs(served - dlrm.predict(batch)))) <= 1e-5
    publisher.close()


def test_hps_demo_runs_the_whole_loop(tmp_path: Path) -> None:
    settings = DemoSettings(steps=40, batch_size=256, cardinality=300, inference_batch=256, report_every_s=5,
                            workdir=tmp_path / "demo")
    with open(tmp_path / "demo.log", "w") as log:
        summary = run_demo(settings, Console(file=log))
    assert summary["inference_errors"] == 0
    assert summary["rows_published"] >= 3 * 300
    assert summary["served_auc"] is not None and 0.5 < summary["served_auc"] <= 1.0
    assert summary["freshness_s"]["p50"] is not None
    assert set(summary["hit_rates"]) == {"cache", "volatile", "persistent"}

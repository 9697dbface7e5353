"""The trainer's model served from int8 rows: a Criteo file -> trainer -> tansu -> `hps serve` with every table
stored as int8 -> Predictor; its AUC on held-out rows stays within 0.002 of the float32 model's (issue 31)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from hps_service.client import HPSClient
from hps_service.config import load_config
from hps_service.trainer.factory import RunSpec, build_run
from hps_service.trainer.metrics import auc
from hps_service.trainer.predictor import Predictor
from hps_service.trainer.train import TrainConfig, Trainer
from hps_service.updates import Publisher
from tests.e2e.test_updates_serve import wait_ready
from tests.helpers import ServerProcess, free_port
from tests.trainer.criteo_data import criteo_config, make_rows, write_tsv

FIELDS = 6


def test_int8_rows_serve_the_trainers_auc_within_0_002(kafka_broker, tmp_path: Path) -> None:
    model = f"q{uuid.uuid4().hex[:8]}"
    grpc_port, http_port = free_port(), free_port()
    rows = make_rows(6000, seed=11, fields=FIELDS)
    tsv = write_tsv(tmp_path / "day_0.tsv", {k: v[:4000] for k, v in rows.items()})
    later = write_tsv(tmp_path / "day_1.tsv", {k: v[4000:] for k, v in rows.items()})
    cfg_path = criteo_config(tmp_path / "c.yaml", fields=FIELDS, dim=16, brokers=kafka_broker.bootstrap, model=model,
                             storage="int8", extra={
                                 "server": {"grpc_port": grpc_port, "http_port": http_port},
                                 "cache": {"backend": "numpy", "capacity": 256, "ways": 8},
                                 "persistent": {"type": "rocksdb", "path": str(tmp_path / "db")}})
    cfg = load_config(cfg_path)
    dlrm, source = build_run(cfg.models[0], RunSpec(data_format="criteo", data=(str(tsv),), eval_data=(str(later),),
                                                    seed=3))
    export = tmp_path / "export"
    with (Publisher(kafka_broker.bootstrap, model, "hps") as publisher, ServerProcess(cfg_path, grpc_port) as srv,
          HPSClient(srv.target) as client):
        wait_ready(f"http://127.0.0.1:{http_port}/readyz")
        Trainer(dlrm, source, TrainConfig(batch_size=250, publish_every_steps=4, eval_every=100, holdout_size=2000,
                                          export_dir=str(export), export_every=100), publisher, model_name=model).run()
        publisher.flush()
        batch = source.holdout(2000, 0)
        keys = {f"C{i}": np.unique(batch.sparse[f"C{i}"]) for i in range(1, FIELDS + 1)}
        trained = {n: dlrm.table_rows(n, k) for n, k in keys.items()}
        # int8 keeps each value within half a code step of the row's range
        bound = {n: (r.max(axis=1) - r.min(axis=1))[:, None] / 510 * 1.001 + 1e-7 for n, r in trained.items()}

        def served_within_bound() -> bool:
            got = client.lookup_many(model, keys)
            return all((np.abs(got[n].vectors - trained[n]) <= bound[n]).all() for n in keys)

        deadline = time.monotonic() + 60
        while not served_within_bound():
            assert time.monotonic() < deadline, "published rows not served within int8's bound in 60 s"
            time.sleep(0.05)
        got = client.lookup_many(model, keys)
        assert any(not np.array_equal(got[n].vectors, trained[n]) for n in keys)  # quantised, not the fp32 rows
        fp32_auc = auc(dlrm.predict(batch), batch.labels)
        with Predictor(export, srv.target) as predictor:
            int8_auc = auc(predictor.predict(batch), batch.labels)
    print(f"held-out AUC: trainer fp32 {fp32_auc:.5f}, served int8 {int8_auc:.5f}")
    assert fp32_auc > 0.6  # the planted signal was learnt: the comparison means something
    assert abs(int8_auc - fp32_auc) <= 0.002

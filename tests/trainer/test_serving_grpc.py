"""The online loop over real ports: a Criteo file -> trainer -> tansu -> `hps serve` -> Predictor / `hps predict`
(rows, deletes of evicted rows, defaults of unseen ids all served as the trainer has them); `hps demo` end to end."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from rich.console import Console

from hps_service.cli.demo import DemoSettings, run_demo
from hps_service.client import HPSClient
from hps_service.config import load_config
from hps_service.local import LocalClient
from hps_service.trainer.factory import RunSpec, build_run
from hps_service.trainer.metrics import auc, log_loss
from hps_service.trainer.predictor import Predictor
from hps_service.trainer.train import TrainConfig, Trainer
from hps_service.updates import Publisher
from tests.e2e.test_updates_serve import wait_ready
from tests.helpers import REPO, ServerProcess, free_port, run_hps
from tests.trainer.criteo_data import criteo_config, make_rows, write_tsv

FIELDS = 6


def test_a_criteo_file_trained_published_exported_and_scored_over_grpc(kafka_broker, tmp_path: Path) -> None:
    model = f"g{uuid.uuid4().hex[:8]}"
    grpc_port, http_port = free_port(), free_port()
    rows = make_rows(4000, seed=5, fields=FIELDS)
    tsv = write_tsv(tmp_path / "day_0.tsv", {k: v[:3000] for k, v in rows.items()})
    later = write_tsv(tmp_path / "day_1.tsv", {k: v[3000:] for k, v in rows.items()})  # newer: held out
    store = Path(tempfile.mkdtemp(prefix="hps-trainer-store-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    cfg_path = criteo_config(tmp_path / "c.yaml", fields=FIELDS, brokers=kafka_broker.bootstrap, model=model, extra={
        "server": {"grpc_port": grpc_port, "http_port": http_port, "local": {"enabled": True, "path": str(store)}},
        "cache": {"backend": "numpy", "capacity": 64, "ways": 8},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db")},
    })
    cfg = load_config(cfg_path)
    dlrm, source = build_run(cfg.models[0], RunSpec(data_format="criteo", data=(str(tsv),), eval_data=(str(later),),
                                                    seed=3, max_rows_per_table=150))  # 200 ids: evictions
    export = tmp_path / "export"
    publisher = Publisher(kafka_broker.bootstrap, model, "hps")
    with ServerProcess(cfg_path, grpc_port) as srv, HPSClient(srv.target) as client:
        wait_ready(f"http://127.0.0.1:{http_port}/readyz")
        metrics = Trainer(dlrm, source, TrainConfig(batch_size=500, publish_every_steps=2, eval_every=3,
                                                    holdout_size=1000, export_dir=str(export), export_every=3),
                          publisher, model_name=model).run()
        assert metrics["steps"] == 6 and len(metrics["exports"]) == 2  # steps 3 and 6 (the end)
        assert metrics["publishing"]["rows_deleted"] > 0
        publisher.flush()
        batch = source.holdout(1000, 0)  # held-out rows: trained, evicted (deleted) and never seen ids
        held = dlrm.tables["C1"].keys[dlrm.tables["C1"].live]
        unseen = ~np.isin(batch.sparse["C1"].ravel(), held)
        keys = {f"C{i}": np.unique(batch.sparse[f"C{i}"]) for i in range(1, FIELDS + 1)}

        def served_equals_model() -> bool:
            got = client.lookup_many(model, keys)
            return all(np.array_equal(got[n].vectors, dlrm.table_rows(n, k)) for n, k in keys.items())

        deadline = time.monotonic() + 60
        while not served_equals_model():
            assert time.monotonic() < deadline, "published rows not served within 60 s"
            time.sleep(0.05)
        expected = dlrm.predict(batch)
        with Predictor(export, srv.target) as predictor:
            assert predictor.version == metrics["publishing"]["last_version"] and unseen.any()
            got = predictor.predict(batch)
            raw = next(source.eval_files.tables(1000)).drop(["label"])  # the same rows as they are in the file
            assert np.array_equal(predictor.predict_raw(raw), got)
        print("max |served - trainer| prediction difference", float(np.max(np.abs(got - expected))))
        assert float(np.max(np.abs(got - expected))) <= 1e-5
        result = run_hps("predict", "--export-dir", str(export), "--target", srv.target, "--data", str(later),
                         "--limit", "1000")
        assert result.returncode == 0, result.stderr
        printed = re.search(r"rows 1000\s+AUC (\S+)\s+log-loss (\S+)", result.stdout)
        assert printed, result.stdout
        assert float(printed.group(1)) == pytest.approx(auc(expected, batch.labels), abs=1e-4)
        assert float(printed.group(2)) == pytest.approx(log_loss(expected, batch.labels), abs=1e-4)
        # the same scores from rows read in this process out of the server's shared store (issue 18)
        with LocalClient(store) as local, Predictor(export, local) as colocated:
            assert local.mapped
            np.testing.assert_allclose(colocated.predict(batch), got, atol=1e-6)
        example = subprocess.run([sys.executable, str(REPO / "examples" / "local_inference.py"), "--store",
                                  str(store), "--export-dir", str(export), "--data", str(later), "--limit", "1000",
                                  "--batch-size", "4096"],
                                 capture_output=True, text=True, timeout=300, cwd=REPO)
        assert example.returncode == 0, example.stderr
        assert "rows from the shared store" in example.stdout, example.stdout
        printed_local = re.search(r"rows 1000\s+AUC (\S+)\s+log-loss (\S+)", example.stdout)
        assert printed_local and printed_local.groups() == printed.groups(), example.stdout
    publisher.close()
    shutil.rmtree(store, ignore_errors=True)


def test_hps_demo_runs_the_whole_loop(tmp_path: Path) -> None:
    settings = DemoSettings(steps=40, batch_size=256, cardinality=300, inference_batch=256, report_every_s=5,
                            export_every=10, workdir=tmp_path / "demo")
    with open(tmp_path / "demo.log", "w") as log:
        summary = run_demo(settings, Console(file=log))
    assert summary["inference_errors"] == 0
    assert summary["rows_published"] >= 300
    assert summary["served_auc"] is not None and 0.5 < summary["served_auc"] <= 1.0
    assert summary["served_model_version"] == 40  # generation 0, step 40: the last export
    assert summary["freshness_s"]["p50"] is not None
    assert set(summary["hit_rates"]) == {"cache", "volatile", "persistent"}

"""The dense tower exported to S3 (a real SeaweedFS server) and loaded back by the Predictor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hps_service.trainer.data import PlantedTeacherData, TeacherConfig
from hps_service.trainer.export import latest_version
from hps_service.trainer.model import DLRM, DLRMConfig, TableSpec
from hps_service.trainer.predictor import Predictor
from hps_service.trainer.rowstore import LatestRowStore
from hps_service.trainer.sources import SyntheticSource
from hps_service.trainer.train import TrainConfig, Trainer, make_version


def test_exports_to_s3_load_the_newest_tower(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, s3_server) -> None:
    s3 = s3_server  # the session's one SeaweedFS: a second instance beside it could collide on its extra ports
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    bucket = s3.new_bucket()
    dest = f"s3://{bucket}/models/ctr"
    teacher = TeacherConfig(cardinalities=(30, 30, 10), seed=1)
    data = SyntheticSource(PlantedTeacherData(teacher))
    torch.manual_seed(0)
    model = DLRM(DLRMConfig(tables=tuple(TableSpec(n, 8) for n in teacher.fields), num_dense=4))
    store = LatestRowStore({n: 8 for n in teacher.fields})
    metrics = Trainer(model, data, TrainConfig(steps=12, batch_size=256, eval_every=12, holdout_size=1000,
                                               publish_every_steps=4, export_dir=dest, export_every=5),
                      publisher=store).run()
    assert metrics["exports"] == [f"s3://{bucket}/models/ctr/v{make_version(0, s):020d}" for s in (5, 10, 12)]
    assert latest_version(dest) == make_version(0, 12)
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert f"models/ctr/v{12:020d}/config.json" in keys and f"models/ctr/v{12:020d}/model.safetensors" in keys
    batch = data.holdout(1000, 12)
    with Predictor(dest, store) as predictor:
        assert predictor.version == make_version(0, 12)
        got = predictor.predict(batch)
    assert float(np.max(np.abs(got - model.predict(batch)))) <= 1e-5

"""``--normalize-dense``: running statistics of the samples trained on, exported and checkpointed with the tower."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hps_service.errors import FailedPreconditionError
from hps_service.trainer.criteo import DENSE_FIELDS, SPARSE_FIELDS, CriteoFiles
from hps_service.trainer.export import config_from_dict, config_to_dict
from hps_service.trainer.model import DLRM, DLRMConfig, TableSpec
from hps_service.trainer.normalize import DenseNormalizer
from hps_service.trainer.predictor import Predictor
from hps_service.trainer.rowstore import LatestRowStore
from hps_service.trainer.sources import FileSource
from hps_service.trainer.train import TrainConfig, Trainer
from tests.trainer.criteo_data import write_parquet


def test_the_statistics_are_those_of_every_sample_folded_in() -> None:
    rng = np.random.default_rng(0)
    norm = DenseNormalizer(3)
    x = torch.from_numpy(rng.normal(size=(5, 3)).astype(np.float32))
    assert torch.equal(norm(x), x)  # nothing seen yet: the identity
    seen = []
    for size in (7, 1, 64, 30):
        batch = np.c_[7.0 + 0.3 * rng.normal(size=size), rng.exponential(size=size), np.full(size, 4.0)]
        norm.update(torch.from_numpy(batch.astype(np.float32)))
        seen.append(batch.astype(np.float32).astype(np.float64))
    everything = np.concatenate(seen)
    assert int(norm.count) == len(everything)
    np.testing.assert_allclose(norm.mean.numpy(), everything.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(norm.var.numpy(), everything.var(0), rtol=1e-9, atol=1e-12)
    out = norm(torch.from_numpy(everything.astype(np.float32))).numpy()
    np.testing.assert_allclose(out[:, :2].mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(out[:, :2].std(0), 1.0, atol=1e-5)
    assert np.allclose(out[:, 2], 0.0)  # a constant feature is centred, never divided by ~0


def _offset_log(path: Path, n: int, seed: int = 0) -> Path:
    """Clicks that depend on two dense features whose log sits far from 0 (1000 x an odds, as counts and rates
    do), and a weak categorical."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=n), rng.normal(size=n)
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-1.5 * (a - b)))).astype(np.int64)
    dense = {c: [None] * n for c in DENSE_FIELDS}
    dense["I1"] = np.rint(1000 * np.exp(0.6 * a)).astype(np.int64).tolist()
    dense["I2"] = np.rint(1000 * np.exp(0.6 * b)).astype(np.int64).tolist()
    sparse = {c: [None] * n for c in SPARSE_FIELDS}
    sparse["C1"] = [f"u{v}" for v in rng.integers(0, 30, n)]
    return write_parquet(path, {"label": labels.tolist(), **dense, **sparse})


def _train(data: Path, normalize: bool, **config) -> tuple[DLRM, FileSource, LatestRowStore, dict]:
    torch.manual_seed(0)
    model = DLRM(DLRMConfig(tables=(TableSpec("C1", 4),), num_dense=len(DENSE_FIELDS), normalize_dense=normalize))
    source = FileSource(CriteoFiles([data], "parquet", ("C1",)), holdout_last=2000)
    store = LatestRowStore({"C1": 4})
    metrics = Trainer(model, source, TrainConfig(batch_size=256, eval_every=10**6, holdout_size=2000, **config),
                      publisher=store).run()
    return model, source, store, metrics


def test_normalized_features_train_better_and_serve_as_trained(tmp_path: Path) -> None:
    data = _offset_log(tmp_path / "clicks.parquet", 12_000)
    *_, raw = _train(data, normalize=False)
    model, source, store, metrics = _train(data, normalize=True, export_dir=str(tmp_path / "export"),
                                           checkpoint_dir=tmp_path / "ckpt")
    assert metrics["progressive"]["overall"]["auc"] > raw["progressive"]["overall"]["auc"] + 0.01
    assert metrics["final"]["auc"] > raw["final"]["auc"] + 0.01
    norm = model.tower.normalizer
    assert norm is not None and int(norm.count) == metrics["samples"] == 10_000
    assert float(norm.mean[0]) > 6.0  # the log of 1000 x an odds, centred by the normalizer
    assert config_from_dict(config_to_dict(model.config)) == model.config
    holdout = source.holdout(2000, metrics["steps"])
    with Predictor(tmp_path / "export", store) as predictor:
        assert predictor.tower.config.normalize_dense
        np.testing.assert_allclose(predictor.predict(holdout), model.predict(holdout), atol=1e-6)
    # a resume carries the statistics on
    torch.manual_seed(1)
    resumed = DLRM(model.config)
    Trainer(resumed, source, TrainConfig(batch_size=256, checkpoint_dir=tmp_path / "ckpt", resume=True)).restore()
    for name in ("count", "mean", "var"):
        assert torch.equal(getattr(resumed.tower.normalizer, name), getattr(norm, name)), name



def test_a_checkpoint_from_before_the_option_resumes_and_another_setting_is_refused(tmp_path: Path) -> None:
    data = _offset_log(tmp_path / "clicks.parquet", 3000)
    _, source, _, _ = _train(data, normalize=False, checkpoint_dir=tmp_path / "ckpt", steps=2)
    meta_path = next((tmp_path / "ckpt").glob("step-*")) / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["dlrm"]["normalize_dense"]  # as checkpoints written before --normalize-dense hold it
    meta_path.write_text(json.dumps(meta))
    for normalize, refused in ((False, False), (True, True)):
        model = DLRM(DLRMConfig(tables=(TableSpec("C1", 4),), num_dense=len(DENSE_FIELDS),
                                normalize_dense=normalize))
        trainer = Trainer(model, source, TrainConfig(batch_size=256, checkpoint_dir=tmp_path / "ckpt", resume=True))
        if refused:
            with pytest.raises(FailedPreconditionError, match="normalize_dense: checkpoint False, this run True"):
                trainer.restore()
        else:
            assert trainer.restore() and trainer.step == 2

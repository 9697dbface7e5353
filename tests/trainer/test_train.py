"""DLRM training: optimizer, FLOP count, publishing the touched rows, serving-path consistency, quality vs oracle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.baseline import train_logistic_baseline
from hps_service.trainer.data import Batch, PlantedTeacherData, TeacherConfig
from hps_service.trainer.metrics import auc
from hps_service.trainer.model import DLRM, DLRMConfig, TableSpec, predict_from_rows
from hps_service.trainer.moe import MoEConfig
from hps_service.trainer.optim import SparseRowOptimizer, TouchedRows
from hps_service.trainer.rowstore import LatestRowStore
from hps_service.trainer.train import TrainConfig, Trainer, make_version

SMALL = TeacherConfig(cardinalities=(30, 30, 10), seed=0)
MOE = MoEConfig(num_experts=4, top_k=2, ffn_hidden=16, expert_bias=True, shared_expert_hidden=16)


def _model(teacher: TeacherConfig, dims: tuple[int, ...] = (8, 8, 8), moe: MoEConfig | None = None) -> DLRM:
    torch.manual_seed(0)
    tables = tuple(TableSpec(n, d, c) for n, d, c in zip(teacher.fields, dims, teacher.cardinalities))
    return DLRM(DLRMConfig(tables=tables, num_dense=teacher.num_dense, moe=moe, moe_hidden=16))


def _rows_for(lookup, model: DLRM, batch: Batch) -> dict[str, np.ndarray]:
    return {name: lookup(name, batch.sparse[name].ravel()) for name in model.config.table_names}


def test_row_wise_adagrad_moves_only_touched_rows_by_the_formula() -> None:
    bag = torch.nn.EmbeddingBag(10, 3, mode="sum", sparse=True)
    before = bag.weight.detach().clone()
    ids = torch.tensor([[1, 1], [4, 2]])
    coeff = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 0.0]])
    (bag(ids) * coeff).sum().backward()
    opt = SparseRowOptimizer({"t": bag}, lr=0.1, kind="adagrad")
    touched = opt.step()
    assert sorted(touched["t"].tolist()) == [1, 2, 4]
    grads = {1: 2 * coeff[0], 2: coeff[1], 4: coeff[1]}
    for row, g in grads.items():
        expected = before[row] - 0.1 * g / (g.pow(2).mean().sqrt() + 1e-8)
        torch.testing.assert_close(bag.weight[row].detach(), expected)
    untouched = [r for r in range(10) if r not in grads]
    assert torch.equal(bag.weight[untouched].detach(), before[untouched])
    assert bag.weight.grad is None
    marks = TouchedRows({"t": 10})
    marks.mark("t", touched["t"])
    marks.mark("t", np.array([4, 9]))
    assert marks.take()["t"].tolist() == [1, 2, 4, 9]
    assert marks.take() == {} and marks.pending() == 0


def test_flops_per_sample_counts_every_gemm() -> None:
    plain = _model(SMALL)
    bottom = 4 * 32 + 32 * 8
    interaction = 4 * 4 * 8
    top = 14 * 64 + 64 * 32 + 32 * 1  # 8 dense outputs + 6 pairwise dots in
    assert plain.tower.flops_per_sample() == 2 * (bottom + interaction + top)
    moe = _model(SMALL, moe=MOE)
    moe_part = 14 * 16 + 16 * 4 + 2 * (2 * 16 * 16) + 2 * 16 * 16  # in-proj, router, 2 experts, shared
    top_moe = 16 * 64 + 64 * 32 + 32 * 1
    assert moe.tower.flops_per_sample() == 2 * (bottom + interaction + moe_part + top_moe)


@pytest.mark.parametrize("moe", [None, MOE])
def test_predict_from_rows_reproduces_the_trainers_predictions(moe: MoEConfig | None) -> None:
    teacher = TeacherConfig(cardinalities=(30, 30, 10), bag_size=2, seed=1)
    data = PlantedTeacherData(teacher)
    model = _model(teacher, dims=(8, 6, 4), moe=moe)  # narrower tables go through projections
    Trainer(model, data, TrainConfig(steps=20, batch_size=256, eval_every=20, holdout_size=1000)).run()
    batch = data.holdout(3000)
    expected = model.predict(batch)
    got = predict_from_rows(model.tower, _rows_for(model.table_rows, model, batch), batch)
    assert float(np.max(np.abs(got - expected))) <= 1e-5
    assert float(np.std(expected)) > 0.01  # a trained model, not a constant
    with pytest.raises(InvalidArgumentError, match="shape"):
        predict_from_rows(model.tower, {n: np.zeros((3, 8)) for n in model.config.table_names}, batch)


def test_published_rows_reproduce_the_model_through_a_row_store(tmp_path: Path) -> None:
    data = PlantedTeacherData(SMALL)
    model = _model(SMALL, moe=MOE)
    store = LatestRowStore({t.name: (t.cardinality, t.dim) for t in model.config.tables})
    cfg = TrainConfig(steps=30, batch_size=256, publish_every_steps=7, publish_every_s=3600.0, eval_every=30,
                      holdout_size=2000, generation=3)
    metrics = Trainer(model, data, cfg, publisher=store).run(tmp_path / "m.json")
    for spec in model.config.tables:
        keys = np.arange(spec.cardinality)
        np.testing.assert_array_equal(store.lookup(spec.name, keys), model.table_rows(spec.name, keys))
        versions = store.versions(spec.name, keys)
        assert versions.min() >= make_version(3, 0) and versions.max() == make_version(3, 30)
    batch = data.holdout(2000)
    got = predict_from_rows(model.tower, _rows_for(store.lookup, model, batch), batch)
    assert float(np.max(np.abs(got - model.predict(batch)))) <= 1e-5
    # initial full publish + steps 7, 14, 21, 28 + the rest at 30
    assert metrics["publishing"]["publishes"] == 6 == store.flushes
    assert metrics["publishing"]["rows_published"] == store.rows_published
    assert metrics["publishing"]["last_version"] == make_version(3, 30)
    assert json.loads((tmp_path / "m.json").read_text())["publishing"]["rows_published"] == store.rows_published


def test_without_the_initial_publish_only_trained_rows_are_sent() -> None:
    data = PlantedTeacherData(SMALL)
    model = _model(SMALL)
    store = LatestRowStore({t.name: (t.cardinality, t.dim) for t in model.config.tables})
    cfg = TrainConfig(steps=3, batch_size=16, publish_initial=False, eval_every=3, holdout_size=500)
    Trainer(model, data, cfg, publisher=store).run()
    for name in SMALL.fields:
        seen = np.unique(np.concatenate([data.batch(s, 16).sparse[name].ravel() for s in range(3)]))
        published = np.flatnonzero(store.versions(name, np.arange(model.embeddings[name].num_embeddings)) >= 0)
        np.testing.assert_array_equal(published, seen)


def test_short_run_reaches_the_oracle_and_beats_logistic_regression() -> None:
    data = PlantedTeacherData(SMALL)
    model = _model(SMALL)
    cfg = TrainConfig(steps=400, batch_size=1024, embedding_lr=0.2, dense_lr=1e-2, eval_every=100,
                      holdout_size=20_000)
    metrics = Trainer(model, data, cfg).run()
    final = metrics["final"]
    print("DLRM", final)
    assert final["auc_gap"] <= 0.01
    assert final["log_loss_gap"] <= 0.015
    baseline = train_logistic_baseline(data, steps=400, batch_size=1024)
    holdout = data.holdout(20_000)
    baseline_auc = auc(baseline.predict(holdout), holdout.labels)
    print("logistic regression AUC", baseline_auc)
    assert final["auc"] > baseline_auc + 0.05
    assert metrics["samples_per_s"] > 0 and metrics["model_flops_per_s"] > 0 and metrics["moe"] is None


def test_moe_run_learns_with_balanced_experts() -> None:
    data = PlantedTeacherData(SMALL)
    model = _model(SMALL, moe=MOE)
    cfg = TrainConfig(steps=100, batch_size=1024, eval_every=50, holdout_size=10_000)
    metrics = Trainer(model, data, cfg).run()
    moe = metrics["moe"]
    print("MoE", metrics["final"], moe)
    assert metrics["final"]["auc_gap"] <= 0.05
    assert len(moe["load_per_expert"]) == 4 and sum(moe["load_per_expert"]) == pytest.approx(1.0)
    assert moe["max_load_over_mean"] < 1.5
    assert moe["dropped_fraction"] == 0.0
    assert moe["aux_loss"] == pytest.approx(MOE.aux_loss_coeff, rel=0.5)
    assert 0 < moe["z_loss"] < 1.0
    assert any(b != 0 for b in moe["expert_bias"])


def test_trainer_rejects_a_model_that_does_not_fit_the_data() -> None:
    data = PlantedTeacherData(SMALL)
    small = TeacherConfig(cardinalities=(10, 30, 10), seed=0)
    with pytest.raises(InvalidArgumentError, match="holds 10 rows"):
        Trainer(_model(small), data, TrainConfig(steps=1))
    with pytest.raises(InvalidArgumentError, match="steps"):
        TrainConfig(steps=0)

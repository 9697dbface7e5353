"""Online training: dropless serving, admission, expiry, resume republishing, towers, schedules, held-out tail."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hps_service.trainer.criteo import CriteoFiles
from hps_service.trainer.data import Batch, PlantedTeacherData, TeacherConfig
from hps_service.trainer.export import config_from_dict, config_to_dict
from hps_service.trainer.metrics import auc
from hps_service.trainer.model import DLRM, DLRMConfig, TableSpec
from hps_service.trainer.moe import MoEConfig
from hps_service.trainer.predictor import Predictor
from hps_service.trainer.progressive import BinnedAUC
from hps_service.trainer.rowstore import LatestRowStore
from hps_service.trainer.schedule import dense_lr_factor
from hps_service.trainer.sources import FileSource, SyntheticSource
from hps_service.trainer.train import TrainConfig, Trainer
from tests.trainer.criteo_data import make_rows, write_tsv

SMALL = TeacherConfig(cardinalities=(30, 30, 10), seed=0)


def _model(teacher: TeacherConfig, moe: MoEConfig | None = None, **tower) -> DLRM:
    torch.manual_seed(0)
    tables = tuple(TableSpec(n, 8) for n in teacher.fields)
    return DLRM(DLRMConfig(tables=tables, num_dense=teacher.num_dense, moe=moe, moe_hidden=16, **tower), 100_000)


def _store(model: DLRM) -> LatestRowStore:
    return LatestRowStore({t.name: t.dim for t in model.config.tables})


class ListSource(SyntheticSource):
    """Given batches, in order, once."""

    def __init__(self, teacher: PlantedTeacherData, batches: list[Batch]) -> None:
        super().__init__(teacher)
        self.items = batches

    def batches(self, batch_size, position, rank=0, world=1, stop=None):
        for i in range(int(position or 0), len(self.items)):
            yield self.items[i], i + 1, len(self.items[i])


def test_serving_is_dropless_whatever_the_capacity_factor(tmp_path: Path) -> None:
    data = SyntheticSource(PlantedTeacherData(SMALL))
    moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden=16, capacity_factor=0.5, pad_to_capacity=True)
    model = _model(SMALL, moe=moe)
    store = _store(model)
    metrics = Trainer(model, data, TrainConfig(steps=8, batch_size=512, eval_every=8, holdout_size=500,
                                               export_dir=str(tmp_path / "x")), publisher=store).run()
    assert metrics["moe"]["dropped_fraction"] > 0.2  # training drops tokens
    rows = data.holdout(4096, 8)
    whole = model.predict(rows)
    by_64 = np.concatenate([model.predict(rows.rows(slice(i, i + 64))) for i in range(0, 4096, 64)])
    alone = np.concatenate([model.predict(rows.rows(slice(i, i + 1))) for i in range(0, 4096, 97)])
    assert float(np.max(np.abs(by_64 - whole))) <= 1e-6
    assert float(np.max(np.abs(alone - whole[::97]))) <= 1e-6
    with Predictor(tmp_path / "x", store) as predictor:  # the exported tower routes dropless too
        served = np.concatenate([predictor.predict(rows.rows(slice(i, i + 64))) for i in range(0, 4096, 64)])
    assert float(np.max(np.abs(served - whole))) <= 1e-5


def test_an_id_seen_fewer_than_admit_after_times_has_no_row_and_trains_as_the_default() -> None:
    teacher = PlantedTeacherData(SMALL)
    batches = [teacher.batch(s, 64) for s in range(6)]
    for b in batches:
        b.sparse["user"][:] = 7  # every sample: user 7 (admitted at once)
    batches[0].sparse["user"][:2, 0] = 1001  # id 1001 seen twice (N-1 with N = 3)
    batches[1].sparse["user"][:2, 0] = 1002  # id 1002 twice here, once more later: three times
    batches[4].sparse["user"][5, 0] = 1002
    model = _model(SMALL)
    store = _store(model)
    cfg = TrainConfig(batch_size=64, eval_every=100, holdout_size=100, admit_after=3, publish_every_steps=1)
    metrics = Trainer(model, ListSource(teacher, batches), cfg, publisher=store).run()
    keys = np.array([7, 1001, 1002], dtype=np.int64)
    assert store.versions("user", keys).tolist()[1] == -1  # never published
    assert store.versions("user", keys)[[0, 2]].min() > 0
    table = model.tables["user"]
    assert table.index.find(np.array([1001]))[0] == -1
    assert np.array_equal(model.table_rows("user", keys[1:2]), store.lookup("user", keys[1:2]))  # the default
    assert metrics["tables"]["user"]["not_admitted_sightings"] == 2 + 2


def test_rows_unused_for_t_steps_are_expired_and_published_as_deletes() -> None:
    teacher = PlantedTeacherData(SMALL)
    batches = [teacher.batch(s, 64) for s in range(40)]
    for i, b in enumerate(batches):
        b.sparse["user"][:] = 100 + (i >= 10)  # user 100 until step 10, then 101
    model = _model(SMALL)
    store = _store(model)
    cfg = TrainConfig(batch_size=64, eval_every=100, holdout_size=100, expire_after_steps=16, publish_every_steps=2)
    metrics = Trainer(model, ListSource(teacher, batches), cfg, publisher=store).run()
    assert metrics["tables"]["user"]["expired"] >= 1
    assert 100 not in store.held("user") and 101 in store.held("user")
    assert model.tables["user"].index.find(np.array([100]))[0] == -1
    assert metrics["publishing"]["rows_deleted"] >= 1


def test_a_resume_republishes_only_what_the_acknowledged_publishes_did_not_cover(tmp_path: Path) -> None:
    teacher = TeacherConfig(cardinalities=(3000, 3000, 50), seed=3)
    data = SyntheticSource(PlantedTeacherData(teacher))
    store = LatestRowStore({"user": 8, "item": 8, "category": 8})

    def run(steps: int, resume: bool) -> dict:
        cfg = TrainConfig(steps=steps, batch_size=128, eval_every=1000, holdout_size=100, checkpoint_dir=tmp_path,
                          checkpoint_every=10, resume=resume, publish_every_steps=5, publish_every_s=3600.0)
        return Trainer(_model(teacher), data, cfg, publisher=store).run()

    first = run(30, resume=False)  # its last checkpoint, at the end, is after every publish was acknowledged
    held = sum(t["rows"] for t in first["tables"].values())
    second = run(40, resume=True)
    assert second["publishing"]["republished_on_resume"] == 0 and held > 1000
    assert second["publishing"]["rows_published"] < held  # only what steps 31..40 changed


def test_each_interaction_exports_and_predicts_equal_to_the_trainer(tmp_path: Path) -> None:
    data = SyntheticSource(PlantedTeacherData(SMALL))
    for interaction in ("dot", "dcn"):
        model = _model(SMALL, moe=MoEConfig(num_experts=2, top_k=1, ffn_hidden=8), bottom_hidden=(16, 12),
                       interaction_dim=12, top_hidden=(24,), interaction=interaction, dcn_layers=3)
        assert config_from_dict(config_to_dict(model.config)) == model.config
        store = _store(model)
        export = tmp_path / interaction
        metrics = Trainer(model, data, TrainConfig(steps=40, batch_size=256, eval_every=40, holdout_size=2000,
                                                   export_dir=str(export)), publisher=store).run()
        assert metrics["final"]["auc"] > 0.6, interaction
        holdout = data.holdout(2000, 40)
        with Predictor(export, store) as predictor:
            assert predictor.tower.config == model.config
            got = predictor.predict(holdout)
        assert float(np.max(np.abs(got - model.predict(holdout)))) <= 1e-5, interaction
    assert model.tower.cross is not None and len(model.tower.cross.layers) == 3


def test_the_dense_rate_is_constant_without_a_step_budget_and_decays_with_one() -> None:
    constant = dense_lr_factor(0, None, 0.1)
    assert [constant(s) for s in (0, 10, 10**6)] == [1.0, 1.0, 1.0]
    warm = dense_lr_factor(10, None, 0.1)
    assert warm(0) == pytest.approx(0.1) and warm(9) == 1.0 and warm(10**6) == 1.0
    decay = dense_lr_factor(10, 110, 0.1)
    assert decay(9) == 1.0 and decay(60) == pytest.approx(0.55) and decay(110) == pytest.approx(0.1)


def test_the_held_out_set_is_the_newest_rows_and_is_never_trained(tmp_path: Path) -> None:
    cols = make_rows(2300, seed=1, fields=2)
    files = CriteoFiles([write_tsv(tmp_path / "d.tsv", cols)], "criteo", ("C1", "C2"))
    source = FileSource(files, holdout_last=300)
    trained = [b for b, _, _ in source.batches(500, None)]
    assert [len(b) for b in trained] == [500, 500, 500, 500]
    assert np.array_equal(source.holdout(10, 0).labels, np.asarray(cols["label"][2000:], dtype=np.float32))
    assert source.total_steps(500, None) == 4
    synthetic = SyntheticSource(PlantedTeacherData(SMALL))
    assert len(synthetic.holdout(2048, 0)) == 2048 and len(synthetic.holdout(10_000, 0)) == 10_000


def test_binned_auc_equals_the_exact_auc() -> None:
    rng = np.random.default_rng(0)
    prob = 1 / (1 + np.exp(-rng.normal(-2, 1.5, 50_000)))
    labels = (rng.random(50_000) < prob).astype(np.float32)
    binned = BinnedAUC()
    for i in range(0, 50_000, 4096):
        binned.add(prob[i:i + 4096], labels[i:i + 4096])
    assert binned.auc() == pytest.approx(auc(prob, labels), abs=2e-4)

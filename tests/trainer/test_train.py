"""DLRM training: FLOP counts, publishing, serving-path consistency, eviction, precision, checkpoints, quality."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hps_service.errors import FailedPreconditionError, InvalidArgumentError
from hps_service.trainer.baseline import train_logistic_baseline
from hps_service.trainer.data import PlantedTeacherData, TeacherConfig
from hps_service.trainer.metrics import auc
from hps_service.trainer.model import DLRM, DLRMConfig, TableSpec
from hps_service.trainer.moe import MoEConfig
from hps_service.trainer.predictor import Predictor
from hps_service.trainer.rowstore import LatestRowStore
from hps_service.trainer.sources import SyntheticSource
from hps_service.trainer.train import TrainConfig, Trainer, make_version, resolve_device

SMALL = TeacherConfig(cardinalities=(30, 30, 10), seed=0)
MOE = MoEConfig(num_experts=4, top_k=2, ffn_hidden=16, shared_expert_hidden=16)


def _model(teacher: TeacherConfig, dims: tuple[int, ...] = (8, 8, 8), moe: MoEConfig | None = None,
           max_rows: int = 10_000) -> DLRM:
    torch.manual_seed(0)
    tables = tuple(TableSpec(n, d) for n, d in zip(teacher.fields, dims))
    return DLRM(DLRMConfig(tables=tables, num_dense=teacher.num_dense, moe=moe, moe_hidden=16), max_rows)


def _store(model: DLRM) -> LatestRowStore:
    return LatestRowStore({t.name: t.dim for t in model.config.tables})


def test_flops_per_sample_counts_every_gemm() -> None:
    plain = _model(SMALL)
    bottom = 4 * 32 + 32 * 8
    interaction = 4 * 4 * 8
    top = 14 * 64 + 64 * 32 + 32 * 1  # 8 dense outputs + 6 pairwise dots in
    assert plain.tower.flops_per_sample() == 2 * (bottom + interaction + top)
    moe = _model(SMALL, moe=MOE)
    always = 14 * 16 + 16 * 4 + 2 * 16 * 16  # in-proj, router, shared expert
    routed = 2 * (2 * 16 * 16)  # k=2 experts of two GEMMs each
    top_moe = 16 * 64 + 64 * 32 + 32 * 1
    assert moe.tower.dense_flops_per_sample() == 2 * (bottom + interaction + always + top_moe)
    assert moe.tower.flops_per_sample() == 2 * (bottom + interaction + always + routed + top_moe)


def test_served_rows_and_the_exported_tower_reproduce_the_trainers_predictions(tmp_path: Path) -> None:
    teacher = TeacherConfig(cardinalities=(30, 30, 10), bag_size=2, seed=1)
    data = SyntheticSource(PlantedTeacherData(teacher))
    model = _model(teacher, dims=(8, 6, 4), moe=MOE)  # narrower tables go through projections
    store = _store(model)
    cfg = TrainConfig(steps=30, batch_size=256, publish_every_steps=7, publish_every_s=3600.0, eval_every=30,
                      holdout_size=2000, generation=3, export_dir=str(tmp_path / "export"), export_every=14)
    metrics = Trainer(model, data, cfg, publisher=store, model_name="m").run(tmp_path / "m.json")
    assert metrics["publishing"]["publishes"] == 5 == store.flushes  # steps 7, 14, 21, 28 and the rest at 30
    assert metrics["publishing"]["last_version"] == make_version(3, 30)
    assert json.loads((tmp_path / "m.json").read_text())["publishing"]["rows_published"] == store.rows_published
    assert [Path(p).name for p in metrics["exports"]] == [f"v{make_version(3, s):020d}" for s in (14, 28, 30)]
    held = store.held("user")
    assert held.size and np.array_equal(store.lookup("user", held), model.table_rows("user", held))
    assert store.versions("user", held).min() >= make_version(3, 7)
    batch = data.holdout(3000, 30)
    batch.sparse["user"][:5, 0] = 2**62 + np.arange(5)  # ids never trained: served and trained as the default
    expected = model.predict(batch)
    assert float(np.std(expected)) > 0.01  # a trained model, not a constant
    with Predictor(tmp_path / "export", store) as predictor:
        assert predictor.version == make_version(3, 30) and predictor.model == "m"
        assert predictor.tower is not model.tower
        got = predictor.predict(batch)
    assert float(np.max(np.abs(got - expected))) <= 1e-5


def test_short_run_reaches_the_oracle_and_beats_logistic_regression() -> None:
    data = PlantedTeacherData(SMALL)
    model = _model(SMALL)
    cfg = TrainConfig(steps=400, batch_size=1024, eval_every=100, holdout_size=20_000)
    metrics = Trainer(model, SyntheticSource(data), cfg).run()
    final = metrics["final"]
    print("DLRM", final)
    assert final["auc_gap"] <= 0.01
    assert final["log_loss_gap"] <= 0.015
    baseline = train_logistic_baseline(data, steps=400, batch_size=1024)
    holdout = data.holdout(20_000)
    baseline_auc = auc(baseline.predict(holdout), holdout.labels)
    print("logistic regression AUC", baseline_auc)
    assert final["auc"] > baseline_auc + 0.05
    # progressive validation: each batch scored before training on it; the rolling AUC approaches the oracle's on
    # the same samples, and the AUC over the whole run (its first, untrained batches too) lags behind it
    progressive = metrics["progressive"]
    rolling = progressive["rolling"]
    print("progressive", progressive["rolling"], progressive["overall"])
    assert rolling["samples"] == 100_000 and rolling["oracle_auc"] - rolling["auc"] <= 0.015
    assert progressive["overall"]["samples"] == 400 * 1024
    assert progressive["overall"]["auc"] < rolling["auc"] - 0.01
    curve = [p["progressive_auc"] for p in metrics["history"]]
    assert curve[0] < curve[-1] and progressive["per_day"] == {}  # the teacher's samples carry no time
    assert metrics["samples_per_s"] > 0 and metrics["model_flops_per_s"] > 0 and metrics["moe"] is None
    assert metrics["throughput_window_steps"] == 50 and metrics["mfu"] is None  # no GPU: no utilisation claimed


def test_moe_run_with_deepseek_defaults_learns_with_balanced_experts_and_counts_routed_flops() -> None:
    data = SyntheticSource(PlantedTeacherData(SMALL))
    model = _model(SMALL, moe=MOE)
    metrics = Trainer(model, data, TrainConfig(steps=100, batch_size=1024, eval_every=50, holdout_size=10_000)).run()
    moe = metrics["moe"]
    print("MoE", metrics["final"], moe)
    assert metrics["final"]["auc_gap"] <= 0.06  # from about 0.3 at the start
    assert len(moe["load_per_expert"]) == 4 and sum(moe["load_per_expert"]) == pytest.approx(1.0)
    assert moe["max_load_over_mean"] < 1.5
    assert moe["dropped_fraction"] == 0.0
    assert [p["step"] for p in moe["load_over_time"]] == [50, 100]
    assert all(sum(p["load"]) == pytest.approx(1.0) for p in moe["load_over_time"])
    assert 0 < moe["aux_loss"] < 1e-3 and moe["z_loss"] == 0.0  # the sequence aux loss only
    assert any(b != 0 for b in moe["expert_bias"])
    per_sample = metrics["model_flops_per_s"] / metrics["samples_per_s"]
    assert per_sample == pytest.approx(metrics["model_flops_per_sample_nominal"], rel=1e-6)  # nothing dropped
    dropping = _model(SMALL, moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden=16, capacity_factor=0.5))
    m2 = Trainer(dropping, data, TrainConfig(steps=20, batch_size=512, eval_every=20, holdout_size=2000)).run()
    assert m2["moe"]["dropped_fraction"] > 0.2
    assert m2["model_flops_per_s"] / m2["samples_per_s"] < m2["model_flops_per_sample_nominal"]


def test_bounded_tables_evict_and_the_served_view_still_equals_the_trainers() -> None:
    teacher = TeacherConfig(cardinalities=(400, 30, 10), seed=2)
    data = SyntheticSource(PlantedTeacherData(teacher))
    model = _model(teacher, max_rows=120)
    store = _store(model)
    cfg = TrainConfig(steps=40, batch_size=128, publish_every_steps=5, eval_every=40, holdout_size=1000)
    metrics = Trainer(model, data, cfg, publisher=store).run()
    assert metrics["tables"]["user"]["rows"] <= 120 and metrics["tables"]["user"]["evictions"] > 0
    assert metrics["publishing"]["rows_deleted"] > 0 and store.rows_deleted > 0
    keys = np.arange(400, dtype=np.int64)
    assert np.array_equal(store.lookup("user", keys), model.table_rows("user", keys))


def test_mixed_precision_on_the_cpu_learns_like_fp32_and_keeps_fp32_state() -> None:
    data = SyntheticSource(PlantedTeacherData(SMALL))
    aucs = {}
    for precision in ("fp32", "bf16", "fp16"):
        model = _model(SMALL, moe=MOE)
        cfg = TrainConfig(steps=40, batch_size=256, eval_every=40, holdout_size=5000, precision=precision,
                          device="auto")
        metrics = Trainer(model, data, cfg).run()
        assert metrics["device"] == "cpu" and metrics["precision"] == precision
        assert all(p.dtype == torch.float32 for p in model.tower.parameters())
        assert model.tables["user"].weight.dtype == torch.float32
        aucs[precision] = metrics["final"]["auc"]
    print(aucs)
    assert aucs["fp32"] > 0.6  # from about 0.5
    assert abs(aucs["bf16"] - aucs["fp32"]) < 0.02 and abs(aucs["fp16"] - aucs["fp32"]) < 0.02
    assert aucs["bf16"] != aucs["fp32"]  # autocast really ran the tower in bf16


def test_device_choice() -> None:
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(FailedPreconditionError, match="no CUDA"):
            resolve_device("cuda")
    with pytest.raises(InvalidArgumentError, match="--device"):
        resolve_device("tpu")
    with pytest.raises(InvalidArgumentError, match="precision"):
        TrainConfig(steps=1, precision="fp8")  # type: ignore[arg-type]


class _CrashingSource(SyntheticSource):
    """The synthetic stream, dying before training step ``crash_at``."""

    crash_at = 10**9

    def batches(self, batch_size: int, position: int, rank: int = 0, world: int = 1, stop=None):
        for batch, after, size in super().batches(batch_size, position, rank, world, stop):
            if after > self.crash_at:
                raise RuntimeError("killed")
            yield batch, after, size


def test_resume_after_a_crash_continues_exactly_with_a_newer_generation(tmp_path: Path) -> None:
    data = _CrashingSource(PlantedTeacherData(SMALL))
    store = LatestRowStore({"user": 8, "item": 8, "category": 8})

    def run(ckpt: Path | None, resume: bool = False):
        model = _model(SMALL, moe=MOE)
        cfg = TrainConfig(steps=50, batch_size=256, eval_every=1000, holdout_size=1000, generation=4,
                          checkpoint_dir=ckpt, checkpoint_every=10, keep_checkpoints=2, resume=resume,
                          publish_every_steps=5, publish_every_s=3600.0)
        trainer = Trainer(model, data, cfg, publisher=store if ckpt else None)
        return model, trainer, trainer.run

    straight, _, go = run(None)
    go()
    data.crash_at = 35
    _, crashed, go = run(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="killed"):
        go()
    assert crashed.last_version == make_version(4, 35)  # rows of steps 31..35 reached the server
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-000000000020", "step-000000000030"]
    with pytest.raises(FailedPreconditionError, match="--resume"):
        run(tmp_path / "ckpt")[2]()
    data.crash_at = 10**9
    resumed, trainer, go = run(tmp_path / "ckpt", resume=True)
    second = go()
    assert second["resumed_from"].endswith("step-000000000030") and second["steps"] == 50
    assert second["publishing"]["generation"] == 5 and second["publishing"]["last_version"] == make_version(5, 50)
    for a, b in zip(straight.tower.state_dict().values(), resumed.tower.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name in ("user", "item", "category"):
        keys = np.arange(30, dtype=np.int64)
        np.testing.assert_allclose(straight.table_rows(name, keys), resumed.table_rows(name, keys), atol=1e-6)
        held = store.held(name)  # everything served is the resumed model's
        assert np.array_equal(store.lookup(name, held), resumed.table_rows(name, held))
        # nothing the lost steps 31..35 published survives: those keys were published again at generation 5
        versions = store.versions(name, held)
        lost = (versions >> 32 == 4) & ((versions & 0xFFFFFFFF) > 30)
        assert not lost.any()
    # a resume publishes what the acknowledged publishes did not cover (test_online.py: fewer than it holds)
    held_rows = sum(t["rows"] for t in second["tables"].values())
    assert 0 < second["publishing"]["republished_on_resume"] <= held_rows  # 70 hot ids: steps 31..35 touched all

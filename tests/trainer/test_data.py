"""Planted-teacher data: oracle quality near the target, determinism per seed, drift confined to its ids; metrics."""

from __future__ import annotations

import numpy as np
import pytest

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.data import DriftSpec, PlantedTeacherData, TeacherConfig
from hps_service.trainer.metrics import auc, expected_auc, log_loss


def test_oracle_auc_on_held_out_data_is_near_target() -> None:
    data = PlantedTeacherData(TeacherConfig(seed=5))
    holdout = data.holdout(60_000)
    oracle = auc(holdout.prob, holdout.labels)
    assert abs(oracle - 0.80) < 0.012
    # the oracle is the best calibrated predictor: a constant rate and a blurred teacher both lose to it
    rate = np.full(len(holdout), holdout.labels.mean())
    assert log_loss(holdout.prob, holdout.labels) < log_loss(rate, holdout.labels)
    blurred = 1.0 / (1.0 + np.exp(-0.5 * np.log(holdout.prob / (1.0 - holdout.prob))))
    assert log_loss(holdout.prob, holdout.labels) < log_loss(blurred, holdout.labels)


def test_every_cluster_is_used_and_ids_are_zipf_skewed() -> None:
    cfg = TeacherConfig(cardinalities=(1000, 500, 50), num_clusters=4, seed=1)
    batch = PlantedTeacherData(cfg).batch(0, 50_000)
    assert np.bincount(batch.cluster, minlength=4).min() > 0.03 * len(batch)
    counts = np.sort(np.bincount(batch.sparse["user"].ravel(), minlength=1000))[::-1]
    harmonic = np.sum(1.0 / np.arange(1, 1001) ** cfg.zipf_a)
    assert counts[0] / counts.sum() == pytest.approx(1.0 / harmonic, rel=0.1)
    assert counts[0] > 50 * max(counts[500], 1)
    assert batch.sparse["item"].max() < 500 and batch.sparse["category"].min() >= 0


def test_batches_are_deterministic_per_seed_and_step() -> None:
    a = PlantedTeacherData(TeacherConfig(seed=7, bag_size=2))
    b = PlantedTeacherData(TeacherConfig(seed=7, bag_size=2))
    c = PlantedTeacherData(TeacherConfig(seed=8, bag_size=2))
    x, y, z = a.batch(3, 256), b.batch(3, 256), c.batch(3, 256)
    np.testing.assert_array_equal(x.dense, y.dense)
    np.testing.assert_array_equal(x.labels, y.labels)
    for name in a.config.fields:
        assert x.sparse[name].shape == (256, 2)
        np.testing.assert_array_equal(x.sparse[name], y.sparse[name])
    assert not np.array_equal(x.dense, z.dense)
    assert not np.array_equal(x.dense, a.batch(4, 256).dense)
    assert x.dense.dtype == np.float32 and x.sparse["user"].dtype == np.int64


def test_drift_redraws_only_the_drifted_ids_from_its_step() -> None:
    ids = (0, 3, 5, 11, 17)
    plain = PlantedTeacherData(TeacherConfig(seed=2, cardinalities=(50, 40, 10)))
    drifting = PlantedTeacherData(
        TeacherConfig(seed=2, cardinalities=(50, 40, 10), drift=DriftSpec(step=10, field="item", ids=ids))
    )
    before, after = drifting.rows_at(9), drifting.rows_at(10)
    changed = np.flatnonzero(np.any(before["item"] != after["item"], axis=1))
    assert changed.tolist() == list(ids)
    np.testing.assert_array_equal(before["user"], after["user"])
    np.testing.assert_array_equal(before["item"], plain.true_rows["item"])
    # before the drift step the streams are identical; after it only samples holding a drifted id change
    np.testing.assert_array_equal(plain.batch(9, 512).prob, drifting.batch(9, 512).prob)
    p, d = plain.batch(10, 2048), drifting.batch(10, 2048)
    np.testing.assert_array_equal(p.dense, d.dense)
    touched = np.isin(d.sparse["item"], ids).any(axis=1)
    assert touched.any()
    np.testing.assert_array_equal(p.prob[~touched], d.prob[~touched])
    assert np.all(p.prob[touched] != d.prob[touched])


def test_invalid_teacher_configs_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="cardinalities"):
        TeacherConfig(fields=("a", "b"), cardinalities=(10,))
    with pytest.raises(InvalidArgumentError, match="drift field"):
        TeacherConfig(drift=DriftSpec(step=1, field="nope", ids=(1,)))
    with pytest.raises(InvalidArgumentError, match="drift ids"):
        TeacherConfig(cardinalities=(10, 10, 10), drift=DriftSpec(step=1, field="user", ids=(10,)))
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        PlantedTeacherData(TeacherConfig(cardinalities=(10, 10, 10))).batch(0, 0)


def test_auc_matches_pairwise_definition_with_ties() -> None:
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=300).astype(float)  # many ties
    labels = (rng.random(300) < 0.4).astype(float)
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    brute = (np.sum(diff > 0) + 0.5 * np.sum(diff == 0)) / diff.size
    assert auc(scores, labels) == pytest.approx(brute, abs=1e-12)
    assert auc(-scores, labels) == pytest.approx(1.0 - brute, abs=1e-12)
    with pytest.raises(InvalidArgumentError):
        auc(scores, np.zeros(300))


def test_expected_auc_agrees_with_sampled_labels() -> None:
    rng = np.random.default_rng(1)
    prob = 1.0 / (1.0 + np.exp(-rng.normal(-1.0, 1.5, size=200_000)))
    labels = (rng.random(prob.size) < prob).astype(float)
    assert expected_auc(prob) == pytest.approx(auc(prob, labels), abs=0.005)
    assert log_loss(np.array([0.5, 0.5]), np.array([0.0, 1.0])) == pytest.approx(np.log(2.0))

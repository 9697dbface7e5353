"""Seeded streaming click data drawn from a planted teacher, so the best achievable AUC and log-loss are known.

The teacher: Zipf-distributed ids per sparse field, a true embedding row per id, a dense-feature projection,
pairwise dot-product interactions (the structure DLRM can represent), hidden clusters (a function of the dense
features) each routed to its own small teacher MLP (so MoE experts have something to specialise on), and labels
drawn from the true click probability. Every batch is a pure function of (seed, stream, step), so any step can be
regenerated, and a drift option re-draws the true rows of a known id set from a given step on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.metrics import expected_auc

_TRAIN_STREAM = 1
_HOLDOUT_STREAM = 2
_CALIBRATION_STREAM = 3
_DRIFT_STREAM = 4
_ID_ORDER_STREAM = 5


@dataclass(frozen=True)
class DriftSpec:
    """From training step ``step`` on, the true rows of ``ids`` in ``field`` are re-drawn."""

    step: int
    field: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class TeacherConfig:
    """Shape and strength of the planted teacher."""

    fields: tuple[str, ...] = ("user", "item", "category")
    cardinalities: tuple[int, ...] = (1000, 1000, 100)
    num_dense: int = 4
    latent_dim: int = 4
    bag_size: int = 1
    zipf_a: float = 1.05
    num_clusters: int = 4
    cluster_hidden: int = 8
    cluster_weight: float = 0.5
    target_auc: float = 0.80
    base_logit: float = -1.0
    seed: int = 0
    drift: DriftSpec | None = None

    def __post_init__(self) -> None:
        if not self.fields:
            raise InvalidArgumentError("teacher needs at least one sparse field")
        if len(set(self.fields)) != len(self.fields):
            raise InvalidArgumentError(f"teacher field names must be unique, got {self.fields}")
        if len(self.cardinalities) != len(self.fields):
            raise InvalidArgumentError(
                f"{len(self.fields)} fields but {len(self.cardinalities)} cardinalities; give one per field"
            )
        if min(self.cardinalities) < 1:
            raise InvalidArgumentError(f"cardinalities must be >= 1, got {self.cardinalities}")
        for name, value in (("num_dense", self.num_dense), ("latent_dim", self.latent_dim),
                            ("bag_size", self.bag_size), ("num_clusters", self.num_clusters),
                            ("cluster_hidden", self.cluster_hidden)):
            if value < 1:
                raise InvalidArgumentError(f"teacher {name} must be >= 1, got {value}")
        if self.zipf_a <= 0:
            raise InvalidArgumentError(f"zipf_a must be > 0, got {self.zipf_a}")
        if not 0.5 < self.target_auc < 1.0:
            raise InvalidArgumentError(f"target_auc must be in (0.5, 1), got {self.target_auc}")
        if self.drift is not None:
            if self.drift.field not in self.fields:
                raise InvalidArgumentError(f"drift field {self.drift.field!r} is not one of {self.fields}")
            card = self.cardinalities[self.fields.index(self.drift.field)]
            ids = np.asarray(self.drift.ids, dtype=np.int64)
            if ids.size == 0 or ids.min() < 0 or ids.max() >= card:
                raise InvalidArgumentError(f"drift ids must be non-empty and in [0, {card})")
            if self.drift.step < 0:
                raise InvalidArgumentError(f"drift step must be >= 0, got {self.drift.step}")


@dataclass
class Batch:
    """One batch: dense features, id bags per field (int64 keys), labels, and (planted teacher) the true probability."""

    dense: np.ndarray  # (B, num_dense) float32
    sparse: dict[str, np.ndarray]  # field -> (B, bag_size) int64
    labels: np.ndarray  # (B,) float32 in {0, 1}
    prob: np.ndarray | None = None  # (B,) float64, the true click probability where it is known
    cluster: np.ndarray | None = None  # (B,) int64, the hidden cluster that scored the sample
    step: int = -1
    time: np.ndarray | None = None  # (B,) int64 Unix seconds of each sample, where the data carries a time

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def rows(self, index: slice | np.ndarray) -> Batch:
        """The samples at ``index`` (a slice or an index array), as a new Batch."""
        return Batch(
            dense=self.dense[index], sparse={k: v[index] for k, v in self.sparse.items()}, labels=self.labels[index],
            prob=None if self.prob is None else self.prob[index],
            cluster=None if self.cluster is None else self.cluster[index], step=self.step,
            time=None if self.time is None else self.time[index],
        )

    @staticmethod
    def concat(parts: list[Batch]) -> Batch:
        """One batch of the samples of ``parts`` in order (an optional field is kept where every part has it)."""
        if len(parts) == 1:
            return parts[0]

        def join(values: list[np.ndarray | None]) -> np.ndarray | None:
            present = [v for v in values if v is not None]
            return np.concatenate(present) if len(present) == len(values) else None

        return Batch(
            dense=np.concatenate([p.dense for p in parts]),
            sparse={k: np.concatenate([p.sparse[k] for p in parts]) for k in parts[0].sparse},
            labels=np.concatenate([p.labels for p in parts]), prob=join([p.prob for p in parts]),
            cluster=join([p.cluster for p in parts]), time=join([p.time for p in parts]), step=parts[0].step,
        )


class PlantedTeacherData:
    """Generates batches from a fixed random teacher; ``oracle`` metrics use the teacher's own probabilities."""

    def __init__(self, config: TeacherConfig) -> None:
        self.config = config
        cfg = config
        rng = np.random.default_rng([cfg.seed, 0])
        lat = cfg.latent_dim
        self._rank_to_id = [self._id_order(cfg, f) for f in range(len(cfg.fields))]
        self._cdf = []
        for card in cfg.cardinalities:
            weights = 1.0 / np.arange(1, card + 1, dtype=np.float64) ** cfg.zipf_a
            cdf = np.cumsum(weights)
            self._cdf.append(cdf / cdf[-1])
        self.true_rows = {
            name: rng.normal(0.0, 1.0 / np.sqrt(lat), size=(card, lat))
            for name, card in zip(cfg.fields, cfg.cardinalities)
        }
        self._dense_proj = rng.normal(0.0, 1.0 / np.sqrt(cfg.num_dense), size=(cfg.num_dense, lat)) * 1.5
        n_vec = len(cfg.fields) + 1
        self._pair_i, self._pair_j = np.triu_indices(n_vec, k=1)
        n_pairs = self._pair_i.size
        self._pair_weights = rng.normal(0.0, 1.0, size=n_pairs)
        self._centroids = rng.normal(0.0, 1.0, size=(lat, cfg.num_clusters))
        self._mlp_w1 = rng.normal(0.0, 2.0 / np.sqrt(n_pairs), size=(cfg.num_clusters, n_pairs, cfg.cluster_hidden))
        self._mlp_b1 = rng.normal(0.0, 0.5, size=(cfg.num_clusters, cfg.cluster_hidden))
        self._mlp_w2 = rng.normal(0.0, 1.0 / np.sqrt(cfg.cluster_hidden), size=(cfg.num_clusters, cfg.cluster_hidden))
        self.drifted_rows = dict(self.true_rows)
        if cfg.drift is not None:
            drift_rng = np.random.default_rng([cfg.seed, _DRIFT_STREAM])
            ids = np.unique(np.asarray(cfg.drift.ids, dtype=np.int64))
            rows = self.true_rows[cfg.drift.field].copy()
            rows[ids] = drift_rng.normal(0.0, 1.0 / np.sqrt(lat), size=(ids.size, lat))
            self.drifted_rows = {**self.true_rows, cfg.drift.field: rows}
        self._raw_mean = 0.0
        self._raw_std = 1.0
        self.scale = 1.0
        self._calibrate()

    @staticmethod
    def _id_order(config: TeacherConfig, field_index: int) -> np.ndarray:
        rng = np.random.default_rng([config.seed, _ID_ORDER_STREAM, field_index])
        return rng.permutation(config.cardinalities[field_index]).astype(np.int64)

    @staticmethod
    def hottest_ids(config: TeacherConfig, field_index: int, count: int) -> np.ndarray:
        """The ``count`` most frequent ids of a field, most frequent first (known before any data is drawn)."""
        return PlantedTeacherData._id_order(config, field_index)[:count]

    # ---- sampling ------------------------------------------------------------------------------------------
    def rows_at(self, step: int) -> dict[str, np.ndarray]:
        """The true embedding tables in force at training step ``step`` (after drift if it has happened)."""
        drift = self.config.drift
        return self.drifted_rows if drift is not None and step >= drift.step else self.true_rows

    def _sample(self, rng: np.random.Generator, n: int, rows: dict[str, np.ndarray]) -> Batch:
        cfg = self.config
        dense = rng.normal(0.0, 1.0, size=(n, cfg.num_dense))
        sparse: dict[str, np.ndarray] = {}
        for f, name in enumerate(cfg.fields):
            ranks = np.searchsorted(self._cdf[f], rng.random((n, cfg.bag_size)), side="right")
            sparse[name] = self._rank_to_id[f][np.minimum(ranks, cfg.cardinalities[f] - 1)]
        raw, cluster = self._raw_score(dense, sparse, rows)
        logit = self.scale * (raw - self._raw_mean) / self._raw_std + cfg.base_logit
        prob = 1.0 / (1.0 + np.exp(-logit))
        labels = (rng.random(n) < prob).astype(np.float32)
        return Batch(dense=dense.astype(np.float32), sparse=sparse, labels=labels, prob=prob, cluster=cluster)

    def _raw_score(
        self, dense: np.ndarray, sparse: dict[str, np.ndarray], rows: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        z0 = np.tanh(dense @ self._dense_proj)
        vectors = [z0] + [rows[name][sparse[name]].sum(axis=1) for name in self.config.fields]
        stacked = np.stack(vectors, axis=1)  # (n, F+1, L)
        gram = np.einsum("nil,njl->nij", stacked, stacked)
        dots = gram[:, self._pair_i, self._pair_j]  # (n, P)
        cluster = np.argmax(z0 @ self._centroids, axis=1)
        hidden = np.maximum(np.einsum("np,nph->nh", dots, self._mlp_w1[cluster]) + self._mlp_b1[cluster], 0.0)
        expert = np.einsum("nh,nh->n", hidden, self._mlp_w2[cluster])
        return dots @ self._pair_weights + self.config.cluster_weight * expert, cluster

    def _calibrate(self, n: int = 50_000) -> None:
        """Standardise the raw teacher score and bisect its scale so the expected oracle AUC hits the target."""
        rng = np.random.default_rng([self.config.seed, _CALIBRATION_STREAM])
        probe = self._sample(rng, n, self.true_rows)
        raw, _ = self._raw_score(probe.dense.astype(np.float64), probe.sparse, self.true_rows)
        self._raw_mean = float(raw.mean())
        self._raw_std = float(raw.std()) or 1.0
        z = (raw - self._raw_mean) / self._raw_std
        lo, hi = 0.01, 20.0
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            prob = 1.0 / (1.0 + np.exp(-(mid * z + self.config.base_logit)))
            if expected_auc(prob) < self.config.target_auc:
                lo = mid
            else:
                hi = mid
        self.scale = 0.5 * (lo + hi)

    def batch(self, step: int, batch_size: int) -> Batch:
        """The training batch of ``step``: the same (seed, step, batch_size) always gives the same batch."""
        if batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")
        if step < 0:
            raise InvalidArgumentError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([self.config.seed, _TRAIN_STREAM, step])
        out = self._sample(rng, batch_size, self.rows_at(step))
        out.step = step
        return out

    def stream(self, batch_size: int, start_step: int = 0) -> Iterator[Batch]:
        """Yield training batches from ``start_step`` on, forever."""
        step = start_step
        while True:
            yield self.batch(step, batch_size)
            step += 1

    def holdout(self, n: int, at_step: int = 0) -> Batch:
        """A held-out set (its own random stream) labelled by the teacher in force at ``at_step``."""
        if n < 1:
            raise InvalidArgumentError(f"holdout size must be >= 1, got {n}")
        rng = np.random.default_rng([self.config.seed, _HOLDOUT_STREAM])
        return self._sample(rng, n, self.rows_at(at_step))

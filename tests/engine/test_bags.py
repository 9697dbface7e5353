"""Pooled lookups in the engine against a NumPy reference built from plain lookups of the same keys: sum, mean and
weighted sums, empty bags, keys no tier holds (the default pooled in), duplicates within and across bags, fp16 and
int8 tables (decoded, then accumulated in float32), and every refusal of bad bags at and one past its bound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hps_service.config import ModelConfig, TableConfig
from hps_service.engine import LookupEngine
from hps_service.engine.bags import MEAN, SUM, check_bags
from hps_service.errors import InvalidArgumentError, ResourceExhaustedError
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier

DIM = 8


def reference(rows: np.ndarray, sources: np.ndarray, offsets: np.ndarray, combiner: int,
              weights: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """What torch's embedding_bag answers over ``rows`` (one per key), bag by bag in float32, and each bag's
    deepest source."""
    n = rows.shape[0]
    ends = np.append(offsets[1:], n)
    out = np.zeros((offsets.shape[0], rows.shape[1]), np.float32)
    deepest = np.zeros(offsets.shape[0], np.uint8)
    for b, (start, end) in enumerate(zip(offsets, ends)):
        for i in range(start, end):
            out[b] += rows[i] * (weights[i] if weights is not None else np.float32(1))
        if combiner == MEAN and end > start:
            out[b] /= np.float32(end - start)
        deepest[b] = sources[start:end].max() if end > start else 0
    return out, deepest


@pytest.fixture
def engine(tmp_path: Path):  # noqa: ANN201
    eng = LookupEngine(HashMapTier(10_000), RocksDBTier(tmp_path / "db", block_cache_mb=8))
    eng.register_model(ModelConfig(name="m", tables=[
        TableConfig(name="f32", dim=DIM, default={"constant": 0.5}),
        TableConfig(name="f16", dim=DIM, storage="fp16"),
        TableConfig(name="i8", dim=DIM, storage="int8")]))
    rng = np.random.default_rng(5)
    keys = np.arange(1, 301, dtype=np.int64)
    for table in ("f32", "f16", "i8"):
        eng.apply_updates("m", table, keys, rng.standard_normal((300, DIM)).astype(np.float32), 1)
    yield eng
    eng.close()


@pytest.mark.parametrize("table", ["f32", "f16", "i8"])
def test_pooled_answers_equal_the_reference_over_plain_lookups(engine: LookupEngine, table: str) -> None:
    rng = np.random.default_rng(7)
    for _ in range(30):
        n = int(rng.integers(0, 200))
        keys = rng.integers(-5, 400, n).astype(np.int64)  # keys outside 1..300 are stored nowhere: the default
        bags = int(rng.integers(1 if n else 0, 40))
        offsets = np.sort(rng.integers(0, n + 1, bags)).astype(np.int64)
        if bags:
            offsets[0] = 0
        combiner = int(rng.choice([SUM, MEAN]))
        weights = rng.standard_normal(n).astype(np.float32) if combiner == SUM and rng.random() < 0.5 else None
        plain = engine.lookup("m", table, keys)
        want, deepest = reference(plain.vectors, plain.sources, offsets, combiner, weights)
        got = engine.lookup_bags("m", table, keys, check_bags(n, offsets, combiner, weights, 1000))
        np.testing.assert_allclose(got.vectors, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got.sources, deepest)


def test_empty_bags_are_zero_rows_and_a_missing_key_pools_its_default(engine: LookupEngine) -> None:
    got = engine.lookup_bags("m", "f32", np.zeros(0, np.int64), check_bags(0, np.zeros(3, np.int64), SUM, None, 8))
    assert got.vectors.shape == (3, DIM) and not got.vectors.any() and not got.sources.any()
    keys = np.array([10_000, 10_001, 7], dtype=np.int64)
    got = engine.lookup_bags("m", "f32", keys, check_bags(3, np.array([0, 0, 2], np.int64), MEAN, None, 8))
    np.testing.assert_allclose(got.vectors[1], 0.5)  # two unstored keys: the mean of two defaults
    assert not got.vectors[0].any() and got.sources.tolist()[:2] == [0, 4]


@pytest.mark.parametrize("n,offsets,combiner,weights,fragment", [
    (3, [1, 2], SUM, None, "must start at 0"),
    (3, [0, 2, 1], SUM, None, "go backwards at bag 2"),
    (3, [0, 4], SUM, None, "past the 3 keys"),
    (3, [], SUM, None, "offsets is empty"),
    (3, [0], 3, None, "neither SUM (1) nor MEAN (2)"),
    (3, [0], MEAN, [1, 1, 1], "weights go with combiner SUM only"),
    (3, [0], SUM, [1, 1], "2 weights for 3 keys"),
    (3, [0], SUM, [1, np.nan, 1], "NaN or infinite"),
])
def test_bad_bags_are_refused_naming_the_field(n: int, offsets: list, combiner: int, weights: list | None,
                                              fragment: str) -> None:
    w = None if weights is None else np.array(weights, np.float32)
    with pytest.raises(InvalidArgumentError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_bags(n, np.array(offsets, np.int64), combiner, w, 8)


def test_bags_per_request_are_bounded_at_and_one_past_the_limit() -> None:
    assert check_bags(0, np.zeros(8, np.int64), SUM, None, 8).count == 8
    with pytest.raises(ResourceExhaustedError, match="9 bags in one request exceeds server.max_batch_keys=8"):
        check_bags(0, np.zeros(9, np.int64), SUM, None, 8)

"""A lookup's misses filled in place by the volatile tier (``Tier.fill``) answer what the general path answers.

A small L1 and a hash map that evicts leave every batch with keys answered by L1, by the hash map in place, by
RocksDB through the general path and by the default, side by side: random batches with duplicates, deleted and
never-written keys and the int64 edges, each answer checked against what was written, with the stored format asked
and not, and L1 kept correct by the rows the fill path offers it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hps_service.cache import build_table_cache
from hps_service.config import CacheConfig, ConstantDefault, ModelConfig, TableConfig
from hps_service.engine import LookupEngine
from hps_service.engine.levels import CACHE, DEFAULT, PERSISTENT, VOLATILE
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier

DIM, DEFAULT_VALUE = 8, -1.0
I64 = np.iinfo(np.int64)
EDGES = np.array([I64.min, I64.min + 1, -1, 0, 1, I64.max - 1, I64.max], dtype=np.int64)


def _rows(keys: np.ndarray, version: int) -> np.ndarray:
    """A row that encodes its key and version, so another key's row or an older one is caught."""
    base = (keys % 10_007).astype(np.float32) * 10 + version
    return np.repeat(base[:, None], DIM, axis=1) + np.arange(DIM, dtype=np.float32) / 8


@pytest.fixture
def engine(tmp_path: Path) -> LookupEngine:
    cfg = CacheConfig(backend="numpy", capacity=128, ways=8, hit_rate_threshold=1.0, warm_start=False)
    eng = LookupEngine(
        volatile=HashMapTier(capacity_rows=600),  # fewer rows than written: the rest only RocksDB holds
        persistent=RocksDBTier(tmp_path / "rocksdb"),
        cache_factory=lambda t, fetch, warm: build_table_cache(cfg, t.format.words, 0, fetch, None, None),
    )
    eng.register_model(ModelConfig(name="m", tables=[
        TableConfig(name="t", dim=DIM, default=ConstantDefault(constant=DEFAULT_VALUE))]))
    return eng


@pytest.mark.parametrize("stored", [False, True])
def test_random_batches_answer_every_key_its_newest_row_or_the_default(engine: LookupEngine, stored: bool) -> None:
    rng = np.random.default_rng(29)
    written = np.unique(np.concatenate([EDGES, rng.integers(I64.min, I64.max, 1500, dtype=np.int64)]))
    newest = {}
    for version in (1, 2):
        part = written if version == 1 else written[::3]
        engine.apply_updates("m", "t", part, _rows(part, version), version)
        newest.update(dict.fromkeys(part.tolist(), version))
    deleted = written[1::7]
    engine.apply_deletes("m", "t", deleted, 3)
    for k in deleted.tolist():
        newest.pop(k)
    never = rng.integers(I64.min, I64.max, 300, dtype=np.int64)
    never = never[~np.isin(never, written)]
    pool = np.concatenate([written, never, EDGES])
    seen = set()
    for _ in range(150):
        keys = rng.choice(pool, int(rng.integers(1, 400)))
        keys = np.concatenate([keys, keys[: int(rng.integers(0, 40))]])  # duplicates in one batch
        res = engine.lookup("m", "t", keys, stored=stored)
        have = np.array([k in newest for k in keys.tolist()])
        want = np.full((keys.shape[0], DIM), DEFAULT_VALUE, dtype=np.float32)
        for i in np.flatnonzero(have):
            want[i] = _rows(keys[i : i + 1], newest[int(keys[i])])[0]
        np.testing.assert_array_equal(res.vectors, want)
        assert (res.sources[~have] == DEFAULT).all()
        assert np.isin(res.sources[have], (CACHE, VOLATILE, PERSISTENT)).all()
        seen.update(np.unique(res.sources[have]).tolist())
    assert seen == {CACHE, VOLATILE, PERSISTENT}, "every level answered some of the batches"

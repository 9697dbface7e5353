"""Lookups of a table without L1 go through the hash map's compiled pass (``ReadTier.lane``) and answer what the general
path answers: random batches with duplicates, deleted and never-written keys and the int64 edges, over a hash map
smaller than the table (RocksDB answers the rest, through the general path) and over one that holds it all (complete:
a key it does not hold answers the default with no RocksDB read), with the stored format asked and not, pooled too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hps_service.config import ConstantDefault, ModelConfig, TableConfig
from hps_service.engine import LookupEngine
from hps_service.engine.bags import SUM, Bags
from hps_service.engine.levels import DEFAULT, PERSISTENT, VOLATILE
from hps_service.engine.read import Reader
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier
from tests.engine.test_fill_path import EDGES, I64, _rows

DIM, DEFAULT_VALUE = 8, -1.0


def _engine(tmp_path: Path, capacity: int, storage: str = "fp32") -> LookupEngine:
    eng = LookupEngine(volatile=HashMapTier(capacity_rows=capacity), persistent=RocksDBTier(tmp_path / "rocksdb"))
    eng.register_model(ModelConfig(name="m", tables=[
        TableConfig(name="t", dim=DIM, storage=storage, default=ConstantDefault(constant=DEFAULT_VALUE))]))
    return eng


def _written(engine: LookupEngine, rng: np.random.Generator) -> tuple[dict[int, int], np.ndarray]:
    written = np.unique(np.concatenate([EDGES, rng.integers(I64.min, I64.max, 1500, dtype=np.int64)]))
    newest: dict[int, int] = {}
    for version in (1, 2):
        part = written if version == 1 else written[::3]
        engine.apply_updates("m", "t", part, _rows(part, version), version)
        newest.update(dict.fromkeys(part.tolist(), version))
    deleted = written[1::7]
    engine.apply_deletes("m", "t", deleted, 3)
    for k in deleted.tolist():
        newest.pop(k)
    never = rng.integers(I64.min, I64.max, 300, dtype=np.int64)
    return newest, np.concatenate([written, never[~np.isin(never, written)], EDGES])


def _check(engine: LookupEngine, rng: np.random.Generator, newest: dict[int, int], pool: np.ndarray,
           stored: bool) -> set[int]:
    seen: set[int] = set()
    for _ in range(120):
        keys = rng.choice(pool, int(rng.integers(1, 400)))
        keys = np.concatenate([keys, keys[: int(rng.integers(0, 40))]])
        res = engine.lookup("m", "t", keys, stored=stored)
        have = np.array([k in newest for k in keys.tolist()])
        want = np.full((keys.shape[0], DIM), DEFAULT_VALUE, dtype=np.float32)
        for i in np.flatnonzero(have):
            want[i] = _rows(keys[i : i + 1], newest[int(keys[i])])[0]
        np.testing.assert_array_equal(res.vectors, want)
        assert (res.sources[~have] == DEFAULT).all()
        seen.update(np.unique(res.sources).tolist())
    return seen


@pytest.mark.parametrize("stored", [False, True])
def test_a_hash_map_smaller_than_the_table_answers_with_rocksdb_behind_it(tmp_path: Path, stored: bool) -> None:
    engine = _engine(tmp_path, capacity=600)
    try:
        newest, pool = _written(engine, np.random.default_rng(29))
        assert engine.table("m", "t").cache is None and not engine.volatile.is_complete("m.t")
        assert _check(engine, np.random.default_rng(30), newest, pool, stored) == {VOLATILE, PERSISTENT, DEFAULT}
    finally:
        engine.close()


@pytest.mark.parametrize("stored", [False, True])
def test_a_complete_table_answers_its_misses_with_the_default_and_reads_no_rocksdb(tmp_path: Path,
                                                                                    stored: bool) -> None:
    engine = _engine(tmp_path, capacity=10_000)
    try:
        newest, pool = _written(engine, np.random.default_rng(31))
        assert engine.volatile.is_complete("m.t")  # an empty table was complete at load; every write reached both
        before = dict(engine.table_stats("m", "t")["persistent"])
        assert _check(engine, np.random.default_rng(32), newest, pool, stored) == {VOLATILE, DEFAULT}
        after = engine.table_stats("m", "t")["persistent"]
        assert (after["hits"], after["misses"]) == (before["hits"], before["misses"]), "a complete table read RocksDB"
        assert engine.table_stats("m", "t")["volatile"]["complete"] == 1
    finally:
        engine.close()


def test_the_stored_format_is_answered_as_stored(tmp_path: Path) -> None:
    engine = _engine(tmp_path, capacity=10_000, storage="fp16")
    try:
        keys = np.arange(1, 65, dtype=np.int64)
        rows = _rows(keys, 1)
        engine.apply_updates("m", "t", keys, rows, 1)
        asked = np.concatenate([keys, [-5, 0]])
        words = engine.lookup("m", "t", asked, stored=True)
        fmt = engine.table("m", "t").format
        np.testing.assert_array_equal(words.vectors[:64], fmt.encode(rows, None))
        np.testing.assert_array_equal(words.vectors[64:], fmt.encode(np.full((2, DIM), DEFAULT_VALUE, np.float32), 0))
        assert (words.sources == [VOLATILE] * 64 + [DEFAULT] * 2).all()
        decoded = engine.lookup("m", "t", asked)  # fp32 of a stored format: the general path decodes
        np.testing.assert_allclose(decoded.vectors[:64], rows, rtol=1e-3)
    finally:
        engine.close()


def test_pooled_lookups_read_their_unique_keys_through_the_pass(tmp_path: Path) -> None:
    engine = _engine(tmp_path, capacity=10_000)
    try:
        keys = np.arange(1, 33, dtype=np.int64)
        engine.apply_updates("m", "t", keys, _rows(keys, 1), 1)
        asked = np.array([1, 2, 2, 40, 3], dtype=np.int64)
        res = engine.lookup_bags("m", "t", asked, Bags(np.array([0, 3], dtype=np.int64), SUM, None))
        want = np.stack([_rows(asked[:3], 1).sum(axis=0), _rows(asked[4:], 1)[0] + DEFAULT_VALUE])
        np.testing.assert_allclose(res.vectors, want)
    finally:
        engine.close()


def test_the_pass_is_what_the_general_path_answers(tmp_path: Path) -> None:
    """The same lookups with the pass and with the general path (a reader whose tier offers none)."""
    engine = _engine(tmp_path, capacity=800)
    try:
        newest, pool = _written(engine, np.random.default_rng(33))
        t = engine.table("m", "t")
        general = Reader(engine.volatile, engine.persistent, 65536)
        general._lane = lambda t, stored: None  # type: ignore[method-assign]
        rng = np.random.default_rng(34)
        for _ in range(50):
            keys = rng.choice(pool, int(rng.integers(1, 300)))
            a, b = engine.reader.lookup(t, keys), general.lookup(t, keys)
            np.testing.assert_array_equal(a.vectors, b.vectors)
            np.testing.assert_array_equal(a.sources == DEFAULT, b.sources == DEFAULT)
    finally:
        engine.close()

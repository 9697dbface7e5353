"""Property tests: the set-associative cache (xp reference and numba paths) against the plain-Python model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hps_service.cache.set_assoc import EMPTY, SetAssociativeCache, set_index
from hps_service.errors import InvalidArgumentError
from tests.cache.cache_model import CacheModel, set_of

SETS, WAYS, DIM = 3, 4, 2
I64 = st.integers(min_value=-(2**63) + 1, max_value=2**63 - 1)
# Mostly a few small keys so sets fill and collide; now and then an extreme one.
KEY = st.one_of(st.integers(min_value=-12, max_value=12), I64)
KEYS = st.lists(KEY, max_size=24)
OP = st.tuples(st.sampled_from(["insert", "insert_no_evict", "query", "update", "invalidate"]), KEYS)
OPS = st.lists(OP, max_size=30)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def vectors_for(step: int, keys: list[int]) -> list[tuple[float, ...]]:
    return [(float(step), float(k % 1009)) for k in keys]


def expected_evictions(cache: SetAssociativeCache, keys: list[int], evict: bool) -> int:
    """Evictions the rules allow: per set, new keys beyond its free slots (at most ways new keys a set)."""
    if not evict:
        return 0
    flat = cache.keys
    cached = {int(k) for k in flat.reshape(-1) if k != EMPTY}
    new_per_set: dict[int, int] = {}
    for key in dict.fromkeys(keys):
        if key not in cached:
            s = set_of(key, cache.sets)
            new_per_set[s] = new_per_set.get(s, 0) + 1
    free = (flat == EMPTY).sum(axis=1)
    return sum(max(0, min(m, cache.ways) - int(free[s])) for s, m in new_per_set.items())


def assert_same_state(cache: SetAssociativeCache, model: CacheModel) -> None:
    for s in range(model.sets):
        for w in range(model.ways):
            entry = model.slots[s][w]
            if entry is None:
                assert cache.keys[s, w] == EMPTY
            else:
                assert cache.keys[s, w] == entry.key
                assert cache.clock[s, w] == entry.clock
                assert tuple(cache.values[s * model.ways + w].tolist()) == entry.vector
    held = cache.keys[cache.keys != EMPTY]
    assert len(np.unique(held)) == len(held), "a key is held in two slots"


def run_against_model(ops: list[tuple[str, list[int]]], policy: str, compiled: bool) -> None:
    cache = SetAssociativeCache(SETS * WAYS, DIM, ways=WAYS, policy=policy, compiled=compiled)
    model = CacheModel(SETS, WAYS, policy)
    for step, (kind, keys) in enumerate(ops):
        karr = np.array(keys, dtype=np.int64)
        vecs = vectors_for(step, keys)
        varr = np.array(vecs, dtype=np.float32).reshape(len(keys), DIM)
        if kind.startswith("insert"):
            evict = kind == "insert"
            allowed = expected_evictions(cache, keys, evict)
            got = cache.insert(karr, varr, evict=evict)
            assert dataclasses.astuple(got) == model.insert(keys, vecs, evict=evict)
            assert got.evicted == allowed
        elif kind == "query":
            out = np.full((len(keys), DIM), -1.0, dtype=np.float32)
            hit = cache.query(karr, out)
            want = model.query(keys)
            assert hit.tolist() == [w is not None for w in want]
            for i, w in enumerate(want):
                assert tuple(out[i].tolist()) == (w if w is not None else (-1.0, -1.0))
        elif kind == "update":
            assert cache.update(karr, varr) == model.update(keys, vecs)
        else:
            assert cache.invalidate(karr) == model.invalidate(keys)
        assert_same_state(cache, model)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@FAST
@given(ops=OPS)
def test_reference_path_answers_like_the_model(policy: str, ops: list[tuple[str, list[int]]]) -> None:
    run_against_model(ops, policy, compiled=False)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@FAST
@given(ops=OPS)
def test_compiled_path_answers_like_the_model(policy: str, ops: list[tuple[str, list[int]]]) -> None:
    run_against_model(ops, policy, compiled=True)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@FAST
@given(ops=OPS, seed=st.integers(0, 2**32 - 1))
def test_compiled_path_equals_reference_path(policy: str, ops: list[tuple[str, list[int]]], seed: int) -> None:
    """Same sequences through both paths on a larger cache: identical slots, clocks, rows, answers, counters."""
    rng = np.random.default_rng(seed)
    a = SetAssociativeCache(8 * 8, 16, ways=8, policy=policy, compiled=True)
    b = SetAssociativeCache(8 * 8, 16, ways=8, policy=policy, compiled=False)
    for kind, keys in ops:
        karr = np.array(keys + rng.integers(-200, 200, size=40).tolist(), dtype=np.int64)
        varr = rng.random((len(karr), 16), dtype=np.float32)
        if kind.startswith("insert"):
            assert a.insert(karr, varr, kind == "insert") == b.insert(karr, varr, kind == "insert")
        elif kind == "query":
            oa, ob = np.zeros((len(karr), 16), np.float32), np.zeros((len(karr), 16), np.float32)
            assert np.array_equal(a.query(karr, oa), b.query(karr, ob))
            assert np.array_equal(oa, ob)
        elif kind == "update":
            assert a.update(karr, varr) == b.update(karr, varr)
        else:
            assert a.invalidate(karr) == b.invalidate(karr)
        assert np.array_equal(a.keys, b.keys) and np.array_equal(a.clock, b.clock)
        held = a.keys.reshape(-1) != EMPTY
        assert np.array_equal(a.values[held], b.values[held])
    assert a.stats() == b.stats()


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(I64, max_size=50), sets=st.integers(1, 2**32))
def test_set_index_is_the_documented_mapping(keys: list[int], sets: int) -> None:
    got = set_index(np, np.array(keys, dtype=np.int64), sets)
    assert got.tolist() == [set_of(k, sets) for k in keys]


def test_full_cache_keeps_hottest_and_reports_stats() -> None:
    cache = SetAssociativeCache(64, 4, ways=8)
    keys = np.arange(1000, dtype=np.int64)
    cache.insert(keys, np.repeat(keys[:, None], 4, axis=1).astype(np.float32))
    stats = cache.stats()
    assert stats["rows"] == 64 and stats["occupancy"] == 1.0 and stats["capacity"] == 64
    out = np.zeros((1000, 4), np.float32)
    hit = cache.query(keys, out)
    assert hit.sum() == 64
    assert np.array_equal(out[hit][:, 0], keys[hit].astype(np.float32))
    assert cache.stats()["hits"] == 64 and cache.stats()["misses"] == 936
    dumped_keys, dumped_rows = cache.dump()
    assert sorted(dumped_keys.tolist()) == sorted(keys[hit].tolist())
    assert np.array_equal(dumped_rows[:, 0], dumped_keys.astype(np.float32))
    cache.clear()
    assert cache.rows() == 0 and cache.dump()[0].shape == (0,)


def test_hottest_keys_orders_by_recency_and_by_count() -> None:
    lru = SetAssociativeCache(32, 2, ways=32, policy="lru")
    lfu = SetAssociativeCache(32, 2, ways=32, policy="lfu")
    keys = np.array([5, 6, 7], dtype=np.int64)
    for cache in (lru, lfu):
        cache.insert(keys, np.zeros((3, 2), np.float32))
        out = np.zeros((1, 2), np.float32)
        for key in (6, 6, 6, 7, 7, 5):
            cache.query(np.array([key], dtype=np.int64), out)
    assert lru.hottest_keys().tolist() == [5, 7, 6]
    assert lfu.hottest_keys().tolist() == [6, 7, 5]


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.insert(np.array([EMPTY], dtype=np.int64), np.zeros((1, 2), np.float32)),
        lambda c: c.insert(np.array([1, 2], dtype=np.int64), np.zeros((1, 2), np.float32)),
        lambda c: c.query(np.array([1.5]), np.zeros((1, 2), np.float32)),
        lambda c: c.query(np.array([1], dtype=np.int64), np.zeros((1, 3), np.float32)),
        lambda c: c.update(np.zeros((2, 2), dtype=np.int64), np.zeros((2, 2), np.float32)),
    ],
)
def test_bad_arguments_raise_invalid_argument(call) -> None:
    with pytest.raises(InvalidArgumentError):
        call(SetAssociativeCache(8, 2, ways=4))


@pytest.mark.parametrize(
    "kwargs", [{"capacity_rows": 10, "ways": 4}, {"capacity_rows": 0}, {"dim": 0}, {"policy": "fifo"}]
)
def test_bad_shapes_raise_invalid_argument(kwargs: dict) -> None:
    args = {"capacity_rows": 8, "dim": 2, "ways": 4} | kwargs
    with pytest.raises(InvalidArgumentError):
        SetAssociativeCache(**args)

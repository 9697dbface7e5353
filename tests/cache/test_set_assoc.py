"""Property tests: the set-associative cache (NumPy reference and numba paths) against the plain-Python model,
over the full int64 key range, with row versions."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hps_service.cache import cpu_kernels
from hps_service.cache.layout import META_SEQ, META_TICK, CacheArrays
from hps_service.cache.set_assoc import SetAssociativeCache, latest_per_key, set_index, tag_of
from hps_service.errors import InvalidArgumentError
from tests.cache.cache_model import CacheModel, set_of
from tests.cache.cache_model import tag_of as model_tag_of

SETS, WAYS, DIM = 3, 4, 2
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
EDGES = [I64_MIN, I64_MAX, -1, 0, I64_MIN + 1, I64_MAX - 1]
I64 = st.integers(min_value=I64_MIN, max_value=I64_MAX)
# Mostly a few small keys so sets fill and collide; the int64 edges and any other int64 now and then.
KEY = st.one_of(st.integers(min_value=-12, max_value=12), st.sampled_from(EDGES), I64)
KEYS = st.lists(KEY, max_size=24)
VERSION = st.integers(min_value=0, max_value=4)
OP = st.tuples(
    st.sampled_from(["insert", "insert_no_evict", "query", "update", "invalidate", "invalidate_versioned"]),
    KEYS, st.lists(VERSION, min_size=24, max_size=24),
)
OPS = st.lists(OP, max_size=30)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def vectors_for(step: int, keys: list[int]) -> list[tuple[float, ...]]:
    return [(float(step), float(k % 1009)) for k in keys]


def assert_same_state(cache: SetAssociativeCache, model: CacheModel) -> None:
    for s in range(model.sets):
        for w in range(model.ways):
            entry = model.slots[s][w]
            if entry is None:
                assert cache.tags[s, w] == 0
            else:
                assert cache.tags[s, w] == model_tag_of(entry.key)
                assert cache.keys[s, w] == entry.key
                assert cache.versions[s, w] == entry.version
                assert cache.clock[s, w] == entry.clock
                assert tuple(cache.values[s * model.ways + w].tolist()) == entry.vector
    held = cache.keys[cache.tags != 0]
    assert len(np.unique(held)) == len(held), "a key is held in two slots"
    assert cache.rows() == model.rows() == len(held), "the rows counter drifted from the slots"
    assert cache.tick == model.tick


def run_against_model(ops: list[tuple[str, list[int], list[int]]], policy: str, compiled: bool) -> None:
    cache = SetAssociativeCache(SETS * WAYS, DIM, ways=WAYS, policy=policy, compiled=compiled)
    model = CacheModel(SETS, WAYS, policy)
    evictions = 0
    for step, (kind, keys, all_versions) in enumerate(ops):
        versions = all_versions[: len(keys)]
        karr = np.array(keys, dtype=np.int64)
        varr_versions = np.array(versions, dtype=np.int64)
        vecs = vectors_for(step, keys)
        varr = np.array(vecs, dtype=np.float32).reshape(len(keys), DIM)
        if kind.startswith("insert"):
            evict = kind == "insert"
            got = cache.insert(karr, varr, varr_versions, evict=evict)
            assert dataclasses.astuple(got) == model.insert(keys, vecs, versions, evict=evict)
            evictions += got.evicted
        elif kind == "query":
            out = np.full((len(keys), DIM), -1.0, dtype=np.float32)
            hit = cache.query(karr, out)
            want = model.query(keys)
            assert hit.tolist() == [w is not None for w in want]
            for i, w in enumerate(want):
                assert tuple(out[i].tolist()) == (w if w is not None else (-1.0, -1.0))
        elif kind == "update":
            assert cache.update(karr, varr, varr_versions) == model.update(keys, vecs, versions)
        elif kind == "invalidate":
            assert cache.invalidate(karr) == model.invalidate(keys)
        else:
            assert cache.invalidate(karr, varr_versions) == model.invalidate(keys, versions)
        assert_same_state(cache, model)
    assert cache.stats()["evictions"] == evictions


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@FAST
@given(ops=OPS)
def test_reference_path_answers_like_the_model(policy: str, ops: list) -> None:
    run_against_model(ops, policy, compiled=False)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@FAST
@given(ops=OPS)
def test_compiled_path_answers_like_the_model(policy: str, ops: list) -> None:
    run_against_model(ops, policy, compiled=True)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@FAST
@given(ops=OPS, seed=st.integers(0, 2**32 - 1))
def test_compiled_path_equals_reference_path(policy: str, ops: list, seed: int) -> None:
    """Same sequences through both paths on a larger cache: identical slots, clocks, rows, answers, counters."""
    rng = np.random.default_rng(seed)
    a = SetAssociativeCache(8 * 8, 16, ways=8, policy=policy, compiled=True)
    b = SetAssociativeCache(8 * 8, 16, ways=8, policy=policy, compiled=False)
    for kind, keys, _ in ops:
        karr = np.array(keys + rng.integers(-200, 200, size=40).tolist(), dtype=np.int64)
        varr = rng.random((len(karr), 16), dtype=np.float32)
        vers = rng.integers(0, 4, size=len(karr))
        if kind.startswith("insert"):
            assert a.insert(karr, varr, vers, kind == "insert") == b.insert(karr, varr, vers, kind == "insert")
        elif kind == "query":
            oa, ob = np.zeros((len(karr), 16), np.float32), np.zeros((len(karr), 16), np.float32)
            assert np.array_equal(a.query(karr, oa), b.query(karr, ob))
            assert np.array_equal(oa, ob)
        elif kind == "update":
            assert a.update(karr, varr, vers) == b.update(karr, varr, vers)
        elif kind == "invalidate":
            assert a.invalidate(karr) == b.invalidate(karr)
        else:
            assert a.invalidate(karr, vers) == b.invalidate(karr, vers)
        for name in ("tags", "keys", "versions", "clock", "meta"):
            held = a.tags != 0
            x, y = getattr(a, name), getattr(b, name)
            assert np.array_equal(x[held], y[held]) if name in ("keys", "versions") else np.array_equal(x, y)
        held = a.tags.reshape(-1) != 0
        assert np.array_equal(a.values[held], b.values[held])
    assert a.stats() == b.stats()


@pytest.mark.parametrize("compiled", [True, False])
def test_every_int64_edge_is_an_ordinary_key(compiled: bool) -> None:
    """Defect 1 of issue 14: -2**63 was the empty-slot marker, so it 'hit' every free slot of its set."""
    cache = SetAssociativeCache(64, 2, ways=8, compiled=compiled)
    keys = np.array(EDGES, dtype=np.int64)
    out = np.full((len(keys), 2), -7.0, np.float32)
    assert not cache.query(keys, out).any(), "a key no one inserted was answered from an empty cache"
    assert (out == -7.0).all()
    rows = np.arange(len(keys) * 2, dtype=np.float32).reshape(-1, 2)
    assert cache.insert(keys, rows, 1).placed == len(keys)
    hit = cache.query(keys, out)
    assert hit.all() and np.array_equal(out, rows)
    assert cache.invalidate(keys[:1]) == 1
    hit = cache.query(keys, out)
    assert hit.tolist() == [False] + [True] * (len(keys) - 1)
    assert cache.rows() == len(keys) - 1


@pytest.mark.parametrize("ways", [32, 16, 12, 3])
def test_a_wide_set_with_shared_and_neighbouring_tags_answers_like_the_reference(ways: int) -> None:
    """The compiled probe scans a set's tags eight at a time (whole words when ``ways`` allows): a key behind
    others with its tag, a key whose tag differs by one bit from a resident's, freed slots that still hold a
    key, and absent keys with a resident's tag all answer as the one-tag-at-a-time reference does."""
    candidates = np.arange(-(1 << 20), 1 << 20, dtype=np.int64)
    in_set0 = candidates[set_index(candidates, 2) == 0]
    tags = tag_of(in_set0)
    target = int(np.bincount(tags).argmax())
    same = in_set0[tags == target]
    near = np.concatenate([in_set0[tags == (target ^ bit)][:2] for bit in (1, 2, 0x40)])
    resident = np.concatenate([near[: ways // 3], same[: ways - ways // 3]])[:ways]
    absent = same[ways : ways + 8]
    freed = resident[1::4]
    compiled, reference = (SetAssociativeCache(2 * ways, 2, ways=ways, compiled=c) for c in (True, False))
    rows = np.stack([resident.astype(np.float32), -resident.astype(np.float32)], axis=1)
    for cache in (compiled, reference):
        assert cache.insert(resident, rows, 1).placed == len(resident)
        cache.invalidate(freed)
    asked = np.concatenate([resident, absent, freed, resident[::-1]])
    want_hit = ~np.isin(asked, freed) & np.isin(asked, resident)
    for cache in (compiled, reference):
        out = np.full((len(asked), 2), np.nan, np.float32)
        hit = cache.query(asked, out)
        assert hit.tolist() == want_hit.tolist()
        assert np.array_equal(out[hit, 0], asked[hit].astype(np.float32))


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(st.one_of(I64, st.sampled_from(EDGES)), max_size=50), sets=st.integers(1, 2**32))
def test_set_index_and_tag_are_the_documented_mapping(keys: list[int], sets: int) -> None:
    arr = np.array(keys, dtype=np.int64)
    assert set_index(arr, sets).tolist() == [set_of(k, sets) for k in keys]
    assert tag_of(arr).tolist() == [model_tag_of(k) for k in keys]
    assert all(t & 0x80 for t in tag_of(arr).tolist())


@settings(deadline=None)
@given(keys=st.lists(st.one_of(st.integers(-5, 5), I64), max_size=40), seed=st.integers(0, 2**16))
def test_compiled_latest_per_key_equals_reference(keys: list[int], seed: int) -> None:
    arr = np.array(keys, dtype=np.int64)
    versions = np.random.default_rng(seed).integers(0, 3, size=len(keys))
    assert np.array_equal(cpu_kernels.latest_per_key(arr, versions), latest_per_key(arr, versions))


def test_versions_never_go_back() -> None:
    """Defect 2 of issue 14: an older row never replaces a newer one, by admission, update or versioned delete."""
    cache = SetAssociativeCache(32, 2, ways=8)
    key = np.array([9], dtype=np.int64)
    out = np.zeros((1, 2), np.float32)
    cache.insert(key, np.full((1, 2), 5.0, np.float32), 5)
    assert cache.update(key, np.full((1, 2), 3.0, np.float32), 3) == 0
    assert cache.insert(key, np.full((1, 2), 4.0, np.float32), 4).stale == 1
    assert cache.invalidate(key, 4) == 0
    assert cache.query(key, out).all() and out[0, 0] == 5.0
    assert cache.update(key, np.full((1, 2), 6.0, np.float32), 6) == 1
    assert cache.query(key, out).all() and out[0, 0] == 6.0
    assert cache.invalidate(key, 6) == 1 and not cache.query(key, out).any()


def test_a_read_overlapped_by_a_writer_is_discarded_untouched() -> None:
    """The query checks the sequence in meta itself; a discarded attempt draws no tick and touches no clock."""
    cache = SetAssociativeCache(32, 2, ways=8, policy="lfu")
    keys = np.array([1, 2], dtype=np.int64)
    cache.insert(keys, np.ones((2, 2), np.float32))
    out, hit = np.zeros((2, 2), np.float32), np.zeros(2, bool)
    clock, tick = cache.clock.copy(), cache.tick
    cpu_kernels.seq_begin(cache.meta)
    assert cache.query_once(keys, out, hit) == -1
    assert np.array_equal(cache.clock, clock) and cache.tick == tick
    cpu_kernels.seq_end(cache.meta)
    assert cache.meta[META_SEQ] == 2 and cache.meta[META_TICK] == tick
    assert cache.query_once(keys, out, hit) == 2
    assert cache.clock.sum() == clock.sum() + 2 and cache.tick == tick + 1


def test_concurrent_readers_lose_no_counts() -> None:
    """Readers touch LFU counts with atomic adds and count hits per thread: the totals are exact."""
    cache = SetAssociativeCache(64, 4, ways=8, policy="lfu")
    keys = np.arange(16, dtype=np.int64)
    cache.insert(keys, np.ones((16, 4), np.float32))
    threads, calls = 4, 300
    start = cache.clock.copy()

    def reader() -> None:
        out = np.empty((16, 4), np.float32)
        for _ in range(calls):
            cache.query(keys, out)

    workers = [threading.Thread(target=reader) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert int((cache.clock - start).sum()) == threads * calls * 16
    assert cache.tick == 1 + threads * calls
    assert cache.stats()["hits"] == threads * calls * 16


def test_stats_come_from_counters() -> None:
    cache = SetAssociativeCache(64, 4, ways=8)
    keys = np.arange(1000, dtype=np.int64)
    cache.insert(keys, np.repeat(keys[:, None], 4, axis=1).astype(np.float32))
    stats = cache.stats()
    assert stats["rows"] == 64 and stats["occupancy"] == 1.0 and stats["capacity"] == 64
    assert stats["evictions"] == 0 and stats["backend"] == "numpy" and stats["memory_bytes"] == cache.arrays.nbytes
    cache.tags[0, 0] = 0  # a scan would see 63 rows; the counter is what writers recorded
    assert cache.stats()["rows"] == 64
    out = np.zeros((1000, 4), np.float32)
    hit = cache.query(keys, out)
    assert hit.sum() == 63
    assert np.array_equal(out[hit][:, 0], keys[hit].astype(np.float32))
    assert cache.stats()["hits"] == 63 and cache.stats()["misses"] == 937
    dumped_keys, dumped_rows, dumped_versions = cache.dump()
    assert sorted(dumped_keys.tolist()) == sorted(keys[hit].tolist()) and (dumped_versions == 0).all()
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


def test_arrays_allocated_by_the_caller_are_the_whole_state() -> None:
    """Two caches over the same caller-allocated arrays (as two processes mapping shared memory) see one cache."""
    buffers: list[np.ndarray] = []

    def alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        buffers.append(np.zeros(shape, dtype))
        return buffers[-1]

    writer = SetAssociativeCache(64, 4, ways=8, alloc=alloc)
    assert len(buffers) == 6
    reader = SetAssociativeCache(64, 4, ways=8, arrays=CacheArrays(*buffers))
    keys = np.array([I64_MIN, 3], dtype=np.int64)
    writer.insert(keys, np.ones((2, 4), np.float32), 1)
    out = np.zeros((2, 4), np.float32)
    assert reader.query(keys, out).all() and (out == 1).all()
    assert reader.rows() == 2
    with pytest.raises(InvalidArgumentError):
        SetAssociativeCache(128, 4, ways=8, arrays=writer.arrays)


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.insert(np.array([1, 2], dtype=np.int64), np.zeros((1, 2), np.float32)),
        lambda c: c.insert(np.array([1], dtype=np.int64), np.zeros((1, 2), np.float32), np.zeros(2, np.int64)),
        lambda c: c.query(np.array([1.5]), np.zeros((1, 2), np.float32)),
        lambda c: c.query(np.array([1], dtype=np.int64), np.zeros((1, 3), np.float32)),
        lambda c: c.update(np.zeros((2, 2), dtype=np.int64), np.zeros((2, 2), np.float32)),
        lambda c: c.invalidate(np.array([1], dtype=np.int64), np.array([0.5])),
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

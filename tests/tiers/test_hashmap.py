"""Tests of the in-process hash map tier: round trips, versions, overflow eviction, threads and memory."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hps_service.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from hps_service.tiers.hashmap import seqlock
from hps_service.tiers.hashmap.tier import HashMapTier

TABLE = "demo.item"
I64 = np.iinfo(np.int64)
#: Table clocks a test starts at: 0, just before the 31-bit stamps wrap, just before int32 and uint32 would.
STAMP_WRAPS = [0, (1 << 31) - 40, (1 << 32) - 40, (1 << 40) + (1 << 31) - 40]


def _rows(keys: np.ndarray, dim: int, salt: float = 0.0) -> np.ndarray:
    """Rows that encode their key, so a row returned for the wrong key is caught."""
    return (keys.astype(np.float64)[:, None] % 100_003 + np.arange(dim) * 0.5 + salt).astype(np.float32)


def _tier(capacity: int = 10_000, dim: int = 8, policy: str = "lru", fraction: float = 0.1) -> HashMapTier:
    tier = HashMapTier(capacity, overflow_policy=policy, evict_fraction=fraction)  # type: ignore[arg-type]
    tier.create_table(TABLE, dim)
    return tier


def test_round_trip_and_missing_keys() -> None:
    tier = _tier()
    keys = np.arange(0, 3000, 3, dtype=np.int64)
    vectors = _rows(keys, 8)
    written = tier.put(TABLE, keys, vectors, np.full(keys.size, 7))
    assert written.all()
    assert tier.count(TABLE) == keys.size

    asked = np.concatenate([keys[::-1], keys + 1])
    got = tier.get(TABLE, asked)
    n = keys.size
    assert got.found[:n].all() and not got.found[n:].any()
    np.testing.assert_array_equal(got.vectors[:n], vectors[::-1])
    np.testing.assert_array_equal(got.versions[:n], 7)
    assert tier.get(TABLE, np.empty(0, dtype=np.int64)).found.shape == (0,)


def test_extreme_keys() -> None:
    tier = _tier(dim=4)
    keys = np.array([0, -1, 1, I64.min, I64.max, I64.min + 1, I64.max - 1, -(2**40)], dtype=np.int64)
    vectors = np.arange(keys.size * 4, dtype=np.float32).reshape(-1, 4)
    assert tier.put(TABLE, keys, vectors, np.arange(keys.size)).all()
    got = tier.get(TABLE, keys[::-1])
    assert got.found.all()
    np.testing.assert_array_equal(got.vectors, vectors[::-1])
    np.testing.assert_array_equal(got.versions, np.arange(keys.size)[::-1])
    assert not tier.get(TABLE, np.array([2, -2, I64.min + 2], dtype=np.int64)).found.any()


def test_versions_never_go_backwards() -> None:
    tier = _tier(dim=2)
    keys = np.array([10, 20, 30], dtype=np.int64)
    tier.put(TABLE, keys, np.full((3, 2), 5, np.float32), np.array([5, 5, 5]))

    offered = np.array([4, 5, 6])
    written = tier.put(TABLE, keys, np.array([[4, 4], [55, 55], [6, 6]], np.float32), offered)
    np.testing.assert_array_equal(written, [False, True, True])
    got = tier.get(TABLE, keys)
    np.testing.assert_array_equal(got.versions, [5, 5, 6])
    np.testing.assert_array_equal(got.vectors[:, 0], [5, 55, 6])


def test_delete_counts_present_keys_and_keeps_others() -> None:
    tier = _tier(dim=4)
    keys = np.arange(-500, 500, dtype=np.int64)
    tier.put(TABLE, keys, _rows(keys, 4), np.ones(keys.size, np.int64))
    gone = keys[::2]
    assert tier.delete(TABLE, np.concatenate([gone, np.array([10_000, 10_001])])) == gone.size
    assert tier.delete(TABLE, gone) == 0
    assert tier.count(TABLE) == keys.size - gone.size
    got = tier.get(TABLE, keys)
    np.testing.assert_array_equal(got.found, np.arange(keys.size) % 2 == 1)
    np.testing.assert_array_equal(got.vectors[got.found], _rows(keys[1::2], 4))
    assert sorted(tier.scan_keys(TABLE, 10_000).tolist()) == keys[1::2].tolist()


def test_duplicate_keys_in_a_batch_apply_in_order() -> None:
    tier = _tier(dim=2)
    keys = np.array([1, 1, 2, 1], dtype=np.int64)
    vectors = np.array([[1, 1], [2, 2], [3, 3], [0, 0]], np.float32)
    written = tier.put(TABLE, keys, vectors, np.array([1, 2, 1, 1]))
    np.testing.assert_array_equal(written, [True, True, True, False])
    assert tier.count(TABLE) == 2
    got = tier.get(TABLE, np.array([1, 2]))
    np.testing.assert_array_equal(got.vectors[:, 0], [2, 3])
    np.testing.assert_array_equal(got.versions, [2, 1])
    assert tier.delete(TABLE, np.array([1, 1])) == 1


def test_versioned_delete_leaves_a_tombstone_that_refuses_older_puts() -> None:
    tier = _tier(dim=4)
    keys = np.arange(100, dtype=np.int64)
    tier.put(TABLE, keys, _rows(keys, 4), np.full(keys.size, 5))
    assert tier.delete(TABLE, keys[:50], np.full(50, 4)) == 0  # a lagging delete keeps the newer rows
    assert tier.get(TABLE, keys).found.all()
    assert tier.delete(TABLE, keys[:50], np.full(50, 5)) == 50  # a delete at the row's version removes it
    absent = np.arange(1000, 1010, dtype=np.int64)
    assert tier.delete(TABLE, absent, 7) == 0  # a delete of an absent key still leaves a tombstone
    assert tier.count(TABLE) == 50
    stats = tier.stats(TABLE)
    assert stats.rows == 50 and stats.extra["tombstones"] == 60
    assert not tier.get(TABLE, np.concatenate([keys[:50], absent])).found.any()
    assert sorted(tier.scan_keys(TABLE, 1000).tolist()) == keys[50:].tolist()

    old = _rows(keys[:50], 4, salt=0.25)
    assert not tier.put(TABLE, keys[:50], old, np.full(50, 5)).any()  # at the tombstone's version: refused
    assert not tier.put(TABLE, keys[:50], old, np.full(50, 3)).any()  # a replayed older put: refused
    assert not tier.put(TABLE, absent, _rows(absent, 4), np.full(10, 7)).any()
    assert not tier.get(TABLE, keys[:50]).found.any()
    assert tier.delete(TABLE, keys[:10], 2) == 0  # a lower delete never lowers the tombstone
    assert not tier.put(TABLE, keys[:10], old[:10], np.full(10, 4)).any()

    newer = _rows(keys[:50], 4, salt=0.5)
    assert tier.put(TABLE, keys[:50], newer, np.full(50, 6)).all()
    got = tier.get(TABLE, keys[:50])
    assert got.found.all()
    np.testing.assert_array_equal(got.vectors, newer)
    assert tier.count(TABLE) == 100 and tier.stats(TABLE).extra["tombstones"] == 10

    assert tier.delete(TABLE, absent) == 0  # an admin delete forgets the tombstone: any version is accepted
    assert tier.put(TABLE, absent, _rows(absent, 4), np.full(10, 1)).all()
    assert tier.stats(TABLE).extra["tombstones"] == 0 and tier.count(TABLE) == 110


def test_duplicate_keys_of_a_versioned_delete_take_the_highest_version() -> None:
    tier = _tier(dim=2)
    keys = np.array([1, 2], dtype=np.int64)
    tier.put(TABLE, keys, np.ones((2, 2), np.float32), np.array([4, 4]))
    assert tier.delete(TABLE, np.array([1, 1, 2]), np.array([3, 6, 3])) == 1
    np.testing.assert_array_equal(tier.get(TABLE, keys).found, [False, True])
    np.testing.assert_array_equal(
        tier.put(TABLE, keys, np.ones((2, 2), np.float32), np.array([5, 5])), [False, True]
    )


@pytest.mark.parametrize("clock", STAMP_WRAPS)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_tombstones_are_evicted_first_oldest_first(policy: str, clock: int) -> None:
    """Also across the wrap of the four-byte stamps (see tiers/hashmap/stamps): the second tombstones are stamped
    past it."""
    tier = _tier(capacity=100, dim=4, policy=policy, fraction=0.1)
    tier.table_arrays(TABLE).ctrl[seqlock.CTRL_CLOCK] = clock
    live = np.arange(50, dtype=np.int64)
    tier.put(TABLE, live, _rows(live, 4), np.ones(50, np.int64))
    first, second = np.arange(1000, 1015, dtype=np.int64), np.arange(2000, 2015, dtype=np.int64)
    tier.delete(TABLE, first, 9)
    tier.table_arrays(TABLE).ctrl[seqlock.CTRL_CLOCK] += 30
    tier.delete(TABLE, second, 9)
    assert not tier.get(TABLE, np.concatenate([first, second])).found.any()
    more = np.arange(100, 140, dtype=np.int64)
    assert tier.put(
        TABLE, more, _rows(more, 4), np.ones(40, np.int64)
    ).all()  # 20 rows over: 20 tombstones go
    stats = tier.stats(TABLE)
    assert stats.rows == 90 and stats.extra["tombstones"] == 10 and stats.evictions == 20
    assert tier.get(TABLE, np.concatenate([live, more])).found.all()
    assert tier.put(TABLE, second, _rows(second, 4), np.ones(15, np.int64)).sum() == 5  # 10 tombstones remain
    assert tier.put(TABLE, first, _rows(first, 4), np.ones(15, np.int64)).all()  # the oldest were evicted


def test_lru_overflow_keeps_recently_read_rows() -> None:
    tier = _tier(capacity=1000, dim=4, policy="lru", fraction=0.2)
    old = np.arange(1000, dtype=np.int64)
    tier.put(TABLE, old, _rows(old, 4), np.ones(1000, np.int64))
    hot = old[::5]  # 200 rows read after the insert
    assert tier.get(TABLE, hot).found.all()

    new = np.arange(10_000, 10_100, dtype=np.int64)
    assert tier.put(TABLE, new, _rows(new, 4), np.ones(100, np.int64)).all()
    stats = tier.stats(TABLE)
    assert stats.evictions == 200
    assert tier.count(TABLE) == 900
    assert tier.get(TABLE, hot).found.all()
    assert tier.get(TABLE, new).found.all()
    cold_found = tier.get(TABLE, np.setdiff1d(old, hot)).found
    assert cold_found.sum() == 600
    np.testing.assert_array_equal(tier.get(TABLE, hot).vectors, _rows(hot, 4))


def test_lfu_overflow_keeps_frequently_read_rows() -> None:
    tier = _tier(capacity=500, dim=4, policy="lfu", fraction=0.5)
    keys = np.arange(500, dtype=np.int64)
    tier.put(TABLE, keys, _rows(keys, 4), np.ones(500, np.int64))
    frequent = keys[250:]
    for _ in range(3):
        tier.get(TABLE, frequent)
    tier.get(TABLE, keys[:250])  # read once, and more recently than the frequent rows

    new = np.arange(1000, 1010, dtype=np.int64)
    assert tier.put(TABLE, new, _rows(new, 4), np.ones(10, np.int64)).all()
    assert tier.stats(TABLE).evictions == 250
    assert tier.get(TABLE, frequent).found.all()
    assert not tier.get(TABLE, keys[:250]).found.any()
    np.testing.assert_array_equal(tier.get(TABLE, frequent).vectors, _rows(frequent, 4))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("fraction", [0.1, 0.01])  # many victims: index rebuilt; few: slots removed one by one
def test_count_never_exceeds_capacity(policy: str, fraction: float) -> None:
    capacity = 300
    tier = _tier(capacity=capacity, dim=4, policy=policy, fraction=fraction)
    rng = np.random.default_rng(1)
    for step in range(40):
        keys = np.unique(rng.integers(-5000, 5000, size=rng.integers(1, 400)))
        written = tier.put(TABLE, keys, _rows(keys, 4), np.full(keys.size, step))
        assert tier.count(TABLE) <= capacity
        got = tier.get(TABLE, keys[written])
        assert got.found.all()
        np.testing.assert_array_equal(got.vectors, _rows(keys[written], 4))
        tier.get(TABLE, rng.integers(-5000, 5000, size=100))
    assert tier.stats(TABLE).evictions > 0
    big = np.arange(100_000, 101_000, dtype=np.int64)
    assert tier.put(TABLE, big, _rows(big, 4), np.ones(big.size, np.int64)).sum() == capacity
    assert tier.count(TABLE) == capacity


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "delete", "versioned_delete"]),
            st.lists(st.integers(min_value=-40, max_value=40), min_size=0, max_size=30, unique=True),
            st.integers(min_value=0, max_value=5),
        ),
        max_size=25,
    )
)
def test_matches_a_dict_model(ops: list[tuple[str, list[int], int]]) -> None:
    """Against a dict of key -> (version, value or None for a tombstone)."""
    tier = _tier(capacity=1000, dim=3)
    model: dict[int, tuple[int, float | None]] = {}
    for op, key_list, version in ops:
        keys = np.array(key_list, dtype=np.int64)
        live = [k in model and model[k][1] is not None for k in key_list]
        if op == "put":
            values = keys.astype(np.float32) * 10 + version
            vectors = np.repeat(values[:, None], 3, axis=1)
            written = tier.put(TABLE, keys, vectors, np.full(keys.size, version))
            expected = [
                k not in model or (model[k][0] <= version if is_live else model[k][0] < version)
                for k, is_live in zip(key_list, live, strict=True)
            ]
            assert written.tolist() == expected
            for k, ok, v in zip(key_list, expected, values.tolist(), strict=True):
                if ok:
                    model[k] = (version, v)
        elif op == "delete":
            assert tier.delete(TABLE, keys) == sum(live)
            for k in key_list:
                model.pop(k, None)
        elif op == "versioned_delete":
            removed = tier.delete(TABLE, keys, np.full(keys.size, version))
            assert removed == sum(is_live and model[k][0] <= version for k, is_live in zip(key_list, live))
            for k in key_list:
                if k not in model or model[k][0] <= version:
                    model[k] = (version, None)
        got = tier.get(TABLE, keys)
        assert got.found.tolist() == [k in model and model[k][1] is not None for k in key_list]
        for i, k in enumerate(key_list):
            if got.found[i]:
                assert got.versions[i] == model[k][0]
                assert got.vectors[i].tolist() == [model[k][1]] * 3
        live_keys = sorted(k for k, (_, v) in model.items() if v is not None)
        assert tier.count(TABLE) == len(live_keys)
        assert sorted(tier.scan_keys(TABLE, 1000).tolist()) == live_keys


def test_readers_never_see_torn_rows() -> None:
    dim = 64
    tier = _tier(capacity=2000, dim=dim, fraction=0.25)
    errors: list[str] = []
    done = threading.Event()

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for version in range(1, 300):
            keys = np.unique(rng.integers(0, 3000, size=256))
            vectors = np.full((keys.size, dim), version, dtype=np.float32)
            tier.put(TABLE, keys, vectors, np.full(keys.size, version))
            if version % 50 == 0:
                tier.delete(TABLE, keys[:20])

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not done.is_set():
            got = tier.get(TABLE, rng.integers(0, 3000, size=512))
            rows = got.vectors[got.found]
            expected = got.versions[got.found].astype(np.float32)[:, None]
            if not (rows == expected).all():
                errors.append("a row mixed two versions or does not match its version")
                return

    writers = [threading.Thread(target=writer, args=(s,)) for s in range(2)]
    readers = [threading.Thread(target=reader, args=(100 + s,)) for s in range(3)]
    for thread in writers + readers:
        thread.start()
    for thread in writers:
        thread.join()
    done.set()
    for thread in readers:
        thread.join()
    assert not errors
    assert 0 < tier.count(TABLE) <= 2000


def test_memory_within_target_at_200k_rows() -> None:
    dim = 64
    tier = _tier(capacity=10_000_000, dim=dim)
    step = 10_000
    ratios = []
    for start in range(0, 200_000, step):
        keys = np.arange(start, start + step, dtype=np.int64) * 7919
        tier.put(TABLE, keys, np.ones((step, dim), np.float32), np.ones(step, np.int64))
        if start + step >= 50_000:
            ratios.append(tier.table_bytes(TABLE) / (tier.count(TABLE) * dim * 4))
    assert tier.count(TABLE) == 200_000
    assert max(ratios) <= 1.3, ratios
    all_keys = np.arange(200_000, dtype=np.int64) * 7919
    assert tier.get(TABLE, all_keys).found.all()
    assert not tier.get(TABLE, all_keys + 1).found.any()
    assert tier.stats(TABLE).extra["memory_ratio"] == pytest.approx(ratios[-1])


def _resident_bytes() -> int:
    """This process's resident set size (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_capacity_is_reserved_not_resident_and_rows_never_move() -> None:
    """A 10M-row table (2.7 GB of storage) uses memory only for the rows it holds, reported by table_bytes, and
    its storage is never reallocated (copied) as rows arrive."""
    dim, n, step = 64, 200_000, 10_000
    before = _resident_bytes()
    tier = _tier(capacity=10_000_000, dim=dim)
    storage = tier._tables[TABLE].rows
    for start in range(0, n, step):
        keys = np.arange(start, start + step, dtype=np.int64)
        tier.put(TABLE, keys, _rows(keys, dim), np.ones(step, np.int64))
    grown = _resident_bytes() - before
    assert tier._tables[TABLE].rows is storage
    assert n * dim * 4 * 0.5 < grown < 2 * tier.table_bytes(TABLE) + (32 << 20), (grown, tier.table_bytes(TABLE))
    keys = np.arange(n, dtype=np.int64)
    np.testing.assert_array_equal(tier.get(TABLE, keys).vectors, _rows(keys, dim))


def test_capacity_beyond_the_address_space_is_refused_clearly() -> None:
    tier = HashMapTier(2**31 - 2)
    with pytest.raises(ResourceExhaustedError, match="volatile.capacity_rows"):
        tier.create_table(TABLE, 65_536)  # 512 TiB of rows: more than a process can address


def test_validation_and_unknown_tables() -> None:
    tier = _tier(dim=4)
    with pytest.raises(NotFoundError, match="nope"):
        tier.get("demo.nope", np.array([1]))
    with pytest.raises(NotFoundError):
        tier.put("demo.nope", np.array([1]), np.zeros((1, 4), np.float32), np.array([1]))
    with pytest.raises(InvalidArgumentError, match="1-D"):
        tier.get(TABLE, np.zeros((2, 2), np.int64))
    with pytest.raises(InvalidArgumentError, match="integers"):
        tier.get(TABLE, np.array([1.5]))
    with pytest.raises(InvalidArgumentError, match="shape"):
        tier.put(TABLE, np.array([1, 2]), np.zeros((2, 3), np.float32), np.array([1, 1]))
    with pytest.raises(InvalidArgumentError, match="float32"):
        tier.put(TABLE, np.array([1]), np.array([["a", "b", "c", "d"]]), np.array([1]))
    with pytest.raises(InvalidArgumentError, match="versions"):
        tier.put(TABLE, np.array([1, 2]), np.zeros((2, 4), np.float32), np.array([1]))
    with pytest.raises(InvalidArgumentError, match="delete versions must have shape"):
        tier.delete(TABLE, np.array([1, 2]), np.array([1]))
    with pytest.raises(InvalidArgumentError, match="delete versions must be integers"):
        tier.delete(TABLE, np.array([1]), np.array([1.5]))
    with pytest.raises(InvalidArgumentError, match="dim"):
        tier.create_table(TABLE, 8)
    with pytest.raises(InvalidArgumentError, match="overflow_policy"):
        HashMapTier(10, overflow_policy="fifo")  # type: ignore[arg-type]
    tier.create_table(TABLE, 4)

    small = np.array([3, 4], dtype=np.int32)
    assert tier.put(TABLE, small, np.ones((2, 4), np.float64), np.array([1, 1], np.int32)).all()
    assert tier.get(TABLE, np.array([3, 4], dtype=np.uint16)).found.all()
    assert tier.stats(TABLE).rows == 2
    tier.drop_table(TABLE)
    with pytest.raises(NotFoundError):
        tier.count(TABLE)
    tier.close()

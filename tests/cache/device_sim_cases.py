"""The CUDA kernels of the L1 cache run in numba's CUDA simulator against the NumPy reference (hypothesis).

Run in a process of its own with ``NUMBA_ENABLE_CUDASIM=1`` (set before numba.cuda is imported):
``tests/cache/test_device_kernels.py`` does that. The simulator runs every simulated thread as a Python
thread, so batches and caches are small; lanes per key and keys per block are small launch shapes of the
same kernel source a GPU runs with a warp per key.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 before numba.cuda is imported (run by test_device_kernels.py)",
                allow_module_level=True)

from numba import cuda  # noqa: E402

from hps_service.cache.cuda_kernels import RETRY  # noqa: E402
from hps_service.cache.device import DeviceCache  # noqa: E402
from hps_service.cache.layout import META_SEQ, META_TICK  # noqa: E402
from hps_service.cache.set_assoc import SetAssociativeCache  # noqa: E402
from hps_service.cache.table_cache import SetAssocTableCache  # noqa: E402

# uint64 hashing of scalars in simulated kernels wraps on purpose.
warnings.filterwarnings("ignore", category=RuntimeWarning)
np.seterr(over="ignore")

SETS, WAYS, DIM = 3, 4, 3
SIM = {"lanes": 2, "keys_per_block": 2, "write_threads": 4}
EDGES = [-(2**63), 2**63 - 1, -1, 0]
KEY = st.one_of(st.integers(-6, 6), st.sampled_from(EDGES), st.integers(-(2**63), 2**63 - 1))
OP = st.tuples(st.sampled_from(["insert", "insert_no_evict", "query", "update", "invalidate", "invalidate_v"]),
               st.lists(KEY, max_size=7), st.lists(st.integers(0, 2), min_size=7, max_size=7))


def assert_same_state(dev: DeviceCache, host: SetAssociativeCache) -> None:
    a = dev.host_arrays()
    held = host.tags != 0
    assert np.array_equal(a["tags"], host.tags)
    assert np.array_equal(a["keys"][held], host.keys[held])
    assert np.array_equal(a["versions"][held], host.versions[held])
    assert np.array_equal(a["clock"], host.clock)
    assert np.array_equal(a["values"][held.reshape(-1)], host.values[held.reshape(-1)])
    assert dev.rows() == host.rows() and dev.stats()["evictions"] == host.stats()["evictions"]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OP, min_size=1, max_size=6))
def test_device_kernels_answer_like_the_numpy_reference(policy: str, ops: list) -> None:
    dev = DeviceCache(SETS * WAYS, DIM, ways=WAYS, policy=policy, **SIM)
    host = SetAssociativeCache(SETS * WAYS, DIM, ways=WAYS, policy=policy, compiled=False)
    for step, (kind, keys, all_versions) in enumerate(ops):
        k = np.array(keys, dtype=np.int64)
        v = np.array(all_versions[: len(keys)], dtype=np.int64)
        rows = (np.arange(len(keys) * DIM, dtype=np.float32).reshape(-1, DIM) + 100 * step)
        if kind.startswith("insert"):
            evict = kind == "insert"
            assert dev.insert(k, rows, v, evict) == host.insert(k, rows, v, evict)
        elif kind == "query":
            out_d, out_h = np.full((len(k), DIM), -1, np.float32), np.full((len(k), DIM), -1, np.float32)
            hit_d, hit_h = dev.query(k, out_d), host.query(k, out_h)
            assert np.array_equal(hit_d, hit_h) and np.array_equal(out_d[hit_d], out_h[hit_h])
        elif kind == "update":
            assert dev.update(k, rows, v) == host.update(k, rows, v)
        elif kind == "invalidate":
            assert dev.invalidate(k) == host.invalidate(k)
        else:
            assert dev.invalidate(k, v) == host.invalidate(k, v)
        assert_same_state(dev, host)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_clocks_wrap_on_the_device_as_on_the_host(policy: str) -> None:
    """Ticks from just before the clocks' 31 bits wrap: the same slots, clocks and evictions as the reference."""
    start = (1 << 31) - 4
    dev = DeviceCache(SETS * WAYS, DIM, ways=WAYS, policy=policy, **SIM)
    dev._ticks = itertools.count(start + 1)  # the device draws its ticks on the host, from 1 otherwise
    host = SetAssociativeCache(SETS * WAYS, DIM, ways=WAYS, policy=policy, compiled=False)
    host.meta[META_TICK] = start
    rng = np.random.default_rng(3)
    for step in range(12):
        k = rng.integers(-9, 9, size=5).astype(np.int64)
        if step % 3 == 2:
            out_d, out_h = np.zeros((5, DIM), np.float32), np.zeros((5, DIM), np.float32)
            assert np.array_equal(dev.query(k, out_d), host.query(k, out_h))
        else:
            rows = rng.random((5, DIM), dtype=np.float32)
            assert dev.insert(k, rows, 1) == host.insert(k, rows, 1)
        assert_same_state(dev, host)
    assert host.stats()["evictions"] > 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_versions_on_the_device(policy: str) -> None:
    """Equal versions overwrite, older ones never do: insert, update and versioned delete, against the reference."""
    dev = DeviceCache(SETS * WAYS, DIM, ways=WAYS, policy=policy, **SIM)
    host = SetAssociativeCache(SETS * WAYS, DIM, ways=WAYS, policy=policy, compiled=False)
    key = np.array([9], dtype=np.int64)
    steps = [("insert", 5), ("update", 5), ("update", 3), ("insert", 4), ("insert", 5), ("invalidate", 4),
             ("update", 6), ("invalidate", 6), ("insert", 1)]
    for i, (op, version) in enumerate(steps):
        row = np.full((1, DIM), float(i), np.float32)
        if op == "insert":
            assert dev.insert(key, row, version) == host.insert(key, row, version), (i, op, version)
        elif op == "update":
            assert dev.update(key, row, version) == host.update(key, row, version), (i, op, version)
        else:
            assert dev.invalidate(key, version) == host.invalidate(key, version), (i, op, version)
        assert_same_state(dev, host)


def test_int64_edges_on_the_device() -> None:
    dev = DeviceCache(SETS * WAYS, DIM, ways=WAYS, **SIM)
    keys = np.array(EDGES, dtype=np.int64)
    out = np.zeros((4, DIM), np.float32)
    assert not dev.query(keys, out).any(), "an empty device cache answered a key"
    rows = np.arange(4 * DIM, dtype=np.float32).reshape(4, DIM)
    assert dev.insert(keys, rows, 1).placed == 4
    assert dev.query(keys, out).all() and np.array_equal(out, rows)
    assert dev.invalidate(keys[:1]) == 1 and dev.query(keys, out).tolist() == [False, True, True, True]


def test_a_block_overlapped_by_a_write_is_rerun_and_touches_once() -> None:
    """The device-side sequence lock: with the counter odd (a write in flight) every key is marked RETRY and
    nothing is touched; the rerun after the write answers them and counts each access once."""
    dev = DeviceCache(SETS * WAYS, DIM, ways=WAYS, policy="lfu", **SIM)
    keys = np.array([1, 2, 3], dtype=np.int64)
    dev.insert(keys, np.ones((3, DIM), np.float32))
    before = dev.host_arrays()["clock"].sum()
    cuda.to_device(np.array([1], np.int64), to=dev.arrays.meta[META_SEQ : META_SEQ + 1])  # a writer is inside
    finished = []

    class WriterFinishes:
        """What waiting for the writers' mutex amounts to: the write completes (counter even again)."""

        def __enter__(self) -> None:
            finished.append(True)
            cuda.to_device(np.array([2], np.int64), to=dev.arrays.meta[META_SEQ : META_SEQ + 1])

        def __exit__(self, *exc: object) -> None:
            return None

    dev.exclusive = WriterFinishes
    out, hit = np.zeros((3, DIM), np.float32), np.zeros(3, bool)
    assert dev.query_once(keys, out, hit) == 3 and finished == [True]
    assert (out == 1).all()
    assert dev.host_arrays()["clock"].sum() == before + 3
    assert RETRY == 2


def test_table_cache_over_the_device_cache() -> None:
    """SetAssocTableCache drives the device cache like the host one: admission, versioned update and delete,
    counters for stats, readers on threads of their own (each with its own stream)."""

    def fetch(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.repeat(keys[:, None], DIM, 1).astype(np.float32), np.ones(len(keys), np.int64), \
            np.ones(len(keys), bool)

    cache = SetAssocTableCache(DeviceCache(8 * 4, DIM, ways=4, **SIM), fetch, hit_rate_threshold=1.0,
                               warm_start=False)
    try:
        keys = np.arange(6, dtype=np.int64)
        rows, versions, _ = fetch(keys)
        cache.admit(keys, rows, versions, 0.0)
        cache.update(keys[:2], np.full((2, DIM), 9, np.float32), 3)
        cache.update(keys[:2], np.full((2, DIM), 7, np.float32), 2)  # older: kept out
        cache.invalidate(keys[5:], 0)  # older than the cached row: kept
        cache.invalidate(keys[4:5])
        results: list[np.ndarray] = []

        def reader() -> None:
            out = np.empty((6, DIM), np.float32)
            hit = cache.lookup(keys, out)
            results.append(np.where(hit[:, None], out, -1))

        for _ in range(2):  # two serving threads, each with its own stream and buffers (one at a time: the
            t = threading.Thread(target=reader)  # simulator's launches are not thread-safe)
            t.start()
            t.join()
        want = np.where(np.arange(6)[:, None] == 4, -1, np.repeat(keys[:, None], DIM, 1)).astype(np.float32)
        want[:2] = 9
        for got in results:
            np.testing.assert_array_equal(got, want)
        stats = cache.stats()
        assert stats["backend"] == "cuda" and stats["rows"] == 5 and stats["hits"] == 10 and stats["misses"] == 2
        assert stats["memory_bytes"] > 0
        cache.clear()
        assert cache.stats()["rows"] == 0
    finally:
        cache.close()


def test_warm_up_changes_nothing() -> None:
    dev = DeviceCache(SETS * WAYS, DIM, ways=WAYS, **SIM)
    dev.insert(np.array([4], np.int64), np.ones((1, DIM), np.float32), 1)
    before = dev.host_arrays()
    dev.warm_up()
    after = dev.host_arrays()
    for name in ("tags", "keys", "versions", "clock", "values"):
        assert np.array_equal(before[name], after[name]), name

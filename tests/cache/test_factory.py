"""build_table_cache: capacity from config, disabled caches, backend choice."""

from __future__ import annotations

import numpy as np
import pytest

from hps_service.cache import TableCache, build_table_cache, capacity_rows
from hps_service.cache.array_module import cupy_usable, get_array_module
from hps_service.config import CacheConfig
from hps_service.errors import InvalidArgumentError, UnavailableError


def fetch(keys: np.ndarray) -> np.ndarray:
    return np.repeat(keys[:, None], 4, axis=1).astype(np.float32)


@pytest.mark.parametrize(
    ("capacity", "ways", "table_rows", "rows"),
    [(0.2, 32, 10_000, 2016), (1.0, 32, 100, 128), (0.5, 8, 3, 8), (0.1, 8, 5, 0), (100, 32, 0, 128), (64, 32, 10, 64), (0, 32, 9, 0)],
)
def test_capacity_is_a_fraction_or_rows_rounded_up_to_whole_sets(
    capacity: float, ways: int, table_rows: int, rows: int
) -> None:
    assert capacity_rows(CacheConfig(capacity=capacity, ways=ways), table_rows) == rows


def test_builds_a_table_cache_that_serves_rows() -> None:
    cfg = CacheConfig(backend="numpy", capacity=64, ways=8, warm_start=False)
    cache = build_table_cache(cfg, 4, 1000, fetch, None, None)
    try:
        assert isinstance(cache, TableCache) and cache.capacity == 64 and cache.dim == 4
        keys = np.arange(10, dtype=np.int64)
        cache.admit(keys, fetch(keys), 0.0)
        out = np.zeros((10, 4), np.float32)
        assert cache.lookup(keys, out).all() and np.array_equal(out, fetch(keys))
    finally:
        cache.close()


def test_warm_start_off_leaves_the_cache_cold() -> None:
    cfg = CacheConfig(backend="numpy", capacity=64, ways=8, warm_start=False)
    cache = build_table_cache(cfg, 4, 1000, fetch, lambda n: np.arange(n, dtype=np.int64), None)
    try:
        assert cache.wait_warm(1.0) and cache.stats()["rows"] == 0
    finally:
        cache.close()


def test_disabled_or_empty_cache_is_none() -> None:
    assert build_table_cache(CacheConfig(enabled=False), 4, 1000, fetch, None, None) is None
    assert build_table_cache(CacheConfig(capacity=0), 4, 1000, fetch, None, None) is None
    assert build_table_cache(CacheConfig(capacity=0.1), 4, 5, fetch, None, None) is None


def test_backend_choice() -> None:
    assert get_array_module("numpy") is np
    with pytest.raises(InvalidArgumentError):
        get_array_module("tpu")
    if cupy_usable():
        assert get_array_module("auto").__name__ == "cupy"
    else:
        assert get_array_module("auto") is np
        with pytest.raises(UnavailableError, match="no usable CUDA device"):
            get_array_module("cupy")

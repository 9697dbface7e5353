"""build_table_cache: capacity from config, disabled caches, backend choice."""

from __future__ import annotations

import numpy as np
import pytest

from hps_service.cache import TableCache, build_table_cache, capacity_rows
from hps_service.cache.backend import device_status, resolve_backend
from hps_service.config import CacheConfig
from hps_service.errors import InvalidArgumentError, UnavailableError


def rows(keys: np.ndarray) -> np.ndarray:
    return np.repeat(keys[:, None], 4, axis=1).astype(np.float32)


def fetch(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return rows(keys), np.ones(len(keys), np.int64), np.ones(len(keys), bool)


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
        cache.admit(keys, rows(keys), 1, 0.0)
        out = np.zeros((10, 4), np.float32)
        assert cache.lookup(keys, out).all() and np.array_equal(out, rows(keys))
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


def test_backend_choice(caplog: pytest.LogCaptureFixture) -> None:
    """auto takes the device only when one is usable, and logs what it chose and why."""
    assert resolve_backend("numpy") == "numpy"
    with pytest.raises(InvalidArgumentError):
        resolve_backend("tpu")
    usable, why = device_status()
    with caplog.at_level("INFO", logger="hps_service.cache.backend"):
        chosen = resolve_backend("auto")
    assert chosen == ("cuda" if usable else "numpy")
    assert why in caplog.text and "'auto' chose" in caplog.text
    if not usable:
        with pytest.raises(UnavailableError, match="no usable CUDA device"):
            resolve_backend("cupy")

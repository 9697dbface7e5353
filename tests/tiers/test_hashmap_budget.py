"""The hash map's memory budget per table (``volatile.capacity_mb``): rows of narrower stored formats fit more of
them, the table's arrays never outgrow the budget, and a budget that holds no row is refused."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from hps_service.config import HPSConfig, ModelConfig, TableConfig
from hps_service.errors import InvalidArgumentError
from hps_service.rows.formats import row_format
from hps_service.tiers.hashmap.tier import HashMapTier, rows_within
from hps_service.tiers.registry import build_volatile

BUDGET = 4 << 20


@pytest.mark.parametrize("dim", [1, 18, 64, 1000])
def test_rows_within_is_the_most_that_fit(dim: int) -> None:
    n = rows_within(BUDGET, dim)
    tier = HashMapTier(10_000_000, capacity_bytes=BUDGET)
    tier.create_table("t", dim)
    keys = np.arange(n, dtype=np.int64) * 7 - n
    for lo in range(0, n, 50_000):
        k = keys[lo : lo + 50_000]
        tier.put("t", k, np.ones((k.size, dim), np.float32), np.ones(k.size, np.int64))
    assert tier.count("t") == n and tier.stats("t").capacity == n
    assert tier.table_bytes("t") <= BUDGET  # storage and index at their fullest
    assert rows_within(BUDGET + 4 * dim + 32, dim) >= n  # monotone
    unbounded = HashMapTier(n + 1)  # one row more than the budget's rows takes more than the budget
    unbounded.create_table("t", dim)
    more = np.arange(n + 1, dtype=np.int64)
    for lo in range(0, n + 1, 50_000):
        k = more[lo : lo + 50_000]
        unbounded.put("t", k, np.ones((k.size, dim), np.float32), np.ones(k.size, np.int64))
    assert unbounded.count("t") == n + 1 and unbounded.table_bytes("t") > BUDGET
    unbounded.close()
    tier.put("t", np.array([10**12]), np.ones((1, dim), np.float32), np.ones(1, np.int64))
    assert tier.count("t") <= n and tier.stats("t").evictions > 0  # full: it evicts instead of growing
    tier.close()


def test_int8_rows_fit_about_three_times_as_many_as_fp32() -> None:
    tier = HashMapTier(10_000_000, capacity_bytes=BUDGET)
    for storage in ("fp32", "fp16", "int8"):
        tier.create_table(storage, row_format(storage, 64).words)
    fp32, fp16, int8 = (tier.stats(s).capacity for s in ("fp32", "fp16", "int8"))
    assert 1.6 < fp16 / fp32 < 2.0 and 2.4 < int8 / fp32 < 3.0, (fp32, fp16, int8)  # the index doubles in steps
    tier.close()


def test_capacity_rows_still_bounds_a_table() -> None:
    tier = HashMapTier(1000, capacity_bytes=BUDGET)
    tier.create_table("t", 8)
    assert tier.stats("t").capacity == 1000
    tier.close()


def test_a_budget_that_holds_no_row_is_refused() -> None:
    tier = HashMapTier(1000, capacity_bytes=1024)
    with pytest.raises(InvalidArgumentError, match=r"volatile.capacity_mb .* holds no row of table 't'"):
        tier.create_table("t", 1024)
    with pytest.raises(InvalidArgumentError, match="capacity_bytes must be a positive integer"):
        HashMapTier(1000, capacity_bytes=0)
    with pytest.raises(ValidationError, match="capacity_mb"):
        HPSConfig(volatile={"capacity_mb": 0})


def test_the_config_budget_reaches_the_tier() -> None:
    cfg = HPSConfig(volatile={"capacity_mb": 4}, models=[ModelConfig(name="m", tables=[TableConfig(name="t", dim=8)])])
    tier = build_volatile(cfg.volatile)
    assert isinstance(tier, HashMapTier) and tier.capacity_bytes == BUDGET
    tier.create_table("m.t", 8)
    assert tier.stats("m.t").capacity == rows_within(BUDGET, 8)
    tier.close()

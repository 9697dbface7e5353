"""Part 4 of ``make bench``: the bytes per row the in-process tiers hold (hash map, L1 arrays) over the raw row's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.harness.plan import DIM, Plan


def _resident_bytes() -> int:
    """This process's resident set size (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def part(p: Plan) -> dict[str, Any]:
    """Bytes held per stored row by the hash-map tier and by the L1 cache arrays, over dim * 4."""
    from hps_service.cache import SetAssociativeCache
    from hps_service.tiers.hashmap.tier import HashMapTier

    rows = p.rows
    raw_row = DIM * 4
    rng = np.random.default_rng(0)
    keys = rng.permutation(np.arange(rows, dtype=np.int64) * 7 + 1)
    vectors = rng.standard_normal((rows, DIM), dtype=np.float32)
    warm = HashMapTier(capacity_rows=16)  # loads the compiled kernels, so their code is not counted as rows
    warm.create_table("m.t", DIM)
    warm.put("m.t", keys[:1], vectors[:1], np.ones(1, np.int64))
    warm.close()
    resident_before = _resident_bytes()
    tier = HashMapTier(capacity_rows=rows)
    tier.create_table("m.t", DIM)
    for lo in range(0, rows, 65536):
        tier.put("m.t", keys[lo:lo + 65536], vectors[lo:lo + 65536], np.ones(min(65536, rows - lo), np.int64))
    held = tier.count("m.t")
    hashmap_bytes = tier.table_bytes("m.t")
    resident_growth = _resident_bytes() - resident_before  # cross-checks table_bytes against the OS
    tier.close()
    capacity = -(-rows // 32) * 32
    cache = SetAssociativeCache(capacity, DIM, ways=32)
    cache_bytes = cache.memory_bytes()
    return {"rows": held, "raw_row_bytes": raw_row, "hashmap_bytes_per_row": hashmap_bytes / held,
            "hashmap_resident_bytes_per_row": resident_growth / held,
            "hashmap_ratio": hashmap_bytes / (held * raw_row), "l1_bytes_per_row": cache_bytes / capacity,
            "l1_ratio": cache_bytes / (capacity * raw_row), "target": 1.3}

"""Part 3 of ``make bench``: the L3 miss path (no L1, no volatile tier) against a raw rocksdict multi-get of the same
keys on the same store."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from hps_service.config import load_config
from hps_service.serve.process import build_engine
from hps_service.tiers.base import table_id
from loadtest.harness.plan import DIM, MODEL, TABLE, Plan


def part(p: Plan, db_path: Path, keys: np.ndarray) -> dict[str, Any]:
    """engine.lookup with no L1 and no volatile tier vs rocksdict multi-get on the very column family it reads,
    batches of 1024 distinct present keys, interleaved and alternated, after warming both."""
    config = load_config(None, cache={"enabled": False}, volatile={"type": "disabled"},
                         persistent={"type": "rocksdb", "path": str(db_path)},
                         models=[{"name": MODEL, "tables": [{"name": TABLE, "dim": DIM}]}])
    engine = build_engine(config)
    try:
        cf = engine.persistent._cfs[table_id(MODEL, TABLE)]  # the same store and options: isolates our overhead
        rng = np.random.default_rng(5)
        batches = [keys[rng.choice(keys.shape[0], 1024, replace=False)] for _ in range(p.l3_batches)]
        encoded = [b.astype(">i8").view("V8").tolist() for b in batches]
        for b, e in zip(batches, encoded):
            engine.lookup(MODEL, TABLE, b)
            cf.get(e)
        t_ours, t_raw = [], []
        for i, (b, e) in enumerate(zip(batches, encoded)):
            for ours_turn in (True, False) if i % 2 == 0 else (False, True):  # alternate who goes first
                t = time.perf_counter()
                if ours_turn:
                    engine.lookup(MODEL, TABLE, b)
                    t_ours.append(time.perf_counter() - t)
                else:
                    cf.get(e)
                    t_raw.append(time.perf_counter() - t)
        sources = engine.lookup(MODEL, TABLE, batches[0]).sources
        del cf
    finally:
        engine.close()
    ours, raw = statistics.median(t_ours), statistics.median(t_raw)
    return {"ours_ms": ours * 1e3, "raw_ms": raw * 1e3, "ratio": raw / ours, "target": 0.67,
            "all_from_persistent": bool((sources == 3).all()), "batches": p.l3_batches}

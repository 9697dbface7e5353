"""Quantised rows (issue 31): memory per row in L1 + the hash map, RocksDB bytes on disk per row, and lookup speed
of each storage format beside fp32, measured side by side in one run.

    python -m loadtest.benchmarks.storage [--rows 1000000] [--dim 64]

Memory is the bytes of the arrays that hold a table in L1 and the in-process hash map once every row is in both
(keys, versions, clocks, index and rows: what a node's PSS grows by); RocksDB is the size of its SST files after a
bulk import and a compaction. Speed is one in-process lookup of 1024 all-L1 keys through the engine (decode
included), rounds of every format interleaved so that the machine's noise falls on all of them alike.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from hps_service.cache import build_table_cache
from hps_service.config import CacheConfig, ModelConfig, TableConfig
from hps_service.engine import LookupEngine
from hps_service.rows import STORAGES
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier
from loadtest.harness import cli

BATCH = 1024
TARGETS = {"fp16": 0.55, "bf16": 0.55, "int8": 0.35}


def _engine(path: Path, storage: str, rows: int, dim: int) -> LookupEngine:
    cfg = CacheConfig(backend="numpy", capacity=rows, ways=8, hit_rate_threshold=1.0, warm_start=False)
    eng = LookupEngine(volatile=HashMapTier(capacity_rows=rows), persistent=RocksDBTier(path, block_cache_mb=64),
                       cache_factory=lambda t, fetch, warm: build_table_cache(cfg, t.format.words, 0, fetch, None,
                                                                              None),
                       max_batch_keys=65_536)
    eng.register_model(ModelConfig(name="m", tables=[TableConfig(name="t", dim=dim, storage=storage)]))
    return eng


def _sst_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.sst"))


def run(rows: int, dim: int, console: Console, rounds: int = 30) -> dict[str, Any]:
    """Each format's memory and disk per row and lookup time, with its ratio to fp32."""
    rng = np.random.default_rng(0)
    keys = rng.choice(2**40, rows, replace=False).astype(np.int64)
    vectors = rng.standard_normal((rows, dim)).astype(np.float32)
    work = Path(tempfile.mkdtemp(prefix="hps-bench-storage-"))
    engines: dict[str, LookupEngine] = {}
    out: dict[str, Any] = {"rows": rows, "dim": dim, "formats": {}}
    try:
        for storage in STORAGES:
            eng = _engine(work / storage, storage, rows, dim)
            eng.import_rows("m", "t", keys, vectors, version=1)
            eng.persistent._db.compact_range(None, None)  # noqa: SLF001  # the files a snapshot would ship
            for start in range(0, rows, 65_536):  # every row into the hash map, then into L1
                eng.lookup("m", "t", keys[start:start + 65_536])
                eng.lookup("m", "t", keys[start:start + 65_536])
            t = eng.table("m", "t")
            assert t.cache is not None
            held = eng.table_stats("m", "t")["cache"]["rows"]
            mem = eng.volatile.stats("m.t").extra["memory_bytes"] + float(t.cache.stats()["memory_bytes"])
            out["formats"][storage] = {"memory_per_row": mem / rows, "disk_per_row": _sst_bytes(work / storage) / rows,
                                       "l1_rows": int(held)}
            engines[storage] = eng
        batches = [keys[rng.integers(0, rows, BATCH)] for _ in range(8)]
        times: dict[str, list[float]] = {s: [] for s in STORAGES}
        for r in range(rounds):
            for storage, eng in engines.items():
                q = batches[r % len(batches)]
                start = time.perf_counter()
                for _ in range(20):
                    eng.lookup("m", "t", q)
                times[storage].append((time.perf_counter() - start) / 20)
        for storage in STORAGES:
            out["formats"][storage]["lookup_us"] = float(np.median(times[storage])) * 1e6
        base = out["formats"]["fp32"]
        console.print(f"rows {rows:,} x dim {dim}: per row in L1 + hash map, on disk, 1024-key L1 lookup")
        for storage, f in out["formats"].items():
            mem_x, disk_x = f["memory_per_row"] / base["memory_per_row"], f["disk_per_row"] / base["disk_per_row"]
            speed_x = base["lookup_us"] / f["lookup_us"]
            f.update(memory_x=mem_x, disk_x=disk_x, speed_x=speed_x)
            target = TARGETS.get(storage)
            verdict = "" if target is None else (f"  memory {cli.judged(mem_x, cli.at_most(target))}, "
                                                  f"disk {cli.judged(disk_x, cli.at_most(target))}")
            console.print(f"  {storage}: {f['memory_per_row']:.0f} B ({mem_x:.2f}x), disk {f['disk_per_row']:.0f} B "
                          f"({disk_x:.2f}x), lookup {f['lookup_us']:.0f} us ({speed_x:.2f}x fp32's speed; L1 held "
                          f"{f['l1_rows']:,}){verdict}")
    finally:
        for eng in engines.values():
            eng.close()
        shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    args = ap.parse_args(argv)
    run(args.rows, args.dim, Console())
    return 0


if __name__ == "__main__":
    cli.run(main)

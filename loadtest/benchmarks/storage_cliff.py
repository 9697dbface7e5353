"""The table-size cliff per row format (issue 31, part 13c): one memory budget for the hash map
(``volatile.capacity_mb``), tables of growing size stored as fp32 and as int8, and the share of uniform lookups the
hash map answers with its keys/s. Past the largest table the budget holds whole, lookups fall to RocksDB: the
cliff. int8 rows move it out by the ratio of the two formats' bytes per row (target: 2.9x or more).

    python -m loadtest.benchmarks.storage_cliff [--budget-mb 16] [--dim 64]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from hps_service.config import ModelConfig, TableConfig
from hps_service.engine import LookupEngine
from hps_service.rows.formats import row_format
from hps_service.tiers.hashmap.tier import HashMapTier, rows_within
from hps_service.tiers.rocksdb.tier import RocksDBTier
from loadtest.harness import cli

BATCH = 1024
FORMATS = ("fp32", "int8")
TARGET = 2.9
#: Table sizes, as multiples of the rows fp32 fits in the budget, beside int8's own cliff and past it.
FP32_MULTIPLES = (0.5, 1.0, 1.5, 2.0)
INT8_MULTIPLES = (1.0, 1.5)


def _served_share(path: Path, storage: str, budget: int, dim: int, rows: int, seed: int) -> dict[str, float]:
    """Import ``rows`` rows into RocksDB, read every key twice (the hash map fills, evicting what it cannot hold),
    then time uniform lookups: the share the hash map answered and keys/s."""
    eng = LookupEngine(volatile=HashMapTier(capacity_rows=10_000_000, capacity_bytes=budget),
                       persistent=RocksDBTier(path, block_cache_mb=8), max_batch_keys=65_536)
    try:
        eng.register_model(ModelConfig(name="m", tables=[TableConfig(name="t", dim=dim, storage=storage)]))
        rng = np.random.default_rng(seed)
        keys = rng.choice(2**40, rows, replace=False).astype(np.int64)
        for lo in range(0, rows, 65_536):
            eng.import_rows("m", "t", keys[lo:lo + 65_536],
                            rng.standard_normal((min(65_536, rows - lo), dim)).astype(np.float32), version=1)
        for _ in range(2):
            for lo in range(0, rows, 65_536):
                eng.lookup("m", "t", keys[lo:lo + 65_536])
        batches = [keys[rng.integers(0, rows, BATCH)] for _ in range(64)]
        volatile = 0
        start = time.perf_counter()
        for q in batches:
            volatile += int(np.count_nonzero(eng.lookup("m", "t", q).sources <= 2))
        wall = time.perf_counter() - start
        return {"volatile_share": volatile / (len(batches) * BATCH), "keys_per_s": len(batches) * BATCH / wall,
                "capacity": float(eng.volatile.stats("m.t").capacity)}
    finally:
        eng.close()


def run(budget_mb: int, dim: int, console: Console) -> dict[str, Any]:
    """The curve (table rows -> hash-map share and keys/s) of each format, and the cliff ratio int8 / fp32."""
    budget = budget_mb << 20
    fits = {s: rows_within(budget, row_format(s, dim).words) for s in FORMATS}
    sizes = sorted({int(fits["fp32"] * m) for m in FP32_MULTIPLES} | {int(fits["int8"] * m) for m in INT8_MULTIPLES})
    work = Path(tempfile.mkdtemp(prefix="hps-bench-cliff-"))
    out: dict[str, Any] = {"budget_mb": budget_mb, "dim": dim, "fits": fits, "curve": {s: {} for s in FORMATS}}
    try:
        for i, n in enumerate(sizes):
            for storage in FORMATS:
                out["curve"][storage][n] = _served_share(work / f"{storage}-{i}", storage, budget, dim, n, seed=i)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    whole = {s: max((n for n, m in out["curve"][s].items() if m["volatile_share"] >= 0.999), default=0)
             for s in FORMATS}
    out["cliff_x"] = fits["int8"] / fits["fp32"]
    console.print(f"hash map budget {budget_mb} MiB per table, dim {dim}: holds {fits['fp32']:,} fp32 rows, "
                  f"{fits['int8']:,} int8 rows")
    for n in sizes:
        cells = [f"{s} {out['curve'][s][n]['volatile_share']:6.1%} from the hash map, "
                 f"{out['curve'][s][n]['keys_per_s'] / 1e6:5.2f} M keys/s" for s in FORMATS]
        console.print(f"  {n:>9,} rows: " + " | ".join(cells))
    console.print(f"  largest table served whole from the hash map (of those measured): fp32 {whole['fp32']:,}, int8 "
                  f"{whole['int8']:,}; the cliff moves out {cli.judged(out['cliff_x'], cli.at_least(TARGET))}; "
                  f"at dim {dim} each row also takes 24 B of key, version and stamps and ~6-11 B of index whatever "
                  "its format")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--budget-mb", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    args = ap.parse_args(argv)
    run(args.budget_mb, args.dim, Console())
    return 0


if __name__ == "__main__":
    cli.run(main)

"""A table converted to int8 while it is served (issue 31, part 13d): how fast the copy runs, and what lookups cost
before, during the copy and after the switch, side by side in one run. One engine (RocksDB and a hash map big enough
to hold the table) in this process, one thread looking up 1,024 random keys in a loop.

    python -m loadtest.benchmarks.convert [--rows 1000000] [--dim 64]
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from hps_service.config import ModelConfig, TableConfig
from hps_service.engine import LookupEngine
from hps_service.engine import convert as convert_module
from hps_service.node.owner import store_parent
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier
from loadtest.harness import cli

BATCH = 1024
#: Seconds of lookups measured before the conversion and after its switch.
WINDOW_S = 3.0


def _ms(samples: list[float], q: float) -> float:
    return float(np.percentile(samples, q) * 1e3) if samples else float("nan")


def _wait_preloaded(eng: LookupEngine, table: str, rows: int, timeout_s: float = 120.0) -> float:
    """Wait until the hash map holds every row of ``table``; the seconds waited."""
    assert eng.volatile is not None
    started = time.perf_counter()
    while eng.volatile.stats(table).rows < rows and time.perf_counter() - started < timeout_s:
        time.sleep(0.05)
    return time.perf_counter() - started


def run(rows: int, dim: int, console: Console) -> dict[str, Any]:
    """Convert an fp32 table of ``rows`` x ``dim`` to int8 under lookups; copy rate and lookup p50/p99 per phase."""
    work = Path(tempfile.mkdtemp(prefix="hps-bench-convert-", dir=store_parent()))
    eng = LookupEngine(HashMapTier(capacity_rows=int(rows * 1.2)), RocksDBTier(work / "db"))
    try:
        eng.register_model(ModelConfig(name="m", tables=[TableConfig(name="t", dim=dim)]))
        rng = np.random.default_rng(0)
        keys = rng.choice(2**40, rows, replace=False).astype(np.int64)
        for lo in range(0, rows, 262_144):
            eng.import_rows("m", "t", keys[lo:lo + 262_144],
                            rng.standard_normal((min(262_144, rows - lo), dim)).astype(np.float32), version=1)
        eng.register_model(eng.model("m"))  # again, now that it holds rows: the hash map preloads them all
        _wait_preloaded(eng, "m.t", rows)
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def lookups() -> None:
            ask = np.random.default_rng(1)
            while not stop.is_set():
                q = keys[ask.integers(0, rows, BATCH)]
                t0 = time.perf_counter()
                eng.lookup("m", "t", q)
                samples.append((t0, time.perf_counter() - t0))

        reader = threading.Thread(target=lookups)
        reader.start()
        try:
            time.sleep(WINDOW_S)
            started = time.perf_counter()
            result = eng.convert_table("m", "t", "int8")
            _wait_preloaded(eng, result["stored_as"], rows)
            settled = time.perf_counter()
            time.sleep(WINDOW_S)
        finally:
            stop.set()
            reader.join()
        copy_end = started + result["copy_s"]
        phases = {"before": [d for t, d in samples if t < started],
                  "copy": [d for t, d in samples if started <= t < copy_end],
                  "switch": [d for t, d in samples if copy_end <= t < settled],
                  "after": [d for t, d in samples if t >= settled]}
        out: dict[str, Any] = {"rows": rows, "dim": dim, "copy_s": result["copy_s"],
                               "entries_per_s": result["entries_copied"] / result["copy_s"],
                               "grace_s": convert_module.DROP_GRACE_S,
                               "lookups": {p: {"n": len(s), "p50_ms": _ms(s, 50), "p99_ms": _ms(s, 99)}
                                           for p, s in phases.items()}}
        before = out["lookups"]["before"]
        for p in ("copy", "switch", "after"):
            out["lookups"][p]["p99_x"] = out["lookups"][p]["p99_ms"] / before["p99_ms"]
        console.print(f"{rows:,} x {dim} fp32 -> int8 copied in {result['copy_s']:.1f} s "
                      f"({out['entries_per_s'] / 1e3:,.0f}k entries/s), old rows dropped {out['grace_s']:.0f} s "
                      "after the switch; the hash map holds the table before and after (preloaded)")
        for p, m in out["lookups"].items():
            console.print(f"  lookups of {BATCH} keys {p:>6}: {m['n']:5} calls, p50 {m['p50_ms']:6.2f} ms, "
                          f"p99 {m['p99_ms']:6.2f} ms" + (f" ({m['p99_x']:.2f}x before)" if "p99_x" in m else ""))
        return out
    finally:
        eng.close()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    args = ap.parse_args(argv)
    run(args.rows, args.dim, Console())
    return 0


if __name__ == "__main__":
    cli.run(main)

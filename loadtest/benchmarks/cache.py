"""L1 cache hit path vs a raw NumPy gather of the same rows, side by side in one run.

``python -m loadtest.benchmarks.cache``: for each batch size, times (interleaved, median of repeats)
``np.take(table, idx, axis=0, out=buf, mode="clip")`` from a preallocated array, the probe the cache used
before slot tags (every key of the set compared; kept here to measure the tags against it in one run), the
cache's compiled query (tag bytes scanned, a key compared only on a tag match), the same query behind a plain
mutex, and ``SetAssocTableCache.lookup`` (sequence lock, argument
checks, hit counters); prints times and the speed ratio gather_time / cache_time (target: >= 0.5 at
batch 1024, i.e. the cache within 2x of the gather).

Every contender cycles through the same ``--distinct`` different batches (64 by default), as a server
sees a new batch on every call. With one batch repeated (``--distinct 1``, also printed at batch 1024
for reference) the gather's 256 KiB of rows stay in the core's L2 cache between calls while the cache
also walks its key and clock lines, which measures cache residency rather than the lookup.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from hps_service.cache import SetAssociativeCache, SetAssocTableCache
from hps_service.cache.cpu_kernels import PREFETCH_AHEAD
from hps_service.jit.hashing import mix64
from hps_service.jit.prefetch import prefetch
from loadtest.harness import cli
from loadtest.harness.plan import DIM, Plan

#: The speed of TableCache.lookup relative to the raw gather (gather time / its time).
TARGET = cli.at_least(0.5)
#: Different batches each contender cycles through (the same ones for every contender).
DISTINCT_BATCHES = 64


_S32 = np.uint64(32)
_NO_KEY = np.uint64(1 << 63)


@numba.njit(cache=True, nogil=True)
def key_scan_query(table, values, keys, out, hit, sets):  # type: ignore[no-untyped-def]
    """The probe before slot tags, for comparison in the same run: the set's 32 int64 keys prefetched (4 lines)
    and compared one by one (a key equal to the free marker 2**63 as uint64 stands for a free slot)."""
    ways = table.shape[1]
    dim = values.shape[1]
    usets = np.uint64(sets)
    n = keys.shape[0]
    ahead = PREFETCH_AHEAD
    set_idx = np.empty(n, np.int64)
    for i in range(n):
        set_idx[i] = np.int64(((mix64(keys[i]) >> _S32) * usets) >> _S32)
    slots = np.empty(n, np.int64)
    nhit = 0
    for j in range(n + ahead):
        if j < n:
            for c in range(0, ways, 8):
                prefetch(table, set_idx[j], c)
        i = j - ahead
        if i >= 0:
            s = set_idx[i]
            slots[i] = -1
            hit[i] = False
            for w in range(ways):
                if table[s, w] == keys[i]:
                    slots[i] = s * ways + w
                    hit[i] = True
                    nhit += 1
                    break
    for j in range(n + ahead):
        if j < n and slots[j] >= 0:
            for d in range(0, dim, 16):
                prefetch(values, slots[j], d)
        i = j - ahead
        if i >= 0 and slots[i] >= 0:
            for d in range(dim):
                out[i, d] = values[slots[i], d]
    return nhit


def _time_per_call(fn: Callable[[int], object], calls: int, distinct: int) -> float:
    start = time.perf_counter()
    for j in range(calls):
        fn(j % distinct)
    return (time.perf_counter() - start) / calls


def build(rows: int, dim: int, ways: int, seed: int) -> tuple[np.ndarray, np.ndarray, SetAssociativeCache]:
    """A cache at half load and, as a preallocated array, exactly the rows it ended up holding.

    Returns (keys, table, cache): ``table[i]`` is the row of ``keys[i]``, so gathering ``table[idx]``
    and looking up ``keys[idx]`` produce the same rows.
    """
    rng = np.random.default_rng(seed)
    offered = rng.choice(np.iinfo(np.int64).max, size=rows, replace=False).astype(np.int64)
    cache = SetAssociativeCache(-(-2 * rows // ways) * ways, dim, ways=ways)
    cache.insert(offered, rng.random((rows, dim), dtype=np.float32))
    keys, table, _ = cache.dump()
    return keys, np.ascontiguousarray(table), cache


def run(rows: int, dim: int, ways: int, batches: list[int], repeats: int, budget_s: float,
        distinct: int = DISTINCT_BATCHES) -> list[dict]:
    """Median seconds per call of each contender at each batch size, cycling through ``distinct`` batches."""
    keys, table, cache = build(rows, dim, ways, seed=0)
    print(f"table {len(keys)} rows x {dim} float32 ({table.nbytes / 2**20:.0f} MiB), all of them in a cache of "
          f"capacity {cache.capacity} ({cache.values.nbytes / 2**20:.0f} MiB values), {ways} ways; "
          f"{distinct} different batches per size")
    table_cache = SetAssocTableCache(
        cache, lambda k: (np.zeros((len(k), dim), np.float32), np.zeros(len(k), np.int64), np.ones(len(k), bool)),
        hit_rate_threshold=0.0)
    mutex = threading.Lock()
    scan_table = np.where(cache.tags != 0, cache.keys.view(np.uint64), _NO_KEY)
    rng = np.random.default_rng(1)
    results = []
    try:
        for batch in batches:
            idx = [rng.integers(0, len(keys), size=batch, dtype=np.int64) for _ in range(distinct)]
            batch_keys = [keys[i] for i in idx]
            buf = np.empty((batch, dim), np.float32)
            out = np.empty((batch, dim), np.float32)
            hit = np.empty(batch, np.bool_)

            def mutex_query(j: int, batch_keys: list[np.ndarray] = batch_keys, out: np.ndarray = out) -> None:
                with mutex:
                    cache.query(batch_keys[j], out)

            contenders: dict[str, Callable[[int], object]] = {
                "gather": lambda j, idx=idx, buf=buf: np.take(table, idx[j], axis=0, out=buf, mode="clip"),
                "key-scan probe": lambda j, k=batch_keys, out=out, hit=hit: key_scan_query(
                    scan_table, cache.values, k[j].view(np.uint64), out, hit, cache.sets),
                "query": lambda j, k=batch_keys, out=out: cache.query(k[j], out),
                "query+mutex": mutex_query,
                "TableCache.lookup": lambda j, k=batch_keys, out=out: table_cache.lookup(k[j], out),
            }
            for j in range(distinct):
                assert table_cache.lookup(batch_keys[j], out).all() and np.array_equal(out, table[idx[j]])
            single = _time_per_call(contenders["gather"], distinct, distinct)
            calls = max(distinct, int(budget_s / repeats / max(single, 1e-7) / len(contenders)))
            samples: dict[str, list[float]] = {name: [] for name in contenders}
            for _ in range(repeats):
                for name, fn in contenders.items():
                    samples[name].append(_time_per_call(fn, calls, distinct))
            med = {name: statistics.median(v) for name, v in samples.items()}
            results.append({"batch": batch, "distinct": distinct, **med})
    finally:
        table_cache.close()
    return results


def report(results: list[dict]) -> None:
    """Print microseconds per call and speed ratios (gather time / contender time)."""
    print(f"{'batch':>6} {'batches':>7} {'gather us':>10} {'scan us':>8} {'ratio':>6} {'query us':>9} {'ratio':>6} "
          f"{'+mutex us':>10} {'ratio':>6} {'lookup us':>10} {'ratio':>6} {'lookup Mkeys/s':>15}")
    for r in results:
        g = r["gather"]
        scan = r["key-scan probe"]
        print(f"{r['batch']:>6} {r['distinct']:>7} {g * 1e6:>10.1f} {scan * 1e6:>8.1f} {g / scan:>6.2f} "
              f"{r['query'] * 1e6:>9.1f} {g / r['query']:>6.2f} "
              f"{r['query+mutex'] * 1e6:>10.1f} {g / r['query+mutex']:>6.2f} "
              f"{r['TableCache.lookup'] * 1e6:>10.1f} {g / r['TableCache.lookup']:>6.2f} "
              f"{r['batch'] / r['TableCache.lookup'] / 1e6:>15.2f}")
    at_1024 = next((r for r in results if r["batch"] == 1024 and r["distinct"] > 1), None)
    if at_1024 is not None:
        ratio = at_1024["gather"] / at_1024["TableCache.lookup"]
        print(f"batch 1024: TableCache.lookup speed vs the raw gather {cli.judged(ratio, TARGET)}; "
              f"the bare compiled query {at_1024['gather'] / at_1024['query']:.2f}x")


def part(p: Plan) -> dict[str, Any]:
    """Part 1 of ``make bench``: :func:`run`'s interleaved medians at the plan's batches; ratio = gather time / our
    time (speed relative to the gather)."""
    results = run(rows=1 << 17, dim=DIM, ways=32, batches=list(p.batches), repeats=p.l1_repeats,
                  budget_s=p.l1_budget_s)
    rows = [{"batch": r["batch"], "gather_us": r["gather"] * 1e6, "query_us": r["query"] * 1e6,
             "lookup_us": r["TableCache.lookup"] * 1e6, "ratio_query": r["gather"] / r["query"],
             "ratio_lookup": r["gather"] / r["TableCache.lookup"]} for r in results]
    return {"per_batch": rows, "ratio_min_lookup": min(r["ratio_lookup"] for r in rows), "target": TARGET.bound}


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__spec__, __doc__)
    parser.add_argument("--rows", type=int, default=1 << 17)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ways", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--budget-s", type=float, default=2.0, help="seconds of timing per batch size")
    parser.add_argument("--distinct", type=int, default=DISTINCT_BATCHES, help="different batches per batch size")
    args = parser.parse_args(argv)
    results = run(args.rows, args.dim, args.ways, args.batches, args.repeats, args.budget_s, args.distinct)
    if args.distinct > 1 and 1024 in args.batches:
        results += run(args.rows, args.dim, args.ways, [1024], args.repeats, args.budget_s, distinct=1)
    report(results)
    return 0


if __name__ == "__main__":
    cli.run(main)

"""Run the L1 cache on CuPy, check every answer against the NumPy path, print lookups/s.

``python -m loadtest.gpu_check``: the same random insert/query/update/invalidate sequence goes through
a NumPy cache (numba kernels) and a CuPy cache (RawKernel query, xp reference for the rest); slots,
clocks, rows, hit masks and answered vectors must be identical after every step. Then it times hit
lookups at batch 1024 and 65536, on device arrays and host-to-host through the TableCache. With no
usable CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from hps_service.cache import SetAssociativeCache, SetAssocTableCache
from hps_service.cache.array_module import cupy_usable, get_array_module, to_host
from hps_service.cache.set_assoc import EMPTY


def check_equivalence(cp: object, policy: str, steps: int, seed: int) -> int:
    """Drive both backends with one sequence; returns the number of mismatching steps."""
    rng = np.random.default_rng(seed)
    ways, sets, dim = 32, 64, 24
    host = SetAssociativeCache(sets * ways, dim, ways=ways, policy=policy)
    dev = SetAssociativeCache(sets * ways, dim, ways=ways, policy=policy, xp=cp)
    mismatches = 0
    for step in range(steps):
        keys = rng.integers(-3000, 3000, size=int(rng.integers(1, 700)), dtype=np.int64)
        rows = rng.random((len(keys), dim), dtype=np.float32)
        op = ("insert", "query", "query", "update", "invalidate")[step % 5]
        if op == "insert":
            same = host.insert(keys, rows) == dev.insert(cp.asarray(keys), cp.asarray(rows))
        elif op == "query":
            out_h = np.zeros((len(keys), dim), np.float32)
            out_d = cp.zeros((len(keys), dim), dtype=cp.float32)
            hit_h = host.query(keys, out_h)
            hit_d = to_host(dev.query(cp.asarray(keys), out_d))
            same = np.array_equal(hit_h, hit_d) and np.array_equal(out_h, to_host(out_d))
        elif op == "update":
            same = host.update(keys, rows) == dev.update(cp.asarray(keys), cp.asarray(rows))
        else:
            same = host.invalidate(keys) == dev.invalidate(cp.asarray(keys))
        held = host.keys.reshape(-1) != EMPTY
        same = (
            same
            and np.array_equal(host.keys, to_host(dev.keys))
            and np.array_equal(host.clock, to_host(dev.clock))
            and np.array_equal(host.values[held], to_host(dev.values)[held])
        )
        if not same:
            mismatches += 1
            print(f"  MISMATCH policy={policy} step={step} op={op}")
    return mismatches


def throughput(cp: object, rows: int, dim: int, batches: list[int], seconds: float) -> None:
    """Hit lookups/s on device arrays and through SetAssocTableCache.lookup (host in, host out)."""
    rng = np.random.default_rng(3)
    cache = SetAssociativeCache(-(-2 * rows // 32) * 32, dim, ways=32, xp=cp)
    cache.insert(cp.arange(rows, dtype=cp.int64), cp.random.random((rows, dim), dtype=cp.float32))
    cached, _ = cache.dump()
    cached = to_host(cached)
    table_cache = SetAssocTableCache(cache, lambda k: np.zeros((len(k), dim), np.float32), hit_rate_threshold=0.0)
    try:
        for batch in batches:
            keys_h = cached[rng.integers(0, len(cached), size=batch)]
            keys_d = cp.asarray(keys_h)
            out_d = cp.empty((batch, dim), dtype=cp.float32)
            out_h = np.empty((batch, dim), np.float32)
            assert bool(cache.query(keys_d, out_d).all()) and table_cache.lookup(keys_h, out_h).all()
            for name, fn in (
                ("device query", lambda k=keys_d, o=out_d: cache.query(k, o)),
                ("TableCache.lookup host->host", lambda k=keys_h, o=out_h: table_cache.lookup(k, o)),
            ):
                cp.cuda.Device().synchronize()
                calls, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds:
                    fn()
                    calls += 1
                cp.cuda.Device().synchronize()
                elapsed = time.perf_counter() - start
                print(f"  batch {batch:>6} {name:<30} {calls * batch / elapsed / 1e6:10.1f} M lookups/s "
                      f"({elapsed / calls * 1e6:8.1f} us/call)")
    finally:
        table_cache.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rows", type=int, default=1 << 21)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    if not cupy_usable():
        print("gpu_check: no GPU found (CuPy not installed or no usable CUDA device); nothing to check")
        return 0
    cp = get_array_module("cupy")
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    print(f"gpu_check on {props['name'].decode()} (CuPy {cp.__version__})")
    failures = 0
    for policy in ("lru", "lfu"):
        bad = check_equivalence(cp, policy, args.steps, seed=11)
        print(f"  {policy}: {args.steps} steps, {bad} mismatching against the NumPy path")
        failures += bad
    throughput(cp, args.rows, args.dim, [1024, 65536], args.seconds)
    print("gpu_check: PASS" if failures == 0 else f"gpu_check: FAIL ({failures} mismatching steps)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Device check of the CUDA L1 cache: correctness against the CPU reference and query speed against cupy.take.

``python -m loadtest.probes.gpu_check`` on a machine with a CUDA GPU and the ``gpu`` extra (numba-cuda, CuPy), in
under 5 minutes:

1. Correctness: the same random sequence of lookups, inserts (with eviction), versioned updates and deletes,
   over keys that include the int64 edges, goes through the device cache and the host cache (numba kernels,
   themselves held to the NumPy reference by the test suite): every answer and every insert/update/delete
   count must match, and the full slot state (tags, keys, versions, clocks, rows) after every 50th batch and
   at the end. ``--ops`` key operations in all (default 1M), for LRU and LFU.
2. Speed: query keys/s at batch 1024 and 16384 (dim 64, every key a hit) against ``cupy.take`` of the same
   rows from a preallocated device array (target >= 0.5x): device-resident (keys and rows stay on the
   device: one launch) and host-to-host (keys from and rows into pinned host memory, one sync), each with 1
   and 4 threads (a stream each).

Exit status 0 when everything matched, 1 on a mismatch, 2 when there is no usable CUDA device (with the
reason). Per lookup the cache does 1 host-to-device copy, 1 kernel launch, 2 device-to-host copies, 1 sync.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from loadtest.harness import cli

#: The cache's keys/s relative to cupy.take of the same rows.
TARGET = cli.at_least(0.5)
EDGES = np.array([-(2**63), 2**63 - 1, -1, 0, -(2**63) + 1, 2**63 - 2], dtype=np.int64)


def _batch_keys(rng: np.random.Generator, n: int, key_space: int) -> np.ndarray:
    keys = rng.integers(-key_space, key_space, size=n, dtype=np.int64)
    if rng.random() < 0.3:
        keys[rng.integers(0, n, size=min(n, 4))] = rng.choice(EDGES, size=min(n, 4))
    return keys


def check_correctness(policy: str, ops: int, seed: int, sets: int = 256, ways: int = 32, dim: int = 16,
                      max_batch: int = 2048, **launch: int) -> int:
    """Drive a device and a host cache with one random sequence; returns the number of mismatches."""
    from hps_service.cache.device import DeviceCache
    from hps_service.cache.set_assoc import SetAssociativeCache

    rng = np.random.default_rng(seed)
    dev = DeviceCache(sets * ways, dim, ways=ways, policy=policy, **launch)
    host = SetAssociativeCache(sets * ways, dim, ways=ways, policy=policy)
    key_space = 3 * sets * ways  # three keys per slot: admissions evict all the time
    done = batches = mismatches = 0
    while done < ops:
        n = int(rng.integers(1, max_batch))
        keys = _batch_keys(rng, n, key_space)
        rows = rng.random((n, dim), dtype=np.float32)
        versions = rng.integers(0, 8, size=n)
        op = rng.choice(["query", "query", "insert", "update", "delete", "delete_v"])
        if op == "query":
            out_d, out_h = np.empty((n, dim), np.float32), np.empty((n, dim), np.float32)
            hit_d, hit_h = dev.query(keys, out_d), host.query(keys, out_h)
            same = np.array_equal(hit_d, hit_h) and np.array_equal(out_d[hit_d], out_h[hit_h])
        elif op == "insert":
            same = dev.insert(keys, rows, versions) == host.insert(keys, rows, versions)
        elif op == "update":
            same = dev.update(keys, rows, versions) == host.update(keys, rows, versions)
        elif op == "delete":
            same = dev.invalidate(keys) == host.invalidate(keys)
        else:
            same = dev.invalidate(keys, versions) == host.invalidate(keys, versions)
        batches += 1
        done += n
        if same and (batches % 50 == 0 or done >= ops):
            a = dev.host_arrays()
            held = host.tags != 0
            same = (np.array_equal(a["tags"], host.tags) and np.array_equal(a["keys"][held], host.keys[held])
                    and np.array_equal(a["versions"][held], host.versions[held])
                    and np.array_equal(a["clock"], host.clock)
                    and np.array_equal(a["values"][held.reshape(-1)], host.values[held.reshape(-1)])
                    and dev.rows() == host.rows())
        if not same:
            mismatches += 1
            print(f"  MISMATCH policy={policy} batch={batches} op={op} n={n}")
            if mismatches >= 5:
                break
    print(f"  {policy}: {done} key operations in {batches} batches, {mismatches} mismatching batches")
    return mismatches


def _rate(fn: Callable[[], None], seconds: float, threads: int, sync: Callable[[], None]) -> float:
    """Calls per second of ``fn`` run by ``threads`` threads for about ``seconds``."""
    counts = [0] * threads
    stop = threading.Event()

    def worker(t: int) -> None:
        fn()  # per-thread buffers and streams made before timing
        sync()
        while not stop.is_set():
            fn()
            counts[t] += 1
        sync()

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    return sum(counts) / (time.perf_counter() - start)


def _measure_batch(dev: Any, table: Any, table_h: np.ndarray, keys: np.ndarray, batch: int, seconds: float,
                   rng: np.random.Generator) -> list[dict]:
    """Both contenders at one batch size: device-resident and host-to-host, 1 and 4 threads."""
    import cupy as cp
    from numba import cuda

    dim = dev.dim
    results = []
    idx_h = rng.integers(0, keys.shape[0], size=batch).astype(np.int64)
    keys_h = np.ascontiguousarray(keys[idx_h])
    out_h = np.empty((batch, dim), np.float32)
    hit = np.empty(batch, bool)
    assert dev.query_once(keys_h, out_h, hit) == batch and np.array_equal(out_h, table_h[idx_h])
    local = threading.local()

    def ours_device() -> None:
        if not hasattr(local, "ours"):
            s = cuda.stream()
            local.ours = (s, cuda.to_device(keys_h.view(np.uint64), stream=s),
                          cuda.device_array(batch * dim, np.float32), cuda.device_array(batch, np.uint8))
        s, k, o, src = local.ours
        dev.launch_query(k, o, src, batch, s)

    def take_device() -> None:
        if not hasattr(local, "take"):
            local.take = (cp.cuda.Stream(non_blocking=True), cp.asarray(idx_h),
                          cp.empty((batch, dim), cp.float32))
        s, i, o = local.take
        with s:
            cp.take(table, i, axis=0, out=o)

    def ours_host() -> None:
        if not hasattr(local, "out"):
            local.out, local.hit = np.empty((batch, dim), np.float32), np.empty(batch, bool)
        dev.query_once(keys_h, local.out, local.hit)

    def take_host() -> None:
        if not hasattr(local, "take_h"):
            pin_i = cp.cuda.alloc_pinned_memory(batch * 8)
            pin_o = cp.cuda.alloc_pinned_memory(batch * dim * 4)
            local.take_h = (cp.cuda.Stream(non_blocking=True), np.frombuffer(pin_i, np.int64, batch),
                            np.frombuffer(pin_o, np.float32, batch * dim).reshape(batch, dim),
                            cp.empty(batch, cp.int64), cp.empty((batch, dim), cp.float32),
                            np.empty((batch, dim), np.float32))
        s, pi, po, di, do, final = local.take_h
        pi[:] = idx_h
        di.set(pi, stream=s)
        with s:
            cp.take(table, di, axis=0, out=do)
        do.get(stream=s, out=po, blocking=False)
        s.synchronize()
        final[:] = po

    def sync_all() -> None:
        cuda.synchronize()
        cp.cuda.Device().synchronize()

    for threads in (1, 4):
        for mode, ours, theirs in (("device", ours_device, take_device), ("host", ours_host, take_host)):
            ours_rate = _rate(ours, seconds, threads, sync_all) * batch
            take_rate = _rate(theirs, seconds, threads, sync_all) * batch
            results.append({"batch": batch, "mode": mode, "threads": threads, "ours": ours_rate,
                            "take": take_rate})
            print(f"  batch {batch:>6} {mode:<6} {threads} thread(s): cache {ours_rate / 1e6:9.1f} M keys/s, "
                  f"cupy.take {take_rate / 1e6:9.1f} M keys/s, ratio {cli.judged(ours_rate / take_rate, TARGET)}")
    return results


def measure_speed(rows: int, dim: int, batches: list[int], seconds: float) -> list[dict]:
    """Query keys/s vs cupy.take at each batch, device-resident and host-to-host, 1 and 4 threads."""
    import cupy as cp

    from hps_service.cache.device import DeviceCache

    capacity = -(-2 * rows // 32) * 32
    dev = DeviceCache(capacity, dim, ways=32)
    dev.warm_up()
    rng = np.random.default_rng(3)
    offered = rng.choice(np.iinfo(np.int64).max, size=rows, replace=False).astype(np.int64)
    for lo in range(0, rows, 1 << 18):
        chunk = offered[lo : lo + (1 << 18)]
        dev.insert(chunk, rng.random((chunk.shape[0], dim), dtype=np.float32), 1)
    keys, table_h, _ = dev.dump()
    table = cp.asarray(table_h)
    results = []
    for batch in batches:
        results += _measure_batch(dev, table, table_h, keys, batch, seconds, rng)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__spec__, __doc__)
    parser.add_argument("--ops", type=int, default=1_000_000, help="key operations of the correctness check")
    parser.add_argument("--rows", type=int, default=1 << 21, help="rows cached for the speed check")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per contender and configuration")
    args = parser.parse_args(argv)
    from hps_service.cache.backend import device_status

    usable, why = device_status()
    if not usable or "simulator" in why:
        print(f"gpu_check: no usable CUDA device: {why}", file=sys.stderr)
        return 2
    print(f"gpu_check on {why}")
    started = time.perf_counter()
    failures = sum(check_correctness(policy, args.ops // 2, seed=11 + i) for i, policy in enumerate(("lru", "lfu")))
    print(f"  correctness: {time.perf_counter() - started:.0f} s")
    measure_speed(args.rows, args.dim, [1024, 16384], args.seconds)
    print(f"gpu_check: {'PASS' if failures == 0 else f'FAIL ({failures} mismatching batches)'} "
          f"in {time.perf_counter() - started:.0f} s")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    cli.run(main)

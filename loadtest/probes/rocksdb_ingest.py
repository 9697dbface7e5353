"""RocksDB settings for a sustained versioned ingest: what flushes and compactions cost, per setting, in one run.

    python -m loadtest.probes.rocksdb_ingest                      # 1M rows x dim 64, 2M updates per setting
    python -m loadtest.probes.rocksdb_ingest --rows 20000 --dim 32  # the soak's table
    python -m loadtest.probes.rocksdb_ingest --interleave --no-sync --only "default,compression,sorted"

Each setting gets its own store (the same rows imported), then the same stream of versioned updates through
``RocksDBTier.put`` (the update consumer's read-modify-write: multi-get of the stored versions, one write batch),
1000 random keys a batch. Reported per setting: the put's time per row in the calling thread (the part that
competes with lookups for the GIL), RocksDB's background CPU (flush and compaction threads) per million rows, the
flushes, compactions and write stalls, and a point multi-get's time per key afterwards (read amplification).
CPU seconds are counted per thread from /proc, so they hold up on a busy machine better than wall time does.
``--interleave`` opens every chosen setting's store at once and applies each batch to all of them in turn, so the
caller's costs are compared under the same load (background CPU is then not separable: the stores share RocksDB's
thread pool).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rocksdict import BlockBasedOptions, DataBlockIndexType, DBCompressionType, Options

from hps_service.tiers.rocksdb.tier import RocksDBTier
from loadtest.harness import cli

TABLE = "m.t"

#: Settings compared: name -> (Options method, arguments) applied on top of the tier's own options.
SETTINGS: dict[str, list[tuple[str, tuple]]] = {
    "default (2 background jobs, L0 trigger 4, no rate limit, memtable bloom)": [],
    "1 background job": [("set_max_background_jobs", (1,))],
    "4 background jobs": [("set_max_background_jobs", (4,))],
    "rate limiter 8 MB/s": [("set_ratelimiter", (8 << 20, 100_000, 10))],
    "L0 compaction trigger 2": [("set_level_zero_file_num_compaction_trigger", (2,))],
    "L0 compaction trigger 8": [("set_level_zero_file_num_compaction_trigger", (8,))],
    "write buffer 16 MiB": [("set_write_buffer_size", (16 << 20,))],
    "no compression (float rows do not compress)": [("set_compression_type", (DBCompressionType.none(),))],
    "no memtable bloom filter (the tier's default has one)": [("set_memtable_prefix_bloom_ratio", (0.0,))],
    "keys sorted in each batch": [("sorted", ())],
    "data blocks of 1 KiB (4 KiB default)": [("block_size", (1024,))],
    "block cache 512 MiB (256 MiB default)": [("block_cache_mb", (512,))],
}
#: Settings that are not Options methods: handled by TunedTier itself.
_SPECIAL = {"sorted", "block_size", "block_cache_mb"}


class TunedTier(RocksDBTier):
    """The tier with extra RocksDB options (for this comparison only)."""

    def __init__(self, path: Path, extra: list[tuple[str, tuple]], **kwargs: Any) -> None:
        self._extra = extra
        for name, args in extra:
            if name == "block_cache_mb":
                kwargs["block_cache_mb"] = args[0]
        super().__init__(path, **kwargs)

    def _options(self) -> Options:
        opts = super()._options()
        for name, args in self._extra:
            if name == "block_size":
                table = BlockBasedOptions()  # the tier's table options, with another block size
                table.set_block_cache(self._block_cache)
                table.set_bloom_filter(10, False)
                table.set_cache_index_and_filter_blocks(True)
                table.set_pin_l0_filter_and_index_blocks_in_cache(True)
                table.set_data_block_index_type(DataBlockIndexType.binary_and_hash())
                table.set_data_block_hash_ratio(0.75)
                table.set_block_size(args[0])
                opts.set_block_based_table_factory(table)
            elif name not in _SPECIAL:
                getattr(opts, name)(*args)
        return opts

    def put(self, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray) -> np.ndarray:
        if ("sorted", ()) not in self._extra:
            return super().put(table, keys, vectors, versions)
        order = np.argsort(keys, kind="stable")
        return super().put(table, keys[order], vectors[order], np.broadcast_to(versions, keys.shape)[order])


def background_cpu_s() -> float:
    """CPU seconds of this process's RocksDB background threads (named rocksdb:*)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            if not (task / "comm").read_text().startswith("rocksdb:"):
                continue
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def run_setting(name: str, extra: list[tuple[str, tuple]], workdir: Path, rows: int, dim: int, updates: int,
                batch: int, sync: bool) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    path = workdir / "db"
    tier = TunedTier(path, extra, block_cache_mb=256, sync_writes=sync)
    try:
        tier.create_table(TABLE, dim)
        tier.bulk_import(TABLE, np.arange(rows, dtype=np.int64), rng.standard_normal((rows, dim), dtype=np.float32))
        db = tier._db
        bg0, thread0, wall0 = background_cpu_s(), time.thread_time(), time.perf_counter()
        stall0 = int(db.property_int_value("rocksdb.actual-delayed-write-rate") or 0)
        for i in range(updates // batch):
            keys = rng.integers(0, rows, batch)
            tier.put(TABLE, keys, rng.standard_normal((batch, dim), dtype=np.float32), np.full(batch, i + 1))
        thread_s, wall_s = time.thread_time() - thread0, time.perf_counter() - wall0
        time.sleep(2.0)  # let the last flush or compaction finish before counting background CPU
        bg_s = background_cpu_s() - bg0
        cf = tier._cfs[TABLE]
        props = {p: int(cf.property_int_value(f"rocksdb.{p}") or 0)
                 for p in ("num-files-at-level0", "num-files-at-level1", "total-sst-files-size")}
        stats = db.property_value("rocksdb.stats") or ""
        stall_line = next((ln.strip() for ln in stats.splitlines() if ln.strip().startswith("Cumulative stall")), "")
        lookups = []
        for _ in range(50):
            keys = rng.integers(0, rows, 1024)
            t0 = time.perf_counter()
            tier.get(TABLE, keys)
            lookups.append(time.perf_counter() - t0)
        out = {
            "setting": name, "put_wall_us_per_row": wall_s / updates * 1e6,
            "put_thread_cpu_us_per_row": thread_s / updates * 1e6,
            "background_cpu_s_per_million_rows": bg_s / updates * 1e6, "stall": stall_line,
            "delayed_write_rate_start": stall0, "get_us_per_key": statistics.median(lookups) / 1024 * 1e6, **props,
        }
    finally:
        tier.close()
        shutil.rmtree(path, ignore_errors=True)
    return out


def run_interleaved(chosen: dict[str, list[tuple[str, tuple]]], workdir: Path, rows: int, dim: int, updates: int,
                    batch: int, sync: bool) -> list[dict[str, Any]]:
    """Every setting's store open at once, each batch of updates applied to each in turn (the order rotating), so
    a busy machine's drift hits all alike; the caller's CPU and wall time per row and the multi-get per key are
    compared (background CPU cannot be told apart here: RocksDB's thread pool is shared by the stores)."""
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((rows, dim), dtype=np.float32)
    tiers = {}
    for i, (name, extra) in enumerate(chosen.items()):
        tier = TunedTier(workdir / f"db{i}", extra, block_cache_mb=256, sync_writes=sync)
        tier.create_table(TABLE, dim)
        tier.bulk_import(TABLE, np.arange(rows, dtype=np.int64), vectors)
        tiers[name] = tier
    cpu = {n: 0.0 for n in tiers}
    wall = {n: 0.0 for n in tiers}
    gets: dict[str, list[float]] = {n: [] for n in tiers}
    names = list(tiers)
    try:
        for i in range(updates // batch):
            keys = rng.integers(0, rows, batch)
            vec = rng.standard_normal((batch, dim), dtype=np.float32)
            for name in names[i % len(names):] + names[:i % len(names)]:
                c0, w0 = time.thread_time(), time.perf_counter()
                tiers[name].put(TABLE, keys, vec, np.full(batch, i + 1))
                cpu[name] += time.thread_time() - c0
                wall[name] += time.perf_counter() - w0
            if i % 10 == 0:
                probe = rng.integers(0, rows, 1024)
                for name in names:
                    t0 = time.perf_counter()
                    tiers[name].get(TABLE, probe)
                    gets[name].append(time.perf_counter() - t0)
    finally:
        for tier in tiers.values():
            tier.close()
    return [{"setting": n, "put_thread_cpu_us_per_row": cpu[n] / updates * 1e6,
             "put_wall_us_per_row": wall[n] / updates * 1e6,
             "get_us_per_key": statistics.median(gets[n]) / 1024 * 1e6} for n in names]


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--updates", type=int, default=2_000_000, help="rows updated per setting")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--no-sync", action="store_true", help="unsynced writes (the WAL fsync does not depend on the "
                    "settings compared and dominates the wall time)")
    ap.add_argument("--only", default=None, help="comma-separated setting names (substrings) to run")
    ap.add_argument("--interleave", action="store_true", help="all settings at once, batch by batch (caller's "
                    "cost only)")
    cli.add_json(ap)
    args = ap.parse_args(argv)
    chosen = {k: v for k, v in SETTINGS.items()
              if args.only is None or any(s.strip() in k for s in args.only.split(","))}
    results = []
    with tempfile.TemporaryDirectory(prefix="hps-rocksdb-ingest-", dir=os.environ.get("HPS_BENCH_DIR")) as tmp:
        if args.interleave:
            results = run_interleaved(chosen, Path(tmp), args.rows, args.dim, args.updates, args.batch,
                                      not args.no_sync)
            for r in results:
                print(f"{r['setting']:58s} put {r['put_wall_us_per_row']:6.1f} us/row wall, "
                      f"{r['put_thread_cpu_us_per_row']:5.1f} us/row CPU in the caller; get {r['get_us_per_key']:.2f} "
                      "us/key", flush=True)
            chosen = {}
        for name, extra in chosen.items():
            r = run_setting(name, extra, Path(tmp), args.rows, args.dim, args.updates, args.batch, not args.no_sync)
            results.append(r)
            print(f"{name:58s} put {r['put_wall_us_per_row']:6.1f} us/row wall, {r['put_thread_cpu_us_per_row']:5.1f} "
                  f"us/row CPU in the caller; background {r['background_cpu_s_per_million_rows']:5.2f} CPU s per M rows; "
                  f"L0 files {r['num-files-at-level0']}, get {r['get_us_per_key']:.2f} us/key; {r['stall']}",
                  flush=True)
    if args.json:
        cli.write_json(results, args.json)
    return 0


if __name__ == "__main__":
    cli.run(main)

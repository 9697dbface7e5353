"""Bulk import and L3 multi-get of RocksDBTier, side by side with raw rocksdict on the same rows, in one run.

Run: ``python -m loadtest.probes.bulk_import --rows 1000000 --dim 64``. Prints times and the ratios ours/raw
(targets: import < 2x raw SstFileWriter + ingest; get of 1024 present keys within 1.5x raw multi-get).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rocksdict import IngestExternalFileOptions, Options, Rdict, SstFileWriter

from hps_service.admin.importer import import_table, read_model_source, synthesize_model
from hps_service.tiers.rocksdb.tier import RocksDBTier
from loadtest.harness import cli

TABLE = "bench.item"
#: Import time over raw SstFileWriter + ingest; get time over the raw multi-get.
IMPORT_TARGET, GET_TARGET = cli.at_most(2), cli.at_most(1.5)


def raw_import(path: Path, keys: np.ndarray, vectors: np.ndarray) -> Rdict:
    """The floor: sort, one SstFileWriter over the raw key/vector bytes, one ingest, default raw options."""
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    db = Rdict(str(path), opts)
    order = np.argsort(keys.view(np.uint64))
    key_bytes = keys[order].astype(">i8").view("V8").tolist()
    value_bytes = np.ascontiguousarray(vectors[order]).view(f"V{vectors.shape[1] * 4}").ravel().tolist()
    sst = path / "raw.sst"
    writer = SstFileWriter(opts)
    writer.open(str(sst))
    deque(map(writer.__setitem__, key_bytes, value_bytes), maxlen=0)
    writer.finish()
    ingest = IngestExternalFileOptions()
    ingest.set_move_files(True)
    db.ingest_external_file([str(sst)], ingest)
    return db


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


#: A reader gets the int64 batch and its pre-encoded key bytes (encoded outside the timed call).
Reader = Callable[[np.ndarray, list[bytes]], object]


def encode(keys: np.ndarray) -> list[bytes]:
    return keys.astype(">i8").view("V8").tolist()


def warm(readers: dict[str, Reader], keys: np.ndarray) -> None:
    """Read every key once through each reader so block, row and page caches start equal."""
    for start in range(0, keys.size, 65536):
        chunk = keys[start : start + 65536]
        encoded = encode(chunk)
        for read in readers.values():
            read(chunk, encoded)


def bench_gets(readers: dict[str, Reader], keys: np.ndarray, batches: int) -> dict[str, float]:
    """Median seconds per batch of 1024 random present keys for each reader, interleaved batch by batch."""
    rng = np.random.default_rng(1)
    times: dict[str, list[float]] = {name: [] for name in readers}
    names = list(readers)
    for i in range(batches):
        batch = keys[rng.integers(0, keys.size, 1024)]
        encoded = encode(batch)
        for name in names if i % 2 == 0 else names[::-1]:  # alternate the order so no reader is favoured
            start = time.perf_counter()
            readers[name](batch, encoded)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__spec__, __doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="hps-bench-", dir=args.dir))
    try:
        keys, vectors = synthesize_model(args.rows, args.dim, seed=0)
        src = scratch / "model.npz"
        np.savez(src, keys=keys, vectors=vectors)

        raw_dir = scratch / "raw"
        raw_dir.mkdir()
        t_raw, raw_db = timed(raw_import, raw_dir, keys, vectors)
        tier = RocksDBTier(scratch / "ours", block_cache_mb=256)

        def ours_import() -> int:
            k, v = read_model_source(src)
            return import_table(tier, TABLE, args.dim, k, v, version=1)

        t_ours, written = timed(ours_import)
        assert written == args.rows
        print(
            f"import {args.rows} rows x dim {args.dim}: ours {t_ours:.2f} s (npz on disk -> ingested), "
            f"raw SstFileWriter+ingest {t_raw:.2f} s, ratio {cli.judged(t_ours / t_raw, IMPORT_TARGET)}"
        )

        tier.checkpoint(scratch / "ours-rowcache")  # hard links: the same files, read with a row cache
        cached = RocksDBTier(scratch / "ours-rowcache", block_cache_mb=256, row_cache_mb=256)
        readers: dict[str, Reader] = {
            "ours": lambda batch, _: tier.get(TABLE, batch),
            "ours+row cache": lambda batch, _: cached.get(TABLE, batch),
            # the very column family our tier reads: isolates our per-batch overhead
            "raw same store": lambda _, encoded, same=tier._cfs[TABLE]: same.get(encoded),
            "raw default store": lambda _, encoded: raw_db.get(encoded),
        }
        warm(readers, keys)
        med = bench_gets(readers, keys, args.batches)
        print(
            f"get 1024 present keys, warm, median of {args.batches} batches: "
            + ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in med.items())
        )
        print(
            f"  ratio ours / raw same store {cli.judged(med['ours'] / med['raw same store'], GET_TARGET)}, "
            f"ours / raw default store {cli.judged(med['ours'] / med['raw default store'], GET_TARGET)}"
        )
        print(
            f"  row cache 256 MiB / none {med['ours+row cache'] / med['ours']:.2f}x; "
            f"ours+row cache / raw default store {med['ours+row cache'] / med['raw default store']:.2f}x"
        )
        del readers  # column-family handles keep their DB (and its lock) open
        tier.close()
        cached.close()
        raw_db.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    cli.run(main)

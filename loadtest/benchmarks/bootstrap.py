"""A replica's bootstrap from a snapshot vs ``hps import`` of the same rows, and the catch-up of a replica behind the
update log, in one run on this machine.

1. Bootstrap: a 1M x 64 table imported (``read_model_source`` + ``import_table``, what ``hps import`` does), snapshotted
   to a SeaweedFS S3 server, then restored into an empty directory by ``fleet.bootstrap`` (list, download, SHA-256
   check, open) and opened as the store; target: bootstrap <= 1.5x the import.
2. Catch-up: rows published to a tansu topic, then a consumer over an empty engine started and timed until it says
   caught up (every partition applied up to the end offsets it saw at assignment); rows/s.

Run: ``python -m loadtest.benchmarks.bootstrap [--rows 1000000] [--dim 64] [--catch-up-rows 200000]``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from hps_service.admin.importer import import_table, read_model_source, synthesize_model
from hps_service.config import HPSConfig, UpdatesConfig
from hps_service.fleet.bootstrap import BootstrapProgress, bootstrap
from hps_service.fleet.bucket import SnapshotBucket
from hps_service.serve.process import build_engine
from hps_service.tiers.rocksdb.tier import RocksDBTier
from hps_service.updates import Publisher, UpdateConsumer
from hps_service.updates.local_broker import running_tansu
from loadtest.harness import cli
from tests.fixtures.seaweedfs import running_seaweedfs

MODEL, TABLE = "bench", "item"
#: The bootstrap's time over the import's.
TARGET = cli.at_most(1.5)


def bench_bootstrap(rows: int, dim: int, work: Path) -> dict[str, float]:
    """Seconds of the import and of the bootstrap of the same rows, and the snapshot's bytes."""
    keys, vectors = synthesize_model(rows, dim, seed=7)
    source = work / "table.npz"
    np.savez(source, keys=keys, vectors=vectors)
    del keys, vectors
    tid = f"{MODEL}.{TABLE}"
    t0 = time.perf_counter()
    k, v = read_model_source(source)
    tier = RocksDBTier(work / "imported", block_cache_mb=64)
    import_table(tier, tid, dim, k, v)
    import_s = time.perf_counter() - t0
    del k, v
    with running_seaweedfs() as s3:
        os.environ.update(s3.env)
        bucket = SnapshotBucket(f"s3://{s3.new_bucket()}/bench")
        t0 = time.perf_counter()
        info = tier.export(work / "export", [tid], {f"hps.{MODEL}"})
        manifest = bucket.upload(MODEL, work / "export", {"tables": {TABLE: info["tables"][tid]}, "positions": []})
        snapshot_s = time.perf_counter() - t0
        tier.close()
        t0 = time.perf_counter()
        restored = bootstrap(work / "restored", bucket, [MODEL], BootstrapProgress())
        opened = RocksDBTier(work / "restored", block_cache_mb=64)
        bootstrap_s = time.perf_counter() - t0
        assert restored == {MODEL: manifest["id"]} and opened.count(tid) == rows
        probe = np.asarray(read_model_source(source)[0][:1000])
        assert opened.get(tid, probe).found.all()
        opened.close()
    return {"rows": rows, "dim": dim, "import_s": import_s, "bootstrap_s": bootstrap_s, "snapshot_s": snapshot_s,
            "snapshot_mib": manifest["bytes"] / (1 << 20), "ratio": bootstrap_s / import_s}


def bench_catch_up(rows: int, dim: int, work: Path) -> dict[str, float]:
    """Seconds for a consumer over an empty engine to catch up with ``rows`` rows already on the topic."""
    model = f"c{uuid.uuid4().hex[:8]}"
    keys, vectors = synthesize_model(rows, dim, seed=3)
    with running_tansu() as broker:
        with Publisher(broker.bootstrap, model) as pub:
            for lo in range(0, rows, 50_000):
                pub.publish(TABLE, keys[lo : lo + 50_000], vectors[lo : lo + 50_000], 1)
            pub.flush(120)
        config = HPSConfig(cache={"backend": "numpy", "capacity": 0.2, "warm_start": False},
                           persistent={"path": str(work / "catch-up"), "block_cache_mb": 64},
                           models=[{"name": model, "tables": [{"name": TABLE, "dim": dim}]}])
        engine = build_engine(config)
        consumer = UpdateConsumer(UpdatesConfig(type="kafka", brokers=broker.bootstrap), engine, [model], "bench")
        t0 = time.perf_counter()
        consumer.start()
        caught_up = consumer.wait_caught_up(600)
        catch_up_s = time.perf_counter() - t0
        consumer.stop()
        held = engine.persistent.count(f"{model}.{TABLE}") if engine.persistent is not None else 0
        engine.close()
    assert caught_up and held == rows, (caught_up, held)
    return {"rows": rows, "dim": dim, "catch_up_s": catch_up_s, "rows_per_s": rows / catch_up_s}


def part(quick: bool) -> dict[str, Any]:
    """Part 9 of ``make bench``: this module as a subprocess (its own S3 server and broker); its printed lines
    parsed."""
    rows, catch_up = (200_000, 50_000) if quick else (1_000_000, 200_000)
    cmd = [sys.executable, "-m", __spec__.name, "--rows", str(rows), "--catch-up-rows", str(catch_up)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False, cwd=cli.REPO)
    except subprocess.TimeoutExpired:
        return {"run": False, "reason": f"{__spec__.name} did not finish within 900 s"}
    if proc.returncode != 0:
        return {"run": False, "reason": f"{__spec__.name} exited {proc.returncode}: {proc.stderr.strip()[-400:]}"}
    text = proc.stdout
    boot = re.search(r"snapshot \(([\d.]+) MiB .*?: ([\d.]+) s; hps import of the same rows: ([\d.]+) s", text)
    up = re.search(r"rows on the topic: ([\d.]+) s \(([\d,]+) rows/s\)", text)
    return {"run": True, "rows": rows, "catch_up_rows": catch_up,
            "bootstrap_s": float(boot.group(2)) if boot else None, "import_s": float(boot.group(3)) if boot else None,
            "snapshot_mib": float(boot.group(1)) if boot else None,
            "catch_up_s": float(up.group(1)) if up else None,
            "catch_up_rows_per_s": float(up.group(2).replace(",", "")) if up else None,
            "output": text.strip().splitlines()}


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--catch-up-rows", type=int, default=200_000)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hps-bench-bootstrap-"))
    try:
        b = bench_bootstrap(args.rows, args.dim, work)
        print(f"bootstrap of {b['rows']:,} x {b['dim']} from a snapshot ({b['snapshot_mib']:.0f} MiB in SeaweedFS S3): "
              f"{b['bootstrap_s']:.2f} s; hps import of the same rows: {b['import_s']:.2f} s; "
              f"ratio {cli.judged(b['ratio'], TARGET)}; taking + uploading the snapshot: {b['snapshot_s']:.2f} s")
        c = bench_catch_up(args.catch_up_rows, args.dim, work)
        print(f"catch-up of a replica behind {c['rows']:,} x {c['dim']} rows on the topic: {c['catch_up_s']:.2f} s "
              f"({c['rows_per_s']:,.0f} rows/s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    cli.run(main)

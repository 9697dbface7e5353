"""A rollout from the model repository (issue 53, part 15 of ``make bench``): how long a new version takes from the
bucket to ``ready`` on every replica, against ``hps import`` of the same file, and what the load does to lookups.

1. Baseline: ``hps import``'s own work (``cli.importing.import_source``, in this process: no interpreter start
   counted) of a ``rows`` x ``dim`` ``.npz`` into an empty RocksDB, before and after the rollout (their mean).
2. Rollout: ``replicas`` ``hps serve`` processes, each with its own RocksDB holding the model's base rows, poll a
   SeaweedFS bucket (``repository.poll_s``). The same file is uploaded as version 1; timed from the end of the upload
   to the moment every replica lists the version ``ready`` (imported, registered and preloaded), polled every 50 ms.
   Target: <= 1.5x the baseline.
3. Lookups meanwhile: a thread per replica sends a 64-key gRPC lookup of the base model every 10 ms; the p99 of the
   ``before_s`` seconds before the upload against the p99 from the upload to ready everywhere. Target: <= 1.5x.

    python -m loadtest.benchmarks.rollout [--rows 1000000] [--dim 64] [--replicas 3]
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console

from hps_client import HPSClient
from hps_service.admin.importer import synthesize_model
from hps_service.cli.importing import import_source
from hps_service.config import load_config
from loadtest.harness import cli
from tests.fixtures.seaweedfs import running_seaweedfs

#: Ready on every replica over hps import; lookup p99 during the load over before it.
LOAD_TARGET, P99_TARGET = cli.at_most(1.5), cli.at_most(1.5)
#: Seconds between a poller's lookups, and keys per lookup.
LOOKUP_EVERY_S, LOOKUP_KEYS = 0.01, 64


def _config(work: Path, name: str, dim: int, bucket: str | None, poll_s: float, workers: int) -> dict[str, Any]:
    from tests.helpers import free_port

    data: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "grpc_port": free_port(), "http_port": free_port(), "workers": workers,
                   "grace_period_s": 2},
        "cache": {"backend": "numpy", "capacity": 0.2, "warm_start": False},
        "persistent": {"type": "rocksdb", "path": str(work / name / "db"), "block_cache_mb": 64},
        "models": [{"name": "m", "tables": [{"name": "item", "dim": dim}]}],
    }
    if bucket is not None:
        data["repository"] = {"url": f"s3://{bucket}/models", "poll_s": poll_s}
    return data


def baseline(source: Path, work: Path, dim: int) -> float:
    """Seconds of ``hps import``'s work on ``source`` into an empty store."""
    cfg = load_config(None, **_config(work, "baseline", dim, None, 1.0, 0))
    started = time.perf_counter()
    import_source(cfg, source, "m", "item", model_version=0, console=Console(quiet=True))
    took = time.perf_counter() - started
    shutil.rmtree(work, ignore_errors=True)
    return took


def _poll_lookups(target: str, keys: np.ndarray, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    rng = np.random.default_rng(abs(hash(target)) % 2**32)
    with HPSClient(target, retries=0) as client:
        while not stop.wait(LOOKUP_EVERY_S):
            batch = keys[rng.integers(0, keys.shape[0], LOOKUP_KEYS)]
            started = time.perf_counter()
            client.lookup("m", "item", batch, version=0)
            out.append((time.monotonic(), time.perf_counter() - started))


def _phases(log: str) -> dict[str, float]:
    """The import's and the preload's seconds of version 1, from a replica's log."""
    out = {}
    for what, pattern in (("import_s", r"version 1 of model 'm' imported from \S+ in ([0-9.]+) s"),
                          ("preload_s", r"preloaded \d+ rows of m#v1\.item into the volatile tier in ([0-9.]+) s")):
        found = re.search(pattern, log)
        if found:
            out[what] = float(found.group(1))
    return out


def rollout(source: Path, base: Path, base_keys: np.ndarray, work: Path, dim: int, replicas: int, poll_s: float,
            workers: int, before_s: float) -> dict[str, Any]:
    """Seconds from the end of the upload to ready on every replica, per replica, and lookup latencies."""
    from tests.helpers import ServerProcess, write_config

    with running_seaweedfs() as s3:
        os.environ.update(s3.env)
        bucket = s3.new_bucket()
        servers: list[ServerProcess] = []
        urls: list[str] = []
        stop = threading.Event()
        latencies: list[list[tuple[float, float]]] = [[] for _ in range(replicas)]
        threads: list[threading.Thread] = []
        try:
            for i in range(replicas):
                data = _config(work, f"r{i}", dim, bucket, poll_s, workers)
                import_source(load_config(None, **data), base, "m", "item", model_version=0,
                              console=Console(quiet=True))
                cfg = write_config(work / f"r{i}.yaml", data)
                servers.append(ServerProcess(cfg, data["server"]["grpc_port"], env=s3.env).start(timeout=180))
                urls.append(f"http://127.0.0.1:{data['server']['http_port']}")
            for i, srv in enumerate(servers):
                threads.append(threading.Thread(target=_poll_lookups, args=(srv.target, base_keys, stop,
                                                                            latencies[i]), daemon=True))
                threads[-1].start()
            time.sleep(before_s)
            upload_started = time.monotonic()
            s3.client().upload_file(str(source), bucket, "models/m/1/item.npz")
            uploaded = time.monotonic()
            ready: dict[int, float] = {}
            deadline = uploaded + 1800
            while len(ready) < replicas:
                for i, url in enumerate(urls):
                    if i not in ready:
                        versions = httpx.get(f"{url}/v1/models/m/versions", timeout=30).json()["versions"]
                        state = next((v["state"] for v in versions if v["version"] == 1), None)
                        if state == "failed":
                            raise RuntimeError(f"replica {i}: version 1 failed: {versions}")
                        if state == "ready":
                            ready[i] = time.monotonic() - uploaded
                if time.monotonic() > deadline:
                    raise RuntimeError(f"version 1 not ready everywhere within 30 min: {ready}")
                time.sleep(0.05)
            done = time.monotonic()
            phases = [_phases(srv.log()) for srv in servers]
        finally:
            stop.set()
            for th in threads:
                th.join(10)
            for srv in servers:
                srv.stop()
    before = [s for lat in latencies for t, s in lat if t < upload_started]
    during = [s for lat in latencies for t, s in lat if uploaded <= t <= done]
    return {"upload_s": uploaded - upload_started, "ready_s": [ready[i] for i in range(replicas)], "phases": phases,
            "all_ready_s": max(ready.values()), "lookups_before": len(before), "lookups_during": len(during),
            "p99_before_s": _quantile(before, 99), "p99_during_s": _quantile(during, 99),
            "p50_before_s": _quantile(before, 50), "p50_during_s": _quantile(during, 50)}


def _quantile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run(rows: int, dim: int, replicas: int, console: Console, poll_s: float = 0.5, workers: int = 1,
        before_s: float = 8.0) -> dict[str, Any]:
    """Both measurements, printed; returns their numbers."""
    work = Path(tempfile.mkdtemp(prefix="hps-bench-rollout-"))
    try:
        keys, vectors = synthesize_model(rows, dim, seed=53)
        source = work / "version.npz"
        np.savez(source, keys=keys, vectors=vectors)
        base_rows = min(rows, 100_000)
        base = work / "base.npz"
        np.savez(base, keys=keys[:base_rows], vectors=vectors[:base_rows] * np.float32(0.5))
        base_keys = keys[:base_rows].copy()
        del keys, vectors
        first = baseline(source, work / "before", dim)
        out = rollout(source, base, base_keys, work, dim, replicas, poll_s, workers, before_s)
        last = baseline(source, work / "after", dim)  # before and after: a burst of load elsewhere hits both alike
        import_s = (first + last) / 2
        console.print(f"hps import of {rows:,} x {dim}: {first:.1f} s before the rollout, {last:.1f} s after",
                      highlight=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.update(rows=rows, dim=dim, replicas=replicas, poll_s=poll_s, workers=workers, import_s=import_s,
               load_ratio=out["all_ready_s"] / import_s, p99_ratio=out["p99_during_s"] / out["p99_before_s"])
    console.print(f"version of {rows:,} x {dim} from the bucket to ready on {replicas} replicas (poll_s {poll_s}): "
                  f"{out['all_ready_s']:.1f} s (each: {', '.join(f'{s:.1f}' for s in out['ready_s'])} s; upload "
                  f"{out['upload_s']:.1f} s before) vs hps import {import_s:.1f} s: "
                  f"{cli.judged(out['load_ratio'], LOAD_TARGET)}", highlight=False)
    console.print("  per replica, import and preload: " + "; ".join(
        f"{p.get('import_s', float('nan')):.1f} s + {p.get('preload_s', float('nan')):.1f} s" for p in out["phases"]),
        highlight=False)
    console.print(f"lookups ({LOOKUP_KEYS} keys every {LOOKUP_EVERY_S * 1e3:.0f} ms per replica): p99 "
                  f"{out['p99_before_s'] * 1e3:.1f} ms before ({out['lookups_before']}), "
                  f"{out['p99_during_s'] * 1e3:.1f} ms during the load ({out['lookups_during']}): "
                  f"{cli.judged(out['p99_ratio'], P99_TARGET)}", highlight=False)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--poll-s", type=float, default=0.5, help="repository.poll_s of the replicas")
    ap.add_argument("--workers", type=int, default=1, help="server.workers of each replica")
    cli.add_out(ap)
    args = ap.parse_args(argv)
    res = run(args.rows, args.dim, args.replicas, cli.console(), args.poll_s, args.workers)
    cli.write_result(res, args.out, "bench-rollout")
    return 0 if LOAD_TARGET.met(res["load_ratio"]) and P99_TARGET.met(res["p99_ratio"]) else 1


if __name__ == "__main__":
    cli.run(main)

"""The soak's run: a real ``hps serve`` and broker, lookup threads checking every row, a publisher, sampling."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import httpx
import numpy as np
import yaml

from hps_service.client import HPSClient
from hps_service.errors import HPSError
from hps_service.runtime.processes import free_port, stop_process
from hps_service.updates import Publisher
from loadtest.harness.cli import REPO
from loadtest.soak.plot import plot
from loadtest.soak.result import Limits, Sample, SoakResult
from loadtest.soak.verdict import judge
from loadtest.soak.watch import TABLE, Watch, cpu_seconds, rss_mib, server_cpu_seconds, server_memory_mib


def rows_for(keys: np.ndarray, version: np.ndarray | int, dim: int) -> np.ndarray:
    """Rows that encode key and version in column 0 (``key * 1e-3 + version``), so any served row is checkable."""
    base = np.asarray(keys, dtype=np.float64) * 1e-3 + np.asarray(version, dtype=np.float64)
    return np.repeat(base.astype(np.float32)[:, None], dim, axis=1)


def served_versions(keys: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """The version each served row encodes (rounded; -1 where the row does not decode to a whole version)."""
    raw = vectors[:, 0].astype(np.float64) - np.asarray(keys, dtype=np.float64) * 1e-3
    versions = np.rint(raw)
    ok = (np.abs(raw - versions) < 0.05) & (vectors == vectors[:, :1]).all(axis=1)
    return np.where(ok, versions, -1).astype(np.int64)


def _wait(predicate, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (httpx.HTTPError, HPSError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def plan_publishing(duration_s: float, rows_per_s: int, publish_every_s: float, partitions: int,
                    max_record_batches: int, keys: int) -> tuple[float, int, int]:
    """(publish interval, rows per publish, record batches over the run): one batch per partition per publish,
    the interval raised until the run's batches fit ``max_record_batches`` (the bound on the broker's log)."""
    interval = max(publish_every_s, partitions * duration_s / max_record_batches)
    rows = max(1, min(keys, round(rows_per_s * interval)))
    return interval, rows, partitions * math.ceil(duration_s / interval)


def run_soak(duration_s: float, interval_s: float, out_dir: Path, brokers: str | None = None,
             broker_pid: int | None = None, keys: int = 20_000, dim: int = 32, lookup_workers: int = 2,
             batch: int = 256, rows_per_s: int = 10_000, publish_every_s: float = 1.0, partitions: int = 4,
             compression: str = "lz4", max_record_batches: int = 20_000, limits: Limits = Limits()) -> SoakResult:
    """Run the soak and return what it saw, judged (also written as JSON next to the PNG under ``out_dir``)."""
    from hps_service.updates.local_broker import running_tansu

    out_dir.mkdir(parents=True, exist_ok=True)
    result = SoakResult(duration_s=duration_s, partitions=partitions)
    result.publish_every_s, result.rows_per_publish, result.record_batches = plan_publishing(
        duration_s, rows_per_s, publish_every_s, partitions, max_record_batches, keys)
    broker_ctx = nullcontext(brokers) if brokers else running_tansu()
    with broker_ctx as broker, tempfile.TemporaryDirectory(prefix="hps-soak-") as tmp:
        bootstrap = broker if isinstance(broker, str) else broker.bootstrap
        if not isinstance(broker, str):
            broker_pid = broker.process.pid
        model = f"soak{uuid.uuid4().hex[:6]}"
        grpc_port, http_port = free_port(), free_port()
        cfg = Path(tmp) / "soak.yaml"
        cfg.write_text(yaml.safe_dump({
            "server": {"grpc_port": grpc_port, "http_port": http_port, "grace_period_s": 20},
            "cache": {"backend": "numpy", "capacity": 0.25, "min_rows": 1024, "warm_start": False},
            "volatile": {"type": "hashmap", "capacity_rows": keys},
            "persistent": {"type": "rocksdb", "path": f"{tmp}/db", "block_cache_mb": 16},
            "updates": {"type": "kafka", "brokers": bootstrap, "topic_prefix": "soak", "group": "soak",
                        "stall_after_s": limits.max_no_apply_s},
            "cluster": {"partitions": partitions},
            "models": [{"name": model, "tables": [{"name": TABLE, "dim": dim}]}],
        }))
        all_keys = np.arange(1, keys + 1, dtype=np.int64)
        latest = np.ones(keys, dtype=np.int64)
        publisher = Publisher(bootstrap, model, topic_prefix="soak", partitions=partitions,
                              **{"compression.type": compression, "linger.ms": 20})
        publisher.publish(TABLE, all_keys, rows_for(all_keys, 1, dim), 1)
        publisher.flush(60)
        published: deque[tuple[int, float]] = deque([(1, time.monotonic())])
        with open(out_dir / "server.log", "wb") as server_log:
            server = subprocess.Popen([sys.executable, "-m", "hps_service.cli.main", "serve", "--config", str(cfg),
                                       "--log-level", "warning"], cwd=REPO, stdout=server_log,
                                      stderr=subprocess.STDOUT, env=dict(os.environ))
        target = f"127.0.0.1:{grpc_port}"
        lock = threading.Lock()
        latencies: list[float] = []
        stop = threading.Event()
        watch: Watch | None = None
        try:
            with HPSClient(target, timeout=30) as client:
                _wait(lambda: httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=2).status_code == 200, 120,
                      "the server to be ready")

                def all_initial_served() -> bool:
                    return all((served_versions(k, client.lookup(model, TABLE, k)) >= 1).all()
                               for k in np.array_split(all_keys, max(1, keys // 10_000)))

                _wait(all_initial_served, 120, "the initial rows to be served")
            watch = Watch(http_port, model, published, limits.max_no_apply_s, stop).start()

            def lookups(seed: int) -> None:
                rng = np.random.default_rng(seed)
                with HPSClient(target, timeout=10, retries=0) as c:
                    while not stop.is_set():
                        k = all_keys[rng.zipf(1.2, size=batch) % keys]
                        t0 = time.perf_counter()
                        try:
                            got = c.lookup(model, TABLE, k)
                        except HPSError as exc:
                            result.lookup_errors.append(str(exc))
                            continue
                        elapsed = time.perf_counter() - t0
                        # A served row must decode to a version that was published (1 .. latest so far).
                        versions = served_versions(k, got)
                        bad = int(np.count_nonzero((versions < 1) | (versions > latest[k - 1])))
                        with lock:
                            latencies.append(elapsed)
                            result.lookups += 1
                            result.wrong_rows += bad

            def updates() -> None:
                rng = np.random.default_rng(99)
                version = 1
                next_at = time.monotonic()
                while not stop.is_set():
                    version += 1
                    k = (rng.choice(keys, size=result.rows_per_publish, replace=False) + 1).astype(np.int64)
                    latest[k - 1] = version  # before publishing, so a lookup never sees a version beyond it
                    published.append((version, time.monotonic()))
                    try:
                        publisher.publish(TABLE, k, rows_for(k, version, dim), version)
                        publisher.flush(30)
                    except HPSError as exc:
                        result.publish_errors.append(str(exc))
                    result.rows_published += k.size
                    next_at += result.publish_every_s
                    stop.wait(max(0.0, next_at - time.monotonic()))

            threads = [threading.Thread(target=lookups, args=(i,), daemon=True) for i in range(lookup_workers)]
            threads.append(threading.Thread(target=updates, daemon=True))
            for th in threads:
                th.start()
            start = time.monotonic()
            next_sample = start + interval_s
            cpu = (server_cpu_seconds(server.pid), cpu_seconds(broker_pid), start)
            while time.monotonic() - start < duration_s and not stop.is_set():
                stop.wait(max(0.0, next_sample - time.monotonic()))
                next_sample += interval_s
                with lock:
                    window, latencies[:] = list(latencies), []
                now = time.monotonic()
                server_cpu, broker_cpu = server_cpu_seconds(server.pid), cpu_seconds(broker_pid)
                span = max(now - cpu[2], 1e-6)
                staleness, stalled = watch.take()
                p99 = float(np.percentile(np.asarray(window) * 1e3, 99)) if window else float("nan")
                memtables, block_cache = watch.memory()
                result.samples.append(Sample(
                    round(now - start, 2), server_memory_mib(server.pid), memtables, block_cache,
                    len(window), p99, result.rows_published, watch.rows_applied, round(staleness, 3),
                    round((server_cpu - cpu[0]) / span, 3), round((broker_cpu - cpu[1]) / span, 3),
                    rss_mib(broker_pid), stalled))
                cpu = (server_cpu, broker_cpu, now)
            result.ran_s = time.monotonic() - start
            result.no_apply_failure = watch.failure
            stop.set()
            for th in threads:
                th.join(30)
            publisher.flush(60)
            with HPSClient(target, timeout=30) as client:

                def stale() -> int:
                    got = np.concatenate([client.lookup(model, TABLE, all_keys[i:i + 10_000])
                                          for i in range(0, keys, 10_000)])
                    result.stale_keys_at_end = int(np.count_nonzero(served_versions(all_keys, got) != latest))
                    return result.stale_keys_at_end

                try:
                    _wait(lambda: stale() == 0, 10 if result.no_apply_failure else 60, "every key at its latest "
                          "version")
                except TimeoutError:
                    pass
            watch.stop()
            watch.observe_now()
            result.rows_applied = watch.rows_applied
        finally:
            stop.set()
            if watch is not None:
                watch.stop()
            result.server_exit = stop_process(server, 40)
            publisher.close(10)
            publisher = None  # type: ignore[assignment]  # librdkafka's client goes before the broker stops
    result.checks = judge(result, limits)
    png = out_dir / "soak.png"
    plot(result, png, limits)
    result.plot = str(png)
    summary = asdict(result)
    summary["lookup_errors"] = result.lookup_errors[:20]
    summary["publish_errors"] = result.publish_errors[:20]
    summary["passed"] = result.passed
    (out_dir / "soak.json").write_text(json.dumps(summary, indent=1))
    return result

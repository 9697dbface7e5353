"""Bounded soak: mixed lookups and Kafka updates against a real `hps serve` process (and a local tansu broker),
sampling the server's RSS and the lookup p99 over time. Passes when there are zero errors and wrong rows, every
key ends at its latest published version, and neither RSS nor p99 trends upwards; the samples go to a PNG.

    python -m loadtest.soak                    # about 2 minutes (make soak)
    python -m loadtest.soak --duration 3600    # longer
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
import yaml

from hps_service.client import HPSClient
from hps_service.errors import HPSError
from hps_service.local_processes import free_port, stop_process
from hps_service.updates import Publisher

REPO = Path(__file__).resolve().parents[1]
TABLE = "item"


@dataclass
class Sample:
    """One sampling interval: seconds since start, server RSS, RocksDB memtables (bounded by write_buffer_size,
    they grow with every write until a flush), lookups answered and their p99 in the interval."""

    t_s: float
    rss_mib: float
    memtable_mib: float
    lookups: int
    p99_ms: float
    rows_published: int


@dataclass
class SoakResult:
    """What the soak saw, and its verdict."""

    duration_s: float
    samples: list[Sample] = field(default_factory=list)
    lookups: int = 0
    lookup_errors: list[str] = field(default_factory=list)
    wrong_rows: int = 0
    publish_errors: list[str] = field(default_factory=list)
    rows_published: int = 0
    stale_keys_at_end: int = -1
    rss_growth: float = 0.0  # fitted growth of RSS less memtables over the measured part, fraction of its mean
    p99_ratio: float = 0.0  # median p99 of the last third / the first third of the measured part
    server_exit: int | None = None
    plot: str | None = None

    @property
    def correct(self) -> bool:
        """Zero errors, no wrong row, every key at its latest version, clean exit."""
        return (not self.lookup_errors and not self.publish_errors and self.wrong_rows == 0
                and self.stale_keys_at_end == 0 and self.server_exit == 0)

    def passed(self, max_rss_growth: float, max_p99_ratio: float) -> bool:
        return self.correct and self.rss_growth <= max_rss_growth and self.p99_ratio <= max_p99_ratio


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


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memtable_mib(http_port: int, model: str) -> float:
    """RocksDB memtable bytes of the soak table, from the server's /v1/stats."""
    stats = httpx.get(f"http://127.0.0.1:{http_port}/v1/stats", timeout=10).json()
    persistent = stats["models"][model]["tables"][TABLE]["persistent"]
    return float(persistent.get("memtable_bytes", 0.0)) / 2**20


def trend(samples: list[Sample]) -> tuple[float, float]:
    """(growth of RSS less RocksDB memtables over the measured part as a fraction of its mean, p99 last third /
    first third); the first quarter of the run is warm-up (imports, JIT, caches filling) and is left out."""
    measured = samples[len(samples) // 4:]
    if len(measured) < 3:
        return 0.0, 0.0
    t = np.array([s.t_s for s in measured])
    rss = np.array([s.rss_mib - s.memtable_mib for s in measured])
    slope = np.polyfit(t, rss, 1)[0]
    growth = float(slope * (t[-1] - t[0]) / rss.mean())
    p99 = np.array([s.p99_ms for s in measured])
    third = max(1, len(p99) // 3)
    ratio = float(np.median(p99[-third:]) / max(np.median(p99[:third]), 1e-6))
    return growth, ratio


def plot(result: SoakResult, path: Path) -> None:
    """RSS, p99 and lookups per interval against time, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t_s for s in result.samples]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(t, [s.rss_mib for s in result.samples], marker=".", label="RSS")
    axes[0].plot(t, [s.rss_mib - s.memtable_mib for s in result.samples], marker=".", label="RSS - memtables")
    axes[0].legend(loc="lower right")
    axes[0].set_ylabel("server memory (MiB)")
    axes[0].set_title(f"soak {result.duration_s:.0f} s: {result.lookups} lookups, {len(result.lookup_errors)} errors, "
                      f"RSS trend {result.rss_growth:+.1%}, p99 ratio {result.p99_ratio:.2f}")
    axes[1].plot(t, [s.p99_ms for s in result.samples], marker=".", color="tab:red")
    axes[1].set_ylabel("lookup p99 (ms)")
    axes[2].plot(t, [s.lookups for s in result.samples], marker=".", color="tab:green")
    axes[2].set_ylabel("lookups / interval")
    axes[2].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


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


def run_soak(duration_s: float, interval_s: float, out_dir: Path, brokers: str | None = None, keys: int = 20_000,
             dim: int = 32, lookup_workers: int = 2, batch: int = 256, update_rows: int = 500,
             update_every_s: float = 0.05) -> SoakResult:
    """Run the soak and return what it saw (also written as JSON next to the PNG under ``out_dir``)."""
    from hps_service.updates.local_broker import running_tansu

    out_dir.mkdir(parents=True, exist_ok=True)
    result = SoakResult(duration_s=duration_s)
    broker_ctx = nullcontext(brokers) if brokers else running_tansu()
    with broker_ctx as broker, tempfile.TemporaryDirectory(prefix="hps-soak-") as tmp:
        bootstrap = broker if isinstance(broker, str) else broker.bootstrap
        model = f"soak{uuid.uuid4().hex[:6]}"
        grpc_port, http_port = free_port(), free_port()
        cfg = Path(tmp) / "soak.yaml"
        cfg.write_text(yaml.safe_dump({
            "server": {"grpc_port": grpc_port, "http_port": http_port, "grace_period_s": 20},
            "cache": {"backend": "numpy", "capacity": 0.25, "min_rows": 1024, "warm_start": False},
            "volatile": {"type": "hashmap", "capacity_rows": keys},
            "persistent": {"type": "rocksdb", "path": f"{tmp}/db", "block_cache_mb": 16},
            "updates": {"type": "kafka", "brokers": bootstrap, "topic_prefix": "soak", "group": "soak"},
            "models": [{"name": model, "tables": [{"name": TABLE, "dim": dim}]}],
        }))
        all_keys = np.arange(1, keys + 1, dtype=np.int64)
        latest = np.ones(keys, dtype=np.int64)
        publisher = Publisher(bootstrap, model, topic_prefix="soak")
        publisher.publish(TABLE, all_keys, rows_for(all_keys, 1, dim), 1)
        publisher.flush(60)
        server = subprocess.Popen([sys.executable, "-m", "hps_service.cli", "serve", "--config", str(cfg),
                                   "--log-level", "warning"], cwd=REPO, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=dict(os.environ))
        target = f"127.0.0.1:{grpc_port}"
        lock = threading.Lock()
        latencies: list[float] = []
        stop = threading.Event()
        try:
            with HPSClient(target, timeout=10) as client:
                _wait(lambda: httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=2).status_code == 200, 120,
                      "the server to be ready")

                def all_initial_served() -> bool:
                    return all((served_versions(k, client.lookup(model, TABLE, k)) >= 1).all()
                               for k in np.array_split(all_keys, max(1, keys // 10_000)))

                _wait(all_initial_served, 120, "the initial rows to be served")

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
                while not stop.is_set():
                    version += 1
                    k = np.unique(rng.integers(1, keys + 1, size=update_rows)).astype(np.int64)
                    latest[k - 1] = version  # before publishing, so a lookup never sees a version beyond it
                    try:
                        publisher.publish(TABLE, k, rows_for(k, version, dim), version)
                        if version % 20 == 0:
                            publisher.flush(30)
                    except HPSError as exc:
                        result.publish_errors.append(str(exc))
                    result.rows_published += k.size
                    time.sleep(update_every_s)

            threads = [threading.Thread(target=lookups, args=(i,), daemon=True) for i in range(lookup_workers)]
            threads.append(threading.Thread(target=updates, daemon=True))
            for th in threads:
                th.start()
            start = time.monotonic()
            next_sample = start + interval_s
            while time.monotonic() - start < duration_s:
                time.sleep(max(0.0, next_sample - time.monotonic()))
                next_sample += interval_s
                with lock:
                    window, latencies[:] = list(latencies), []
                p99 = float(np.percentile(np.asarray(window) * 1e3, 99)) if window else float("nan")
                result.samples.append(Sample(round(time.monotonic() - start, 2), rss_mib(server.pid),
                                             memtable_mib(http_port, model), len(window), p99,
                                             result.rows_published))
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
                    _wait(lambda: stale() == 0, 60, "every key at its latest version")
                except TimeoutError:
                    pass
        finally:
            stop.set()
            result.server_exit = stop_process(server, 40)
            publisher.close(10)
            publisher = None  # type: ignore[assignment]  # librdkafka's client goes before the broker stops
    result.rss_growth, result.p99_ratio = trend(result.samples)
    png = out_dir / "soak.png"
    plot(result, png)
    result.plot = str(png)
    summary = asdict(result)
    summary["lookup_errors"] = result.lookup_errors[:20]
    (out_dir / "soak.json").write_text(json.dumps(summary, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument("--interval", type=float, default=None, help="seconds per sample (default duration/40)")
    parser.add_argument("--out", type=Path, default=REPO / "loadtest" / "results" / "soak")
    parser.add_argument("--brokers", default=None, help="an existing broker; default: start a local tansu")
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--lookup-workers", type=int, default=2)
    parser.add_argument("--max-rss-growth", type=float, default=0.10, help="fitted RSS growth, fraction of mean")
    parser.add_argument("--max-p99-ratio", type=float, default=2.0, help="late p99 / early p99")
    args = parser.parse_args()
    interval = args.interval or max(1.0, args.duration / 40)
    result = run_soak(args.duration, interval, args.out, brokers=args.brokers, keys=args.keys, dim=args.dim,
                      lookup_workers=args.lookup_workers)
    rss = [s.rss_mib - s.memtable_mib for s in result.samples]
    print(f"soak {args.duration:.0f} s: {result.lookups} lookups, {len(result.lookup_errors)} lookup errors, "
          f"{result.wrong_rows} wrong rows, {result.rows_published} rows published "
          f"({len(result.publish_errors)} errors), stale keys at end {result.stale_keys_at_end}, "
          f"server exit {result.server_exit}")
    print(f"RSS less memtables {min(rss):.0f}-{max(rss):.0f} MiB, fitted growth {result.rss_growth:+.1%} "
          f"(limit {args.max_rss_growth:.0%}); p99 late/early {result.p99_ratio:.2f} (limit {args.max_p99_ratio})")
    print(f"plot: {result.plot}")
    ok = result.passed(args.max_rss_growth, args.max_p99_ratio)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

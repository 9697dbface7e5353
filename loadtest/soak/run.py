"""Soak: mixed lookups and sustained Kafka updates against a real `hps serve` process and a local tansu broker,
judged on what its plots show, while it runs and at the end.

    python -m loadtest.soak                     # 3 minutes (make soak)
    python -m loadtest.soak --duration 3600     # an hour

Two lookup threads check every served row (it encodes its key and version: never a version that was not
published); a publisher sends ``--rows-per-s`` distinct rows every ``--publish-every`` seconds. The verdict:

- correct: zero lookup and publish errors, zero wrong rows, every key at its latest version at the end, exit 0;
- fresh: FAIL as soon as published rows wait and no update was applied for ``--max-no-apply`` seconds (30);
- lookups per interval, late vs early (median of the last third vs the first third after a warm-up): >= 0.8;
- lookup p99, late vs early: <= 1.5;
- memory: the server's PSS (its workers included) net of RocksDB's memtables and block-cache usage (both from /v1/stats) has no upward
  trend over the last half (robust fitted growth <= ``--max-mem-growth`` of its median).

The test broker's log is bounded: tansu's in-memory log serves a fetch more slowly the more record batches it
holds (tens of thousands make fetches take seconds), and its DeleteRecords is not implemented (the broker drops
the connection), so the soak bounds the volume instead: one record batch per partition per publish, at most
``--max-record-batches`` over the run (the publish interval grows to fit), compressed with lz4. The plot adds the
broker's CPU and RSS, since the broker shares the machine. Samples, plot and verdict go under ``--out``.
"""

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from hps_service.client import HPSClient
from hps_service.errors import HPSError
from hps_service.runtime.processes import free_port, process_tree, pss_bytes, stop_process
from hps_service.updates import Publisher
from loadtest.harness.cli import REPO
from loadtest.harness.loadgen import process_cpu_s

TABLE = "item"
_MiB = 2**20


@dataclass
class Sample:
    """One sampling interval: seconds since start; server PSS (workers included) and the RocksDB memory inside it that is bounded by
    configuration (memtables, block cache); lookups answered and their p99; rows published and applied so far;
    the oldest unapplied publish's age (max in the interval); server and broker CPU (cores) and broker RSS."""

    t_s: float
    mem_mib: float
    memtable_mib: float
    block_cache_mib: float
    lookups: int
    p99_ms: float
    rows_published: int
    rows_applied: int
    staleness_s: float
    server_cpu: float
    broker_cpu: float
    broker_rss_mib: float
    server_stalled: bool

    @property
    def net_mib(self) -> float:
        """PSS net of memtables and block-cache usage: what must not trend upwards."""
        return self.mem_mib - self.memtable_mib - self.block_cache_mib


@dataclass(frozen=True)
class Limits:
    """What the verdict allows."""

    max_no_apply_s: float = 30.0
    min_lookup_ratio: float = 0.8
    max_p99_ratio: float = 1.5
    max_mem_growth: float = 0.05
    warmup_fraction: float = 0.1


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


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
    rows_applied: int = 0
    stale_keys_at_end: int = -1
    server_exit: int | None = None
    no_apply_failure: str | None = None  # set the moment rows waited with nothing applied for max_no_apply_s
    ran_s: float = 0.0
    publish_every_s: float = 0.0
    rows_per_publish: int = 0
    partitions: int = 0
    record_batches: int = 0
    lookup_ratio: float = float("nan")  # lookups per interval, late / early
    p99_ratio: float = float("nan")  # p99, late / early
    mem_growth: float = float("nan")  # fitted growth of net memory over the last half, fraction of its median
    checks: list[Check] = field(default_factory=list)
    plot: str | None = None

    @property
    def correct(self) -> bool:
        """Zero errors, no wrong row, every key at its latest version, clean exit."""
        return (not self.lookup_errors and not self.publish_errors and self.wrong_rows == 0
                and self.stale_keys_at_end == 0 and self.server_exit == 0)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)


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


def rss_mib(pid: int | None) -> float:
    """Resident set size of ``pid`` in MiB (NaN when unknown or gone)."""
    if pid is None:
        return float("nan")
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def server_memory_mib(pid: int) -> float:
    """PSS in MiB of ``pid`` and every process under it (a node's owner and its workers): the shared store is
    counted once, not once per process that maps it (NaN when gone)."""
    total = pss_bytes(process_tree(pid))
    return total / _MiB if total else float("nan")


def server_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and the processes under it (its workers)."""
    return process_cpu_s(process_tree(pid))


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds used by ``pid`` so far (NaN when unknown)."""
    return float("nan") if pid is None else process_cpu_s([pid])


# ---------------------------------------------------------------------------------------------- verdict
def windows(samples: list[Sample], warmup_fraction: float) -> tuple[list[Sample], list[Sample]]:
    """(early, late): the first and last third of the samples after the warm-up."""
    measured = samples[max(1, math.ceil(len(samples) * warmup_fraction)):] if len(samples) > 3 else samples
    third = max(1, len(measured) // 3)
    return measured[:third], measured[-third:]


def late_over_early(early: list[float], late: list[float]) -> float:
    """Median of ``late`` over median of ``early`` (NaN values left out)."""
    e = [v for v in early if not math.isnan(v)]
    la = [v for v in late if not math.isnan(v)]
    if not e or not la:
        return float("nan")
    return float(np.median(la) / max(float(np.median(e)), 1e-9))


def fitted_growth(t: np.ndarray, y: np.ndarray) -> float:
    """Theil-Sen slope of ``y`` over ``t`` times the span, as a fraction of the median of ``y``: a trend that a
    few spikes (compactions, a large response) cannot fake."""
    if t.shape[0] < 3:
        return 0.0
    i, j = np.triu_indices(t.shape[0], k=1)
    dt = t[j] - t[i]
    keep = dt > 0
    slope = float(np.median((y[j] - y[i])[keep] / dt[keep]))
    return slope * float(t[-1] - t[0]) / max(float(np.median(y)), 1e-9)


def last_half(samples: list[Sample]) -> list[Sample]:
    return samples[len(samples) // 2:]


def judge(result: SoakResult, limits: Limits) -> list[Check]:
    """The checks of the verdict, from what the samples (the plot) show; see the module docstring."""
    early, late = windows(result.samples, limits.warmup_fraction)
    result.lookup_ratio = late_over_early([s.lookups for s in early], [s.lookups for s in late])
    result.p99_ratio = late_over_early([s.p99_ms for s in early], [s.p99_ms for s in late])
    half = [s for s in last_half(result.samples) if not math.isnan(s.net_mib)]
    result.mem_growth = fitted_growth(np.array([s.t_s for s in half]), np.array([s.net_mib for s in half]))
    errors = len(result.lookup_errors) + len(result.publish_errors)
    return [
        Check("correct", result.correct,
              f"{len(result.lookup_errors)} lookup errors, {len(result.publish_errors)} publish errors, "
              f"{result.wrong_rows} wrong rows, {result.stale_keys_at_end} stale keys at the end, "
              f"server exit {result.server_exit}" + (f"; first error: {(result.lookup_errors + result.publish_errors)[0]}"
                                                    if errors else "")),
        Check("fresh", result.no_apply_failure is None,
              result.no_apply_failure or f"updates applied throughout (never {limits.max_no_apply_s:.0f} s without "
              f"one while rows waited); oldest unapplied publish at most "
              f"{max((s.staleness_s for s in result.samples), default=0.0):.1f} s old"),
        Check("lookups late/early", not result.lookup_ratio < limits.min_lookup_ratio,
              f"{result.lookup_ratio:.2f} (>= {limits.min_lookup_ratio})"),
        Check("p99 late/early", not result.p99_ratio > limits.max_p99_ratio,
              f"{result.p99_ratio:.2f} (<= {limits.max_p99_ratio})"),
        Check("memory trend, last half", not result.mem_growth > limits.max_mem_growth,
              f"PSS net of memtables and block cache {result.mem_growth:+.1%} (<= {limits.max_mem_growth:+.0%}); "
              + (f"{min(s.net_mib for s in half):.0f}-{max(s.net_mib for s in half):.0f} MiB" if half else "no samples")),
    ]


def plot(result: SoakResult, path: Path, limits: Limits) -> None:
    """Memory, p99, lookups per interval, update freshness and the broker against time, one panel each, with the
    windows the verdict compares shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result.samples
    t = np.array([x.t_s for x in s])
    fig, axes = plt.subplots(5, 1, figsize=(9, 13), sharex=True)
    early, late = windows(s, limits.warmup_fraction)
    for ax in axes:
        for win, color in ((early, "tab:green"), (late, "tab:orange")):
            if win:
                ax.axvspan(win[0].t_s, win[-1].t_s, color=color, alpha=0.08)
    verdict = "PASS" if result.passed else "FAIL: " + ", ".join(c.name for c in result.checks if not c.passed)
    axes[0].set_title(f"soak {result.ran_s:.0f} s: {result.lookups} lookups, {result.rows_published} rows published "
                      f"- {verdict}", fontsize=10)
    axes[0].plot(t, [x.mem_mib for x in s], marker=".", label="PSS (server and workers)")
    axes[0].plot(t, [x.net_mib for x in s], marker=".", label="PSS - memtables - block cache")
    half = [x for x in last_half(s) if not math.isnan(x.net_mib)]
    if len(half) >= 2:
        th = np.array([x.t_s for x in half])
        med = float(np.median([x.net_mib for x in half]))
        growth = result.mem_growth * med
        axes[0].plot(th, med + growth * ((th - th.mean()) / max(th[-1] - th[0], 1e-9)), color="k", lw=1,
                     label=f"last half trend {result.mem_growth:+.1%}")
    axes[0].legend(loc="lower right", fontsize=8)
    axes[0].set_ylabel("server memory (MiB)")
    axes[1].plot(t, [x.p99_ms for x in s], marker=".", color="tab:red")
    axes[1].set_ylabel(f"lookup p99 (ms)\nlate/early {result.p99_ratio:.2f}")
    axes[2].plot(t, [x.lookups for x in s], marker=".", color="tab:green")
    axes[2].set_ylabel(f"lookups / interval\nlate/early {result.lookup_ratio:.2f}")
    dt = np.diff(t, prepend=0.0)
    dt[dt <= 0] = np.nan
    axes[3].plot(t, np.diff([0] + [x.rows_published for x in s]) / dt, label="published rows/s")
    axes[3].plot(t, np.diff([0] + [x.rows_applied for x in s]) / dt, label="applied rows/s")
    axes[3].set_ylabel("updates")
    axes[3].legend(loc="lower left", fontsize=8)
    stale_ax = axes[3].twinx()
    stale_ax.plot(t, [x.staleness_s for x in s], color="tab:purple", marker=".", lw=0.8)
    stale_ax.set_ylabel("oldest unapplied\npublish (s)", color="tab:purple")
    axes[4].plot(t, [x.broker_cpu for x in s], marker=".", color="tab:brown", label="broker CPU")
    axes[4].plot(t, [x.server_cpu for x in s], marker=".", color="tab:gray", label="server CPU")
    axes[4].set_ylabel("cores")
    axes[4].legend(loc="upper left", fontsize=8)
    rss_ax = axes[4].twinx()
    rss_ax.plot(t, [x.broker_rss_mib for x in s], color="tab:cyan", marker=".", lw=0.8)
    rss_ax.set_ylabel("broker RSS (MiB)", color="tab:cyan")
    axes[4].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- the run
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


class _Watch:
    """Polls /v1/stats every second: applied rows and versions and the server's stall flag;
    measures how old the oldest unapplied publish is, and flags ``failure`` the moment rows have waited with
    nothing applied for ``max_no_apply_s``."""

    def __init__(self, http_port: int, model: str, published: deque[tuple[int, float]], max_no_apply_s: float,
                 on_failure: threading.Event) -> None:
        self.url = f"http://127.0.0.1:{http_port}/v1/stats"
        self.key = f"{model}.{TABLE}"
        self.model = model
        self.published = published
        self.max_no_apply_s = max_no_apply_s
        self.on_failure = on_failure
        self.rows_applied = 0
        self.max_staleness = 0.0  # since the last take()
        self.server_stalled = False  # since the last take()
        self.failure: str | None = None
        self._progress_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-watch", daemon=True)

    def start(self) -> _Watch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def take(self) -> tuple[float, bool]:
        """(max staleness, server flagged a stall) since the last call."""
        out = (self.max_staleness, self.server_stalled)
        self.max_staleness, self.server_stalled = 0.0, False
        return out

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.wait(1.0):
                try:
                    stats = http.get(self.url).json()
                except (httpx.HTTPError, ValueError):
                    continue
                self._observe(stats, time.monotonic())

    def observe_now(self) -> None:
        """One more /v1/stats read, now, once stopped (the thread reads once a second: its last read may miss the last
        batch)."""
        try:
            self._observe(httpx.get(self.url, timeout=10).json(), time.monotonic())
        except (httpx.HTTPError, ValueError):
            pass

    def memory(self) -> tuple[float, float]:
        """(memtables, block-cache usage) in MiB of the owner's RocksDB and the workers' secondary instances (each
        replays the WAL into memtables of its own), asked now (so they match a PSS read at the same moment); NaN
        when the server does not answer in time."""
        try:
            stats = httpx.get(self.url, timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return float("nan"), float("nan")
        persistent = stats["models"][self.model]["tables"][TABLE]["persistent"]
        workers = stats.get("node", {}).get("workers", [])
        memtables = float(persistent.get("memtable_bytes", 0.0)) + sum(w.get("memtable_bytes", 0) for w in workers)
        cache = float(persistent.get("block_cache_bytes", 0.0)) + sum(w.get("block_cache_bytes", 0) for w in workers)
        return memtables / _MiB, cache / _MiB

    def _observe(self, stats: dict[str, Any], now: float) -> None:
        updates = stats.get("updates", {})
        applied = int(updates.get("rows_received", 0))
        if applied > self.rows_applied:
            self.rows_applied, self._progress_at = applied, now
        self.server_stalled |= bool(updates.get("stall", {}).get("stalled"))
        version = int(updates.get("last_version", {}).get(self.key, 0))
        while self.published and self.published[0][0] <= version:
            self.published.popleft()
        waiting_since = self.published[0][1] if self.published else None
        if waiting_since is None:
            return
        self.max_staleness = max(self.max_staleness, now - waiting_since)
        stuck = now - max(self._progress_at, waiting_since)
        if stuck >= self.max_no_apply_s and self.failure is None:
            self.failure = (f"no update applied for {stuck:.0f} s while published rows waited (applied up to "
                            f"version {version}, {self.rows_applied} rows)")
            self.on_failure.set()


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
        watch: _Watch | None = None
        try:
            with HPSClient(target, timeout=30) as client:
                _wait(lambda: httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=2).status_code == 200, 120,
                      "the server to be ready")

                def all_initial_served() -> bool:
                    return all((served_versions(k, client.lookup(model, TABLE, k)) >= 1).all()
                               for k in np.array_split(all_keys, max(1, keys // 10_000)))

                _wait(all_initial_served, 120, "the initial rows to be served")
            watch = _Watch(http_port, model, published, limits.max_no_apply_s, stop).start()

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

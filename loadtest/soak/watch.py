"""What the soak watches while it runs: the server's /v1/stats (applied rows, stalls, staleness, RocksDB memory)
and the processes' memory and CPU."""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx

from hps_service.runtime.processes import process_tree, pss_bytes
from loadtest.harness.loadgen import process_cpu_s

TABLE = "item"
_MiB = 2**20


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


class Watch:
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

    def start(self) -> Watch:
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

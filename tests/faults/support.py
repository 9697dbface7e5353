"""Shared by the fault, shutdown and soak tests: a lookup load loop with latency and error records, readiness
polling, RSS of a process, and deterministic rows that encode their key and version."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from hps_service.client import HPSClient
from hps_service.errors import HPSError


def rows_for(keys: np.ndarray, version: int, dim: int) -> np.ndarray:
    """Rows that encode key and version, so a served row tells which write it came from."""
    base = (np.asarray(keys, dtype=np.float64) * 1e-3 + version).astype(np.float32)
    return base[:, None] + np.arange(dim, dtype=np.float32)[None, :] * np.float32(1e-4)


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def readyz(http_port: int, scheme: str = "http", **kwargs: object) -> tuple[int, dict]:
    """(status, body) of /readyz."""
    r = httpx.get(f"{scheme}://127.0.0.1:{http_port}/readyz", timeout=5, **kwargs)  # type: ignore[arg-type]
    return r.status_code, r.json()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll until ``predicate()`` is true; TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def percentiles_ms(latencies: list[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds."""
    if not latencies:
        return float("nan"), float("nan")
    arr = np.asarray(latencies) * 1e3
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


@dataclass
class LookupLoad:
    """Lookups of random batches of ``keys`` in a thread; each answer is checked against ``expected(keys)``.

    ``phase`` labels each request's latency, so a test can compare before / during / after a fault.
    """

    target: str
    model: str
    table: str
    keys: np.ndarray
    expected: Callable[[np.ndarray], np.ndarray]
    batch: int = 256
    phase: str = "before"
    latencies: dict[str, list[float]] = field(default_factory=dict)
    sources: dict[str, list[np.ndarray]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    wrong_rows: int = 0
    requests: int = 0
    client_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lookup-load", daemon=True)

    def _run(self) -> None:
        rng = np.random.default_rng(0)
        with HPSClient(self.target, timeout=10, retries=0, **self.client_kwargs) as client:
            try:  # untimed warm-up: the server's first lookup compiles its kernels
                client.lookup(self.model, self.table, self.keys[: self.batch])
            except HPSError as exc:
                self.errors.append(f"warm-up: {exc}")
            while not self._stop.is_set():
                keys = rng.choice(self.keys, size=min(self.batch, self.keys.size), replace=False)
                phase = self.phase
                t0 = time.perf_counter()
                try:
                    answer = client.lookup_with_sources(self.model, self.table, keys)
                except HPSError as exc:
                    self.errors.append(f"{phase}: {exc}")
                    continue
                self.latencies.setdefault(phase, []).append(time.perf_counter() - t0)
                self.sources.setdefault(phase, []).append(answer.sources.copy())
                self.requests += 1
                if not np.array_equal(answer.vectors, self.expected(keys)):
                    self.wrong_rows += 1

    def start(self) -> LookupLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def report(self) -> str:
        """One line per phase: requests, p50 and p99 latency."""
        lines = []
        for phase, lat in self.latencies.items():
            p50, p99 = percentiles_ms(lat)
            lines.append(f"{phase}: {len(lat)} lookups, p50 {p50:.2f} ms, p99 {p99:.2f} ms")
        return "; ".join(lines)

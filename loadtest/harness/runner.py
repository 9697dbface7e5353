"""One load-generator worker process: an asyncio loop driving one backend closed-loop (N calls in flight) or
open-loop (a target rate, each call timed from its intended send time so a slow server cannot hide its
queueing: no coordinated omission).

Workers are started with the ``spawn`` method (gRPC does not survive ``fork``), build their pools, report
ready, and all start at one instant the parent picks on the system-wide monotonic clock.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from array import array
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from hps_service.errors import InvalidArgumentError
from loadtest.harness.drivers import CLIENT_ERROR, Driver, GrpcLookupDriver
from loadtest.harness.workload import Distribution, KeySampler, load_keys, pool_size

Mode = Literal["closed", "open"]
Backend = Literal["grpc", "redis"]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker needs (picklable)."""

    backend: Backend
    target: str  # grpc: host:port; redis: a seed master host:port
    model: str
    tables: tuple[str, ...]
    batch: int
    mode: Mode
    concurrency: int  # closed loop: calls in flight in this worker
    qps: float  # open loop: this worker's share of the target rate
    duration_s: float  # from the common start, warm-up included
    seed: int
    keys_file: str | None = None
    key_range: int | None = None
    distribution: Distribution = "zipf"
    alpha: float = 1.05
    dim: int = 64  # redis: row width
    timeout_s: float = 10.0
    channels: int = 1  # grpc: connections to the target (a node's workers each take some of them)
    max_outstanding: int = 2048  # open loop: sends beyond this many unanswered calls are dropped and counted

    def validate(self) -> None:
        if self.batch < 1:
            raise InvalidArgumentError(f"batch must be >= 1, got {self.batch}")
        if self.mode not in ("closed", "open"):
            raise InvalidArgumentError(f"mode must be 'closed' or 'open', got {self.mode!r}")
        if self.mode == "closed" and self.concurrency < 1:
            raise InvalidArgumentError(f"closed loop needs concurrency >= 1, got {self.concurrency}")
        if self.mode == "open" and not self.qps > 0:
            raise InvalidArgumentError(f"open loop needs a target rate > 0, got {self.qps}")
        if self.duration_s <= 0:
            raise InvalidArgumentError(f"duration must be > 0, got {self.duration_s}")


@dataclass
class Samples:
    """Per call: intended start (s after the common start), latency (s), status, keys answered, cache hits."""

    start: array = field(default_factory=lambda: array("d"))
    latency: array = field(default_factory=lambda: array("d"))
    status: array = field(default_factory=lambda: array("h"))
    keys: array = field(default_factory=lambda: array("i"))
    hits: array = field(default_factory=lambda: array("i"))
    dropped: int = 0
    cpu_s: float = 0.0  # this worker's CPU time (user + system) from the common start to its last answer

    def add(self, start: float, latency: float, status: int, keys: int, hits: int) -> None:
        self.start.append(start)
        self.latency.append(latency)
        self.status.append(status)
        self.keys.append(keys)
        self.hits.append(hits)

    def as_arrays(self) -> dict[str, Any]:
        return {
            "start": np.frombuffer(self.start, dtype=np.float64).copy(),
            "latency": np.frombuffer(self.latency, dtype=np.float64).copy(),
            "status": np.frombuffer(self.status, dtype=np.int16).copy(),
            "keys": np.frombuffer(self.keys, dtype=np.int32).copy(),
            "hits": np.frombuffer(self.hits, dtype=np.int32).copy(),
            "dropped": self.dropped,
            "cpu_s": self.cpu_s,
        }


def make_driver(spec: WorkerSpec) -> Driver:
    """The backend client of ``spec`` with its pool of batches drawn."""
    keys = load_keys(spec.keys_file, spec.key_range)
    sampler = KeySampler(keys, spec.distribution, spec.alpha)
    n_tables = len(spec.tables)
    pool = sampler.pool(pool_size(spec.batch, n_tables), spec.batch * n_tables, spec.seed)
    if spec.backend == "grpc":
        return GrpcLookupDriver(spec.target, spec.model, list(spec.tables), pool, spec.timeout_s, spec.channels)
    if spec.backend == "redis":
        from loadtest.harness.redis_baseline import RedisMgetDriver, cluster_layout, validate_single_table

        validate_single_table(list(spec.tables))
        return RedisMgetDriver(cluster_layout(spec.target), pool, spec.dim, spec.timeout_s)
    raise InvalidArgumentError(f"unknown backend {spec.backend!r}")


async def _timed(driver: Driver, i: int, t0: float, intended: float, samples: Samples) -> None:
    try:
        result = await driver.call(i)
        status, keys, hits = result.status, result.keys, result.cache_hits
    except Exception:  # noqa: BLE001 - any client-side failure is one counted error, not a dead worker
        status, keys, hits = CLIENT_ERROR, 0, -1
    samples.add(intended - t0, time.monotonic() - intended, status, keys, hits)


async def closed_loop(driver: Driver, spec: WorkerSpec, t0: float, samples: Samples) -> None:
    """``spec.concurrency`` callers, each sending its next batch as soon as the last one is answered."""
    end = t0 + spec.duration_s
    counter = iter(range(spec.seed * 7919, 1 << 62))

    async def caller() -> None:
        while True:
            now = time.monotonic()
            if now >= end:
                return
            await _timed(driver, next(counter), t0, now, samples)

    await asyncio.gather(*(caller() for _ in range(spec.concurrency)))


async def open_loop(driver: Driver, spec: WorkerSpec, t0: float, samples: Samples) -> None:
    """Sends at ``spec.qps`` on a fixed schedule (phase-shifted per worker); latency counts from the schedule."""
    interval = 1.0 / spec.qps
    phase = (spec.seed % 1000) / 1000.0 * interval
    n_sends = int((spec.duration_s - phase) * spec.qps)
    pending: set[asyncio.Task] = set()
    for k in range(n_sends):
        intended = t0 + phase + k * interval
        delay = intended - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(pending) >= spec.max_outstanding:
            samples.dropped += 1
            continue
        task = asyncio.ensure_future(_timed(driver, spec.seed * 7919 + k, t0, intended, samples))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.gather(*pending)


async def _run(spec: WorkerSpec, driver: Driver, announce: Any, wait_start: Any) -> Samples:
    await driver.open()
    try:
        await driver.call(0)  # connection and first-call costs stay out of the numbers
        announce()
        t0 = await asyncio.get_running_loop().run_in_executor(None, wait_start)
        delay = t0 - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        samples = Samples()
        cpu0 = time.process_time()
        if spec.mode == "closed":
            await closed_loop(driver, spec, t0, samples)
        else:
            await open_loop(driver, spec, t0, samples)
        samples.cpu_s = time.process_time() - cpu0
        return samples
    finally:
        await driver.close()


def worker_main(spec: WorkerSpec, ready: Any, start: Any, results: Any, worker_id: int) -> None:
    """Process entry: build the driver, connect, make one call, say ready, run from the common start, send back
    the samples."""
    announced = False

    def announce() -> None:
        nonlocal announced
        ready.put((worker_id, None))
        announced = True

    def wait_start() -> float:
        start["event"].wait()
        return float(start["t0"].value)

    try:
        spec.validate()
        driver = make_driver(spec)
        samples = asyncio.run(_run(spec, driver, announce, wait_start))
        results.put((worker_id, samples.as_arrays(), None))
    except BaseException:  # noqa: BLE001 - the parent reports the worker's error
        message = traceback.format_exc()
        if not announced:
            ready.put((worker_id, message))
        results.put((worker_id, None, message))

"""Prometheus metrics of one server: request counters and latency histograms, plus a collector over engine stats.

Request metrics live in a per-server CollectorRegistry (so several servers in one process stay apart). Tier and
cache figures are not counted twice: a custom collector reads ``Engine.table_stats`` at scrape time, the one
source of truth that ``/v1/stats`` also shows. ``/metrics`` serves this registry followed by the default registry,
which holds the process metrics and the update consumer's series.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from hps_service import __version__
from hps_service.engine import LEVELS
from hps_service.engine.api import Engine
from hps_service.server.version_metrics import VersionCollector
from hps_service.shm.counters import (
    KEYS_BUCKETS,
    LATENCY_BUCKETS,
    METHOD_INDEX,
    REQ_FIELDS,
    STATUS_INDEX,
    RequestCounters,
    new_counters,
    request_totals,
)

log = logging.getLogger(__name__)

_UNKNOWN = STATUS_INDEX["UNKNOWN"]


#: The method a pooled request of a method is counted under.
_POOLED = {METHOD_INDEX[plain]: METHOD_INDEX[pooled] for plain, pooled in (
    ("Lookup", "LookupBags"), ("StreamLookup", "StreamLookupBags"), ("RestLookupEmbeddings", "RestLookupBags"))}


class RequestTimer:
    """Counts and times one request in its thread's counter row, as a context manager whose value is the request's
    status (``[name, pooled]``: OK unless the body says otherwise, UNKNOWN when it raises without saying; a pooled
    request, marked so by the body, is counted under its method's pooled twin, e.g. LookupBags). A class rather
    than a generator: it is entered on every lookup."""

    __slots__ = ("_counters", "_method", "_row", "_start", "status")

    def __init__(self, counters: RequestCounters, method: int) -> None:
        self._counters = counters
        self._method = method
        self.status: list[Any] = ["OK", False]

    def __enter__(self) -> list[Any]:
        self._row = self._counters.begin()
        self._start = time.perf_counter()
        return self.status

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is not None and self.status[0] == "OK":
            self.status[0] = grpc.StatusCode.UNKNOWN.name
        method = _POOLED[self._method] if self.status[1] else self._method
        self._counters.finish(self._row, method, STATUS_INDEX.get(self.status[0], _UNKNOWN),
                              time.perf_counter() - self._start)


class EngineCollector(Collector):
    """Per table and tier hits, misses, rows, capacity and evictions, read from the engine at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # series depend on the models loaded at scrape time

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "table", "tier"]
        hits = CounterMetricFamily("hps_tier_hits", "Keys answered by a tier, per table", labels=labels)
        misses = CounterMetricFamily("hps_tier_misses", "Keys a tier was asked for and did not hold", labels=labels)
        rows = GaugeMetricFamily("hps_tier_rows", "Rows held by a tier for a table", labels=labels)
        evictions = CounterMetricFamily("hps_tier_evictions", "Rows evicted by a bounded tier", labels=labels)
        defaults = CounterMetricFamily(
            "hps_default_vectors", "Keys answered with the table default (stored nowhere)", labels=["model", "table"]
        )
        cache_rows = GaugeMetricFamily("hps_cache_rows", "Rows in the L1 embedding cache", labels=["model", "table"])
        cache_capacity = GaugeMetricFamily(
            "hps_cache_capacity_rows", "Capacity of the L1 embedding cache in rows", labels=["model", "table"]
        )
        cache_evictions = CounterMetricFamily(
            "hps_cache_evictions", "Rows evicted from the L1 embedding cache", labels=["model", "table"]
        )
        refused = CounterMetricFamily(
            "hps_cache_admission_refused", "Missed keys kept out of a full L1 (not missed often enough lately)",
            labels=["model", "table"],
        )
        queue = GaugeMetricFamily(
            "hps_cache_promotion_queue_depth",
            "Rows (not offers) waiting for deferred insertion into L1: queued for the worker or grouped for admission",
            labels=["model", "table"],
        )
        cache_memory = GaugeMetricFamily(
            "hps_cache_memory_bytes", "Memory held by the L1 cache's arrays (device memory on the CUDA backend)",
            labels=["model", "table", "backend"],
        )
        for model in self.engine.models():
            for tc in model.tables:
                try:
                    stats = self.engine.table_stats(model.name, tc.name)
                except Exception:  # a model unloaded during the scrape, or a tier failing its stats call
                    log.debug("stats of %s.%s unavailable for /metrics", model.name, tc.name, exc_info=True)
                    continue
                for level in LEVELS:
                    entry = stats[level]
                    if not entry.get("enabled", True):
                        continue
                    lv = [model.name, tc.name, level]
                    hits.add_metric(lv, float(entry["hits"] or 0))
                    misses.add_metric(lv, float(entry["misses"] or 0))
                    rows.add_metric(lv, float(entry["rows"] or 0))
                    evictions.add_metric(lv, float(entry["evictions"] or 0))
                mt = [model.name, tc.name]
                defaults.add_metric(mt, float(stats["default"]["hits"] or 0))
                cache = stats["cache"]
                if cache.get("enabled"):
                    cache_rows.add_metric(mt, float(cache["rows"] or 0))
                    cache_capacity.add_metric(mt, float(cache["capacity"] or 0))
                    cache_evictions.add_metric(mt, float(cache["evictions"] or 0))
                    refused.add_metric(mt, float(cache.get("admission_refused") or 0))
                    depth = cache.get("queued_rows")
                    if depth is not None:
                        queue.add_metric(mt, float(depth))
                    memory = cache.get("memory_bytes")
                    if memory is not None:
                        cache_memory.add_metric([*mt, str(cache.get("backend", ""))], float(memory))
        label_version = GaugeMetricFamily(
            "hps_model_label_version", "The model version each label names (0: the model as configured)",
            labels=["model", "label"],
        )
        for name, named in self.engine.labels.current().items():
            for label, version in named.items():
                label_version.add_metric([name, label], float(version))
        yield from (hits, misses, rows, evictions, defaults, cache_rows, cache_capacity, cache_evictions, refused,
                    queue, cache_memory, label_version)


class RequestCollector(Collector):
    """``hps_lookup_requests_total``, ``hps_lookup_latency_seconds``, ``hps_lookup_keys``, ``hps_lookup_bags`` and
    ``hps_lookup_in_flight``, summed at scrape time over every process and thread that counted (see
    :mod:`hps_service.shm.counters`)."""

    def __init__(self, counters: RequestCounters) -> None:
        self.counters = counters

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        data = request_totals(self.counters.totals())
        requests = CounterMetricFamily("hps_lookup_requests", "Lookup requests by method and final status",
                                       labels=["method", "status"])
        for (method, status), value in sorted(data["requests"].items()):
            requests.add_metric([method, status], value)
        latency = HistogramMetricFamily("hps_lookup_latency_seconds", "Server-side lookup latency by method",
                                        labels=["method"])
        bounds = [*(str(b) for b in LATENCY_BUCKETS), "+Inf"]
        for method, (cumulative, total) in sorted(data["latency"].items()):
            latency.add_metric([method], list(zip(bounds, (float(c) for c in cumulative))), total)
        keys_cumulative, keys_sum = data["keys"]
        keys = HistogramMetricFamily("hps_lookup_keys", "Keys per lookup request (all tables)")
        keys.add_metric([], list(zip([*(str(b) for b in KEYS_BUCKETS), "+Inf"], (float(c) for c in keys_cumulative))),
                        keys_sum)
        in_flight = GaugeMetricFamily("hps_lookup_in_flight", "Lookup requests being served")
        in_flight.add_metric([], data["in_flight"])
        queue_cumulative, queue_sum = data["queue_wait"]
        queue = HistogramMetricFamily("hps_grpc_queue_wait_seconds",
                                      "Time a gRPC call waited for a handler thread after it arrived")
        queue.add_metric([], list(zip(bounds, (float(c) for c in queue_cumulative))), queue_sum)
        bags_cumulative, bags_sum = data["bags"]
        bags = HistogramMetricFamily("hps_lookup_bags", "Bags per pooled lookup request (all tables)")
        bags.add_metric([], list(zip([*(str(b) for b in KEYS_BUCKETS), "+Inf"], (float(c) for c in bags_cumulative))),
                        bags_sum)
        yield from (requests, latency, keys, in_flight, queue, bags)


class ServerMetrics:
    """The request metrics of one process (or of a node: its counters are shared by the owner and its workers)
    and the registry that exposes them with the engine's figures. Counting costs a few array updates in the
    calling thread's own row: no lock, no Prometheus client object on the request path."""

    def __init__(self, engine: Engine | None, counters: RequestCounters | None = None) -> None:
        self.counters = counters if counters is not None else RequestCounters(new_counters(1, REQ_FIELDS), 0)
        self.registry = CollectorRegistry()
        self.registry.register(RequestCollector(self.counters))
        build = Gauge("hps_build_info", "The hps-service version this process runs (always 1)", ["version"],
                      registry=self.registry)
        build.labels(__version__).set(1)
        if engine is not None:
            self.registry.register(EngineCollector(engine))
            self.registry.register(VersionCollector(engine))

    def queue_wait(self, seconds: float) -> None:
        """Count how long a gRPC call waited for a handler thread (see :class:`hps_service.server.grpc_server.HandlerPool`)."""
        self.counters.observe_queue_wait(seconds)

    def observe(self, method: str) -> RequestTimer:
        """Time one request (``with metrics.observe("Lookup") as status``); the body sets ``status[0]`` to the gRPC
        status name (OK unless it says otherwise)."""
        return RequestTimer(self.counters, METHOD_INDEX[method])

    def observe_keys(self, n: int) -> None:
        """Count the keys of one request."""
        self.counters.observe_keys(n)

    def observe_bags(self, n: int) -> None:
        """Count the bags of one pooled request."""
        self.counters.observe_bags(n)

    def requests_served(self, method: str, status: str = "OK") -> float:
        """Requests of ``method`` that ended with ``status`` so far, summed over every process."""
        requests: dict[tuple[str, str], float] = request_totals(self.counters.totals())["requests"]
        return requests.get((method, status), 0.0)

    def render(self) -> bytes:
        """The Prometheus text exposition: this server's registry, then the process-wide default registry."""
        return generate_latest(self.registry) + generate_latest(REGISTRY)

"""One gRPC worker process of a node: maps the shared store and serves the gRPC port beside its siblings.

It binds the node's port with SO_REUSEPORT (the kernel spreads new connections over the workers), answers
lookups with :class:`WorkerEngine`, reports SERVING in gRPC health only while the owner's store says so, and
exits when the owner is gone (the owner's lock on the store is released however it dies) or on SIGTERM, after
draining its calls.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from grpc_health.v1 import health_pb2

from hps_service.config import HPSConfig
from hps_service.errors import UnavailableError
from hps_service.fleet.sharding import ShardMap
from hps_service.node.store import layout
from hps_service.node.store import node_store as ns
from hps_service.node.store.view import StoreView
from hps_service.node.worker_engine import WorkerEngine
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.runtime.gate import ServingGate
from hps_service.runtime.heap import HeapTrimmer
from hps_service.runtime.logs import setup_logging
from hps_service.server.call_tracing import flush_spans
from hps_service.server.grpc_server import build_grpc_server
from hps_service.server.grpc_service import EmbeddingServicer
from hps_service.server.health import HealthServicer
from hps_service.server.metrics import ServerMetrics
from hps_service.server.native_front import serve_behind
from hps_service.server.tls import grpc_server_credentials
from hps_service.shm.counters import RequestCounters

log = logging.getLogger(__name__)

#: How often a worker follows the owner's state (gRPC health) and checks that the owner is alive, and how often a
#: lookup checks it too (a few system calls, at most every 2 ms).
STATE_POLL_S, OWNER_POLL_S, OWNER_CHECK_S = 0.02, 0.1, 0.002
#: How often a worker writes its memory figures and dropped admissions into its status row.
REPORT_S = 1.0
_PR_SET_PDEATHSIG = 1


class StoreGate(ServingGate):
    """Lookups are accepted while the owner's store says SERVING, the owner is alive (checked at most every
    ``OWNER_CHECK_S`` on the request path: a worker never answers for long after its owner died, whatever kills
    it) and this worker is not draining."""

    def __init__(self, view: StoreView) -> None:
        super().__init__()
        self._header = view.header
        self._lock_path = view.path / layout.LOCK
        self._checked = 0.0
        self.owner_gone = False

    def check(self) -> None:
        state = int(self._header[layout.H_STATE])
        if state != layout.SERVING or not self.is_open:
            raise UnavailableError(self.reason if not self.is_open else f"the server is {layout.STATE_NAMES[state]}")
        if not self.owner_running():
            raise UnavailableError(self.reason)

    def owner_running(self, *, now: bool = False) -> bool:
        """Whether the owner still holds the store (looked at most every ``OWNER_CHECK_S``, or ``now``); once it is
        gone, this gate stays closed."""
        if self.owner_gone:
            return False
        t = time.monotonic()
        if now or t - self._checked > OWNER_CHECK_S:
            self._checked = t
            if not layout.owner_alive(self._lock_path):
                self.owner_gone = True
                self.close("the server's owner process is gone")
        return not self.owner_gone


class _ClusterInfo:
    """GetClusterInfo as the owner last published it (it judges readiness), re-read at most every 0.2 s."""

    def __init__(self, view: StoreView, shard_map: ShardMap) -> None:
        self._view = view
        m = shard_map
        self._info: dict[str, Any] = {"shards": m.shards, "shard": m.shard, "partitions": m.partitions,
                                      "partitioner": "murmur2", "owned_partitions": m.owned_partitions(),
                                      "ready": False, "not_ready": ["the server is starting"]}
        self._read_at = 0.0

    def __call__(self) -> dict[str, Any]:
        now = time.monotonic()
        if now - self._read_at > 0.2:
            self._info = self._view.read_json(layout.CLUSTER_INFO, self._info)
            self._read_at = now
        return self._info


def _die_with_parent() -> None:
    """SIGKILL this process when its parent (the fork server, which exits the moment the owner dies) dies (Linux): a
    worker whose owner is gone stops answering at once (its clients retry on other replicas), instead of serving
    rows nobody updates any more. The owner's lock (checked every ``OWNER_POLL_S``) is the fallback."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def worker_main(config: HPSConfig, store_path: str, worker: int, port: int, wake: Any, log_level: int) -> None:
    """Process entry (forked from the fork server)."""
    gc.freeze()  # the fork server's objects stay shared: the collector never writes to their pages
    faulthandler.enable()  # a crash leaves its Python stack in the log before the owner restarts the worker
    _die_with_parent()
    setup_logging(log_level, config.server.log_format,
                  text_format=f"%(asctime)s %(levelname)s %(name)s[worker {worker}]: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the owner decides
    view = StoreView(Path(store_path), writable=True)
    status = view.workers()
    try:
        engine = WorkerEngine(config, view, worker, wake)
        gate = StoreGate(view)
        gate.open()
        metrics = ServerMetrics(None, RequestCounters(view.requests(), worker + 1))
        health_servicer = FollowingHealth(view, engine, gate)
        shard_map = ShardMap.from_config(config.cluster)
        servicer = EmbeddingServicer(engine, config.server, gate, metrics, shard_map, _ClusterInfo(view, shard_map))
        serving = build_grpc_server(config, servicer, health_servicer, reuseport=True, role=f"worker-{worker}")
        server = serving.server
        address = f"{config.server.host}:{port}"
        tls = config.server.tls
        if config.server.front == "native":
            bound = serve_behind(serving, config, servicer, address)
        else:
            bound = (server.add_secure_port(address, grpc_server_credentials(tls)) if tls is not None
                     else server.add_insecure_port(address))
        if bound != port:
            raise UnavailableError(f"worker {worker} cannot bind gRPC to {address}")
        server.start()
        if serving.front is not None:
            serving.front.start()
    except Exception:
        log.exception("gRPC worker %d failed to start", worker)
        status[worker, ns.W_STATE] = ns.W_FAILED
        sys.exit(3)
    status[worker, ns.W_STATE] = ns.W_READY
    trimmer = HeapTrimmer(config.server.heap_trim_interval_s)
    trimmer.watch(lambda: int(status[worker, ns.W_MEMTABLE_BYTES]))  # as _report last read it
    trimmer.start()
    _serve(view, health_servicer, stop, gate, partial(_report, status[worker], engine))
    trimmer.stop()
    health_servicer.enter_graceful_shutdown()
    serving.drain_and_stop(gate, config.server.grace_period_s)
    engine.close()
    status[worker, ns.W_STATE] = ns.W_STOPPED
    log.debug("gRPC worker %d stopped", worker)
    flush_spans()
    # Leave without interpreter teardown: the fork server's inherited state is not ours to finalise.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class FollowingHealth(HealthServicer):
    """gRPC health of a worker: what the owner answers (it judges readiness: tiers, updates caught up, per model),
    as it last published it, and NOT_SERVING while the store is not SERVING (starting, draining). Brought up to date
    by every Check (so it agrees with the REST call that just returned) and by the worker's poll."""

    def __init__(self, view: StoreView, engine: WorkerEngine, gate: StoreGate) -> None:
        super().__init__()
        self._view = view
        self._engine = engine
        self._gate = gate
        self._shown: dict[str, int] = {}
        self._statuses: dict[str, int] = {}  # the owner's statuses as last read, and the publication they came from
        self._published = -1
        self._follow_lock = threading.Lock()  # HealthServicer has its own _lock
        self._service = pb.DESCRIPTOR.services_by_name["EmbeddingService"].full_name

    def follow(self) -> None:
        with self._follow_lock:
            self._engine.sync()
            published = int(self._view.header[layout.H_HEALTH])
            if published != self._published:  # read the file only when the owner replaced it (polled 50 times a second)
                self._statuses = dict(self._view.read_json(layout.HEALTH, {}))
                self._published = published
            statuses = dict(self._statuses)
            # An owner killed without a word leaves the store saying SERVING: its lock tells (a worker outlives it
            # by up to OWNER_POLL_S, and a probe in that time must not see a server that is gone as serving).
            if int(self._view.header[layout.H_STATE]) != layout.SERVING or not self._gate.owner_running(now=True):
                statuses = {name: health_pb2.HealthCheckResponse.NOT_SERVING for name in statuses or ("", self._service)}
            # The owner publishes a model it unloaded as NOT_SERVING once, then leaves it out: a publish this worker
            # did not see must not leave the model SERVING here.
            for name in self._shown.keys() - statuses.keys():
                statuses[name] = health_pb2.HealthCheckResponse.NOT_SERVING
            for name, status in statuses.items():
                if self._shown.get(name) != status:
                    self.set(name, status)
            self._shown = statuses

    def Check(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method name
        try:
            self.follow()
        except Exception:  # answer from the last state followed
            log.debug("health follow failed", exc_info=True)
        return super().Check(request, context)

    def Watch(self, request: Any, context: Any, send_response_callback: Any = None) -> Any:  # noqa: N802
        """A watch starts from what the owner published last, not from this worker's last poll: a client balancing
        on ``accepting`` that connects right after the server said it started must not see this worker unknown."""
        try:
            self.follow()
        except Exception:  # answer from the last state followed
            log.debug("health follow failed", exc_info=True)
        return super().Watch(request, context, send_response_callback)


def _report(row: np.ndarray, engine: WorkerEngine) -> None:
    """Write what the owner reports of this worker (``/v1/stats`` node, ``/metrics``) into its status row."""
    memory = engine.memory_bytes()
    row[ns.W_MEMTABLE_BYTES] = memory["memtables"]
    row[ns.W_BLOCK_CACHE_BYTES] = memory["block_cache"]
    row[ns.W_ADMISSIONS_DROPPED] = engine.dropped


def _serve(view: StoreView, health_servicer: FollowingHealth, stop: threading.Event, gate: StoreGate,
           report: Callable[[], None]) -> None:
    """Follow the owner's state and models in gRPC health until SIGTERM or the owner's death; ``report`` every
    ``REPORT_S``."""
    next_owner_check = next_report = 0.0
    while not stop.wait(STATE_POLL_S):
        now = time.monotonic()
        if now >= next_report:
            next_report = now + REPORT_S
            try:
                report()
            except Exception:  # a figure is missed (the secondary being reopened): the next report has it
                log.debug("status report failed", exc_info=True)
        if gate.owner_gone or now >= next_owner_check:
            next_owner_check = now + OWNER_POLL_S
            if gate.owner_gone or not layout.owner_alive(view.path / layout.LOCK):
                log.error("the owner process is gone; this worker exits with it")
                os._exit(1)  # no drain: nobody updates these rows any more, clients retry elsewhere
        try:
            health_servicer.follow()
        except Exception:  # a manifest caught mid-replacement: read again on the next poll
            log.debug("manifest reload failed", exc_info=True)

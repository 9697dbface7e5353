"""The hps-service process: builds tiers and the engine from config, serves gRPC and the REST admin API, drains on
SIGTERM."""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2

from hps_service.admin.checkpoints import DirectoryStore
from hps_service.admin.jobs import JobRunner
from hps_service.admin.snapshots import Snapshots
from hps_service.config import HPSConfig
from hps_service.engine.api import Engine
from hps_service.errors import UnavailableError
from hps_service.fleet.admin_writes import LogWriter
from hps_service.fleet.bootstrap import BootstrapProgress, bootstrap
from hps_service.fleet.bucket import SnapshotBucket
from hps_service.fleet.registrations import sync_registrations
from hps_service.fleet.repository import RepositoryPoller
from hps_service.fleet.services import FleetServices
from hps_service.fleet.sharding import ShardMap
from hps_service.fleet.snapshots import BucketStore
from hps_service.jit.warmup import warm_all
from hps_service.runtime.gate import DRAINING, ServingGate
from hps_service.runtime.heap import HeapTrimmer
from hps_service.serve import readiness
from hps_service.serve.build import build_engine, snapshots_root, staging_root
from hps_service.serve.unix_socket import UnixSocket, bind_unix_socket
from hps_service.server.call_tracing import admin_app
from hps_service.server.grpc_server import (  # noqa: F401  (message_limits re-exported)
    ServingGrpc,
    build_grpc_server,
    message_limits,
)
from hps_service.server.grpc_service import EmbeddingServicer
from hps_service.server.health import HealthServicer
from hps_service.server.http_listener import HttpListener
from hps_service.server.metrics import ServerMetrics
from hps_service.server.probes import ProbeServer
from hps_service.server.rest import AdminContext, ReadinessCheck, SwitchableApp, create_starting_app
from hps_service.server.tls import grpc_server_credentials
from hps_service.shm.permissions import local_access
from hps_service.updates import UpdateConsumer
from hps_service.updates.message import topic_name

if TYPE_CHECKING:
    from hps_service.node.owner import NodeOwner

log = logging.getLogger(__name__)


class HPSServer:
    """One server process: the lookup engine behind gRPC (health checking, reflection) and the REST admin API."""

    def __init__(self, config: HPSConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.engine = engine
        self.shard_map = ShardMap.from_config(config.cluster)
        self.gate = ServingGate()
        self.health = HealthServicer()
        self._grpc: ServingGrpc | None = None
        self._uds: UnixSocket | None = None  # the owner's Unix domain socket, removed on stop
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.metrics: ServerMetrics | None = None
        self.jobs = JobRunner()
        #: Readiness checks added by other parts (the update consumer): each returns None or what is not ready.
        self.readiness: list[ReadinessCheck] = []
        #: Extra /v1/stats sections, e.g. ``{"updates": consumer.stats}``.
        self.stats_sections: dict[str, Callable[[], dict[str, Any]]] = {}
        self._http: HttpListener | None = None
        self._served_models: set[str] = set()
        self._health_lock = threading.Lock()
        self._health_shown: dict[str, int] = {}  # what the health service says now, set again only on a change
        self._stopped = threading.Event()
        self.consumer: UpdateConsumer | None = None
        self._consumer_lock = threading.Lock()
        self.bootstrap = BootstrapProgress()
        #: Snapshots in the bucket (persistent.snapshot_store): taken periodically, restored by recovery and REST.
        self.bucket_snapshots: Snapshots[BucketStore] | None = None
        self.fleet: FleetServices | None = None
        self.repository: RepositoryPoller | None = None
        self.log_writer: LogWriter | None = None
        self._app = SwitchableApp(create_starting_app(self.readiness_report))
        self._probes: ProbeServer | None = None
        self._health_stop = threading.Event()
        self._health_thread: threading.Thread | None = None
        self.node: NodeOwner | None = None
        self.heap_trimmer = HeapTrimmer(config.server.heap_trim_interval_s)
        self.stats_sections["heap"] = self._heap_stats

    def _heap_stats(self) -> dict[str, Any]:
        """/v1/stats "heap": what trimming the C heap gave back in this process (the owner)."""
        return {"trim_supported": self.heap_trimmer.supported, "trim_interval_s": self.heap_trimmer.interval_s,
                **asdict(self.heap_trimmer.stats)}

    def start(self) -> None:
        """Bootstrap an empty store from the snapshot store, open tiers, load models, bind the gRPC port, compile the
        kernels; lookups are accepted once this returns, and health says SERVING once the updates are caught up.

        With ``server.workers`` > 0 (the default: one per usable CPU) this process is the node's owner: the gRPC
        port is served by that many worker processes over the shared store (:mod:`hps_service.node`), and this
        one serves only the Unix domain socket (``server.uds_path``), REST and the update consumer. A server
        given an engine (tests, embedding) serves gRPC itself."""
        cfg = self.config.server
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        # TLS material is read before any tier opens, so a bad path fails fast and leaves nothing open.
        credentials = grpc_server_credentials(cfg.tls) if cfg.tls is not None else None
        # liveness and readiness (with bootstrap progress) answer from here on
        self._http = HttpListener(self._app, cfg.host, cfg.http_port, "REST port", cfg.tls)
        self.http_port = self._http.port
        try:
            if cfg.probe_port is not None:
                self._probes = ProbeServer(cfg.host, cfg.probe_port, self._app)
            # Ready means warm: nothing compiles on a request once health says SERVING (see hps_service.jit.warmup).
            # First, so that on a cold numba cache this process compiles once, saying so, and the tiers it opens and
            # the fork server of the workers then load the kernels instead of compiling them again.
            self.gate.close("compiling the lookup and update kernels")
            warm_all()
            self.gate.close("the server is starting")  # readiness says why until the gate opens, truthfully
            if self.engine is None:
                self._bootstrap()
                if cfg.worker_processes() > 0:
                    self._start_node()
                else:
                    self.engine = build_engine(self.config)
            self._start_grpc(credentials)
            assert self.engine is not None  # built above, by the node or in this process
            self._make_snapshotter()
            self.fleet = FleetServices(self.config, self.engine, self.models_changed, self._group(), self.not_ready)
            self.readiness.append(self.fleet.not_ready)
            self.stats_sections["registry"] = self.fleet.stats
            self._start_updates()  # first: an admin write answered before the log writer exists would bypass the log
            self._app.target = admin_app(self._admin_context())
            self.fleet.start()
            self._start_repository()
            if self.bucket_snapshots is not None:
                self.bucket_snapshots.start(self.config.persistent.snapshot_interval_s)
        except Exception:
            self._stop_listeners()
            if self._grpc is not None:
                self._grpc.server.stop(0)
            if self.node is not None:
                self.node.stop_workers(0)
                if self.engine is not None:
                    self.engine.close()
                self.node.close()
            raise
        self.gate.open()
        self.update_health()
        self._health_thread = threading.Thread(target=self._health_loop, name="hps-health", daemon=True)
        self._health_thread.start()
        engine = self.engine
        self.heap_trimmer.watch(lambda: engine.memory_bytes()["memtables"])
        self.heap_trimmer.start()
        if self.node is not None:
            self.node.publish_cluster_info(self.cluster_info)
        scheme = "TLS" if cfg.tls is not None else "plaintext"
        where = f"{len(self.node.supervisor.pids())} worker processes" if self.node is not None else "this process"
        log.info("gRPC listening on %s:%d (%s), REST admin on %s:%d (%s)", cfg.host, self.grpc_port, where, cfg.host,
                 self.http_port, scheme)
        self._log_degraded()

    def _start_grpc(self, credentials: grpc.ServerCredentials | None) -> None:
        """The gRPC server of this process: on the gRPC port (a node's workers serve it instead) and on the Unix
        domain socket when one is configured."""
        assert self.engine is not None
        cfg = self.config.server
        if self.metrics is None:
            self.metrics = ServerMetrics(self.engine)
        servicer = EmbeddingServicer(self.engine, cfg, self.gate, self.metrics, self.shard_map, self.cluster_info)
        serving = build_grpc_server(self.config, servicer, self.health)
        server = serving.server
        port = self.grpc_port
        if self.node is None:
            address = f"{cfg.host}:{cfg.grpc_port}"
            port = server.add_secure_port(address, credentials) if credentials is not None else \
                server.add_insecure_port(address)
            if port == 0:
                raise UnavailableError(f"cannot bind gRPC to {cfg.host}:{cfg.grpc_port}")
        uds = cfg.local_socket()
        if uds is not None:  # the colocated readers' group may connect, as it may map the store
            self._uds = bind_unix_socket(server, uds, local_access(cfg.local))
        server.start()
        self._grpc = serving
        self.grpc_port = port

    def _start_node(self) -> None:
        """Create the shared store, load the tables into it and start the gRPC worker processes on the port."""
        from hps_service.node.owner import NodeCollector, NodeOwner
        from hps_service.node.supervisor import WorkerProgram
        from hps_service.serve.worker import worker_main
        from hps_service.shm.counters import RequestCounters

        program = WorkerProgram(worker_main, preload="hps_service.serve.fork_preload")
        node = NodeOwner(self.config, logging.getLogger().getEffectiveLevel(), program)
        self.node = node
        self.gate = node.gate
        try:
            self.engine = node.build_engine()
            self.metrics = ServerMetrics(self.engine, RequestCounters(node.store.requests, 0))
            self.metrics.registry.register(NodeCollector(node))
            self.stats_sections["node"] = node.stats
            self.grpc_port = node.reserve_port()
            node.start_workers(self.grpc_port)
            self.readiness.append(node.workers_not_serving)
        except BaseException:
            node.stop_workers(0)
            if self.engine is not None:
                self.engine.close()
            node.close()
            self.node = self.engine = None  # cleaned up: start()'s handler must not close them again
            raise

    def _start_repository(self) -> None:
        """With ``repository`` configured: poll it for new versions (see :mod:`hps_service.fleet.repository`)."""
        if self.config.repository is None:
            return
        assert self.engine is not None
        self.repository = RepositoryPoller(self.config.repository, self.engine, self.models_changed,
                                           staging_root(self.config) / "repository", self.shard_map)
        self.stats_sections["repository"] = self.repository.stats
        self.repository.start()

    def _bootstrap(self) -> None:
        """An empty RocksDB with a snapshot store configured restores each model's newest complete snapshot."""
        pcfg = self.config.persistent
        if pcfg.type != "rocksdb" or pcfg.snapshot_store is None or pcfg.read_only:
            return
        bucket = SnapshotBucket.from_config(pcfg)
        bootstrap(Path(pcfg.path), bucket, [m.name for m in self.config.models], self.bootstrap)

    def _make_snapshotter(self) -> None:
        """With persistent.snapshot_store: the snapshot endpoints use it, and snapshots are taken periodically."""
        assert self.engine is not None
        pcfg = self.config.persistent
        if pcfg.type != "rocksdb" or pcfg.snapshot_store is None:
            return
        prefix = self.config.updates.topic_prefix
        store = BucketStore(SnapshotBucket.from_config(pcfg), snapshots_root(self.config),
                            lambda model: [topic_name(model, prefix)], retain=pcfg.snapshot_retain)
        # made here, not with the admin API: the update path's recovery of lost partitions restores from it too
        self.bucket_snapshots = Snapshots(
            self.engine, store,
            refuse=lambda model: self.consumer.lost_reason(model) if self.consumer is not None else None,
        )

    def _admin_context(self) -> AdminContext:
        assert self.engine is not None and self.metrics is not None and self.fleet is not None
        snapshots: Snapshots[Any] = (self.bucket_snapshots
                                     or Snapshots(self.engine, DirectoryStore(snapshots_root(self.config))))
        return AdminContext(
            engine=self.engine,
            config=self.config,
            metrics=self.metrics,
            gate=self.gate,
            jobs=self.jobs,
            snapshots=snapshots,
            readiness=self.readiness_report,
            stats_sections=self.stats_sections,
            registrations=self.fleet.registrations,
            log_writer=lambda: self.log_writer,
            shard_map=self.shard_map,
            cluster_info=self.cluster_info,
            import_staging=staging_root(self.config),
        )

    # ---- readiness ----------------------------------------------------------------------------
    def not_ready(self, model: str | None = None) -> list[str]:
        """Why the server (or one model) must not receive traffic (see :func:`readiness.not_ready`)."""
        return readiness.not_ready(self, model)

    def not_accepting(self, model: str | None = None) -> list[str]:
        """Why the server would not answer a call now (see :func:`readiness.not_accepting`)."""
        return readiness.not_accepting(self, model)

    def degraded(self) -> list[str]:
        """What is down without taking the replica out of the Service (see :func:`readiness.degraded`)."""
        return readiness.degraded(self)

    def readiness_report(self) -> tuple[list[str], dict[str, Any]]:
        """What /readyz and the probe port answer: the reasons, what is degraded, and the bootstrap's progress."""
        details: dict[str, Any] = {}
        if degraded := self.degraded():
            details["degraded"] = degraded
        if self.bootstrap.state != "idle":
            details["bootstrap"] = self.bootstrap.view()
        return self.not_ready(), details

    def update_health(self) -> None:
        """gRPC health: service "" and EmbeddingService SERVING only when the server is ready, each loaded model when
        it is (its updates caught up), NOT_SERVING for a model unloaded since; ``ACCEPTING_SERVICE`` SERVING while
        it takes calls (what clients balance on). A status is set when it changes: each set is an answer to every
        health Watch of the service."""
        if self.engine is None:
            return
        with self._health_lock:
            statuses, self._served_models = readiness.health_statuses(self, self._served_models)
            for name, status in statuses.items():
                if self._health_shown.get(name) != status:
                    self.health.set(name, status)
                    self._health_shown[name] = status
            if self.node is not None:  # the workers answer gRPC health as this process would
                self.node.publish_health(statuses)

    def _health_loop(self) -> None:
        while not self._health_stop.wait(0.2):
            try:
                self.update_health()
            except Exception:  # a readiness check that broke must not stop health updates for good
                log.warning("health update failed", exc_info=True)

    def cluster_info(self) -> dict[str, Any]:
        """The shard map and readiness (GetClusterInfo, GET /v1/cluster): the fields of hps.v1.ClusterInfo."""
        assert self.engine is not None
        m = self.shard_map
        consumer = self.consumer
        not_ready = self.not_ready()
        return {"shards": m.shards, "shard": m.shard, "partitions": m.partitions, "partitioner": "murmur2",
                "owned_partitions": m.owned_partitions(),
                "topic_partitions": dict(consumer.topic_partitions) if consumer is not None else {},
                "ready": not not_ready, "not_ready": not_ready}

    def _log_degraded(self) -> None:
        """Say in the log when the server starts without a tier it was configured with (it serves from the rest)."""
        assert self.engine is not None
        down = [tier for tier, ok in self.engine.healthy().items() if not ok]
        if down:
            log.warning("starting degraded: %s tier unreachable; lookups fall through to the next level, "
                        "/readyz reports it until it reconnects", ", ".join(down))

    def _start_updates(self) -> None:
        """Run the Kafka update consumer when ``updates.type`` is kafka; /readyz waits for its partitions."""
        assert self.engine is not None
        if self.config.updates.type != "kafka" or not self.engine.models():
            return
        ucfg, group = self.config.updates, self._group()
        cluster = self.config.cluster
        consumer = UpdateConsumer(ucfg, self.engine, [m.name for m in self.engine.models()], group,
                                  partitions=cluster.partitions, shards=cluster.shards, shard=cluster.shard)
        consumer.start()
        self.consumer = consumer
        self.log_writer = LogWriter(ucfg, self.engine, consumer, partitions=cluster.partitions)
        self.log_writer.prepare([m.name for m in self.engine.models()])
        self.stats_sections["updates"] = consumer.stats
        if self.fleet is not None:
            self.fleet.watch_losses(consumer, self.bucket_snapshots)
        log.info("consuming updates from %s as group %s (shard %d of %d: partitions %s of %d)", ucfg.brokers, group,
                 cluster.shard, cluster.shards, self.shard_map.owned_partitions() if cluster.shards > 1 else "all",
                 cluster.partitions)

    def _group(self) -> str:
        """This replica's consumer group: updates.group, or one of its own per pod."""
        return self.config.updates.group or f"{self.config.updates.topic_prefix}.{socket.gethostname()}"

    def models_changed(self) -> None:
        """After a model is registered or unloaded at runtime: stored registrations (models the config does not
        define survive a restart), health per model, and the update topics consumed."""
        assert self.engine is not None
        if not self.config.persistent.read_only:
            sync_registrations(self.engine.persistent, {m.name for m in self.config.models},
                               self.engine.served_models())
        self.update_health()
        with self._consumer_lock:
            names = [m.name for m in self.engine.models()]
            if self.consumer is not None:
                self.consumer.follow(names)
            elif names:
                self._start_updates()

    def stop(self, grace: float | None = None) -> None:
        """Say NOT_SERVING, answer lookups for a lame-duck moment, then refuse them and let in-flight ones finish
        (see :meth:`ServingGrpc.drain_and_stop`), commit applied updates, close the tiers: all within ``grace``
        seconds (server.grace_period_s), the budget Kubernetes gives between SIGTERM and SIGKILL.

        The tiers close only once no write is in progress (the engine takes every table's write lock first and
        refuses later writes), so an update consumer that outlives its join timeout never writes to a closed
        store; a write that outlives the whole grace leaves the tiers open instead."""
        if self._stopped.is_set():
            return
        grace = self.config.server.grace_period_s if grace is None else grace
        deadline = time.monotonic() + grace

        def remaining(share: float = 1.0) -> float:
            return max(0.0, (deadline - time.monotonic()) * share)

        self.gate.begin_draining()
        self._health_stop.set()
        self.heap_trimmer.stop()
        self.health.enter_graceful_shutdown()
        if self.node is not None:
            self.node.stop_workers(remaining(0.6))
        if self._grpc is not None:
            self._grpc.drain_and_stop(self.gate, remaining(0.6))
        if self._uds is not None:
            self._uds.remove()
        self.gate.close(DRAINING)
        if self.repository is not None:
            self.repository.stop(max(remaining(0.3), 0.5))
        if self.fleet is not None:
            self.fleet.stop(max(remaining(0.3), 0.5))
        if self.consumer is not None:
            self.consumer.close_timeout_s = min(self.consumer.close_timeout_s, max(remaining(0.5), 0.5))
            self.consumer.stop(timeout=max(remaining(0.8), 1.0), commit=True)
        if self.log_writer is not None:
            self.log_writer.close()
        if self.bucket_snapshots is not None:
            self.bucket_snapshots.stop(max(remaining(0.5), 0.5))
        self.jobs.close(timeout_s=remaining(0.5))
        self._stop_listeners(remaining(0.5))
        if self.engine is not None and not self.engine.close(timeout_s=remaining()):
            log.error("a write outlived server.grace_period_s; the tiers were left open (RocksDB recovers its WAL)")
        if self.node is not None:
            self.node.close()
        self._stopped.set()
        log.info("stopped")

    def _stop_listeners(self, timeout: float = 0.5) -> None:
        """Close the REST and probe listeners."""
        if self._http is not None:
            self._http.close(timeout)
        if self._probes is not None:
            self._probes.close()
            self._probes = None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped; True if it stopped."""
        return self._stopped.wait(timeout)

    def catch_stop_signals(self) -> threading.Event:
        """From now on SIGTERM and SIGINT set the returned event instead of killing the process. Called before
        start(): a signal sent the moment the server answers (a probe saw it ready) must still drain it."""
        stop_requested = threading.Event()

        def _on_signal(signum: int, _frame: object) -> None:
            log.info("received %s, draining", signal.Signals(signum).name)
            stop_requested.set()

        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
        return stop_requested

    def run_until_signal(self, stop_requested: threading.Event | None = None) -> None:
        """After start(): block until SIGTERM or SIGINT (or ``stop_requested`` from :meth:`catch_stop_signals`),
        then drain and stop."""
        if stop_requested is None:
            stop_requested = self.catch_stop_signals()
        try:
            while not stop_requested.wait(0.5):
                pass
        finally:
            self.stop()

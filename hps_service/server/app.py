"""The hps-service process: builds tiers and the engine from config, serves gRPC, drains on SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hps_service.config import HPSConfig
from hps_service.errors import UnavailableError
from hps_service.lookup import LookupEngine
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.server.grpc_service import EmbeddingServicer, ServingGate
from hps_service.tiers.factory import build_persistent, build_volatile

log = logging.getLogger(__name__)

_MiB = 1 << 20


def build_engine(config: HPSConfig) -> LookupEngine:
    """Open the configured tiers and load every configured model into a LookupEngine."""
    volatile = build_volatile(config.volatile)
    try:
        persistent = build_persistent(config.persistent)
    except Exception:
        if volatile is not None:
            volatile.close()
        raise
    engine = LookupEngine(
        volatile=volatile,
        persistent=persistent,
        cache_factory=None,
        max_batch_keys=config.server.max_batch_keys,
    )
    for model in config.models:
        engine.register_model(model)
    return engine


def message_limits(config: HPSConfig) -> tuple[int, int]:
    """Max receive and send message sizes that fit the configured batch limit (plus protobuf overhead)."""
    max_dim = max((t.dim for m in config.models for t in m.tables), default=1024)
    n = config.server.max_batch_keys
    receive = n * 8 + config.server.max_tables_per_request * 1024 + _MiB
    send = n * (4 * max(max_dim, 1024) + 1) + config.server.max_tables_per_request * 1024 + _MiB
    return receive, send


class HPSServer:
    """One server process: the lookup engine behind gRPC (with health checking and reflection)."""

    def __init__(self, config: HPSConfig, engine: LookupEngine | None = None) -> None:
        self.config = config
        self.engine = engine
        self.gate = ServingGate()
        self.health = health.HealthServicer()
        self._grpc: grpc.Server | None = None
        self.grpc_port: int | None = None
        self._stopped = threading.Event()

    def start(self) -> None:
        """Open tiers, load models, bind the gRPC port; lookups are accepted once this returns."""
        cfg = self.config.server
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.engine is None:
            self.engine = build_engine(self.config)
        receive, send = message_limits(self.config)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.grpc_workers, thread_name_prefix="grpc"),
            options=[
                ("grpc.max_receive_message_length", receive),
                ("grpc.max_send_message_length", send),
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_EmbeddingServiceServicer_to_server(EmbeddingServicer(self.engine, cfg, self.gate), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["EmbeddingService"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME),
            server,
        )
        port = server.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
        if port == 0:
            raise UnavailableError(f"cannot bind gRPC to {cfg.host}:{cfg.grpc_port}")
        server.start()
        self._grpc = server
        self.grpc_port = port
        self.gate.open()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_name = pb.DESCRIPTOR.services_by_name["EmbeddingService"].full_name
        self.health.set(health_name, health_pb2.HealthCheckResponse.SERVING)
        for m in self.engine.models():
            self.health.set(m.name, health_pb2.HealthCheckResponse.SERVING)
        log.info("gRPC listening on %s:%d", cfg.host, port)

    def stop(self, grace: float | None = None) -> None:
        """Refuse new lookups, let in-flight ones finish within ``grace`` seconds, close the tiers."""
        if self._stopped.is_set():
            return
        grace = self.config.server.grace_period_s if grace is None else grace
        self.gate.close("the server is draining")
        self.health.enter_graceful_shutdown()
        if self._grpc is not None:
            self._grpc.stop(grace).wait(grace + 1)
        if self.engine is not None:
            self.engine.close()
        self._stopped.set()
        log.info("stopped")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped; True if it stopped."""
        return self._stopped.wait(timeout)

    def run_until_signal(self) -> None:
        """After start(): block until SIGTERM or SIGINT, then drain and stop."""
        stop_requested = threading.Event()

        def _on_signal(signum: int, _frame: object) -> None:
            log.info("received %s, draining", signal.Signals(signum).name)
            stop_requested.set()

        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
        try:
            while not stop_requested.wait(0.5):
                pass
        finally:
            self.stop()

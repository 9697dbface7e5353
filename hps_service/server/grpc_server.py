"""The gRPC server of a serving process (the owner, or each of a node's workers): the EmbeddingService, health
checking and reflection, with the message limits and connection options of ``server``."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hps_service.config import HPSConfig, ServerConfig
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.server.grpc_service import EmbeddingServicer, add_embedding_service
from hps_service.server.metrics import QueueTimedExecutor

_MiB = 1 << 20


def message_limits(config: HPSConfig) -> tuple[int, int]:
    """Max receive and send message sizes: server.max_message_bytes, else what fits the configured batch limit
    (plus protobuf overhead)."""
    max_dim = max((t.dim for m in config.models for t in m.tables), default=1024)
    n = config.server.max_batch_keys
    receive = config.server.max_message_bytes or n * 8 + config.server.max_tables_per_request * 1024 + _MiB
    send = n * (4 * max(max_dim, 1024) + 1) + config.server.max_tables_per_request * 1024 + _MiB
    return receive, send


def grpc_connection_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    """Keepalive and connection age of the gRPC server: idle connections are pinged, clients may ping every
    ``min_client_ping_interval_s``, and a connection older than ``max_connection_age_s`` is closed with GOAWAY (its
    calls get ``max_connection_age_grace_s``), so clients reconnect and re-balance over the replicas there are now."""
    options = [
        ("grpc.keepalive_time_ms", int(cfg.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(cfg.min_client_ping_interval_s * 1000)),
        ("grpc.http2.max_ping_strikes", 2),
    ]
    if cfg.max_connection_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", int(cfg.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", int(cfg.max_connection_age_grace_s * 1000)),
        ]
    return options


def build_grpc_server(
    config: HPSConfig, servicer: EmbeddingServicer, health_servicer: health.HealthServicer, *, reuseport: bool = False
) -> grpc.Server:
    """A thread-pool gRPC server with the EmbeddingService, health and reflection (no port bound yet).

    ``reuseport``: let the node's worker processes bind one port together (SO_REUSEPORT; the kernel spreads the
    connections over them)."""
    cfg = config.server
    receive, send = message_limits(config)
    server = grpc.server(
        QueueTimedExecutor(servicer.metrics.queue_wait, max_workers=cfg.grpc_threads(), thread_name_prefix="grpc"),
        maximum_concurrent_rpcs=cfg.max_concurrent_requests,
        options=[
            ("grpc.max_receive_message_length", receive),
            ("grpc.max_send_message_length", send),
            ("grpc.so_reuseport", 1 if reuseport else 0),
            *grpc_connection_options(cfg),
        ],
    )
    add_embedding_service(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (pb.DESCRIPTOR.services_by_name["EmbeddingService"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME),
        server,
    )
    return server

"""Readiness of a serving process: why it must not get traffic, why it would not answer a call, what is degraded,
and the gRPC health statuses that say so (overall, per model, and ``ACCEPTING_SERVICE``, which clients balance on).
"""

from __future__ import annotations

from typing import Protocol

from grpc_health.v1 import health_pb2

from hps_client.channel import ACCEPTING_SERVICE
from hps_service.engine.api import Engine
from hps_service.fleet.bootstrap import BootstrapProgress
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.runtime.gate import DRAINING, ServingGate
from hps_service.server.rest import ReadinessCheck
from hps_service.updates import UpdateConsumer
from hps_service.updates.readiness import update_consumer_not_ready


class ServingState(Protocol):
    """What readiness is judged from (an :class:`~hps_service.serve.process.HPSServer`)."""

    engine: Engine | None
    consumer: UpdateConsumer | None
    bootstrap: BootstrapProgress
    gate: ServingGate
    readiness: list[ReadinessCheck]


def not_ready(state: ServingState, model: str | None = None) -> list[str]:
    """Why the server (or one model) must not receive traffic: starting, bootstrapping, draining, a tier down,
    no model, updates not caught up or failing, or a check in ``readiness``. Empty when ready."""
    reasons = not_accepting(state, model)
    if state.engine is None:
        return reasons
    for check in state.readiness:
        if reason := check():
            reasons.append(reason)
    consumer = state.consumer
    if consumer is not None and (reason := update_consumer_not_ready(consumer, model)) and reason not in reasons:
        reasons.append(reason)
    return reasons


def not_accepting(state: ServingState, model: str | None = None) -> list[str]:
    """Why the server would not answer a call now (gRPC health ``ACCEPTING_SERVICE``, which clients balance
    on): starting, bootstrapping, draining, its persistent tier down, no model, or partitions that lost updates
    (their rows can be older than acknowledged ones until bootstrapped again). Update lag is not a reason: it
    hits every replica at once, and taking them all out of the clients' rotation would be an outage."""
    reasons = []
    consumer = state.consumer
    if consumer is not None and (lost := consumer.lost_reason(model)):
        reasons.append(f"update consumer (group {consumer.group}) {lost}")
    if (restoring := state.bootstrap.describe()) is not None:
        reasons.append(restoring)
    if not state.gate.is_open:
        reasons.append(state.gate.reason)
    elif state.gate.draining:
        reasons.append(DRAINING)
    engine = state.engine
    if engine is None:
        return reasons
    if not engine.healthy().get("persistent", True):
        reasons.append("persistent tier is unreachable")
    loaded = [m.name for m in engine.models()]
    if not loaded:
        reasons.append("no model is loaded")
    elif model is not None and model not in loaded:
        reasons.append(f"model '{model}' is not loaded")
    return reasons


def degraded(state: ServingState) -> list[str]:
    """What is down but does not take the replica out of the Service: the shared volatile tier (every replica
    loses it at once, and RocksDB answers meanwhile)."""
    engine = state.engine
    if engine is None or engine.healthy().get("volatile", True):
        return []
    return ["volatile tier is unreachable (lookups are answered from the persistent tier)"]


def health_statuses(state: ServingState, served_before: set[str]) -> tuple[dict[str, int], set[str]]:
    """gRPC health: service "" and EmbeddingService SERVING only when the server is ready, each loaded model when
    it is (its updates caught up), NOT_SERVING for a model unloaded since ``served_before``; ``ACCEPTING_SERVICE``
    SERVING while it takes calls (what clients balance on). Returns the statuses and the models they cover."""
    assert state.engine is not None
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    overall = serving if not not_ready(state) else not_serving
    statuses = {"": overall, pb.DESCRIPTOR.services_by_name["EmbeddingService"].full_name: overall,
                ACCEPTING_SERVICE: serving if not not_accepting(state) else not_serving}
    loaded = {m.name for m in state.engine.models()}
    for name in loaded:
        statuses[name] = serving if not not_ready(state, name) else not_serving
    for name in served_before - loaded:
        statuses[name] = not_serving
    return statuses, loaded

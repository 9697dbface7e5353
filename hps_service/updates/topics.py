"""Kafka topic administration for update topics: look up partition counts, create missing topics.

A topic is created with ``replication_factor`` copies of each partition (``updates.replication_factor``, default 3),
capped at the brokers the cluster has with a WARNING (a single test broker, a small dev cluster), and with
``min.insync.replicas`` (default 2, capped below the replication factor), so that a write the producers' ``acks=all``
acknowledges is on more than one broker whenever the cluster has more than one.
"""

from __future__ import annotations

import logging
import time
from typing import TypedDict

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from hps_service.config import DEFAULT_PARTITIONS
from hps_service.errors import UnavailableError

__all__ = ["DEFAULT_PARTITIONS", "DEFAULT_REPLICATION_FACTOR", "ensure_topic", "replication_for"]

log = logging.getLogger(__name__)

#: Copies of each partition of the topics hps-service creates (``updates.replication_factor``).
DEFAULT_REPLICATION_FACTOR = 3
#: ``min.insync.replicas`` of the topics hps-service creates (``updates.min_insync_replicas``).
DEFAULT_MIN_INSYNC_REPLICAS = 2


class Replication(TypedDict):
    """How the topics a consumer creates are replicated (``ensure_topic``'s keyword arguments)."""

    replication_factor: int
    min_insync_replicas: int


def replication_for(wanted: int, brokers: int, min_insync: int = DEFAULT_MIN_INSYNC_REPLICAS) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) for a topic created on a cluster of ``brokers``: ``wanted``
    capped at the broker count, and ``min_insync`` capped so that one replica may be down (never below 1)."""
    factor = max(1, min(wanted, brokers))
    return factor, max(1, min(min_insync, factor - 1))


def ensure_topic(admin: AdminClient, topic: str, partitions: int = DEFAULT_PARTITIONS, timeout_s: float = 10.0,
                 replication_factor: int = DEFAULT_REPLICATION_FACTOR,
                 min_insync_replicas: int = DEFAULT_MIN_INSYNC_REPLICAS, config: dict[str, str] | None = None) -> int:
    """The partition count of ``topic``, creating it with ``partitions`` first if it does not exist (see the module
    docstring for its replication; ``config``: more topic settings, e.g. ``cleanup.policy``).

    Raises UnavailableError when the broker does not answer within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    created = False
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise UnavailableError(f"Kafka topic {topic!r}: broker did not answer metadata within {timeout_s}s")
        try:
            # All topics: asking for one topic by name lets brokers auto-create it with their default partitions.
            md = admin.list_topics(timeout=min(remaining, 5.0))
        except KafkaException as exc:
            raise UnavailableError(f"Kafka topic {topic!r}: metadata request failed: {exc}") from None
        meta = md.topics.get(topic)
        if meta is not None and meta.error is None and meta.partitions:
            return len(meta.partitions)
        if not created:
            factor, insync = replication_for(replication_factor, len(md.brokers), min_insync_replicas)
            if factor < replication_factor:
                log.warning("Kafka topic %s: created with replication factor %d, not updates.replication_factor=%d: "
                            "the cluster has %d broker(s); an acknowledged update is on %d broker(s) only",
                            topic, factor, replication_factor, len(md.brokers), factor)
            fut = admin.create_topics(
                [NewTopic(topic, num_partitions=partitions, replication_factor=factor,
                          config={**(config or {}), "min.insync.replicas": str(insync)})],
                operation_timeout=remaining,
            )[topic]
            try:
                fut.result(timeout=remaining)
            except KafkaException as exc:
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise UnavailableError(f"Kafka topic {topic!r} could not be created: {exc}") from None
            created = True
        time.sleep(0.02)

"""Kafka topic administration for update topics: look up partition counts, create missing topics."""

from __future__ import annotations

import time

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from hps_service.config import DEFAULT_PARTITIONS
from hps_service.errors import UnavailableError

__all__ = ["DEFAULT_PARTITIONS", "ensure_topic"]


def ensure_topic(admin: AdminClient, topic: str, partitions: int = DEFAULT_PARTITIONS, timeout_s: float = 10.0) -> int:
    """The partition count of ``topic``, creating it with ``partitions`` first if it does not exist.

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
            fut = admin.create_topics(
                [NewTopic(topic, num_partitions=partitions, replication_factor=1)], operation_timeout=remaining
            )[topic]
            try:
                fut.result(timeout=remaining)
            except KafkaException as exc:
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise UnavailableError(f"Kafka topic {topic!r} could not be created: {exc}") from None
            created = True
        time.sleep(0.02)

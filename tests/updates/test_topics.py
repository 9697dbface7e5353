"""Update topics are created with ``updates.replication_factor`` copies (issue 27, defect 8), capped at the brokers
the cluster has with a WARNING, and with ``min.insync.replicas`` so that an ``acks=all`` write is on more than one
broker wherever there is more than one. Before: every topic was created with replication factor 1."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from hps_service.updates import UpdateConsumer
from hps_service.updates.topics import ensure_topic, replication_for


@pytest.mark.parametrize(("wanted", "brokers", "min_insync", "expected"), [
    (3, 5, 2, (3, 2)),  # the usual: 3 copies, an ack needs 2 of them
    (3, 3, 2, (3, 2)),
    (3, 2, 2, (2, 1)),  # capped at the brokers; one may be down
    (3, 1, 2, (1, 1)),  # a single broker
    (5, 7, 4, (5, 4)),
    (2, 7, 4, (2, 1)),  # min.insync.replicas below the factor, so one replica may be down
])
def test_replication_is_capped_at_the_brokers(wanted: int, brokers: int, min_insync: int,
                                              expected: tuple[int, int]) -> None:
    assert replication_for(wanted, brokers, min_insync) == expected


def _min_insync(admin: AdminClient, topic: str) -> str:
    (future,) = admin.describe_configs([ConfigResource("topic", topic)]).values()
    return future.result(timeout=10)["min.insync.replicas"].value


def test_topics_created_with_the_configured_factor_warn_when_capped(
        kafka_broker, updates_cfg, engine, model_name, caplog) -> None:
    """The consumer creates its update and dead-letter topics with updates.replication_factor; on the one test
    broker that is capped at 1, with a WARNING naming the topic and the setting."""
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})
    with caplog.at_level(logging.WARNING, logger="hps_service.updates.topics"):
        assert ensure_topic(admin, f"t-{model_name}", 2, replication_factor=3) == 2
    assert "replication factor 1, not updates.replication_factor=3" in caplog.text
    assert _min_insync(admin, f"t-{model_name}") == "1"
    caplog.clear()
    cfg = updates_cfg.model_copy(update={"replication_factor": 2})
    consumer = UpdateConsumer(cfg, engine, [model_name], "pod-0", partitions=2)
    with caplog.at_level(logging.WARNING, logger="hps_service.updates.topics"):
        consumer.start()
        try:
            assert consumer.wait_ready(30), consumer.stats()
        finally:
            consumer.stop()
    for topic in (f"hps.{model_name}", f"hps.{model_name}.dlq"):
        assert f"Kafka topic {topic}: created with replication factor 1, not updates.replication_factor=2" in (
            caplog.text)

"""A position below the log's start, or a topic deleted and created again, is never skipped silently (issue 27,
defect 3): the partition is stopped, the consumer is not caught up (its readiness reason names the partition), an
ERROR names the offsets lost, ``hps_update_log_gaps_total`` counts it, and a restart still knows. Against tansu: a
topic is created again by deleting and creating it (tansu answers no DeleteRecords, so its log start stays 0)."""

from __future__ import annotations

import logging
import time

import numpy as np
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client import REGISTRY

from hps_service.tiers.rocksdb.tier import RocksDBTier
from hps_service.updates import Publisher, UpdateConsumer
from hps_service.updates.partitioning import partition_of
from hps_service.updates.readiness import update_consumer_not_ready
from hps_service.updates.watermarks import (
    BELOW_START,
    RECREATED,
    BrokerLogs,
    LogLedger,
    LogWatch,
    LostLog,
    check_start,
)
from tests.updates.conftest import TABLE, rows_for, served, wait_until

PARTITIONS = 2


def test_a_position_below_the_log_start_or_from_a_recreated_topic_is_a_loss() -> None:
    part = ("hps.m", 3)
    assert check_start(part, 120, 100, recreated=False) is None
    assert check_start(part, 100, 100, recreated=False) is None
    lost = check_start(part, 40, 100, recreated=False)
    assert lost is not None and lost.reason == BELOW_START
    assert lost.describe() == "hps.m[3]: offsets 40..99 are no longer in the log (it starts at 100)"
    assert check_start(part, 0, 100, recreated=False).reason == BELOW_START  # a stored 0 needed the log from 0
    assert check_start(part, -1, 100, recreated=False) is None  # no position stored: starts at the log's start
    assert check_start(part, 500, 0, recreated=True).reason == RECREATED
    assert check_start(part, 0, 0, recreated=True) is None  # nothing was applied from the old topic


def test_the_ledger_of_lost_partitions_survives_a_reopen(tmp_path) -> None:
    tier = RocksDBTier(tmp_path / "db")
    ledger = LogLedger(tier)
    ledger.set_topic_id("hps.m", "id-1")
    ledger.mark_lost([LostLog("hps.m", 1, 40, 100, BELOW_START), LostLog("hps.n", 0, 7, 0, RECREATED, "id-9")])
    tier.close()
    tier = RocksDBTier(tmp_path / "db")
    ledger = LogLedger(tier)
    assert ledger.topic_id("hps.m") == "id-1"
    assert set(ledger.lost()) == {("hps.m", 1), ("hps.n", 0)}
    assert set(ledger.lost({"hps.n"})) == {("hps.n", 0)}
    ledger.recovered([("hps.m", 1)])
    assert set(ledger.lost()) == {("hps.n", 0)}
    tier.close()


def recreate(bootstrap: str, topic: str, partitions: int) -> None:
    """Delete ``topic`` and create it again (empty, a new topic id)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_topics([topic], operation_timeout=10).values():
        future.result(15)
    assert wait_until(lambda: topic not in admin.list_topics(timeout=5).topics, timeout=15)
    for future in admin.create_topics([NewTopic(topic, partitions)]).values():
        future.result(15)


def gaps_counted(topic: str, partition: int) -> float:
    return REGISTRY.get_sample_value("hps_update_log_gaps_total", {"topic": topic, "partition": str(partition)}) or 0


def test_a_topic_created_again_while_the_replica_was_down_stops_its_partitions(
        kafka_broker, updates_cfg, engine, model_name, caplog) -> None:
    """The replica applied the topic, stopped; the topic was deleted and created again and got more records than
    the replica's positions: resuming there would skip the new log's first records and every update of the old one
    it never read. Before: it resumed at its stored positions and said it was caught up."""
    topic = f"hps.{model_name}"
    keys = np.arange(300, dtype=np.int64)

    def publish(version: int, messages: int) -> None:
        with Publisher(kafka_broker.bootstrap, model_name, partitions=PARTITIONS) as pub:
            for chunk in np.array_split(keys, messages):
                pub.publish(TABLE, chunk, rows_for(chunk, version), version)
                pub.flush()

    def start() -> UpdateConsumer:
        consumer = UpdateConsumer(updates_cfg, engine, [model_name], "pod-0", partitions=PARTITIONS)
        consumer.start()
        assert consumer.wait_ready(30), consumer.stats()
        return consumer

    publish(1, 4)
    first = start()
    assert first.wait_caught_up(60), first.stats()
    first.stop()
    stored = engine.positions()
    assert all(stored[(topic, p)] > 0 for p in range(PARTITIONS)), stored
    recreate(kafka_broker.bootstrap, topic, PARTITIONS)
    publish(2, 20)  # the new log is longer than the positions the rows were applied up to
    before = gaps_counted(topic, 0)
    with caplog.at_level(logging.ERROR, logger="hps_service.updates.log_losses"):
        second = start()
    try:
        assert set(second.lost()) == {(topic, p) for p in range(PARTITIONS)}, second.stats()
        reason = update_consumer_not_ready(second, model_name)
        assert reason is not None and f"{topic}[0]: the topic was deleted and created again" in reason, reason
        assert f"{topic}[1]" in reason and not second.wait_caught_up(1)
        assert f"lost updates on {topic}[0]" in caplog.text and "ERROR" in caplog.text
        assert gaps_counted(topic, 0) == before + 1
        assert second.stats()["lost_partitions"].keys() == {f"{topic}[0]", f"{topic}[1]"}
        time.sleep(1.0)
        vectors, _ = served(engine, model_name, keys)
        assert np.array_equal(vectors, rows_for(keys, 1)), "rows of a stopped partition were applied"
    finally:
        second.stop()
    third = start()  # a restart still knows: the losses are durable
    try:
        assert set(third.lost()) == {(topic, p) for p in range(PARTITIONS)}
        assert not third.wait_caught_up(1)
    finally:
        third.stop()


def test_the_log_watch_finds_a_topic_created_again_under_a_running_replica(kafka_broker, model_name) -> None:
    """What the consumer's log watch asks the broker every updates.log_check_interval_s: a topic created again
    (another topic id) stops the partitions that had applied something from the old one. (No consumer fetches it
    here: tansu's fetch answers for a deleted topic crash librdkafka, see tests/fleet/test_lost_updates.py.)"""
    topic = f"hps.{model_name}"
    kafka_broker.create_topics([topic], PARTITIONS)
    broker = BrokerLogs({"bootstrap.servers": kafka_broker.bootstrap}, timeout_s=5)
    ledger = LogLedger(None)
    ledger.set_topic_id(topic, broker.topic_ids([topic])[topic])
    watch = LogWatch(broker, ledger, lambda: {(topic, 0): 5, (topic, 1): 0}, 0.1, "test")
    watch.start()
    try:
        time.sleep(0.5)
        assert watch.take() == []
        recreate(kafka_broker.bootstrap, topic, PARTITIONS)
        found: list[LostLog] = []
        assert wait_until(lambda: bool(found.extend(watch.take()) or found), timeout=15)
    finally:
        watch.stop()
    assert [(x.part, x.reason, x.position) for x in found] == [((topic, 0), RECREATED, 5)]
    assert found[0].topic_id == broker.topic_ids([topic])[topic] != ledger.topic_id(topic)


def test_a_loss_found_while_running_stops_the_partition_and_only_that_one(
        kafka_broker, updates_cfg, engine, model_name) -> None:
    """The consumer's handling of what its log watch found (a seam: tansu cannot move a log's start), here a
    partition whose log start passed its position: that partition is unassigned and nothing more of it applied,
    the other goes on; the model is not caught up and the loss is recorded for a restart."""
    topic = f"hps.{model_name}"
    consumer = UpdateConsumer(updates_cfg, engine, [model_name], "pod-0", partitions=PARTITIONS)
    consumer.start()
    try:
        assert consumer.wait_caught_up(60), consumer.stats()
        keys = np.arange(400, dtype=np.int64)
        with Publisher(kafka_broker.bootstrap, model_name, partitions=PARTITIONS) as pub:
            pub.publish(TABLE, keys, rows_for(keys, 1), 1)
        # the rows are served once a batch is applied; its offsets are recorded just after, so wait for both
        assert wait_until(lambda: np.array_equal(served(engine, model_name, keys)[0], rows_for(keys, 1))
                          and f"{topic}[0]" in consumer.stats()["applied_offsets"])
        position = consumer.stats()["applied_offsets"][f"{topic}[0]"]
        consumer.log_watch._found.append(LostLog(topic, 0, position, position + 10, BELOW_START))
        assert wait_until(lambda: (topic, 0) in consumer.lost(), timeout=10), consumer.stats()
        assert [(tp.topic, tp.partition) for tp in consumer.assignment.assigned] == [(topic, 1)]
        assert not consumer.caught_up() and f"{topic}[0]: offsets {position}.." in consumer.catching_up()
        with Publisher(kafka_broker.bootstrap, model_name, partitions=PARTITIONS) as pub:
            pub.publish(TABLE, keys, rows_for(keys, 2), 2)
        on_1 = keys[partition_of(keys, PARTITIONS) == 1]
        on_0 = keys[partition_of(keys, PARTITIONS) == 0]
        assert wait_until(lambda: np.array_equal(served(engine, model_name, on_1)[0], rows_for(on_1, 2)))
        assert np.array_equal(served(engine, model_name, on_0)[0], rows_for(on_0, 1))
        assert set(consumer.ledger.lost()) == {(topic, 0)}
    finally:
        consumer.stop()


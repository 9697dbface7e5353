"""Admin-only messages on the update topic (tombstone purges), against a real broker and engine: applied only when
signed with updates.admin_key; unsigned, forged or tampered ones are dead-lettered with the reason and counted, and a
replica without a key applies none. The REST purge through the topic signs it, and is refused without a key."""

from __future__ import annotations

import time

import numpy as np
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from pydantic import SecretStr

from hps_service.errors import FailedPreconditionError
from hps_service.fleet.admin_writes import LogWriter
from hps_service.updates import Publisher, UpdateConsumer
from hps_service.updates.admin_signature import HEADER, REFUSED, sign
from hps_service.updates.message import encode_update
from tests.updates.conftest import TABLE, rows_for, served, wait_until

KEY = "admin-hmac-key-for-the-tests-7c1e"
PARTITIONS = 4


def _consumer(cfg, engine, model: str) -> UpdateConsumer:
    consumer = UpdateConsumer(cfg, engine, [model], "pod-0", partitions=PARTITIONS)
    consumer.start()
    assert consumer.wait_ready(30), consumer.stats()
    return consumer


def _tombstones(engine, model: str) -> int:
    return engine.persistent.tombstones(f"{model}.{TABLE}")


def _with_tombstones(pub: Publisher, engine, model: str) -> None:
    keys = np.arange(200, dtype=np.int64)
    pub.publish(TABLE, keys, rows_for(keys, 5), 5)
    pub.delete(TABLE, keys[:100], 6)
    pub.flush()
    assert wait_until(lambda: _tombstones(engine, model) == 100)


def _applied_up_to_here(pub: Publisher, engine, model: str, marker: int) -> None:
    """Publish a row to every partition and wait until each is served: everything before it was consumed."""
    keys = np.arange(10_000 + marker * 64, 10_000 + marker * 64 + 64, dtype=np.int64)
    pub.publish(TABLE, keys, rows_for(keys, 7), 7)
    pub.flush()
    assert wait_until(lambda: np.array_equal(served(engine, model, keys)[0], rows_for(keys, 7)))


def _dead_letters(bootstrap: str, topic: str, count: int) -> list[str]:
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"dlq-{topic}"})
    reader.assign([TopicPartition(f"{topic}.dlq", 0, OFFSET_BEGINNING)])
    dead = []
    deadline = time.monotonic() + 20
    while len(dead) < count and time.monotonic() < deadline:
        dead.extend(m for m in reader.consume(100, timeout=0.2) if m.error() is None)
    reader.close()
    return [dict(m.headers())["hps-error"].decode() for m in dead]


def _refused(model: str, reason: str) -> float:
    return REFUSED.labels(model, reason)._value.get()


def test_only_signed_purges_are_applied(kafka_broker, engine, model_name, updates_cfg) -> None:
    consumer = _consumer(updates_cfg.model_copy(update={"admin_key": SecretStr(KEY)}), engine, model_name)
    try:
        pub = Publisher(kafka_broker.bootstrap, model_name, partitions=PARTITIONS)
        _with_tombstones(pub, engine, model_name)
        pub.purge_tombstones(TABLE, 10)  # a producer without the key
        forger = Publisher(kafka_broker.bootstrap, model_name, partitions=PARTITIONS, admin_key="not-the-admin-key-0000")
        forger.purge_tombstones(TABLE, 10)
        forger.flush()
        empty = np.empty(0, dtype=np.int64)
        signed = encode_update(model_name, TABLE, empty, np.empty((0, 0), np.float32), empty, purge_tombstones_below=3)
        tampered = encode_update(model_name, TABLE, empty, np.empty((0, 0), np.float32), empty,
                                 purge_tombstones_below=10)
        raw = Producer({"bootstrap.servers": kafka_broker.bootstrap})
        raw.produce(f"hps.{model_name}", value=tampered, partition=0, headers=[(HEADER, sign(KEY, signed))])
        assert raw.flush(10) == 0
        pub.flush()
        _applied_up_to_here(pub, engine, model_name, 1)
        assert _tombstones(engine, model_name) == 100, "an unsigned or forged purge was applied"
        refused = 2 * PARTITIONS + 1
        assert consumer.stats()["malformed"] == {model_name: refused}
        assert _refused(model_name, "unsigned") == PARTITIONS
        assert _refused(model_name, "bad_signature") == PARTITIONS + 1
        reasons = _dead_letters(kafka_broker.bootstrap, f"hps.{model_name}", refused)
        assert sorted(reasons) == sorted([f"admin message refused: no {HEADER} header"] * PARTITIONS
                                         + ["admin message refused: bad signature"] * (PARTITIONS + 1))
        # The REST purge through the topic (fleet.admin_writes) signs with the replica's key: applied everywhere.
        writer = LogWriter(updates_cfg.model_copy(update={"admin_key": SecretStr(KEY)}), engine, consumer,
                           partitions=PARTITIONS)
        try:
            out = writer.purge_tombstones(model_name, TABLE, 10, wait_applied=True)
        finally:
            writer.close()
        assert out["applied"] is True and len(out["offsets"]) == PARTITIONS
        assert _tombstones(engine, model_name) == 0
    finally:
        consumer.stop()


def test_a_replica_without_a_key_applies_no_admin_message(kafka_broker, engine, model_name, updates_cfg) -> None:
    assert updates_cfg.admin_key is None
    writer = LogWriter(updates_cfg, engine, None, partitions=PARTITIONS)
    with pytest.raises(FailedPreconditionError, match="set updates.admin_key"):
        writer.purge_tombstones(model_name, TABLE, 10, wait_applied=False)
    consumer = _consumer(updates_cfg, engine, model_name)
    try:
        pub = Publisher(kafka_broker.bootstrap, model_name, partitions=PARTITIONS, admin_key=KEY)
        _with_tombstones(pub, engine, model_name)
        pub.purge_tombstones(TABLE, 10)  # signed, but this replica cannot tell by whom
        pub.flush()
        _applied_up_to_here(pub, engine, model_name, 2)
        assert _tombstones(engine, model_name) == 100
        assert _refused(model_name, "no_key") == PARTITIONS
        assert set(_dead_letters(kafka_broker.bootstrap, f"hps.{model_name}", PARTITIONS)) == {
            "admin message refused: updates.admin_key is not set on this replica"}
    finally:
        consumer.stop()

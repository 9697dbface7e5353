"""Acknowledged updates survive a model being unloaded and loaded again under the consumer (issue 14, defect 4):
an offset is committed only once every message before it was applied, or dead-lettered on its own."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from confluent_kafka import Consumer, TopicPartition

from hps_service.config import ModelConfig, TableConfig
from hps_service.updates import Publisher, UpdateConsumer
from tests.engine.seams import PATIENCE_S
from tests.updates.conftest import DIM, TABLE, rows_for, served, wait_until


@pytest.fixture
def consumer(updates_cfg, engine, model_name):
    c = UpdateConsumer(updates_cfg, engine, [model_name], "pod-0", partitions=4)
    seen: dict[tuple[str, int], int] = {}
    real = c._process

    def recording(msgs):  # a seam: what the consumer thread has read, per partition (the last offset)
        for m in msgs:
            if m.error() is None:
                seen[(m.topic(), m.partition())] = max(seen.get((m.topic(), m.partition()), -1), m.offset())
        return real(msgs)

    c._process = recording  # type: ignore[method-assign]
    c.seen = seen  # type: ignore[attr-defined]
    c.start()
    assert c.wait_ready(30)
    yield c
    c.stop()


def end_offsets(bootstrap: str, topic: str, partitions: int = 4) -> dict[tuple[str, int], int]:
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})
    try:
        return {(topic, p): probe.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in range(partitions)}
    finally:
        probe.close()


def all_served(engine, model, keys, version) -> bool:
    vectors, _ = served(engine, model, keys)
    return bool(np.array_equal(vectors, rows_for(keys, version)))


def model_config(name: str) -> ModelConfig:
    return ModelConfig(name=name, tables=[TableConfig(name=TABLE, dim=DIM)])


def test_updates_read_while_the_model_is_unloaded_are_applied_once_it_is_back(
    kafka_broker, engine, model_name, consumer
) -> None:
    """The model is unloaded and loaded again while the consumer keeps its partitions (no follow() in between, as
    when both changes happen before the consumer thread looks). Before: the messages read meanwhile were skipped
    and later offsets committed past them: those updates were lost for good."""
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    before = np.arange(0, 200, dtype=np.int64)
    pub.publish(TABLE, before, rows_for(before, 1), 1)
    pub.flush()
    assert wait_until(lambda: all_served(engine, model_name, before, 1)), consumer.stats()
    engine.unregister_model(model_name)
    away = np.arange(200, 400, dtype=np.int64)
    pub.publish(TABLE, away, rows_for(away, 2), 2)
    pub.flush()
    ends = end_offsets(kafka_broker.bootstrap, f"hps.{model_name}")
    assert wait_until(lambda: all(consumer.seen.get(p, -1) >= end - 1 for p, end in ends.items() if end > 0))
    engine.register_model(model_config(model_name))
    after = np.arange(400, 600, dtype=np.int64)
    pub.publish(TABLE, after, rows_for(after, 3), 3)
    pub.flush()
    assert wait_until(lambda: all_served(engine, model_name, after, 3)), consumer.stats()
    assert wait_until(lambda: all_served(engine, model_name, away, 2), timeout=20), consumer.stats()
    assert consumer.stats()["malformed"] == {}


def test_a_model_unloaded_while_its_batch_is_applied_loses_nothing(
    kafka_broker, engine, model_name, consumer
) -> None:
    """The model is unloaded after the batch was validated, before the engine applied it. Before: the engine's
    NotFoundError dead-lettered every message of the table in the batch, valid ones included, and their offsets
    were committed."""
    unloaded = threading.Event()
    real = engine.apply_changes

    def unload_then_apply(changes, *args):  # a seam at the engine call
        if threading.current_thread() is consumer._thread and changes and not unloaded.is_set():
            engine.unregister_model(changes[0].model)
            unloaded.set()
        return real(changes, *args)

    engine.apply_changes = unload_then_apply
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    keys = np.arange(1000, dtype=np.int64)
    for lo in range(0, 1000, 100):  # several messages per partition
        pub.publish(TABLE, keys[lo : lo + 100], rows_for(keys[lo : lo + 100], 1), 1)
    pub.flush()
    assert unloaded.wait(PATIENCE_S)
    assert wait_until(lambda: consumer.stats()["malformed"] or consumer.stats()["parked_offsets"]), consumer.stats()
    engine.register_model(model_config(model_name))
    assert wait_until(lambda: all_served(engine, model_name, keys, 1), timeout=20), consumer.stats()
    assert consumer.stats()["malformed"] == {}
    assert consumer.stats()["parked_offsets"] == {}


def test_a_model_replaced_mid_batch_parks_its_partitions_and_the_consumer_lives(
    kafka_broker, engine, model_name, consumer
) -> None:
    """The model is replaced (unloaded and registered again) while the engine applies a validated batch: the engine
    raises NotFoundError for a model that is loaded again by the time the consumer looks (issue 27, defect 6).
    Before: the consumer thread re-raised it and died for good; nothing more was applied."""
    replaced = threading.Event()
    real = engine.apply_changes

    def replace_then_apply(changes, *args):  # a seam at the engine call: the replacement lands mid-call
        if threading.current_thread() is consumer._thread and changes and not replaced.is_set():
            engine.unregister_model(changes[0].model)
            try:
                return real(changes, *args)
            finally:
                engine.register_model(model_config(model_name))
                replaced.set()
        return real(changes, *args)

    engine.apply_changes = replace_then_apply
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    keys = np.arange(800, dtype=np.int64)
    for lo in range(0, 800, 100):
        pub.publish(TABLE, keys[lo : lo + 100], rows_for(keys[lo : lo + 100], 1), 1)
    pub.flush()
    assert replaced.wait(PATIENCE_S)
    assert wait_until(lambda: all_served(engine, model_name, keys, 1), timeout=20), consumer.stats()
    assert consumer._thread.is_alive() and consumer.stats()["parked_offsets"] == {}
    assert consumer.stats()["malformed"] == {}


def test_the_consumer_survives_an_unexpected_engine_error_and_reads_the_batch_again(
    kafka_broker, engine, model_name, consumer
) -> None:
    """An error nobody expected (here from the engine's check of a batch) is logged and survived: the batch is read
    again from what was applied, and nothing is lost. Before: the consumer thread died for good."""
    failed = threading.Event()
    real = engine.check_change

    def fail_once(change):
        if not failed.is_set():
            failed.set()
            raise RuntimeError("an engine bug")
        return real(change)

    engine.check_change = fail_once
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    keys = np.arange(400, dtype=np.int64)
    pub.publish(TABLE, keys, rows_for(keys, 2), 2)
    pub.flush()
    assert failed.wait(PATIENCE_S)
    assert wait_until(lambda: all_served(engine, model_name, keys, 2), timeout=20), consumer.stats()
    stats = consumer.stats()
    assert consumer._thread.is_alive() and stats["errors"] == 1 and "an engine bug" in stats["last_error"], stats

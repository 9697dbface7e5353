"""A log's end as the consumer has read it (issue 27, defect 9): tansu lists a partition's end as the base offset of
its last record batch + 1, a batch short; the catch-up target and the LogWriter's read-your-writes wait are taken
from what the consumer's fetch responses show, so they are right on any broker. Against tansu with multi-record
batches."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hps_service.engine import Source
from hps_service.fleet.admin_writes import LogWriter
from hps_service.updates import Publisher, UpdateConsumer
from tests.updates.conftest import TABLE, rows_for, served

BATCHED = {"linger.ms": 200}  # the messages of a burst share one record batch


def publish_batched(bootstrap: str, model: str, keys: np.ndarray, version: int, messages: int) -> None:
    """``messages`` messages of ``keys`` on one partition, in one record batch."""
    with Publisher(bootstrap, model, partitions=1, **BATCHED) as pub:
        for chunk in np.array_split(keys, messages):
            pub.publish(TABLE, chunk, rows_for(chunk, version), version)


@pytest.fixture
def slow_apply(engine):
    """Each apply of the consumer thread takes ``delay`` seconds, and records whether the consumer already counted
    as caught up when it began."""
    seen: list[bool] = []
    state = {"delay": 0.0, "consumer": None}
    real = engine.apply_changes

    def apply(changes, *args):
        consumer = state["consumer"]
        if consumer is not None and threading.current_thread() is consumer._thread and changes:
            seen.append(consumer.caught_up())
            time.sleep(state["delay"])
        return real(changes, *args)

    engine.apply_changes = apply
    state["seen"] = seen
    return state


def test_catching_up_ends_only_once_the_whole_last_batch_is_applied(
        kafka_broker, updates_cfg, engine, model_name, slow_apply) -> None:
    """The consumer applies one message at a time; it counts as caught up only after the last message that was on
    the log at assignment. Before: once the first message of the last batch was applied (tansu's listed end), so
    the replica said ready with the rest of that batch unapplied."""
    keys = np.arange(600, dtype=np.int64)
    publish_batched(kafka_broker.bootstrap, model_name, keys, 3, messages=6)
    consumer = UpdateConsumer(updates_cfg, engine, [model_name], "pod-0", partitions=1, batch_messages=1)
    slow_apply["consumer"] = consumer
    consumer.start()
    try:
        assert consumer.wait_caught_up(60), consumer.stats()
        (listed,) = consumer.end_offsets(model_name).values()
        assert listed < 6, "tansu lists the end a batch short of the 6 messages: the premise of this test"
        assert slow_apply["seen"] == [False] * 6, slow_apply["seen"]
        vectors, _ = served(engine, model_name, keys)
        assert np.array_equal(vectors, rows_for(keys, 3))
    finally:
        consumer.stop()


def test_a_delete_without_version_waits_for_the_whole_last_batch(
        kafka_broker, updates_cfg, engine, model_name, slow_apply) -> None:
    """REST delete without a version reads each key's version once every write acknowledged before it is applied
    here: all of the last record batch. Before: only its first message was waited for, so the keys of the others
    got version 0 tombstones, which their rows outlived."""
    consumer = UpdateConsumer(updates_cfg, engine, [model_name], "pod-0", partitions=1, batch_messages=1)
    slow_apply["consumer"] = consumer
    consumer.start()
    writer = LogWriter(updates_cfg, engine, consumer, ack_timeout_s=30, partitions=1)
    try:
        assert consumer.wait_caught_up(60), consumer.stats()
        slow_apply["delay"] = 0.15
        keys = np.arange(1, 501, dtype=np.int64)
        publish_batched(kafka_broker.bootstrap, model_name, keys, 7, messages=5)
        writer.delete(model_name, TABLE, keys, None, wait_applied=True)
        slow_apply["delay"] = 0.0
        _, sources = served(engine, model_name, keys)
        assert (sources == Source.DEFAULT).all(), f"{int((sources != Source.DEFAULT).sum())} deleted rows served"
    finally:
        writer.close()
        consumer.stop()

"""UpdateConsumer against a real tansu broker and a real engine (hash map L2 + RocksDB L3)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from hps_service.engine import Source, resolve_latest
from hps_service.proto.hps.v1.update_pb2 import EmbeddingUpdate
from hps_service.updates import Publisher, UpdateConsumer, make_version
from hps_service.updates.message import encode_update
from tests.helpers import REPO
from tests.updates.conftest import DIM, TABLE, make_engine, rows_for, served, stored_versions, wait_until


def all_served(engine, model, keys, versions) -> bool:
    vectors, _ = served(engine, model, keys)
    return bool(np.array_equal(vectors, rows_for(keys, versions)))


@pytest.fixture
def start_consumer(updates_cfg, engine, model_name):
    """Start consumers over the test's engine; every one still running is stopped after the test."""
    started: list[UpdateConsumer] = []

    def start(group: str = "pod-0", eng=None, **kwargs) -> UpdateConsumer:
        c = UpdateConsumer(updates_cfg, eng or engine, [model_name], group, partitions=4, **kwargs)
        c.start()
        started.append(c)
        assert c.wait_ready(30), c.stats()
        return c

    yield start
    for c in started:
        c.stop()


def test_resolve_latest_prefers_highest_version_and_delete_on_tie() -> None:
    keys = np.array([1, 2, 1, 3, 2], dtype=np.int64)
    versions = np.array([5, 1, 7, 2, 1], dtype=np.int64)
    del_keys = np.array([3, 2, 1], dtype=np.int64)
    del_versions = np.array([2, 0, 6], dtype=np.int64)
    puts, deletes = resolve_latest(keys, versions, del_keys, del_versions)
    assert sorted(puts.tolist()) == [2, 4]  # key 1 at v7; key 2: the later of two v1 puts beats a v0 delete
    assert deletes.tolist() == [0]  # key 3: delete at v2 beats the put at v2


def test_100k_rows_all_served_at_latest_version(kafka_broker, engine, model_name, start_consumer) -> None:
    consumer = start_consumer()
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    keys = np.arange(100_000, dtype=np.int64) * 31 + 7
    for lo in range(0, keys.shape[0], 20_000):
        k = keys[lo : lo + 20_000]
        pub.publish(TABLE, k, rows_for(k, make_version(1, 1)), make_version(1, 1))
    newer = keys[::5]
    pub.publish(TABLE, newer, rows_for(newer, make_version(1, 2)), make_version(1, 2))
    pub.flush()
    expected = np.full(keys.shape[0], make_version(1, 1), dtype=np.int64)
    expected[::5] = make_version(1, 2)
    assert wait_until(lambda: all_served(engine, model_name, keys, expected), timeout=120), consumer.stats()
    tiers = stored_versions(engine, model_name, keys)
    for name, (found, versions) in tiers.items():
        assert found.all(), name
        np.testing.assert_array_equal(versions, expected, err_msg=name)
    stats = consumer.stats()
    assert stats["last_version"][f"{model_name}.{TABLE}"] == make_version(1, 2)
    assert stats["rows_received"] == 120_000
    assert 100_000 <= stats["rows_applied"] <= 120_000  # rows superseded within one batch are not written
    assert stats["end_to_end_lag_s"]["p99"] is not None and stats["malformed"] == {}
    assert wait_until(lambda: set(consumer.stats()["consumer_lag"].values()) == {0}, timeout=10), consumer.stats()
    assert len(consumer.stats()["consumer_lag"]) == 4


def publish_distinct_then_newer(pub: Publisher, n: int, chunk: int, flush_each: bool = False) -> np.ndarray:
    """Every key once at version 1 (so a lost message means missing keys), then the first tenth again at 2.
    ``flush_each``: one record per record batch (see the test that uses it).

    Returns the version each key must end at."""
    keys = np.arange(n, dtype=np.int64)
    for lo in range(0, n, chunk):
        k = keys[lo : lo + chunk]
        pub.publish(TABLE, k, rows_for(k, 1), 1)
        if flush_each:
            pub.flush()
    newer = keys[: n // 10]
    pub.publish(TABLE, newer, rows_for(newer, 2), 2)
    pub.flush()
    expected = np.ones(n, dtype=np.int64)
    expected[: n // 10] = 2
    return expected


def test_stop_without_commit_then_restart_loses_nothing(
    kafka_broker, engine, model_name, start_consumer
) -> None:
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    # one record per record batch: tansu reports the base offset of a partition's last record batch + 1 as its end,
    # and a stored position past that end is read again from the start (the test below), not resumed
    expected = publish_distinct_then_newer(pub, 60_000, 250, flush_each=True)
    keys = np.arange(expected.shape[0], dtype=np.int64)
    total = expected.shape[0] * 11 // 10
    first = start_consumer(batch_messages=8)  # small batches: it is stopped part-way through the log
    assert wait_until(lambda: first.metrics.rows_received >= total // 3, timeout=60)
    first.stop(commit=False)  # as after a crash: nothing more is committed to the group
    received = first.metrics.rows_received
    committed = dict(first._committed)
    stored = engine.positions()  # written with the rows: never behind what the group has committed
    assert all(stored[k] >= o for k, o in committed.items()), (stored, committed)
    assert total // 3 <= received < total, "stopped too late to exercise a restart"
    second = start_consumer()  # resumes from the positions stored with the rows, not the group's offsets
    assert {k: second.progress.start_offsets[k] for k in stored} == stored
    assert wait_until(lambda: all_served(engine, model_name, keys, expected), timeout=120), second.stats()
    found, versions = stored_versions(engine, model_name, keys)["persistent"]
    assert found.all() and (versions == expected).all()


def test_replayed_and_out_of_order_versions_never_regress(
    kafka_broker, engine, model_name, start_consumer
) -> None:
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    keys = np.arange(5_000, dtype=np.int64)
    pub.publish(TABLE, keys, rows_for(keys, 5), 5)
    pub.publish(TABLE, keys, rows_for(keys, 3), 3)  # a lagging writer
    v = np.where(keys % 2 == 0, 7, 6)
    pub.publish(TABLE, keys, rows_for(keys, v), v)
    pub.publish(TABLE, keys, rows_for(keys, 4), 4)
    pub.flush()
    expected = np.where(keys % 2 == 0, 7, 6)
    start_consumer(group="pod-a")
    assert wait_until(lambda: all_served(engine, model_name, keys, expected), timeout=60)
    # The same log replayed from the start into the same engine changes nothing, at any point.
    engine.apply_changes([], dict.fromkeys(engine.positions(), 0))  # stored positions rewound to the start
    replay = start_consumer(group="pod-b", batch_messages=1)
    deadline = time.monotonic() + 60
    while replay.metrics.rows_received < 4 * keys.shape[0] and time.monotonic() < deadline:
        assert all_served(engine, model_name, keys, expected)
    assert replay.metrics.rows_received == 4 * keys.shape[0]
    assert all_served(engine, model_name, keys, expected)


def test_a_position_past_the_brokers_end_is_read_again_from_the_start(
    kafka_broker, engine, model_name, start_consumer
) -> None:
    """Rows stored at positions the topic no longer reaches (recreated, or tansu's end offset, which is the base
    offset of its last record batch + 1): the partition is read again from its first offset, so the consumer
    catches up and serves every row. Before: it was assigned at the stored position, past the end, and never
    became caught up (a restarted server stayed NOT_SERVING)."""
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    keys = np.arange(2_000, dtype=np.int64)
    pub.publish(TABLE, keys, rows_for(keys, 2), 2)
    pub.flush()
    topic = f"hps.{model_name}"
    engine.apply_changes([], {(topic, p): 1_000_000 for p in range(4)})
    consumer = start_consumer()
    assert consumer.wait_caught_up(60), consumer.stats()
    assert wait_until(lambda: all_served(engine, model_name, keys, 2), timeout=60), consumer.stats()
    assert all(o < 1_000_000 for o in consumer.stats()["applied_offsets"].values())


def test_tombstones_delete_from_every_tier(kafka_broker, engine, model_name, start_consumer) -> None:
    consumer = start_consumer()
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    keys = np.arange(1_000, dtype=np.int64)
    pub.publish(TABLE, keys, rows_for(keys, 1), 1)
    pub.flush()
    assert wait_until(lambda: all_served(engine, model_name, keys, 1))
    assert wait_until(lambda: (served(engine, model_name, keys)[1] == Source.CACHE).all())  # admitted to L1
    gone = keys[:300]
    pub.delete(TABLE, gone, 2)
    pub.flush()
    assert wait_until(lambda: not any(f.any() for f, _ in stored_versions(engine, model_name, gone).values()))
    vectors, sources = served(engine, model_name, gone)
    assert (sources == Source.DEFAULT).all() and not vectors.any()  # gone from L1 too; default: zeros
    kept_found, kept_versions = stored_versions(engine, model_name, keys[300:])["persistent"]
    assert kept_found.all() and (kept_versions == 1).all()
    assert consumer.stats()["last_version"][f"{model_name}.{TABLE}"] == 2


def test_delete_then_older_put_does_not_resurrect(kafka_broker, engine, model_name, start_consumer) -> None:
    consumer = start_consumer()
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    keys = np.arange(100, dtype=np.int64)
    pub.publish(TABLE, keys, rows_for(keys, 1), 1)
    pub.flush()
    assert wait_until(lambda: consumer.metrics.rows_received == 100)
    pub.delete(TABLE, keys, 5)
    pub.flush()
    assert wait_until(lambda: consumer.metrics.rows_received == 200)
    assert not stored_versions(engine, model_name, keys)["persistent"][0].any()
    pub.publish(TABLE, keys, rows_for(keys, 3), 3)  # a replayed or lagging put, older than the delete
    pub.flush()
    assert wait_until(lambda: consumer.metrics.rows_received == 300)
    for name, (found, _) in stored_versions(engine, model_name, keys).items():
        assert not found.any(), name


def test_older_delete_keeps_newer_row(kafka_broker, engine, model_name, start_consumer) -> None:
    consumer = start_consumer()
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    keys = np.arange(100, dtype=np.int64)
    pub.publish(TABLE, keys, rows_for(keys, 9), 9)
    pub.flush()
    assert wait_until(lambda: consumer.metrics.rows_received == 100)
    pub.delete(TABLE, keys, 4)  # a lagging delete, older than the stored rows
    pub.flush()
    assert wait_until(lambda: consumer.metrics.rows_received == 200)
    assert all_served(engine, model_name, keys, 9)


def test_malformed_messages_go_to_dlq_and_consumer_lives(
    kafka_broker, engine, model_name, start_consumer
) -> None:
    consumer = start_consumer()
    topic = f"hps.{model_name}"
    keys = np.arange(4, dtype=np.int64)
    nan_rows = np.ones((4, DIM), np.float32)
    nan_rows[2, 3] = np.nan
    short_vectors = EmbeddingUpdate.FromString(encode_update(model_name, TABLE, keys, np.ones((4, DIM), np.float32), keys))
    short_vectors.vectors = short_vectors.vectors[:-4]
    bad = [
        b"\xff\xff\xff not a protobuf",
        encode_update(model_name, TABLE, keys, np.ones((4, DIM + 1), np.float32), keys),  # wrong dim
        encode_update(model_name, "nosuchtable", keys, np.ones((4, DIM), np.float32), keys),  # unknown table
        encode_update(model_name, TABLE, keys, nan_rows, keys),  # NaN
        encode_update("othermodel", TABLE, keys, np.ones((4, DIM), np.float32), keys),  # wrong model
        short_vectors.SerializeToString(),  # vectors shorter than keys * dim
    ]
    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap})
    for i, payload in enumerate(bad):
        producer.produce(topic, value=payload, partition=i % 4)
    assert producer.flush(10) == 0
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    good = np.arange(100, 200, dtype=np.int64)
    pub.publish(TABLE, good, rows_for(good, 1), 1)
    pub.flush()
    assert wait_until(lambda: all_served(engine, model_name, good, 1)), consumer.stats()
    assert consumer.stats()["malformed"] == {model_name: len(bad)}
    found, _ = stored_versions(engine, model_name, keys)["persistent"]
    assert not found.any()
    reader = Consumer({"bootstrap.servers": kafka_broker.bootstrap, "group.id": "dlq-reader"})
    reader.assign([TopicPartition(f"{topic}.dlq", 0, OFFSET_BEGINNING)])
    dead = []
    deadline = time.monotonic() + 20
    while len(dead) < len(bad) and time.monotonic() < deadline:
        dead.extend(m for m in reader.consume(100, timeout=0.2) if m.error() is None)
    reader.close()
    assert sorted(m.value() for m in dead) == sorted(bad)
    assert all(dict(m.headers())["hps-error"] for m in dead)


def test_broker_paused_then_resumed_consumer_catches_up(
    kafka_broker, engine, model_name, start_consumer
) -> None:
    consumer = start_consumer()
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    before = np.arange(2_000, dtype=np.int64)
    pub.publish(TABLE, before, rows_for(before, 1), 1)
    pub.flush()
    assert wait_until(lambda: all_served(engine, model_name, before, 1))
    after = np.arange(2_000, 4_000, dtype=np.int64)
    assert wait_until(lambda: (served(engine, model_name, before)[1] == Source.CACHE).all())  # rows in L1
    kafka_broker.pause()
    try:
        pub.publish(TABLE, after, rows_for(after, 2), 2)  # queued in the producer while the broker is frozen
        pub.publish(TABLE, before, rows_for(before, 2), 2)
        paused_until = time.monotonic() + 3.0
        while time.monotonic() < paused_until:  # serving goes on from the tiers while the broker is down
            assert all_served(engine, model_name, before, 1)
            time.sleep(0.05)
    finally:
        kafka_broker.resume()
    pub.flush(timeout=60)
    both = np.concatenate((before, after))
    assert wait_until(lambda: all_served(engine, model_name, both, 2), timeout=60), consumer.stats()
    assert consumer.ready


def test_consumer_sigkilled_mid_ingest_loses_nothing(kafka_broker, tmp_path, model_name, updates_cfg) -> None:
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    expected = publish_distinct_then_newer(pub, 60_000, 250)
    keys = np.arange(expected.shape[0], dtype=np.int64)
    total = expected.shape[0] * 11 // 10
    db = tmp_path / "db"
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.updates.consumer_process", kafka_broker.bootstrap, model_name, "pod-0", str(db)],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )
    try:
        received = 0
        assert child.stdout is not None
        for line in child.stdout:
            received = int(line)
            if received >= total // 3:
                break
        child.send_signal(signal.SIGKILL)  # no stop(), no final commit, RocksDB not closed
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert total // 3 <= received < total, "the child finished before it was killed; the test proves nothing"
    engine = make_engine(db, model_name)  # the same RocksDB volume, a fresh process state
    consumer = UpdateConsumer(updates_cfg, engine, [model_name], "pod-0", partitions=4)
    try:
        consumer.start()
        assert consumer.wait_ready(30)
        assert any(o >= 0 for o in consumer.progress.start_offsets.values()), "the killed consumer never committed"
        assert wait_until(lambda: all_served(engine, model_name, keys, expected), timeout=120), consumer.stats()
        found, versions = stored_versions(engine, model_name, keys)["persistent"]
        assert found.all() and (versions == expected).all()
    finally:
        consumer.stop()
        engine.close()


def test_consumer_started_while_broker_down_becomes_ready_after(
    kafka_broker, engine, model_name, updates_cfg
) -> None:
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)  # the topic exists before the outage
    keys = np.arange(1_000, dtype=np.int64)
    pub.publish(TABLE, keys, rows_for(keys, 1), 1)
    pub.flush()
    consumer = UpdateConsumer(updates_cfg, engine, [model_name], "pod-0", partitions=4)
    kafka_broker.pause()
    try:
        consumer.start()
        assert not consumer.wait_ready(1.5)  # cannot know its offsets yet: not ready, and not crashed
        assert consumer._thread is not None and consumer._thread.is_alive()
        _, sources = served(engine, model_name, keys)  # serving is unaffected meanwhile
        assert (sources == Source.DEFAULT).all()
    finally:
        kafka_broker.resume()
    try:
        assert consumer.wait_ready(60), consumer.stats()
        assert wait_until(lambda: all_served(engine, model_name, keys, 1), timeout=60), consumer.stats()
    finally:
        consumer.stop()


def test_models_registered_and_unloaded_at_runtime_are_followed(
    kafka_broker, engine, model_name, start_consumer
) -> None:
    """follow(): a model registered after start gets its updates; one unloaded meanwhile loses none of them."""
    from hps_service.config import ModelConfig, TableConfig

    consumer = start_consumer()
    late = f"{model_name}late"
    late_model = ModelConfig(name=late, tables=[TableConfig(name=TABLE, dim=DIM)])
    engine.register_model(late_model)
    consumer.follow([model_name, late])
    pub = Publisher(kafka_broker.bootstrap, late, partitions=4)
    first = np.arange(0, 500, dtype=np.int64)
    pub.publish(TABLE, first, rows_for(first, 1), 1)
    pub.flush()
    assert wait_until(lambda: all_served(engine, late, first, 1)), consumer.stats()
    assert f"hps.{late}" in consumer.stats()["topics"]

    engine.unregister_model(late)
    consumer.follow([model_name])
    assert wait_until(lambda: f"hps.{late}" not in consumer.stats()["topics"]), consumer.stats()
    second = np.arange(500, 900, dtype=np.int64)
    pub.publish(TABLE, second, rows_for(second, 2), 2)  # published while the model is away
    pub.publish(TABLE, first[:100], rows_for(first[:100], 3), 3)
    pub.flush()
    time.sleep(0.5)  # give a wrongly still-assigned partition time to read (and dead-letter) them

    engine.register_model(late_model)
    consumer.follow([model_name, late])
    assert wait_until(lambda: all_served(engine, late, second, 2)), consumer.stats()
    assert wait_until(lambda: all_served(engine, late, first[:100], 3)), consumer.stats()
    assert all_served(engine, late, first[100:], 1)
    assert consumer.stats()["malformed"] == {}
    mine = Publisher(kafka_broker.bootstrap, model_name, partitions=4)  # the first model was followed throughout
    keys = np.arange(10, dtype=np.int64)
    mine.publish(TABLE, keys, rows_for(keys, 4), 4)
    mine.flush()
    assert wait_until(lambda: all_served(engine, model_name, keys, 4)), consumer.stats()

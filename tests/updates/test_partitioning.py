"""The partition function is Kafka's: murmur2 of the key's 8 big-endian bytes, checked against a scalar port of
Kafka's Java ``Utils.murmur2`` and against where librdkafka's ``murmur2_random`` partitioner puts keyed records on a
real broker."""

from __future__ import annotations

import struct
import time
import uuid

import numpy as np
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from hps_service.updates.partitioning import murmur2, partition_of, shard_of


def java_murmur2(data: bytes) -> int:
    """A line-by-line port of Kafka's ``org.apache.kafka.common.utils.Utils.murmur2`` (any length), unsigned."""
    m, h = 0x5BD1E995, (0x9747B28C ^ len(data)) & 0xFFFFFFFF
    whole = len(data) // 4
    for i in range(whole):
        k = int.from_bytes(data[4 * i : 4 * i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail = data[4 * whole :]
    if len(tail) == 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if tail:
        h ^= tail[0]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    return h ^ (h >> 15)


def _signed(x: int) -> int:
    return x - (1 << 32) if x >= 1 << 31 else x


KEYS = np.concatenate((
    np.array([0, 1, -1, 255, 256, 2**31, 2**32, 2**63 - 1, -(2**63)], dtype=np.int64),
    np.random.default_rng(3).integers(-(2**63), 2**63 - 1, 600, dtype=np.int64, endpoint=True),
))


def test_reference_port_matches_kafkas_own_test_vectors() -> None:
    # values from Kafka's UtilsTest.testMurmur2 (Java ints)
    for text, expected in [("21", -973932308), ("foobar", -790332482), ("a-little-bit-long-string", -985981536),
                           ("a-little-bit-longer-string", -1486304829), ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971)]:
        assert _signed(java_murmur2(text.encode())) == expected


def test_vectorised_murmur2_equals_the_reference() -> None:
    expected = np.array([java_murmur2(struct.pack(">q", int(k))) for k in KEYS], dtype=np.uint32)
    np.testing.assert_array_equal(murmur2(KEYS), expected)
    for partitions in (1, 4, 7, 24):
        np.testing.assert_array_equal(partition_of(KEYS, partitions), (expected & 0x7FFFFFFF) % partitions)
    np.testing.assert_array_equal(shard_of(KEYS, 24, 4), partition_of(KEYS, 24) % 4)
    assert partition_of(np.empty(0, dtype=np.int64), 4).shape == (0,)
    with pytest.raises(ValueError, match="multiple"):
        shard_of(KEYS, 10, 4)


def test_keys_spread_evenly_over_partitions() -> None:
    keys = np.arange(200_000, dtype=np.int64) * 1_000_003
    counts = np.bincount(partition_of(keys, 24), minlength=24)
    assert counts.min() > 0.95 * counts.mean() and counts.max() < 1.05 * counts.mean()


def test_librdkafka_murmur2_random_puts_keyed_records_where_we_say(kafka_broker) -> None:
    partitions = 12
    topic = f"murmur2-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topics([topic], partitions)
    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap, "partitioner": "murmur2_random",
                         "linger.ms": 5})
    acked: dict[bytes, int] = {}

    def on_delivery(err, msg) -> None:
        assert err is None, err
        acked[msg.key()] = msg.partition()

    for k in KEYS.tolist():
        producer.produce(topic, key=struct.pack(">q", k), value=b"x", on_delivery=on_delivery)  # no partition given
    assert producer.flush(30) == 0
    consumer = Consumer({"bootstrap.servers": kafka_broker.bootstrap, "group.id": "murmur2-check",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 10})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    stored: dict[bytes, int] = {}
    deadline = time.monotonic() + 30
    try:
        while len(stored) < len(KEYS) and time.monotonic() < deadline:
            for msg in consumer.consume(1000, timeout=0.2):
                if msg.error() is None:
                    stored[msg.key()] = msg.partition()
    finally:
        consumer.close()
    ours = dict(zip((struct.pack(">q", k) for k in KEYS.tolist()), partition_of(KEYS, partitions).tolist()))
    assert acked == ours
    assert stored == ours
    assert len(set(ours.values())) == partitions

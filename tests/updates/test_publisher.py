"""Publisher against a real tansu broker: message fields, key routing, the 1 MiB cap, validation, delivery errors."""

from __future__ import annotations

import time

import numpy as np
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from hps_service.errors import InvalidArgumentError, UnavailableError
from hps_service.proto.hps.v1.update_pb2 import EmbeddingUpdate
from hps_service.updates import Publisher, make_version, split_version
from hps_service.updates.message import MAX_MESSAGE_BYTES, decode_update, rows_per_message
from hps_service.updates.partitioning import partition_of
from tests.updates.conftest import rows_for


def read_all(bootstrap: str, topic: str, partitions: int, expect: int, timeout: float = 30.0) -> list:
    """Every message of ``topic`` from the beginning (waits until ``expect`` arrived)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "reader", "enable.auto.commit": False,
                  "fetch.wait.max.ms": 10})
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    out = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < expect and time.monotonic() < deadline:
            out.extend(m for m in c.consume(1000, timeout=0.2) if m.error() is None)
    finally:
        c.close()
    return out


def test_make_version_orders_by_generation_then_step() -> None:
    v = [make_version(0, 7), make_version(0, 2**32 - 1), make_version(1, 0), make_version(3, 5)]
    assert v == sorted(v)
    assert split_version(make_version(3, 5)) == (3, 5)
    with pytest.raises(ValueError):
        make_version(0, 2**32)
    with pytest.raises(ValueError):
        make_version(-1, 0)


def test_round_trip_fields_and_routing(kafka_broker, model_name) -> None:
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    keys = np.arange(-500, 1500, dtype=np.int64) * 7919
    before = time.time_ns()
    pub.publish("item", keys, rows_for(keys, 1, dim=8), make_version(0, 1))
    pub.publish("item", keys, rows_for(keys, 2, dim=8), make_version(0, 2))
    pub.delete("item", keys[:10], make_version(0, 3))
    pub.flush()
    after = time.time_ns()
    msgs = read_all(kafka_broker.bootstrap, pub.topic, 4, expect=pub.messages_sent)
    assert len(msgs) == pub.messages_sent
    seen: dict[int, list[tuple[int, int]]] = {}
    for m in msgs:
        upd = decode_update(m.value())
        assert (upd.model, upd.table) == (model_name, "item")
        assert before <= upd.produced_at_ns <= after
        all_keys = np.concatenate((upd.keys, upd.delete_keys))
        assert (partition_of(all_keys, 4) == m.partition()).all()
        if upd.keys.size:
            assert upd.dim == 8
            np.testing.assert_array_equal(upd.vectors, rows_for(upd.keys, upd.versions, dim=8))
        np.testing.assert_array_equal(upd.delete_versions, make_version(0, 3))
        for k, v in zip(all_keys.tolist(), np.concatenate((upd.versions, upd.delete_versions)).tolist()):
            seen.setdefault(k, []).append((m.partition(), m.offset(), v))
    assert set(seen) == set(keys.tolist())
    for entries in seen.values():
        assert len({p for p, _, _ in entries}) == 1  # one key, one partition
        versions_in_offset_order = [v for _, _, v in sorted(entries)]
        assert versions_in_offset_order == sorted(versions_in_offset_order)  # order of one key's updates kept
    assert len({p for entries in seen.values() for p, _, _ in entries}) == 4  # keys spread over partitions


def test_one_mib_cap_splits_messages(kafka_broker, model_name) -> None:
    dim = 1024
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    candidates = np.arange(20_000, dtype=np.int64)
    keys = candidates[partition_of(candidates, 4) == 2][:1000]
    cap = rows_per_message(dim)
    sent = pub.publish("big", keys, rows_for(keys, 1, dim=dim), 1)
    pub.flush()
    assert sent == -(-1000 // cap) and sent >= 4
    msgs = read_all(kafka_broker.bootstrap, pub.topic, 4, expect=sent)
    assert len(msgs) == sent
    sizes = [len(m.value()) for m in msgs]
    assert max(sizes) <= MAX_MESSAGE_BYTES
    assert sorted(sizes)[-2] > 0.9 * MAX_MESSAGE_BYTES  # full messages are near the cap, not tiny
    got = np.concatenate([decode_update(m.value()).keys for m in sorted(msgs, key=lambda m: m.offset())])
    np.testing.assert_array_equal(got, keys)  # order within the partition is the publish order


def test_invalid_inputs_raise_invalid_argument(kafka_broker, model_name) -> None:
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
    keys = np.arange(4, dtype=np.int64)
    good = np.ones((4, 8), dtype=np.float32)
    bad_cases = [
        ("item", keys, np.ones((4,), dtype=np.float32), 1),  # 1-D rows
        ("item", keys, np.ones((3, 8), dtype=np.float32), 1),  # row count != key count
        ("item", keys.astype(np.float64), good, 1),  # float keys
        ("item", keys, np.where(np.eye(4, 8) > 0, np.nan, 1.0), 1),  # NaN
        ("item", keys, np.full((4, 8), np.inf), 1),  # inf
        ("item", keys, np.full((4, 8), 1e39), 1),  # overflows float32 to inf
        ("item", keys, np.array([["a"] * 8] * 4), 1),  # strings
        ("item", keys, good, np.array([1, 2, 3])),  # wrong number of versions
        ("item", keys, good, -1),  # negative version
        ("item", keys, good, 1.5),  # float version
        ("bad.table", keys, good, 1),  # invalid table name
        ("item", keys.reshape(2, 2), good, 1),  # 2-D keys
    ]
    for table, k, rows, version in bad_cases:
        with pytest.raises(InvalidArgumentError):
            pub.publish(table, k, rows, version)
    with pytest.raises(InvalidArgumentError):
        pub.delete("item", keys, np.array([1, 2]))
    with pytest.raises(InvalidArgumentError):
        Publisher(kafka_broker.bootstrap, "bad.model")
    assert pub.messages_sent == 0


def test_delivery_error_is_raised_not_lost(kafka_broker, model_name) -> None:
    pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4, **{"message.timeout.ms": 1000})
    keys = np.arange(100, dtype=np.int64)
    kafka_broker.pause()
    try:
        pub.publish("item", keys, rows_for(keys, 1), 1)
        with pytest.raises(UnavailableError, match="failed delivery|not acknowledged"):
            pub.flush(timeout=10)
    finally:
        kafka_broker.resume()
    # The publisher still works once the broker is back. Requests of the outage may still be answered as
    # fenced (librdkafka bumped the producer epoch), failing one more round; a fatal error replaces the producer.
    pub.publish("item", keys, rows_for(keys, 2), 2)
    try:
        pub.flush()
    except UnavailableError as exc:
        assert "fenc" in str(exc) or "epoch" in str(exc), exc
        pub.publish("item", keys, rows_for(keys, 2), 2)
        pub.flush()


def test_message_encoding_is_packed_little_endian() -> None:
    from hps_service.updates.message import encode_update

    payload = encode_update("m", "t", np.array([1, 2]), np.ones((2, 3), np.float32), np.array([5, 6]))
    msg = EmbeddingUpdate.FromString(payload)
    assert msg.keys == np.array([1, 2], "<i8").tobytes()
    assert msg.versions == np.array([5, 6], "<i8").tobytes()
    assert len(msg.vectors) == 2 * 3 * 4 and msg.dim == 3

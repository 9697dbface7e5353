"""Offset gaps (hps_service.updates.gaps): the consumer never moves past a record the broker acknowledged but had
not shown to its fetch yet, and still moves past real holes (transaction markers)."""

from __future__ import annotations

import threading
import time

import numpy as np
from confluent_kafka import Producer

from hps_service.updates import Publisher, UpdateConsumer
from hps_service.updates.gaps import OffsetGaps
from hps_service.updates.message import encode_update, topic_name
from hps_service.updates.publisher import Deliveries
from tests.updates.conftest import TABLE, rows_for, stored_versions, wait_until

P = ("hps.m", 3)


def test_a_gap_is_read_again_then_closed_by_the_missing_record() -> None:
    gaps = OffsetGaps(recheck_s=3600)
    gaps.expect(P, 10)
    gaps.taken(P, 10)
    assert gaps.check(P, 13) == 11  # 11 and 12 not seen: read again from 11
    assert gaps.check(P, 13) == 11  # still the same gap, well within recheck_s: again
    assert gaps.check(P, 11) is None
    gaps.taken(P, 11)
    assert gaps.stats() == {"offset_gaps_seen": 1, "offset_gaps_closed": 1, "offset_gaps_accepted": 0}
    assert gaps.check(P, 12) is None and gaps.check(P, 11) is None  # in order, or a redelivery after a seek


def test_a_gap_that_stays_is_accepted_as_a_hole_after_recheck_s() -> None:
    gaps = OffsetGaps(recheck_s=0.01)
    gaps.expect(P, 5)
    assert gaps.check(P, 7) == 5  # seen once: always read again first
    time.sleep(0.02)
    assert gaps.check(P, 7) is None  # the same gap again once recheck_s passed: a hole
    gaps.taken(P, 7)
    assert gaps.check(P, 8) is None
    assert gaps.stats() == {"offset_gaps_seen": 1, "offset_gaps_closed": 0, "offset_gaps_accepted": 1}


def test_recheck_s_0_turns_checking_off() -> None:
    gaps = OffsetGaps(recheck_s=0.0)
    gaps.expect(P, 5)
    assert gaps.check(P, 9) is None


def test_unknown_or_forgotten_positions_are_not_checked() -> None:
    gaps = OffsetGaps(recheck_s=3600)
    assert gaps.check(P, 100) is None  # never told where the partition starts
    gaps.expect(P, -2)  # OFFSET_BEGINNING: unknown
    assert gaps.check(P, 100) is None
    gaps.expect(P, 0)
    gaps.forget([P])
    assert gaps.check(P, 100) is None


def test_concurrent_producers_lose_no_acknowledged_update(kafka_broker, engine, model_name, updates_cfg) -> None:
    """Three producers writing the same partitions at once, as the trainer, the REST admin writes of every replica
    and other publishers do: tansu then acknowledges some records before a concurrent fetch can see them (seen
    about once per 3,000-9,000 messages). Every acknowledged key must be applied."""
    consumer = UpdateConsumer(updates_cfg, engine, [model_name], "pod-0", partitions=4)
    consumer.start()
    try:
        assert consumer.wait_ready(30), consumer.stats()
        errors: list[str] = []

        def produce(worker: int) -> None:
            pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4, **{"linger.ms": worker % 2})
            try:
                for i in range(2000):  # one key per message, so a skipped message is a missing key
                    key = np.array([worker * 1_000_000 + i], dtype=np.int64)
                    deliveries = Deliveries()
                    pub.publish(TABLE, key, rows_for(key, 1), 1, deliveries=deliveries)
                    if i % 4 == 3:
                        pub.wait(deliveries)
                pub.flush()
            except Exception as exc:  # noqa: BLE001  (reported below)
                errors.append(f"producer {worker}: {exc}")

        threads = [threading.Thread(target=produce, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        topic = topic_name(model_name)
        keys = np.concatenate([w * 1_000_000 + np.arange(2000, dtype=np.int64) for w in range(3)])

        def stored() -> np.ndarray:
            return stored_versions(engine, model_name, keys)["persistent"][0]

        # a skipped message never shows up: its key stays missing after the consumer applied everything after it
        assert wait_until(lambda: stored().all(), timeout=60), (
            f"{int((~stored()).sum())} acknowledged keys never applied, e.g. {keys[~stored()][:5]}; {consumer.stats()}")
        stats = consumer.stats()
        assert stats["offset_gaps_seen"] >= stats["offset_gaps_closed"] + stats["offset_gaps_accepted"]
        assert stats["offset_gaps_accepted"] == 0, f"no hole exists on {topic}; {stats}"
        print("GAPS", {k: v for k, v in stats.items() if k.startswith("offset_gaps")})
    finally:
        consumer.stop()


def test_transaction_markers_are_holes_the_consumer_moves_past(kafka_broker, engine, model_name, updates_cfg) -> None:
    """A transactional producer leaves a control record after each commit: offsets with no message. The consumer
    reads such a hole again, then moves past it, and applies everything after it."""
    consumer = UpdateConsumer(updates_cfg.model_copy(update={"offset_gap_recheck_s": 0.2}), engine, [model_name],
                              "pod-0", partitions=1)
    consumer.start()
    try:
        assert consumer.wait_ready(30), consumer.stats()
        producer = Producer({"bootstrap.servers": kafka_broker.bootstrap, "transactional.id": f"{model_name}-tx"})
        producer.init_transactions(30)
        keys = np.arange(1, 6, dtype=np.int64)
        for key in keys:
            one = np.array([key], dtype=np.int64)
            producer.begin_transaction()
            producer.produce(topic_name(model_name), encode_update(model_name, TABLE, one, rows_for(one, 3),
                                                                    np.array([3], dtype=np.int64)), partition=0)
            producer.commit_transaction(30)
        assert wait_until(lambda: stored_versions(engine, model_name, keys)["persistent"][0].all(), timeout=60), (
            consumer.stats())
        stats = consumer.stats()
        assert stats["offset_gaps_accepted"] >= 1, stats  # the markers between the messages
        assert stats["offset_gaps_closed"] == 0, stats
    finally:
        consumer.stop()

"""A shard's UpdateConsumer assigns only its partitions (p % shards == shard) and refuses a topic whose partition
count is not the configured P, against the real tansu broker."""

from __future__ import annotations

import numpy as np

from hps_service.engine import Source
from hps_service.updates import Publisher, UpdateConsumer, make_version
from hps_service.updates.partitioning import shard_of
from tests.updates.conftest import TABLE, rows_for, served, wait_until


def test_a_shard_applies_only_its_partitions(kafka_broker, updates_cfg, engine, model_name) -> None:
    consumer = UpdateConsumer(updates_cfg, engine, [model_name], "shard-1", partitions=4, shards=2, shard=1)
    consumer.start()
    try:
        assert consumer.wait_ready(30), consumer.stats()
        assert sorted(tp.partition for tp in consumer.assignment.assigned) == [1, 3]
        assert consumer.topic_partitions == {f"hps.{model_name}": 4}
        keys = np.arange(4000, dtype=np.int64) * 7 + 1
        mine = shard_of(keys, 4, 2) == 1
        pub = Publisher(kafka_broker.bootstrap, model_name, partitions=4)
        pub.publish(TABLE, keys, rows_for(keys, 1), make_version(0, 1))
        pub.flush()
        assert wait_until(lambda: consumer.stats()["rows_applied"] >= mine.sum(), timeout=30), consumer.stats()
        vectors, sources = served(engine, model_name, keys)
        np.testing.assert_array_equal(vectors[mine], rows_for(keys[mine], 1))
        assert (sources[~mine] == Source.DEFAULT).all()  # the other shard's rows were never applied here
        assert consumer.stats()["rows_applied"] == mine.sum()
    finally:
        consumer.stop()


def test_a_shard_refuses_a_topic_with_another_partition_count(kafka_broker, updates_cfg, engine, model_name) -> None:
    kafka_broker.create_topics([f"hps.{model_name}"], 4)
    consumer = UpdateConsumer(updates_cfg, engine, [model_name], "shard-0", partitions=8, shards=2, shard=0)
    consumer.start()
    try:
        assert not consumer.wait_ready(2)
        assert "has 4 partitions but cluster.partitions is 8" in (consumer.last_error or ""), consumer.stats()
    finally:
        consumer.stop()
    unsharded = UpdateConsumer(updates_cfg, engine, [model_name], "whole", partitions=8)
    unsharded.start()
    try:  # unsharded, every key is on shard 0 whatever the count: the topic is taken as it is
        assert unsharded.wait_ready(30), unsharded.stats()
        assert len(unsharded.assignment.assigned) == 4
    finally:
        unsharded.stop()

"""A replica whose update topic was deleted and created again while it was down (issue 27, defect 3), end to end:
it stops the topic's partitions, says so on ``/readyz`` (503 naming the partitions), in gRPC health (NOT_SERVING
for the server and the model) and in ``hps_update_log_gaps_total``, refuses to snapshot rows that miss updates,
and bootstraps the partitions again by itself from the first snapshot another replica uploads of the new topic.
Real components: in-process servers, tansu, SeaweedFS.

The topic is recreated while no consumer fetches it: a librdkafka consumer fetching a topic that tansu deletes
crashes its process (SIGSEGV in rd_kafka_metadata_update_op: the leader-discovery tags of tansu's fetch response
become a metadata update without a topic name). The same detection while running is tested at its seam
(``tests/updates/test_lost_updates.py``)."""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hps_service.admin.snapshots import Snapshots
from hps_service.client import HPSClient
from hps_service.config import UpdatesConfig, load_config
from hps_service.engine import LookupEngine
from hps_service.fleet.bucket import SnapshotBucket
from hps_service.fleet.snapshots import BucketStore
from hps_service.serve.process import HPSServer
from hps_service.updates import Publisher, UpdateConsumer
from tests.helpers import free_port
from tests.updates.conftest import make_engine, rows_for, wait_until
from tests.updates.test_lost_updates import recreate

DIM, PARTITIONS = 16, 2
TOKEN = "lost-updates-token"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def store_url(s3_server, monkeypatch) -> str:
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return f"s3://{s3_server.new_bucket()}/fleet"


def health(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=5).status


def test_a_topic_created_again_under_a_running_replica_is_bootstrapped_again(
        kafka_broker, tmp_path: Path, store_url: str) -> None:
    model, prefix = f"l{uuid.uuid4().hex[:8]}", f"p{uuid.uuid4().hex[:6]}"
    topic = f"{prefix}.{model}"
    updates = {"type": "kafka", "brokers": kafka_broker.bootstrap, "topic_prefix": prefix,
               "log_check_interval_s": 0.2}
    config = load_config(
        None,
        server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "admin_token": TOKEN, "workers": 0},
        cache={"backend": "numpy", "capacity": 4096, "warm_start": False},
        volatile={"type": "hashmap", "capacity_rows": 100_000},
        persistent={"type": "rocksdb", "path": str(tmp_path / "a"), "block_cache_mb": 8, "snapshot_store": store_url},
        updates={**updates, "group": "replica-a"},
        cluster={"partitions": PARTITIONS},
        models=[{"name": model, "tables": [{"name": "item", "dim": DIM}]}],
    )
    keys = np.arange(300, dtype=np.int64)

    def publish(version: int, messages: int) -> None:
        with Publisher(kafka_broker.bootstrap, model, topic_prefix=prefix, partitions=PARTITIONS) as pub:
            for chunk in np.array_split(keys, messages):
                pub.publish("item", chunk, rows_for(chunk, version), version)
                pub.flush()

    def caught_up_replica(path: Path, group: str) -> LookupEngine:
        """A replica's store that applied the topic as it is now (what a server that ran until now leaves)."""
        engine = make_engine(path, model)
        consumer = UpdateConsumer(UpdatesConfig(**updates), engine, [model], group, partitions=PARTITIONS)
        consumer.start()
        try:
            assert consumer.wait_caught_up(60), consumer.stats()
        finally:
            consumer.stop()
        return engine

    publish(1, 4)
    caught_up_replica(tmp_path / "a", "replica-a").close()
    recreate(kafka_broker.bootstrap, topic, PARTITIONS)
    publish(2, 20)  # longer than the positions the replica stands at: resuming there would skip records
    srv = HPSServer(config)
    srv.start()
    http = httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}", timeout=10,
                        headers={"Authorization": f"Bearer {TOKEN}"})
    target = f"127.0.0.1:{srv.grpc_port}"
    try:
        def reasons() -> str:  # 503 from the start: "no partitions yet" until the consumer has checked its log
            r = http.get("/readyz")
            return " ".join(r.json()["not_ready"]) if r.status_code == 503 else ""

        lost = f"{topic}[0]: the topic was deleted and created again"
        assert wait_until(lambda: lost in reasons(), timeout=30), http.get("/readyz").json()
        assert f"{topic}[1]" in reasons()
        assert health(target, "") == NOT_SERVING and health(target, model) == NOT_SERVING
        metrics = http.get("/metrics").text
        assert f'hps_update_log_gaps_total{{partition="0",topic="{topic}"}} 1.0' in metrics
        refused = http.post(f"/v1/models/{model}/snapshots")
        assert refused.status_code == 503 and "miss updates" in refused.text, refused.text

        # Another replica reads the new topic from its start and uploads a snapshot: the first replica restores
        # the lost partitions' rows from it and replays the topic from the snapshot's positions.
        other = caught_up_replica(tmp_path / "b", "replica-b")
        try:
            Snapshots(other, BucketStore(SnapshotBucket(store_url), tmp_path / "b-snapshots",
                                         lambda m: [f"{prefix}.{m}"])).take(model)
        finally:
            other.close()
        assert wait_until(lambda: http.get("/readyz").status_code == 200, timeout=60), http.get("/readyz").json()
        with HPSClient(target) as client:
            assert np.array_equal(client.lookup(model, "item", keys), rows_for(keys, 2))
        publish(3, 2)  # and it follows the topic again
        with HPSClient(target) as client:
            assert wait_until(lambda: np.array_equal(client.lookup(model, "item", keys), rows_for(keys, 3)),
                              timeout=30)
    finally:
        http.close()
        srv.stop(grace=1)

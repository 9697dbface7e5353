"""Replicas you can lose, with real components: `hps serve` processes, the tansu broker, SeaweedFS as S3.

- A replica started empty behind 200k rows is NOT_SERVING until caught up, and from its first SERVING answers every
  row published before it started.
- A replica SIGKILLed while a snapshot upload is half-way, its RocksDB deleted, restarts from the last complete
  snapshot (never the partial one), replays from that snapshot's positions and loses nothing.
- A REST put or delete on replica A is served by replica B.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import grpc
import httpx
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hps_service.client import HPSClient
from hps_service.engine import Source
from hps_service.fleet.bucket import SnapshotBucket
from hps_service.updates import Publisher
from tests.faults.support import readyz, rows_for, wait_for
from tests.helpers import HPS, REPO, free_port, write_config

DIM = 8
PREFIX = "fleet"
TOKEN = "fleet-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SERVING = health_pb2.HealthCheckResponse.SERVING


class Replica:
    """One `hps serve` process of a fleet: its own RocksDB and consumer group, the shared topic and snapshot store."""

    def __init__(self, tmp: Path, name: str, brokers: str, model: str, store: str | None = None,
                 env: dict[str, str] | None = None, **persistent: object) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.db = tmp / name / "rocksdb"
        self.config = write_config(tmp / f"{name}.yaml", {
            "server": {"grpc_port": self.grpc_port, "http_port": self.http_port, "admin_token": TOKEN,
                       "grace_period_s": 5, "max_batch_keys": 65536},
            "cache": {"backend": "numpy", "capacity": 0.2, "warm_start": False},
            "volatile": {"type": "hashmap", "capacity_rows": 1_000_000},
            "persistent": {"type": "rocksdb", "path": str(self.db), "block_cache_mb": 16,
                           **({"snapshot_store": store} if store else {}), **persistent},
            "updates": {"type": "kafka", "brokers": brokers, "topic_prefix": PREFIX, "group": f"{name}-{model}"},
            "models": [{"name": model, "tables": [{"name": "item", "dim": DIM}]}],
        })
        self.env = {**os.environ, **(env or {})}
        self.target = f"127.0.0.1:{self.grpc_port}"
        self.base = f"http://127.0.0.1:{self.http_port}"
        self.proc: subprocess.Popen | None = None
        self.log = tmp / f"{name}.log"

    def start(self) -> Replica:
        self.proc = subprocess.Popen([*HPS, "serve", "--config", str(self.config)], cwd=REPO, env=self.env,
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "a"))  # noqa: SIM115
        return self

    def health(self) -> int | None:
        """gRPC health of service "" (None while the port does not answer)."""
        try:
            with grpc.insecure_channel(self.target) as channel:
                return health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=1).status
        except grpc.RpcError:
            return None

    def wait_serving(self, timeout: float = 120) -> None:
        wait_for(lambda: self._alive() and self.health() == SERVING, timeout, f"{self.target} SERVING")

    def _alive(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"hps serve exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}")
        return True

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _served(client: HPSClient, model: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    vectors, sources = [], []
    for lo in range(0, keys.shape[0], 50_000):
        answer = client.lookup_with_sources(model, "item", keys[lo : lo + 50_000])
        vectors.append(answer.vectors)
        sources.append(answer.sources)
    return np.concatenate(vectors), np.concatenate(sources)


def test_replica_started_behind_200k_rows_is_not_serving_until_caught_up(kafka_broker, tmp_path: Path) -> None:
    model = f"c{uuid.uuid4().hex[:8]}"
    keys = np.arange(1, 200_001, dtype=np.int64) * 7919
    with Publisher(kafka_broker.bootstrap, model, topic_prefix=PREFIX) as pub:
        for lo in range(0, keys.shape[0], 50_000):
            chunk = keys[lo : lo + 50_000]
            pub.publish("item", chunk, rows_for(chunk, 3, DIM), 3)
        pub.flush(60)
    replica = Replica(tmp_path, "late", kafka_broker.bootstrap, model)
    t0 = time.monotonic()
    replica.start()
    try:
        seen: list[int | None] = []
        reasons: list[str] = []
        while True:  # watch health closely from the first moment the port answers until the first SERVING
            replica._alive()
            status = replica.health()
            seen.append(status)
            if status == SERVING:
                break
            if status is not None and len(reasons) < 3:
                code, body = readyz(replica.http_port)
                reasons += [r for r in body.get("not_ready", []) if "catching up" in r]
            assert time.monotonic() - t0 < 180, "never became SERVING"
            time.sleep(0.01)
        caught_up_s = time.monotonic() - t0
        with HPSClient(replica.target) as client:
            vectors, sources = _served(client, model, keys)
        answered_s = time.monotonic() - t0
        defaults = int(np.count_nonzero(sources == Source.DEFAULT))
        print(f"\nreplica behind 200k rows: NOT_SERVING observed {seen.count(0) + seen.count(2)} times, then "
              f"SERVING {caught_up_s:.1f} s after the process started; all rows read back by {answered_s:.1f} s; "
              f"defaults for stored keys: {defaults}; /readyz said: {reasons[:1]}")
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen, "it must say NOT_SERVING while catching up"
        assert reasons, "/readyz must say it is catching up"
        assert defaults == 0
        assert np.array_equal(vectors, rows_for(keys, 3, DIM))
    finally:
        replica.stop()


def test_replica_killed_mid_snapshot_upload_with_its_volume_lost_restores_and_loses_nothing(
    kafka_broker, s3_server, tmp_path: Path
) -> None:
    model = f"s{uuid.uuid4().hex[:8]}"
    store = f"s3://{s3_server.new_bucket()}/fleet"
    # 1.5 MB/s: the second snapshot's upload takes seconds, so the replica can be killed half-way through it
    replica = Replica(tmp_path, "a", kafka_broker.bootstrap, model, store, env=s3_server.env,
                      snapshot_upload_bytes_per_s=1_500_000)
    first = np.arange(1, 5_001, dtype=np.int64)
    later = np.arange(100_001, 160_001, dtype=np.int64)
    deleted = first[:500]
    pub = Publisher(kafka_broker.bootstrap, model, topic_prefix=PREFIX)
    replica.start()
    try:
        replica.wait_serving()
        pub.publish("item", first, rows_for(first, 1, DIM), 1)
        pub.flush(30)
        with HPSClient(replica.target) as client:
            wait_for(lambda: np.array_equal(_served(client, model, first)[0], rows_for(first, 1, DIM)), 30,
                     "the first rows applied")
        r = httpx.post(f"{replica.base}/v1/models/{model}/snapshots", headers=AUTH, timeout=120)
        assert r.status_code == 201, r.text
        complete = r.json()
        assert complete["tables"]["item"]["rows"] == first.shape[0]
        # after the snapshot: new rows, newer versions of old ones, deletes (all must be replayed after a restore)
        pub.publish("item", later, rows_for(later, 2, DIM), 2)
        pub.publish("item", first[500:1000], rows_for(first[500:1000], 5, DIM), 5)
        pub.delete("item", deleted, 4)
        pub.flush(30)
        expected_keys = np.concatenate((first, later))
        expected = np.concatenate((rows_for(first, 1, DIM), rows_for(later, 2, DIM)))
        expected[500:1000] = rows_for(first[500:1000], 5, DIM)
        with HPSClient(replica.target) as client:
            wait_for(lambda: np.array_equal(_served(client, model, expected_keys[500:])[0], expected[500:]), 60,
                     "the later updates applied")
        bucket = SnapshotBucket(store, client=s3_server.client())
        def snapshot_killed_half_way() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server dies under it
                httpx.post(f"{replica.base}/v1/models/{model}/snapshots", headers=AUTH, timeout=120)

        uploading = threading.Thread(target=snapshot_killed_half_way, daemon=True)
        uploading.start()
        wait_for(lambda: len(bucket._snapshot_ids(model)) > 1, 60, "the second snapshot's upload to begin", 0.02)
        replica.kill()
        partial = [i for i in bucket._snapshot_ids(model) if i != complete["id"]]
        assert [m["id"] for m in bucket.list(model)] == [complete["id"]], "the killed upload must not be listed"
        shutil.rmtree(replica.db)  # the volume is lost

        replica.start()
        t0 = time.monotonic()
        replica.wait_serving()
        ready_s = time.monotonic() - t0
        with HPSClient(replica.target) as client:
            vectors, sources = _served(client, model, expected_keys)
        status, body = readyz(replica.http_port)
        stats = httpx.get(f"{replica.base}/v1/stats", timeout=10).json()["updates"]
        log = replica.log.read_text()
        print(f"\nreplica killed mid-upload, RocksDB deleted: restored {body['bootstrap']['restored']} "
              f"(partial upload {partial} ignored), SERVING {ready_s:.1f} s after the restart; replayed "
              f"{stats['rows_received']} rows from the snapshot's positions; defaults for stored keys: "
              f"{int(np.count_nonzero(sources[500:] == Source.DEFAULT))}")
        assert status == 200 and body["bootstrap"]["restored"] == {model: complete["id"]}
        assert "restoring snapshot " + complete["id"] in log
        assert not any(p in log for p in partial)
        assert np.array_equal(vectors[500:], expected[500:]), "a row published after the snapshot was lost"
        assert (sources[500:] != Source.DEFAULT).all()
        assert (sources[:500] == Source.DEFAULT).all(), "deleted rows must stay deleted"
        # replayed from the snapshot's positions, not from the start of the topic
        assert stats["rows_received"] == later.shape[0] + 500 + deleted.shape[0]
    finally:
        pub.close()
        replica.stop()


def test_rest_writes_on_one_replica_are_served_by_another(kafka_broker, tmp_path: Path) -> None:
    model = f"w{uuid.uuid4().hex[:8]}"
    a = Replica(tmp_path, "a", kafka_broker.bootstrap, model).start()
    b = Replica(tmp_path, "b", kafka_broker.bootstrap, model).start()
    keys = np.arange(1, 101, dtype=np.int64)
    try:
        a.wait_serving()
        b.wait_serving()
        with HPSClient(b.target) as on_b:
            on_b.lookup(model, "item", keys)  # warm: kernels compiled, defaults cached nowhere
            t0 = time.monotonic()
            r = httpx.put(f"{a.base}/v1/models/{model}/tables/item/embeddings", headers=AUTH, timeout=30,
                          json={"keys": keys.tolist(), "vectors": rows_for(keys, 7, DIM).tolist(), "version": 7})
            acked_s = time.monotonic() - t0
            assert r.status_code == 200 and r.json()["published"] == keys.shape[0], r.text
            wait_for(lambda: np.array_equal(on_b.lookup(model, "item", keys), rows_for(keys, 7, DIM)), 10,
                     "the put on A served by B", 0.005)
            put_s = time.monotonic() - t0
            r = httpx.request("DELETE", f"{a.base}/v1/models/{model}/tables/item/embeddings?wait=applied",
                              headers=AUTH, json={"keys": keys[:10].tolist()}, timeout=30)
            assert r.status_code == 200 and r.json()["applied"] is True, r.text
            with HPSClient(a.target) as on_a:  # applied on A when answered
                assert set(on_a.lookup_with_sources(model, "item", keys[:10]).sources.tolist()) == {Source.DEFAULT}
            wait_for(lambda: set(on_b.lookup_with_sources(model, "item", keys[:10]).sources.tolist())
                     == {Source.DEFAULT}, 10, "the delete on A applied by B", 0.005)
        print(f"\nREST put on replica A: acknowledged in {acked_s * 1e3:.0f} ms, served by replica B "
              f"{put_s * 1e3:.0f} ms after the request (freshness target 1 s)")
    finally:
        a.stop()
        b.stop()

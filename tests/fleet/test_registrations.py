"""Models registered at runtime in a fleet (issue 27, defect 7): ``POST /v1/models`` returns once every gRPC worker
of the node serves the model, and the registration travels through the registration log to every other replica
(an unload too). Two in-process replicas, the first with two gRPC worker processes, and tansu."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from hps_service.client import HPSClient
from hps_service.config import load_config
from hps_service.server.app import HPSServer
from hps_service.updates import Publisher
from tests.helpers import free_port
from tests.updates.conftest import wait_until

TOKEN = "registrations-token"
DIM = 8


class Replica:
    """One in-process replica: a server with ``workers`` worker processes, its REST client, and a client per worker
    (no retries)."""

    def __init__(self, tmp: Path, name: str, brokers: str, prefix: str, workers: int) -> None:
        self.config = load_config(
            None,
            server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "admin_token": TOKEN,
                    "workers": workers, "grace_period_s": 2},
            cache={"backend": "numpy", "capacity": 1024, "warm_start": False},
            volatile={"type": "hashmap", "capacity_rows": 10_000},
            persistent={"type": "rocksdb", "path": str(tmp / name), "block_cache_mb": 8},
            updates={"type": "kafka", "brokers": brokers, "topic_prefix": prefix, "group": name},
            cluster={"partitions": 2},
            models=[{"name": "base", "tables": [{"name": "item", "dim": DIM}]}],
        )
        self.srv = HPSServer(self.config)
        self.srv.start()
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.srv.http_port}", timeout=60,
                                 headers={"Authorization": f"Bearer {TOKEN}"})
        target = f"127.0.0.1:{self.srv.grpc_port}"
        self.clients = self._client_per_worker() if workers else [HPSClient(target, retries=0)]

    def _client_per_worker(self) -> list[HPSClient]:
        """New connections until each worker answered one (the kernel spreads them: SO_REUSEPORT)."""
        found: dict[int, HPSClient] = {}
        target = f"127.0.0.1:{self.srv.grpc_port}"
        for _ in range(40):
            client = HPSClient(target, retries=0, options=[("grpc.use_local_subchannel_pool", 1)])
            before = [w["requests"] for w in self.http.get("/v1/stats").json()["node"]["workers"]]
            client.lookup("base", "item", [1])
            after = [w["requests"] for w in self.http.get("/v1/stats").json()["node"]["workers"]]
            worker = next(i for i, (a, b) in enumerate(zip(before, after)) if b > a)
            if worker in found:
                client.close()
            else:
                found[worker] = client
            if len(found) == len(after):
                return [found[i] for i in sorted(found)]
        raise AssertionError("the kernel never sent a connection to some worker")

    def loaded(self, model: str) -> bool:
        return self.http.get(f"/v1/models/{model}").status_code == 200

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.http.close()
        self.srv.stop(grace=2)


@pytest.fixture
def fleet(kafka_broker, tmp_path: Path):
    prefix = f"r{uuid.uuid4().hex[:6]}"
    replicas = []
    try:
        replicas.append(Replica(tmp_path, "a", kafka_broker.bootstrap, prefix, workers=2))
        replicas.append(Replica(tmp_path, "b", kafka_broker.bootstrap, prefix, workers=0))
        yield prefix, replicas
    finally:
        for replica in replicas:
            replica.close()


def test_a_model_registered_on_one_replica_is_served_at_once_by_its_workers_and_soon_by_the_other(
        kafka_broker, fleet) -> None:
    """Each registration is looked up the moment the POST returned, on every worker of the replica that took it
    (no retry). Before: a worker could answer NOT_FOUND for a while (it had not yet loaded the owner's manifest,
    or was loading it), and the other replica never learnt of the model."""
    prefix, (a, b) = fleet
    keys = np.arange(1, 65, dtype=np.int64)
    names = [f"late{i}" for i in range(3)]
    for name in names:
        r = a.http.post("/v1/models", json={"name": name, "tables": [{"name": "item", "dim": DIM}]})
        assert r.status_code == 201, r.text
        for client in a.clients:
            assert np.array_equal(client.lookup(name, "item", keys), np.zeros((keys.size, DIM), np.float32))
    assert wait_until(lambda: all(b.loaded(n) for n in names), timeout=30), b.http.get("/v1/models").json()
    for client in b.clients:
        assert client.lookup(names[0], "item", keys).shape == (keys.size, DIM)
    assert b.http.get("/v1/stats").json()["registry"]["failed"] == {}

    rows = np.full((keys.size, DIM), 0.5, np.float32)
    with Publisher(kafka_broker.bootstrap, names[0], topic_prefix=prefix, partitions=2) as pub:
        pub.publish("item", keys, rows, 1)
    for replica in (a, b):  # both consume the topic of the model registered on one
        assert wait_until(lambda r=replica: np.array_equal(r.clients[0].lookup(names[0], "item", keys), rows),
                          timeout=30)

    r = b.http.delete(f"/v1/models/{names[1]}")
    assert r.status_code == 200, r.text
    assert not b.loaded(names[1])
    assert wait_until(lambda: not a.loaded(names[1]), timeout=30)
    assert a.http.post("/v1/models", json={"name": names[0], "tables": [{"name": "item", "dim": DIM}]}
                       ).status_code == 409

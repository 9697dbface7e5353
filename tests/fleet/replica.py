"""One in-process replica of a fleet with Kafka updates, for the fleet tests: an HPSServer on its own RocksDB, its
REST client and a gRPC client per worker process."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from hps_service.client import HPSClient
from hps_service.config import load_config
from hps_service.serve.process import HPSServer
from tests.helpers import free_port

TOKEN = "registrations-token"
#: updates.admin_key of the fleet tests: registrations travel between replicas only signed with it.
ADMIN_KEY = "registrations-hmac-key-5f0a9c"
DIM = 8


class Replica:
    """One in-process replica: a server with ``workers`` worker processes, its REST client, and a client per worker
    (no retries)."""

    def __init__(self, tmp: Path, name: str, brokers: str, prefix: str, workers: int,
                 admin_key: str | None = ADMIN_KEY, shards: int = 1, shard: int = 0) -> None:
        self.config = load_config(
            None,
            server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "admin_token": TOKEN,
                    "workers": workers, "grace_period_s": 2},
            cache={"backend": "numpy", "capacity": 1024, "warm_start": False},
            volatile={"type": "hashmap", "capacity_rows": 10_000},
            persistent={"type": "rocksdb", "path": str(tmp / name), "block_cache_mb": 8},
            updates={"type": "kafka", "brokers": brokers, "topic_prefix": prefix, "group": name,
                     "admin_key": admin_key},
            cluster={"partitions": 2, "shards": shards, "shard": shard},
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
            client.lookup("base", "item", [self.owned_key()])
            after = [w["requests"] for w in self.http.get("/v1/stats").json()["node"]["workers"]]
            worker = next(i for i, (a, b) in enumerate(zip(before, after)) if b > a)
            if worker in found:
                client.close()
            else:
                found[worker] = client
            if len(found) == len(after):
                return [found[i] for i in sorted(found)]
        raise AssertionError("the kernel never sent a connection to some worker")

    def owned_key(self) -> int:
        """A key of this replica's shard."""
        from hps_client.partitioning import shard_of

        keys = np.arange(1, 64, dtype=np.int64)
        return int(keys[shard_of(keys, self.config.cluster.partitions, self.config.cluster.shards)
                        == self.config.cluster.shard][0])

    def loaded(self, model: str) -> bool:
        return self.http.get(f"/v1/models/{model}").status_code == 200

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.http.close()
        self.srv.stop(grace=2)

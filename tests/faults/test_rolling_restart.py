"""Three `hps serve` replicas behind one DNS name, as a headless Service gives them: gRPC's round_robin spreads a
client's calls over all three, and a rolling restart of every replica under load costs no failed lookup (a draining
server answers UNAVAILABLE, the channel's retry policy sends the call to another replica, and connections are
re-balanced as replicas come back and as connections reach server.max_connection_age_s)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from hps_service.client import HPSClient
from hps_service.errors import HPSError
from tests.fixtures.dns import loopback_dns
from tests.helpers import ServerProcess, free_port, write_config

HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
NAME = "replicas.hps.test"
TOKEN = "rolling-token"
DIM = 16
KEYS = np.arange(1, 257, dtype=np.int64)
ROWS = (KEYS[:, None] * 0.001 + np.arange(DIM, dtype=np.float32)).astype(np.float32)


def _served(host: str, http_port: int) -> float:
    """Lookups this replica answered OK since it started (from its /metrics)."""
    text = httpx.get(f"http://{host}:{http_port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "hps_lookup_requests":
            return sum(s.value for s in family.samples
                       if s.name.endswith("_total") and s.labels == {"method": "Lookup", "status": "OK"})
    return 0.0


def _shares(client: HPSClient, http_port: int, calls: int) -> list[float]:
    before = [_served(h, http_port) for h in HOSTS]
    for _ in range(calls):
        client.lookup("demo", "item", KEYS[:8])
    return [(_served(h, http_port) - b) / calls for h, b in zip(HOSTS, before)]


def test_round_robin_over_one_name_and_a_rolling_restart_under_load(tmp_path: Path) -> None:
    grpc_port, http_port = free_port(), free_port()
    replicas = []
    for i, host in enumerate(HOSTS):
        cfg = write_config(tmp_path / f"r{i}.yaml", {
            "server": {"host": host, "grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN,
                       "grace_period_s": 5, "max_connection_age_s": 3, "max_connection_age_grace_s": 2,
                       "workers": 1, "grpc_workers": 2},
            "cache": {"capacity": 1024},
            "persistent": {"type": "rocksdb", "path": str(tmp_path / f"db{i}"), "block_cache_mb": 8},
            "models": [{"name": "demo", "tables": [{"name": "item", "dim": DIM}]}],
        })
        replicas.append(ServerProcess(cfg, grpc_port, host=host))
    failures: list[str] = []
    answered = [0]
    stop = threading.Event()
    try:
        for srv, host in zip(replicas, HOSTS):
            srv.start()
            put = httpx.put(f"http://{host}:{http_port}/v1/models/demo/tables/item/embeddings",
                            json={"keys": KEYS.tolist(), "vectors": ROWS.tolist(), "version": 1},
                            headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
            assert put.status_code == 200, put.text
        with loopback_dns({NAME: HOSTS}) as dns_port, \
                HPSClient(f"dns://127.0.0.1:{dns_port}/{NAME}:{grpc_port}", timeout=10) as client:
            client.wait_ready(30)
            client.lookup("demo", "item", KEYS[:1])
            time.sleep(1.0)  # the channel connects to every address it resolved
            shares = _shares(client, http_port, 150)
            print(f"\nshares of 150 calls over one name: {[f'{s:.2f}' for s in shares]}")
            assert min(shares) >= 0.2, shares

            def load() -> None:
                rng = np.random.default_rng(threading.get_ident() % 1000)
                while not stop.is_set():
                    idx = rng.integers(0, KEYS.size, 64)
                    try:
                        got = client.lookup("demo", "item", KEYS[idx])
                    except HPSError as exc:
                        failures.append(str(exc))
                        continue
                    if not np.array_equal(got, ROWS[idx]):
                        failures.append("wrong rows")
                    answered[0] += 1

            workers = [threading.Thread(target=load, daemon=True) for _ in range(2)]
            for w in workers:
                w.start()
            for srv in replicas:
                code = srv.stop(timeout=20)
                assert code == 0, f"{srv.target} exited with {code} on SIGTERM"
                srv.start()
                time.sleep(1.0)
            time.sleep(1.0)
            stop.set()
            for w in workers:
                w.join(30)
            print(f"rolling restart of {len(replicas)} replicas: {answered[0]} lookups answered, "
                  f"{len(failures)} failed {sorted(set(failures))[:3]}")
            assert failures == [] and answered[0] > 30
            # The channel reconnects to the last replica restarted on its reconnect back-off (which grew while that
            # replica was down: a few seconds when its start takes as long), then spreads calls over it again.
            deadline = time.monotonic() + 20
            while min(shares := _shares(client, http_port, 150)) < 0.2:
                assert time.monotonic() < deadline, shares
                time.sleep(0.5)
            print(f"shares after the restart: {[f'{s:.2f}' for s in shares]}")
    finally:
        stop.set()
        for srv in replicas:
            if srv.proc is not None:
                srv.stop()

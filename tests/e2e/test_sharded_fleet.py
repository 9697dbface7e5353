"""A sharded fleet on loopback, as the chart deploys it: 2 shards x 2 replicas of `hps serve` (each replica its own
RocksDB, all sharing the Redis Cluster L2), the tansu broker, and the client over the replicas' endpoints or over one
DNS name per shard (what each shard's headless Service gives).

- 100k keys go through each shard's `hps import`: each shard stores its half (within 5%), and the client answers
  every key exactly, in the order asked, duplicates and absent keys included.
- Updates from the Publisher are applied by the owning shard's replicas only, and served through the client.
- One replica of a shard killed under load: no lookup fails. Both: lookups that need the shard raise
  UnavailableError naming it, and keys of the other shard go on being served.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hps_service.admin.importer import synthesize_model
from hps_service.client import HPSClient
from hps_service.errors import HPSError, UnavailableError
from hps_service.updates import Publisher, make_version
from hps_service.updates.partitioning import shard_of
from tests.fixtures.dns import loopback_dns
from tests.helpers import HPS, REPO, free_port, run_hps, stop_process, wait_serving, write_config

DIM, P, ROWS = 16, 8, 100_000
HOSTS = {(0, 0): "127.0.0.1", (0, 1): "127.0.0.2", (1, 0): "127.0.0.3", (1, 1): "127.0.0.4"}
TABLE = "item"
#: The update test publishes new rows for the first UPDATED keys of the table.
UPDATED = 1500


def _wait_closed(host: str, port: int, timeout: float = 5.0) -> None:
    """Until nothing accepts on ``host:port``: a SIGKILLed owner's workers die a moment after it (PDEATHSIG through
    the fork server), and may answer in between (CI once had a lookup answered right after the kill)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), 0.2).close()
        except OSError:
            return
        assert time.monotonic() < deadline, f"{host}:{port} still accepts {timeout} s after its owner was killed"
        time.sleep(0.02)


@dataclass
class Fleet:
    model: str
    keys: np.ndarray
    vectors: np.ndarray
    grpc_port: int
    http_port: int
    dns_port: int
    procs: dict[tuple[int, int], subprocess.Popen]
    import_output: list[str]
    brokers: str

    def endpoints(self) -> list[str]:
        return [f"{host}:{self.grpc_port}" for host in HOSTS.values()]

    def shard_names(self) -> list[str]:
        return [f"dns://127.0.0.1:{self.dns_port}/shard-{s}.hps.test:{self.grpc_port}" for s in (1, 0)]

    def http(self, replica: tuple[int, int], path: str) -> dict:
        r = httpx.get(f"http://{HOSTS[replica]}:{self.http_port}{path}", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def lookups_served(self, replica: tuple[int, int]) -> float:
        """Lookup calls this replica answered OK (from its /metrics)."""
        text = httpx.get(f"http://{HOSTS[replica]}:{self.http_port}/metrics", timeout=10).text
        return sum(s.value for family in text_string_to_metric_families(text) if family.name == "hps_lookup_requests"
                   for s in family.samples
                   if s.name.endswith("_total") and s.labels == {"method": "Lookup", "status": "OK"})

    def stored_rows(self, replica: tuple[int, int]) -> int:
        tables = self.http(replica, f"/v1/models/{self.model}")["tables"]
        return next(t for t in tables if t["name"] == TABLE)["rows"]["persistent"]


def _start(config: Path) -> subprocess.Popen:
    return subprocess.Popen([*HPS, "serve", "--config", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ), cwd=REPO)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, kafka_broker, redis_cluster) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    model = f"fleet{uuid.uuid4().hex[:8]}"
    keys, vectors = synthesize_model(ROWS, DIM, seed=11)
    np.savez(tmp / "table.npz", keys=keys, vectors=vectors)
    grpc_port, http_port = free_port(), free_port()
    configs = {}
    for (shard, replica), host in HOSTS.items():
        configs[shard, replica] = write_config(tmp / f"s{shard}r{replica}.yaml", {
            "server": {"host": host, "grpc_port": grpc_port, "http_port": http_port, "grpc_workers": 2,
                       "grace_period_s": 2},
            "cache": {"backend": "numpy", "capacity": 4096, "warm_start": False},
            "volatile": {"type": "redis_cluster", "nodes": redis_cluster.nodes},
            "persistent": {"type": "rocksdb", "path": str(tmp / f"s{shard}r{replica}" / "rocksdb"),
                           "block_cache_mb": 8},
            "updates": {"type": "kafka", "brokers": kafka_broker.bootstrap, "topic_prefix": "fleet",
                        "group": f"{model}.s{shard}r{replica}"},
            "cluster": {"shards": 2, "shard": shard, "partitions": P},
            "models": [{"name": model, "tables": [{"name": TABLE, "dim": DIM}]}],
        })
    # each shard imports the whole file and keeps its half; its second replica starts from a copy of the volume
    imports = [subprocess.Popen([*HPS, "import", "--config", str(configs[s, 0]), "--model", model, "--table", TABLE,
                                 str(tmp / "table.npz")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=REPO) for s in (0, 1)]
    outputs = []
    for proc in imports:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(out)
    for s in (0, 1):
        shutil.copytree(tmp / f"s{s}r0", tmp / f"s{s}r1")
    procs: dict[tuple[int, int], subprocess.Popen] = {}
    records = {f"shard-{s}.hps.test": [HOSTS[s, 0], HOSTS[s, 1]] for s in (0, 1)}
    try:
        with loopback_dns(records) as dns_port:
            for replica, config in configs.items():
                procs[replica] = _start(config)
            for replica, proc in procs.items():
                wait_serving(f"{HOSTS[replica]}:{grpc_port}", 90, proc)
            fleet = Fleet(model, keys, vectors, grpc_port, http_port, dns_port, procs, outputs, kafka_broker.bootstrap)
            deadline = time.monotonic() + 60
            for replica in HOSTS:
                while httpx.get(f"http://{HOSTS[replica]}:{http_port}/readyz", timeout=10).status_code != 200:
                    assert time.monotonic() < deadline, fleet.http(replica, "/readyz")
                    time.sleep(0.1)
            yield fleet
    finally:
        for proc in procs.values():
            stop_process(proc, 10)


def _expected(fleet: Fleet, ask: np.ndarray, extra: dict[int, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows and 'stored' flags of ``ask``: imported rows, ``extra`` rows over them, zeros for absent keys."""
    index = {int(k): i for i, k in enumerate(fleet.keys)}
    rows = np.zeros((ask.size, DIM), dtype=np.float32)
    stored = np.zeros(ask.size, dtype=bool)
    for j, k in enumerate(ask.tolist()):
        if extra is not None and k in extra:
            rows[j], stored[j] = extra[k], True
        elif k in index:
            rows[j], stored[j] = fleet.vectors[index[k]], True
    return rows, stored


def test_each_shard_stores_its_half_and_the_client_answers_every_key_in_order(fleet: Fleet) -> None:
    owned = shard_of(fleet.keys, P, 2)
    for s, printed in enumerate(fleet.import_output):
        out = " ".join(printed.split())
        mine = int((owned == s).sum())
        assert f"imported {mine} rows" in out and f"skipped {ROWS - mine} rows of other shards" in out, out
    for (s, r) in HOSTS:
        stored = fleet.stored_rows((s, r))
        assert stored == int((owned == s).sum())
        assert abs(stored - ROWS / 2) <= 0.05 * ROWS / 2, stored
        info = fleet.http((s, r), "/v1/cluster")
        assert (info["shards"], info["shard"], info["partitions"], info["ready"]) == (2, s, P, True)
        assert info["topic_partitions"] == {f"fleet.{fleet.model}": P}
    cli = run_hps("lookup", "--target", f"{HOSTS[0, 1]}:{fleet.grpc_port}", "--target",
                  f"{HOSTS[1, 0]}:{fleet.grpc_port}", "--model", fleet.model, "--table", TABLE, "--json",
                  *map(str, fleet.keys[:6]))
    assert cli.returncode == 0, cli.stderr
    np.testing.assert_allclose(json.loads(cli.stdout)["vectors"], fleet.vectors[:6], rtol=1e-6)
    rng = np.random.default_rng(5)
    absent = np.arange(1, 2001, dtype=np.int64) * -7  # synthesized keys are >= 0
    ask = np.concatenate((rng.permutation(fleet.keys), fleet.keys[rng.integers(0, ROWS, 20_000)], absent))
    ask = ask[rng.permutation(ask.size)]
    with HPSClient(fleet.endpoints(), timeout=30) as client:
        for lo in range(0, ask.size, 40_000):
            part = ask[lo : lo + 40_000]
            got = client.lookup_with_sources(fleet.model, TABLE, part)
            rows, stored = _expected(fleet, part)
            np.testing.assert_array_equal(got.vectors, rows)
            assert (got.sources[stored] != 4).all() and (got.sources[~stored] == 4).all()
        before = {r: fleet.lookups_served(r) for r in HOSTS}
        for _ in range(40):
            client.lookup(fleet.model, TABLE, fleet.keys[:64])  # keys of both shards: one call to each per lookup
        calls = {r: fleet.lookups_served(r) - before[r] for r in HOSTS}
        for s in (0, 1):  # the shard's two replicas share its calls (round robin over one channel per shard)
            assert calls[s, 0] + calls[s, 1] == 40 and min(calls[s, 0], calls[s, 1]) >= 8, calls


def test_updates_are_applied_by_the_owning_shard_only_and_served(fleet: Fleet) -> None:
    applied_before = {r: fleet.http(r, "/v1/stats")["updates"]["rows_applied"] for r in HOSTS}
    stored_before = {r: fleet.stored_rows(r) for r in HOSTS}
    fresh = np.arange(1, 1501, dtype=np.int64) * 1_000_000_007 + 3  # not in the table
    keys = np.concatenate((fleet.keys[:UPDATED], fresh))
    rows = np.random.default_rng(7).standard_normal((keys.size, DIM)).astype(np.float32)
    publisher = Publisher(fleet.brokers, fleet.model, topic_prefix="fleet", partitions=P)
    publisher.publish(TABLE, keys, rows, make_version(0, 5))
    publisher.flush(30)
    extra = dict(zip(keys.tolist(), rows))
    expected, _ = _expected(fleet, keys, extra)
    with HPSClient(fleet.shard_names(), timeout=30) as client:
        deadline = time.monotonic() + 60
        while not np.array_equal(client.lookup(fleet.model, TABLE, keys), expected):
            assert time.monotonic() < deadline, "published rows not served within 60 s"
            time.sleep(0.1)
    owner = shard_of(keys, P, 2)
    for (s, r) in HOSTS:
        applied = fleet.http((s, r), "/v1/stats")["updates"]["rows_applied"] - applied_before[s, r]
        assert applied == int((owner == s).sum()), (s, r, applied)
        assert fleet.stored_rows((s, r)) - stored_before[s, r] == int((shard_of(fresh, P, 2) == s).sum())


def test_one_replica_down_costs_nothing_both_down_fail_loudly(fleet: Fleet) -> None:
    owner = shard_of(fleet.keys, P, 2)
    failures: list[str] = []
    answered = [0]
    stop = threading.Event()
    with HPSClient(fleet.shard_names(), timeout=10) as client:
        client.lookup(fleet.model, TABLE, fleet.keys[:64])

        def load(seed: int) -> None:
            rng = np.random.default_rng(seed)
            while not stop.is_set():
                idx = rng.integers(UPDATED, ROWS, 256)  # rows the update test left as imported
                try:
                    got = client.lookup(fleet.model, TABLE, fleet.keys[idx])
                except HPSError as exc:
                    failures.append(str(exc))
                    continue
                if not np.array_equal(got, fleet.vectors[idx]):
                    failures.append("wrong rows")
                answered[0] += 1

        workers = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(2)]
        for w in workers:
            w.start()
        time.sleep(0.5)
        before = answered[0]
        stop_process(fleet.procs[0, 0], 5, sig=9)  # SIGKILL: no drain
        time.sleep(2.0)
        stop.set()
        for w in workers:
            w.join(30)
        print(f"\none replica of shard 0 killed under load: {answered[0]} lookups answered "
              f"({answered[0] - before} after the kill), {len(failures)} failed {failures[:2]}")
        assert failures == [] and answered[0] - before > 10

        stop_process(fleet.procs[0, 1], 5, sig=9)
        _wait_closed(HOSTS[0, 1], fleet.grpc_port)
        mixed = fleet.keys[:64]
        with pytest.raises(UnavailableError) as err:
            client.lookup(fleet.model, TABLE, mixed)
        n0 = int((owner[:64] == 0).sum())
        assert "shard 0 of 2 is unavailable" in str(err.value)
        assert f"{n0} of the 64 keys asked are on it" in str(err.value)
        only_shard1 = fleet.keys[owner == 1][:5000]
        for lo in range(0, only_shard1.size, 500):
            got = client.lookup(fleet.model, TABLE, only_shard1[lo : lo + 500])
            assert got.shape == (min(500, only_shard1.size - lo), DIM)

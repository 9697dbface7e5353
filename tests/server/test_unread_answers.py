"""A peer that sends calls and never reads the answers makes a worker hold at most ``server.max_calls_per_connection``
of them per connection (issue 57: 4 such connections added 217 MB to a worker, one answer held per call, up to
gRPC's limit of calls in flight), and the worker keeps answering everyone else."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import numpy as np

from hps_client import HPSClient
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from tests.faults.support import rss_bytes
from tests.helpers import ServerProcess, free_port, write_config
from tests.server.h2_peer import UnreadingPeer

DIM, KEYS = 1024, 256  # each answer is 1 MiB of rows
PEERS, CALLS = 2, 200
#: The default server.max_calls_per_connection.
PER_CONNECTION = 16


def _served(http: httpx.Client) -> int:
    """Lookups the node answered so far."""
    text = http.get("/metrics").text
    found = re.search(r'^hps_lookup_requests_total\{method="Lookup",status="OK"\} (\S+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


def _settled(http: httpx.Client, timeout: float = 30.0) -> int:
    """Lookups answered, once the count has not moved for a second."""
    deadline = time.monotonic() + timeout
    last, since = _served(http), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = _served(http)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 1.0:
            break
    return last


def test_peers_that_never_read_hold_a_bounded_number_of_answers(tmp_path: Path) -> None:
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "workers": 1, "grpc_workers": 2,
                   "heap_trim_interval_s": 1},
        "cache": {"backend": "numpy", "capacity": 1024},
        "volatile": {"type": "hashmap", "capacity_rows": 10_000},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": DIM}]}],
    })
    keys = np.arange(KEYS, dtype="<i8")
    request = pb.LookupRequest(model="demo", tables=[pb.TableKeys(table="item", keys=keys.tobytes())])
    with ServerProcess(cfg, grpc_port), httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as http, \
            HPSClient(f"127.0.0.1:{grpc_port}") as client:
        (worker,) = [w["pid"] for w in http.get("/v1/stats").json()["node"]["workers"]]
        for _ in range(20):  # the worker's answer buffer and allocator warm, as under any load
            assert client.lookup("demo", "item", keys).shape == (KEYS, DIM)
        before_calls, before = _settled(http), rss_bytes(worker)
        peers = [UnreadingPeer("127.0.0.1", grpc_port) for _ in range(PEERS)]
        try:
            for _ in range(CALLS):
                for peer in peers:
                    peer.call("/hps.v1.EmbeddingService/Lookup", request.SerializeToString())
            answered = _settled(http) - before_calls
            grown = rss_bytes(worker) - before
            assert client.lookup("demo", "item", keys).shape == (KEYS, DIM)  # everyone else is still answered
        finally:
            for peer in peers:
                peer.close()
    print(f"\n{PEERS} peers that never read, {CALLS} calls each: {answered} answered, worker RSS "
          f"+{grown / 2**20:.0f} MiB")
    assert answered <= PEERS * PER_CONNECTION, f"{answered} answers held for {PEERS} connections"
    assert grown < 200 << 20, f"worker RSS grew by {grown / 2**20:.0f} MiB"

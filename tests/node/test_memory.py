"""One copy of the rows per node: a second worker adds its own interpreter's pages, not another copy of the table.

A 1M x 64 table held entirely in the hash map (and 20% of it in L1): the proportional set size of every process of
the server (owner, fork server, workers, multiprocessing's resource tracker) with ``workers: 2`` is at most 1.15x
that with ``workers: 1``. Minutes on a small machine (two starts, each loading 1M rows from RocksDB into the hash
map): ``HPS_RUN_LONG=1``, or ``make test-node-memory``.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from hps_service.admin.importer import synthesize_model
from hps_service.client import HPSClient
from hps_service.runtime.processes import process_tree, pss_bytes
from hps_service.tiers.rocksdb.tier import RocksDBTier
from tests.helpers import ServerProcess, free_port, write_config

ROWS, DIM = 1_000_000, 64


def _server_pss(tmp_path: Path, db: Path, keys: np.ndarray, workers: int) -> tuple[int, int]:
    """(PSS of the whole server in bytes, its processes) once the hash map holds every row and both workers served."""
    grpc_port, http_port = free_port(), free_port()
    config = {"server": {"grpc_port": grpc_port, "http_port": http_port, "workers": workers},
              "cache": {"backend": "numpy", "capacity": 0.2},
              "volatile": {"type": "hashmap", "capacity_rows": ROWS},
              "persistent": {"type": "rocksdb", "path": str(db), "block_cache_mb": 64},
              "models": [{"name": "m", "tables": [{"name": "item", "dim": DIM}]}]}
    srv = ServerProcess(write_config(tmp_path / f"workers-{workers}.yaml", config), grpc_port).start(timeout=300)
    try:
        deadline = time.monotonic() + 600
        url = f"http://127.0.0.1:{http_port}/v1/stats"
        while httpx.get(url, timeout=30).json()["models"]["m"]["tables"]["item"]["volatile"]["rows"] < ROWS:
            assert time.monotonic() < deadline, "the hash map was not filled"
            time.sleep(0.5)
        rng = np.random.default_rng(0)
        for _ in range(8):  # several connections: both workers read L1 and the hash map
            with HPSClient(srv.target, options=[("grpc.use_local_subchannel_pool", 1)]) as client:
                for _ in range(10):
                    client.lookup("m", "item", keys[rng.integers(0, ROWS, 1024)])
        assert srv.proc is not None
        procs = process_tree(srv.proc.pid)
        return pss_bytes(procs), len(procs)
    finally:
        srv.stop()


@pytest.mark.long
def test_a_second_worker_costs_no_second_copy_of_the_table(tmp_path: Path) -> None:
    keys, vectors = synthesize_model(ROWS, DIM, seed=1)
    db = tmp_path / "db"
    tier = RocksDBTier(db, block_cache_mb=8)
    tier.create_table("m.item", DIM)
    tier.bulk_import("m.item", keys, vectors)
    tier.close()
    one, procs_one = _server_pss(tmp_path, db, keys, workers=1)
    two, procs_two = _server_pss(tmp_path, db, keys, workers=2)
    assert procs_two == procs_one + 1
    raw = ROWS * DIM * 4
    assert one > raw, "the table is not resident: the comparison would say nothing"
    print(f"\nPSS workers 1: {one / 2**20:.0f} MiB, workers 2: {two / 2**20:.0f} MiB ({two / one:.3f}x); "
          f"raw rows {raw / 2**20:.0f} MiB")
    assert two <= 1.15 * one

"""An int8 table as a user runs one: ``hps import`` into RocksDB, ``hps serve`` with two workers and a colocated
store; gRPC, LocalClient and a REST put all answer the row decoded from its int8 form, within half a step."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import httpx
import numpy as np

from hps_service.admin.importer import synthesize_model, write_hugectr_dir
from hps_service.client import HPSClient
from hps_service.local import LocalClient
from hps_service.rows import row_format
from tests.helpers import ServerProcess, free_port, run_hps, write_config

DIM, ROWS, TOKEN = 32, 5000, "quantised-admin"


def test_an_int8_table_is_imported_served_and_updated(tmp_path: Path) -> None:
    store = Path(tempfile.mkdtemp(prefix="hps-int8-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / "hps.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "workers": 2,
                   "grace_period_s": 5, "local": {"enabled": True, "path": str(store)}},
        "cache": {"backend": "numpy", "capacity": 4096},
        "volatile": {"type": "hashmap", "capacity_rows": 20_000},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "models": [{"name": "m", "tables": [{"name": "item", "dim": DIM, "storage": "int8"}]}],
    })
    keys, vectors = synthesize_model(ROWS, DIM, seed=5)
    write_hugectr_dir(tmp_path / "model", keys, vectors)
    done = run_hps("import", "--config", str(cfg), "--model", "m", "--table", "item", str(tmp_path / "model"))
    assert done.returncode == 0, done.stderr
    fmt = row_format("int8", DIM)
    want = fmt.decoded(fmt.encode(vectors))
    scale = (vectors.max(axis=1) - vectors.min(axis=1)) / 255
    assert (np.abs(want - vectors).max(axis=1) <= scale / 2 + 1e-6).all()
    srv = ServerProcess(cfg, grpc_port)
    srv.start(timeout=120)
    try:
        asked = np.concatenate((keys, keys[:100], np.array([2**62], np.int64)))
        with HPSClient(srv.target) as remote, LocalClient(store) as local:
            for _ in range(2):  # from RocksDB, then from the hash map and L1
                got = remote.lookup_with_sources("m", "item", asked)
                np.testing.assert_array_equal(got.vectors[:-1], np.concatenate((want, want[:100])))
                np.testing.assert_array_equal(local.lookup("m", "item", asked), got.vectors)
                for client in (remote, local):  # the int8 rows as stored: codes, scale and bias, decoded here
                    stored = client.lookup_stored("m", "item", asked)
                    assert stored.rows.storage == "int8" and stored.rows.nbytes == 4 * fmt.words * asked.size
                    np.testing.assert_array_equal(stored.rows.to_float32(), got.vectors)
                    assert stored.sources[-1] == 4 and (stored.sources[:-1] != 4).all()
            newer = (vectors[:10] * 3).astype(np.float32)
            r = httpx.put(f"http://127.0.0.1:{http_port}/v1/models/m/tables/item/embeddings",
                          headers={"Authorization": f"Bearer {TOKEN}"},
                          json={"keys": keys[:10].tolist(), "vectors": newer.tolist(), "version": 5}, timeout=30)
            assert r.status_code == 200, r.text
            np.testing.assert_array_equal(remote.lookup("m", "item", keys[:10]), fmt.decoded(fmt.encode(newer)))
    finally:
        assert srv.stop() == 0
        shutil.rmtree(store, ignore_errors=True)

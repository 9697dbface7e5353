"""A table converted as a user converts one: ``hps serve`` with two workers and a colocated store serves an fp32
table; ``POST .../tables/item:convert`` re-encodes it as int8 in a job while gRPC lookups and a REST put go on; every
lookup is answered (fp32 rows before the switch, int8 after), the clients follow the switch, and ``hps import`` and a
restart write and serve int8 though the config still says fp32."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from hps_service.admin.importer import synthesize_model, write_hugectr_dir
from hps_service.client import HPSClient
from hps_service.local import LocalClient
from hps_service.rows import row_format
from tests.helpers import ServerProcess, free_port, run_hps, write_config
from tests.server.conftest import wait_job

DIM, ROWS, TOKEN = 32, 20_000, "convert-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_a_served_table_is_converted_to_int8_and_stays_so(tmp_path: Path) -> None:
    store = Path(tempfile.mkdtemp(prefix="hps-conv-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    grpc_port, http_port = free_port(), free_port()
    http = f"http://127.0.0.1:{http_port}"
    cfg = write_config(tmp_path / "hps.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "workers": 2,
                   "grace_period_s": 5, "local": {"enabled": True, "path": str(store)}},
        "cache": {"backend": "numpy", "capacity": 4096},
        "volatile": {"type": "hashmap", "capacity_rows": 50_000},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "models": [{"name": "m", "tables": [{"name": "item", "dim": DIM}]}],
    })
    keys, vectors = synthesize_model(ROWS, DIM, seed=9)
    write_hugectr_dir(tmp_path / "model", keys, vectors)
    done = run_hps("import", "--config", str(cfg), "--model", "m", "--table", "item", str(tmp_path / "model"))
    assert done.returncode == 0, done.stderr
    int8 = row_format("int8", DIM)
    newer = (vectors[:50] * 2).astype(np.float32)
    row_of = {int(k): i for i, k in enumerate(keys.tolist())}
    srv = ServerProcess(cfg, grpc_port)
    srv.start(timeout=120)
    try:
        refused = [httpx.post(f"{http}/v1/models/m/tables/item:convert", json=body, headers=headers, timeout=10)
                   for body, headers in (({"storage": "fp32"}, AUTH), ({"storage": "fp8"}, AUTH),
                                         ({"storage": "int8"}, {}))]
        assert [r.status_code for r in refused] == [409, 422, 401], [r.text for r in refused]
        assert "already stored as fp32" in refused[0].json()["error"]
        huge = httpx.post(f"{http}/v1/models/m/tables/item:convert", headers=AUTH, timeout=10,
                          content=b'{"storage": "int8", "pad": "' + b"x" * (64 << 10) + b'"}')
        assert huge.status_code == 413, huge.text  # bounded before it is read (a small body: 64 KiB)
        missing = httpx.post(f"{http}/v1/models/m/tables/nope:convert", json={"storage": "int8"}, headers=AUTH)
        assert missing.status_code == 404 and "no table 'nope'" in missing.json()["error"]

        stop, failures, answered = threading.Event(), [], [0]

        def lookups() -> None:  # the whole table, over and over, through the conversion
            with HPSClient(srv.target) as client:
                rng = np.random.default_rng(1)
                while not stop.is_set():
                    ask = rng.choice(keys[50:], 1024)
                    try:
                        got = client.lookup("m", "item", ask)
                    except Exception as exc:  # noqa: BLE001  # counted: none may fail
                        failures.append(repr(exc))
                        continue
                    want = vectors[[row_of[k] for k in ask.tolist()]]
                    exact = (got == want).all(axis=1)
                    quantised = (got == int8.decoded(int8.encode(want))).all(axis=1)
                    if not (exact | quantised).all():
                        failures.append("a row neither fp32 nor its int8 form")
                    answered[0] += 1

        with LocalClient(store) as local:  # opened before the switch: it follows the new manifest
            reader = threading.Thread(target=lookups)
            reader.start()
            try:
                job = httpx.post(f"{http}/v1/models/m/tables/item:convert", json={"storage": "int8"}, headers=AUTH,
                                 timeout=10).json()
                assert job["kind"] == "convert" and job["target"]["storage"] == "int8"
                put = httpx.put(f"{http}/v1/models/m/tables/item/embeddings", headers=AUTH, timeout=30,
                                json={"keys": keys[:50].tolist(), "vectors": newer.tolist(), "version": 7})
                assert put.status_code == 200, put.text
                with httpx.Client(base_url=http, timeout=10) as client:
                    job = wait_job(client, job["id"], 120)
                time.sleep(0.5)  # lookups after the switch, too
            finally:
                stop.set()
                reader.join()
            assert job["state"] == "succeeded", job
            assert job["progress"] == 1.0 and job["result"]["to"] == "int8"
            assert job["result"]["rows_stored"] == ROWS
            assert not failures, failures[:5]
            assert answered[0] > 0
            want = int8.decoded(int8.encode(np.concatenate((newer, vectors[50:]))))
            with HPSClient(srv.target) as remote:
                np.testing.assert_array_equal(remote.lookup("m", "item", keys), want)
                stored = remote.lookup_stored("m", "item", keys[:10])
                assert stored.rows.storage == "int8"
            np.testing.assert_array_equal(local.lookup("m", "item", keys), want)
        assert "Traceback" not in srv.log() and "ERROR" not in srv.log(), srv.log()[-3000:]
        model = httpx.get(f"{http}/v1/models/m", timeout=10).json()
        assert model["tables"][0]["storage"] == "int8"
    finally:
        assert srv.stop() == 0
    tripled = (vectors * 3).astype(np.float32)  # hps import writes the converted table, as int8
    write_hugectr_dir(tmp_path / "model3", keys, tripled)
    done = run_hps("import", "--config", str(cfg), "--model", "m", "--table", "item", "--version", "9",
                   str(tmp_path / "model3"))
    assert done.returncode == 0, done.stderr
    want = int8.decoded(int8.encode(tripled))
    srv = ServerProcess(cfg, grpc_port)  # the config still says fp32
    srv.start(timeout=120)
    try:
        with HPSClient(srv.target) as remote:
            np.testing.assert_array_equal(remote.lookup("m", "item", keys), want)
            assert remote.lookup_stored("m", "item", keys[:1]).rows.storage == "int8"
    finally:
        assert srv.stop() == 0
        shutil.rmtree(store, ignore_errors=True)

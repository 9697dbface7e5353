"""Imports from where rows live (issue 53, part 4), against real servers: the REST import job and ``hps import`` take
``s3://`` URLs (SeaweedFS) of npz, Parquet, safetensors files and HugeCTR directories; ``hps import`` against a
running ``hps serve`` on the same RocksDB sends the job to that server's REST API with the admin token, or stops
with a message that says so (before: RocksDB's raw ``LOCK ... Resource temporarily unavailable``)."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import save

from hps_client import HPSClient
from hps_service.admin.importer import synthesize_model
from tests.helpers import ServerProcess, free_port, run_hps, write_config
from tests.server.conftest import AUTH, TOKEN, base_url, running, wait_job

DIM = 8
TABLES = ("npz", "parquet", "safetensors", "hugectr")


def _objects(keys: np.ndarray, rows: np.ndarray) -> dict[str, dict[str, bytes]]:
    """The rows as each format's objects: table -> {key suffix: bytes}."""
    npz = io.BytesIO()
    np.savez(npz, keys=keys, vectors=rows)
    parquet = io.BytesIO()
    pq.write_table(pa.table({"key": keys, "vector": pa.array(list(rows), type=pa.list_(pa.float32()))}), parquet)
    return {"npz": {".npz": npz.getvalue()}, "parquet": {".parquet": parquet.getvalue()},
            "safetensors": {".safetensors": save({"keys": keys, "vectors": rows})},
            "hugectr": {"/key": keys.astype("<i8").tobytes(), "/emb_vector": rows.astype("<f4").tobytes()}}


def _config(tmp: Path, **server: object) -> dict:
    return {"server": {"host": "127.0.0.1", "grpc_port": free_port(), "http_port": free_port(), "workers": 0,
                       **server},
            "cache": {"backend": "numpy", "capacity": 1024, "warm_start": False},
            "persistent": {"type": "rocksdb", "path": str(tmp / "db"), "block_cache_mb": 8},
            "models": [{"name": "m", "tables": [{"name": t, "dim": DIM} for t in TABLES]}]}


def test_the_rest_import_reads_every_format_from_the_bucket(s3_server, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from hps_service.config import load_config

    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    bucket = s3_server.new_bucket()
    keys, rows = synthesize_model(3_000, DIM, seed=21)
    s3 = s3_server.client()
    for table, parts in _objects(keys, rows).items():
        for suffix, body in parts.items():
            s3.put_object(Bucket=bucket, Key=f"rows/{table}{suffix}", Body=body)
    with running(load_config(None, **_config(tmp_path, admin_token=TOKEN))) as srv, \
            httpx.Client(base_url=base_url(srv), timeout=30) as http:
        for table in TABLES:
            url = f"s3://{bucket}/rows/{table}" + ("" if table == "hugectr" else f".{table}")
            r = http.post(f"/v1/models/m/tables/{table}/import", json={"path": url, "row_version": 3}, headers=AUTH)
            assert r.status_code == 202, r.text
            job = wait_job(http, r.json()["id"])
            assert job["state"] == "succeeded", job
            assert job["result"]["rows_written"] == job["result"]["rows_stored"] == keys.size, job
        with HPSClient(f"127.0.0.1:{srv.grpc_port}") as client:
            for table in TABLES:
                np.testing.assert_array_equal(client.lookup("m", table, keys[::7]), rows[::7], err_msg=table)
        missing = wait_job(http, http.post("/v1/models/m/tables/npz/import", headers=AUTH,
                                           json={"path": f"s3://{bucket}/rows/absent.npz"}).json()["id"])
        assert missing["state"] == "failed" and "does not exist" in missing["error"], missing
        bad = http.post("/v1/models/m/tables/npz/import", json={"path": "s3://Not_A_Bucket/x.npz"}, headers=AUTH)
        assert bad.status_code == 400 and "is not s3://BUCKET/KEY" in bad.json()["detail"]
        assert not any((tmp_path / "staging").iterdir())  # every download removed after its import


def test_hps_import_sends_the_job_to_the_server_that_holds_the_store(s3_server, tmp_path: Path) -> None:
    keys, rows = synthesize_model(2_000, DIM, seed=22)
    np.savez(tmp_path / "rows.npz", keys=keys, vectors=rows)
    data = _config(tmp_path)
    cfg = write_config(tmp_path / "hps.yaml", data)
    args = ("import", "--config", str(cfg), "--model", "m", "--table", "npz", str(tmp_path / "rows.npz"))
    server_env = {"HPS_ADMIN_TOKEN": "import-token"}
    with ServerProcess(cfg, data["server"]["grpc_port"], env=server_env):
        refused = run_hps(*args, env={"HPS_ADMIN_TOKEN": ""})
        assert refused.returncode == 1, refused.stdout
        assert "a running server holds the RocksDB" in refused.stderr and "HPS_ADMIN_TOKEN" in refused.stderr
        assert "LOCK" not in refused.stderr and "temporarily unavailable" not in refused.stderr, refused.stderr
        wrong = run_hps(*args, env={"HPS_ADMIN_TOKEN": "not-it"})
        assert wrong.returncode == 1 and "answered 403" in wrong.stderr, wrong.stderr
        done = run_hps(*args, "--row-version", "4", env=server_env)
        assert done.returncode == 0, done.stderr
        assert "imported 2000 rows into m.npz through the server at http://127.0.0.1:" in done.stdout, done.stdout
        skipped = run_hps(*args, "--if-empty", env=server_env)
        assert skipped.returncode == 0 and "already holds 2000 rows" in skipped.stdout, skipped.stdout
        with HPSClient(f"127.0.0.1:{data['server']['grpc_port']}") as client:
            np.testing.assert_array_equal(client.lookup("m", "npz", keys), rows)
    # no server now: hps import reads the bucket itself
    bucket = s3_server.new_bucket()
    pq.write_table(pa.table({"key": keys, "vector": pa.array(list(rows + 1), type=pa.list_(pa.float32()))}),
                   tmp_path / "rows.parquet")
    s3_server.client().upload_file(str(tmp_path / "rows.parquet"), bucket, "r/rows.parquet")
    offline = run_hps("import", "--config", str(cfg), "--model", "m", "--table", "parquet",
                      f"s3://{bucket}/r/rows.parquet", env=s3_server.env)
    assert offline.returncode == 0 and "imported 2000 rows (dim 8) into m.parquet" in offline.stdout, offline.stderr
    with ServerProcess(cfg, data["server"]["grpc_port"]), HPSClient(f"127.0.0.1:{data['server']['grpc_port']}") as c:
        np.testing.assert_array_equal(c.lookup("m", "parquet", keys), rows + 1)

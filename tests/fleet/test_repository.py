"""The model repository (issue 53, part 3) against real servers: two ``hps serve`` replicas (one with a gRPC worker
process) on the tansu broker with the signed registration log, polling a SeaweedFS bucket. A version uploaded to
the bucket is ``ready`` on every replica and a label switch then serves it on every replica at one offset of the
log; a half-uploaded version, a corrupt file and a wrong dim are ``failed`` with the reason, never served, and
disturb nothing; a failed version's fixed file is imported; retention retires the oldest; a version deleted from
the bucket is unloaded unless labelled; a restarted replica serves what it had from its store."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from hps_client import HPSClient
from hps_client.errors import NotFoundError
from hps_service.admin.importer import synthesize_model
from tests.helpers import ServerProcess, free_port, write_config
from tests.updates.conftest import wait_until

TOKEN, ADMIN_KEY = "repository-token", "repository-hmac-key-0b7e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DIMS = {"a": 8, "b": 4}
KEYS_A, ROWS_A = synthesize_model(3_000, DIMS["a"], seed=31)
KEYS_B, ROWS_B = synthesize_model(1_000, DIMS["b"], seed=32)


def _npz(keys: np.ndarray, rows: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.savez(out, keys=keys, vectors=rows)
    return out.getvalue()


def _rows(version: int, table: str) -> np.ndarray:
    """Version ``version``'s rows of ``table``: the base rows times the version."""
    return (ROWS_A if table == "a" else ROWS_B) * np.float32(version)


@dataclass
class Replica:
    name: str
    process: ServerProcess
    http: httpx.Client
    grpc: str

    def versions(self) -> dict[int, dict]:
        return {v["version"]: v for v in self.http.get("/v1/models/m/versions").json()["versions"]}

    def states(self) -> dict[int, str]:
        return {n: v["state"] for n, v in self.versions().items()}

    def lookup(self, table: str, **kwargs: int) -> np.ndarray:
        keys = KEYS_A if table == "a" else KEYS_B
        with HPSClient(self.grpc, retries=0) as client:
            return client.lookup("m", table, keys[::50], **kwargs)  # type: ignore[arg-type]


@dataclass
class Fleet:
    bucket: str
    s3: object
    replicas: list[Replica]
    configs: list[tuple[Path, int, dict]]

    def upload(self, version: int, tables: dict[str, bytes]) -> None:
        for name, body in tables.items():
            self.s3.put_object(Bucket=self.bucket, Key=f"models/m/{version}/{name}.npz", Body=body)  # type: ignore[attr-defined]

    def delete(self, version: int) -> None:
        listed = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=f"models/m/{version}/")  # type: ignore[attr-defined]
        for obj in listed.get("Contents", []):
            self.s3.delete_object(Bucket=self.bucket, Key=obj["Key"])  # type: ignore[attr-defined]

    def everywhere(self, check, timeout: float = 60.0) -> None:  # noqa: ANN001
        for r in self.replicas:
            assert wait_until(lambda r=r: check(r), timeout=timeout), (r.name, r.versions())


def _good(version: int) -> dict[str, bytes]:
    return {"a": _npz(KEYS_A, _rows(version, "a")), "b": _npz(KEYS_B, _rows(version, "b"))}


@pytest.fixture
def fleet(kafka_broker, s3_server, tmp_path: Path) -> Iterator[Fleet]:
    bucket = s3_server.new_bucket()
    prefix = f"repo{uuid.uuid4().hex[:6]}"
    replicas: list[Replica] = []
    configs = []
    try:
        for i, workers in enumerate((1, 0)):
            grpc_port, http_port = free_port(), free_port()
            data = {
                "server": {"host": "127.0.0.1", "grpc_port": grpc_port, "http_port": http_port, "workers": workers,
                           "admin_token": TOKEN, "grace_period_s": 2},
                "cache": {"backend": "numpy", "capacity": 1024, "warm_start": False},
                "volatile": {"type": "hashmap", "capacity_rows": 100_000},
                "persistent": {"type": "rocksdb", "path": str(tmp_path / f"r{i}" / "db"), "block_cache_mb": 8},
                "updates": {"type": "kafka", "brokers": kafka_broker.bootstrap, "topic_prefix": prefix,
                            "group": f"{prefix}.r{i}", "admin_key": ADMIN_KEY},
                "repository": {"url": f"s3://{bucket}/models", "poll_s": 0.5},
                "models": [{"name": "m", "keep_versions": 2,
                            "tables": [{"name": t, "dim": d} for t, d in DIMS.items()]}],
            }
            cfg = write_config(tmp_path / f"r{i}.yaml", data)
            configs.append((cfg, grpc_port, s3_server.env))
            process = ServerProcess(cfg, grpc_port, env=s3_server.env).start(timeout=120)
            replicas.append(Replica(f"r{i}", process, httpx.Client(base_url=f"http://127.0.0.1:{http_port}",
                                                                   timeout=60, headers=AUTH),
                                    f"127.0.0.1:{grpc_port}"))
        yield Fleet(bucket, s3_server.client(), replicas, configs)
    finally:
        for r in replicas:
            r.http.close()
            r.process.stop()


def test_versions_from_the_bucket_roll_out_fail_safely_retire_and_survive_a_restart(fleet: Fleet) -> None:
    one, two = fleet.replicas
    fleet.upload(1, _good(1))
    fleet.everywhere(lambda r: r.states().get(1) == "ready")
    listed = one.versions()[1]
    assert listed["source"] == f"s3://{fleet.bucket}/models/m/1"
    assert {t["name"]: t["rows"] for t in listed["tables"]} == {"a": KEYS_A.size, "b": KEYS_B.size}
    # a switch on one replica serves the version on both, made at one offset of the registration log
    switched = one.http.put("/v1/models/m/labels/production", json={"version": 1})
    assert switched.status_code == 200 and switched.json()["replicated"] is True, switched.text
    fleet.everywhere(lambda r: np.array_equal(r.lookup("a"), _rows(1, "a")[::50]))
    offsets = [r.http.get("/v1/stats").json()["registry"]["label_offsets"] for r in fleet.replicas]
    assert offsets[0] == offsets[1] and offsets[0], offsets

    # half-uploaded (b missing), corrupt (b cut short), wrong dim (b of dim 5): failed, never served
    fleet.upload(2, {"a": _good(2)["a"]})
    fleet.everywhere(lambda r: r.states().get(2) == "failed")
    assert "no file for table(s) b" in two.versions()[2]["reason"]
    fleet.upload(3, {"a": _good(3)["a"], "b": _good(3)["b"][:300]})
    fleet.everywhere(lambda r: r.states().get(3) == "failed")
    assert "is not a readable .npz file" in one.versions()[3]["reason"]
    fleet.upload(4, {"a": _good(4)["a"], "b": _npz(KEYS_B, np.ones((KEYS_B.size, 5), np.float32))})
    fleet.everywhere(lambda r: r.states().get(4) == "failed")
    assert "table b has dim 4 but" in two.versions()[4]["reason"] and "has dim 5" in two.versions()[4]["reason"]
    for r in fleet.replicas:
        with pytest.raises(NotFoundError):
            r.lookup("a", version=3)
        assert np.array_equal(r.lookup("a"), _rows(1, "a")[::50])  # nothing else disturbed
        assert r.states()[1] == "serving"
        assert 'hps_model_version_state{model="m",state="failed",version="4"} 1.0' in r.http.get("/metrics").text
    refused = two.http.put("/v1/models/m/labels/canary", json={"version": 4})
    assert refused.status_code == 409 and "failed to load from" in refused.json()["detail"], refused.text

    # the fixed file is imported (the version's files changed); retention retires the oldest unlabelled
    fleet.upload(4, {"b": _good(4)["b"]})
    fleet.everywhere(lambda r: r.states().get(4) == "ready")
    for version in (5, 6):
        fleet.upload(version, _good(version))
        fleet.everywhere(lambda r, v=version: r.states().get(v) == "ready")
    fleet.everywhere(lambda r: 4 not in r.states())  # keep_versions 2: 5 and 6 kept, 1 labelled
    assert set(one.states()) >= {1, 5, 6}
    assert np.array_equal(two.lookup("b", version=6), _rows(6, "b")[::50])

    # deleted from the bucket: unloaded, unless labelled
    fleet.delete(6)
    fleet.delete(1)
    fleet.everywhere(lambda r: 6 not in r.states())
    fleet.everywhere(lambda r: r.http.get("/v1/stats").json()["repository"]["deleted_but_labelled"] == [
        "version 1 of model 'm' (labelled)"])
    for r in fleet.replicas:
        assert r.states()[1] == "serving" and np.array_equal(r.lookup("a"), _rows(1, "a")[::50])

    # a restart serves what the replica had, from its store
    two.process.stop()
    two.process.start(timeout=120)
    assert wait_until(lambda: two.states().get(5) == "ready", timeout=60), two.versions()
    assert two.states()[1] == "serving" and two.versions()[5]["source"] == f"s3://{fleet.bucket}/models/m/5"
    assert np.array_equal(two.lookup("a"), _rows(1, "a")[::50])
    assert np.array_equal(two.lookup("a", version=5), _rows(5, "a")[::50])
    assert "importing from" not in two.process.log().split("received SIGTERM")[-1]  # nothing imported again

"""Model versions as a user runs them: ``hps import --model-version`` loads a version offline, ``hps serve`` with two
workers and a colocated store serves it beside the model once ``POST /v1/models/m/versions`` adds it, and label
switches and rollbacks under gRPC and LocalClient load give no request a mix of versions and no failure."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from hps_client.errors import InvalidArgumentError, NotFoundError
from hps_service.admin.importer import synthesize_model, write_hugectr_dir
from hps_service.local import LocalClient
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from tests.helpers import ServerProcess, free_port, run_hps, write_config
from tests.server.conftest import wait_job

DIM, ROWS, TOKEN = 16, 5_000, "versions-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: Version v serves the base rows times SCALE[v].
SCALE = {0: 1.0, 1: 2.0, 2: 3.0}


def _version_of(rows: np.ndarray, base: np.ndarray) -> int | None:
    """The version whose rows ``rows`` are, all of them; None for a mix or rows of no version."""
    for version, scale in SCALE.items():
        if np.array_equal(rows, (base * scale).astype(np.float32)):
            return version
    return None


def _local_client_names_versions_and_labels(store: Path, keys: np.ndarray, vectors: np.ndarray,
                                            row_of: dict[int, int]) -> None:
    """LocalClient reads the version a call names, or its label's, from the mapped store as HPSClient does (label
    ``production`` names version 2 here); what the store cannot tell, the server answers or refuses."""
    ask = keys[:256]
    base = vectors[[row_of[int(k)] for k in ask]]
    with LocalClient(store, timeout=10) as client:
        for kwargs, version in (({}, 2), ({"version": 1}, 1), ({"version": 0}, 0), ({"label": "production"}, 2)):
            for _ in range(2):  # the first call maps the table, the second reads it through the fast path
                answer = client.lookup_with_sources("m", "item", ask, **kwargs)  # type: ignore[arg-type]
                assert _version_of(answer.vectors, base) == version, kwargs
            both = client.lookup_many("m", {"item": ask}, **kwargs)  # type: ignore[arg-type]
            assert _version_of(both["item"].vectors, base) == version, kwargs
        for kwargs, error, text in (({"version": 9}, NotFoundError, "no version 9"),
                                    ({"label": "nope"}, NotFoundError, "no label 'nope'"),
                                    ({"version": 1, "label": "production"}, InvalidArgumentError, "name one")):
            with pytest.raises(error) as err:
                client.lookup("m", "item", ask, **kwargs)  # type: ignore[arg-type]
            assert text in str(err.value), (kwargs, err.value)


def test_versions_are_served_side_by_side_and_labels_switch_under_load(tmp_path: Path) -> None:
    store = Path(tempfile.mkdtemp(prefix="hps-ver-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    grpc_port, http_port = free_port(), free_port()
    http = f"http://127.0.0.1:{http_port}"
    cfg = write_config(tmp_path / "hps.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "workers": 2,
                   "grace_period_s": 5, "local": {"enabled": True, "path": str(store)}},
        "cache": {"backend": "numpy", "capacity": 2048},
        "volatile": {"type": "hashmap", "capacity_rows": 50_000},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "models": [{"name": "m", "tables": [{"name": "item", "dim": DIM}]}],
    })
    keys, vectors = synthesize_model(ROWS, DIM, seed=3)
    row_of = {int(k): i for i, k in enumerate(keys.tolist())}
    for version in (0, 1, 2):
        write_hugectr_dir(tmp_path / f"v{version}", keys, (vectors * SCALE[version]).astype(np.float32))
    for version in (0, 1):  # offline, before the server starts: the model and its version 1
        done = run_hps("import", "--config", str(cfg), "--model", "m", "--table", "item", "--model-version",
                       str(version), str(tmp_path / f"v{version}"))
        assert done.returncode == 0, done.stderr
        assert (f"m#v{version}.item" if version else "m.item") in done.stdout
    srv = ServerProcess(cfg, grpc_port)
    srv.start(timeout=120)
    try:
        for version in (1, 2):
            added = httpx.post(f"{http}/v1/models/m/versions", json={"version": version}, headers=AUTH, timeout=60)
            assert added.status_code == 201, added.text
        job = httpx.post(f"{http}/v1/models/m/tables/item/import", params={"model_version": 2}, headers=AUTH, timeout=10,
                         json={"path": str(tmp_path / "v2")}).json()
        with httpx.Client(base_url=http, timeout=10) as client:
            assert wait_job(client, job["id"], 120)["state"] == "succeeded"

        stop, failures, seen = threading.Event(), [], []

        def grpc_lookups() -> None:  # every answer is one version's rows, and says which
            rng = np.random.default_rng(1)
            with grpc.insecure_channel(srv.target) as channel:
                stub = pb_grpc.EmbeddingServiceStub(channel)
                while not stop.is_set():
                    ask = rng.choice(keys, 512)
                    try:
                        r = stub.Lookup(pb.LookupRequest(model="m", tables=[
                            pb.TableKeys(table="item", keys=ask.astype("<i8").tobytes())]), timeout=10)
                    except grpc.RpcError as exc:
                        failures.append(f"grpc: {exc.code()} {exc.details()}")
                        continue
                    rows = np.frombuffer(r.tables[0].vectors, dtype="<f4").reshape(len(ask), DIM)
                    if _version_of(rows, vectors[[row_of[int(k)] for k in ask]]) != r.version:
                        failures.append(f"grpc: rows not all of version {r.version}")
                    seen.append((time.monotonic(), r.version))

        def local_lookups() -> None:  # hits from the mapped store, misses from the server: one version a call
            rng = np.random.default_rng(2)
            with LocalClient(store, timeout=10) as client:
                while not stop.is_set():
                    ask = rng.choice(keys, 512)
                    try:
                        rows = client.lookup("m", "item", ask)
                    except Exception as exc:  # noqa: BLE001  # counted: none may fail
                        failures.append(f"local: {exc}")
                        continue
                    if _version_of(rows, vectors[[row_of[int(k)] for k in ask]]) is None:
                        failures.append("local: rows of more than one version in one answer")

        threads = [threading.Thread(target=grpc_lookups), threading.Thread(target=local_lookups)]
        for th in threads:
            th.start()
        switch_s, visible_s = [], []
        try:
            time.sleep(0.5)
            for version in (1, 2, 0, 1):  # 0: a rollback to the model as configured
                started = time.monotonic()
                r = httpx.put(f"{http}/v1/models/m/labels/production", json={"version": version}, headers=AUTH,
                              timeout=30)
                returned = time.monotonic()
                assert r.status_code == 200, r.text
                switch_s.append(returned - started)
                deadline = returned + 1.0  # the old rows no longer answered within 1 s of the PUT
                while time.monotonic() < deadline and not any(t > returned and v == version for t, v in seen[-50:]):
                    time.sleep(0.01)
                later = [t for t, v in seen if t > returned and v == version]
                assert later, f"no answer from version {version} within 1 s of the switch"
                visible_s.append(later[0] - returned)
                stale = [v for t, v in seen if t > returned + 0.2 and v != version]
                assert not stale, f"answers of version(s) {set(stale)} after the switch to {version}"
                time.sleep(0.3)
        finally:
            stop.set()
            for th in threads:
                th.join(30)
        assert not failures, failures[:5]
        print(f"label switch: PUT {max(switch_s) * 1000:.0f} ms at most, first answer of the new version "
              f"{max(visible_s) * 1000:.0f} ms after it at most, {len(seen)} gRPC answers")

        versions = httpx.get(f"{http}/v1/models/m/versions", timeout=10).json()
        assert versions["labels"] == {"production": 1} and versions["default_version"] == 1
        assert [v["version"] for v in versions["versions"]] == [1, 2]
        # the CLI: a rollback to version 2 by hand, and the models with their labels
        token = tmp_path / "token"
        token.write_text(TOKEN)
        anonymous = run_hps("label", "m", "production", "2", "--url", http)
        assert anonymous.returncode == 1 and "answered 401" in anonymous.stderr, anonymous.stderr
        # the admin token from HPS_ADMIN_TOKEN, the variable hps serve reads it from, or from a file
        done = run_hps("label", "m", "production", "2", "--url", http, env={"HPS_ADMIN_TOKEN": TOKEN})
        assert done.returncode == 0 and "m production -> version 2 (was 1)" in done.stdout, done.stderr
        refused = run_hps("label", "m", "production", "7", "--url", http, "--token-file", str(token))
        assert refused.returncode == 1 and "no version 7" in refused.stderr
        looked = run_hps("lookup", "--target", srv.target, "--model", "m", "--table", "item", "--model-version", "1",
                         "--json", str(keys[0]))
        assert looked.returncode == 0, looked.stderr
        np.testing.assert_allclose(json.loads(looked.stdout)["vectors"][0], vectors[0] * SCALE[1], rtol=1e-6)
        listed = run_hps("models", "--url", http, "--json")
        assert listed.returncode == 0, listed.stderr
        (model,) = [m for m in json.loads(listed.stdout)["models"] if m["name"] == "m"]
        assert model["labels"] == {"production": 2} and model["versions"] == [1, 2]
        _local_client_names_versions_and_labels(store, keys, vectors, row_of)
    finally:
        srv.stop()
        shutil.rmtree(store, ignore_errors=True)

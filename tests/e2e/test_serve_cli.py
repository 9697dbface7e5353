"""End to end as a user would: `hps synth`, `hps import`, `hps serve` on real ports, HPSClient and `hps lookup`."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from hps_service.client import HPSClient
from hps_service.engine.defaults import hashed_random_rows
from hps_service.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from tests.helpers import REPO, ServerProcess, free_port, run_hps, stop_process, write_config

ROWS, DIM = 100_000, 32


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("e2e")
    npz = d / "item.npz"
    r = run_hps("synth", "--rows", str(ROWS), "--dim", str(DIM), "--seed", "7", "--out", str(npz))
    assert r.returncode == 0, r.stderr
    hugectr = d / "user_sparse"
    r = run_hps("synth", "--rows", "1000", "--dim", "8", "--seed", "3", "--hugectr", "--out", str(hugectr))
    assert r.returncode == 0, r.stderr
    grpc_port = free_port()
    cfg = write_config(
        d / "config.yaml",
        {
            "server": {"host": "127.0.0.1", "grpc_port": grpc_port, "http_port": free_port(), "max_batch_keys": 5000},
            "cache": {"capacity": 0.1},
            "volatile": {"type": "hashmap", "capacity_rows": 20000},
            "persistent": {"type": "rocksdb", "path": str(d / "rocksdb")},
            "models": [
                {
                    "name": "demo",
                    "tables": [
                        {"name": "item", "dim": DIM, "default": {"constant": 0.5}},
                        {"name": "user", "dim": 8, "default": "hashed_random"},
                    ],
                }
            ],
        },
    )
    for table, path in (("item", npz), ("user", hugectr)):
        r = run_hps("import", "--config", str(cfg), "--model", "demo", "--table", table, str(path))
        assert r.returncode == 0, r.stderr
        assert "imported" in r.stdout
    data = np.load(npz)
    return {"dir": d, "config": cfg, "grpc_port": grpc_port, "keys": data["keys"], "vectors": data["vectors"],
            "hugectr": hugectr}


@pytest.fixture(scope="module")
def server(model_files: dict):
    with ServerProcess(model_files["config"], model_files["grpc_port"]) as srv:
        yield srv


def test_lookup_returns_imported_rows_and_defaults_in_order(server: ServerProcess, model_files: dict) -> None:
    keys, vectors = model_files["keys"], model_files["vectors"]
    rng = np.random.default_rng(0)
    idx = rng.integers(0, ROWS, 3000)
    absent = np.array([-5, 2**62, int(keys.max()) + 1], dtype=np.int64)
    absent = absent[~np.isin(absent, keys)]
    query = np.concatenate([keys[idx], absent, keys[idx[:10]]])  # duplicates included
    with HPSClient(server.target) as client:
        for _ in range(2):  # second pass is served from the upper tiers
            answer = client.lookup_with_sources("demo", "item", query)
            assert answer.vectors.shape == (query.shape[0], DIM)
            np.testing.assert_array_equal(answer.vectors[:3000], vectors[idx])
            np.testing.assert_array_equal(answer.vectors[3000:3000 + absent.size], 0.5)
            np.testing.assert_array_equal(answer.vectors[-10:], vectors[idx[:10]])
            assert set(answer.sources[3000:3000 + absent.size]) == {4}
            assert set(answer.sources[:3000]) <= {1, 2, 3}


def test_hugectr_table_and_hashed_random_default(server: ServerProcess, model_files: dict) -> None:
    keys = np.fromfile(model_files["hugectr"] / "key", dtype="<i8")
    vectors = np.fromfile(model_files["hugectr"] / "emb_vector", dtype="<f4").reshape(-1, 8)
    with HPSClient(server.target) as client:
        got = client.lookup_many("demo", {"user": keys[:100], "item": model_files["keys"][:5]})
        np.testing.assert_array_equal(got["user"].vectors, vectors[:100])
        np.testing.assert_array_equal(got["item"].vectors, model_files["vectors"][:5])
        missing = np.array([-123456789], dtype=np.int64)
        np.testing.assert_array_equal(client.lookup("demo", "user", missing), hashed_random_rows(missing, 8))


def test_errors_name_the_problem(server: ServerProcess) -> None:
    with HPSClient(server.target, retries=0) as client:
        with pytest.raises(NotFoundError, match="model 'nope'"):
            client.lookup("nope", "item", [1])
        with pytest.raises(NotFoundError, match="no table 'nope'"):
            client.lookup("demo", "nope", [1])
        with pytest.raises(ResourceExhaustedError, match="max_batch_keys=5000"):
            client.lookup("demo", "item", np.arange(5001))
        stub = pb_grpc.EmbeddingServiceStub(client.transport._channel)
        import grpc

        with pytest.raises(grpc.RpcError) as info:
            stub.Lookup(pb.LookupRequest(model="demo", tables=[pb.TableKeys(table="item", keys=b"\x01" * 13)]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a multiple of 8" in info.value.details()
        with pytest.raises(InvalidArgumentError, match="no table"):
            client.lookup_many("demo", {})
        assert client.list_models() == {"demo": {"item": DIM, "user": 8}}


def test_empty_batch(server: ServerProcess) -> None:
    with HPSClient(server.target) as client:
        assert client.lookup("demo", "item", np.array([], dtype=np.int64)).shape == (0, DIM)


def test_hps_lookup_cli(server: ServerProcess, model_files: dict) -> None:
    key = int(model_files["keys"][0])
    r = run_hps("lookup", "--target", server.target, "--model", "demo", "--table", "item", "--", str(key), "-1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith(f"{key} [")
    assert lines[1].startswith("-1 [default]")
    r = run_hps("lookup", "--target", server.target, "--model", "demo", "--table", "zzz", "1")
    assert r.returncode == 1 and "no table 'zzz'" in r.stderr
    # a bag: one row per bag, the mean of its keys' rows, with the deepest level that answered any of them
    second = int(model_files["keys"][1])
    r = run_hps("lookup", "--target", server.target, "--model", "demo", "--table", "item", "--offsets", "0,2,2",
                "--combiner", "mean", "--json", "--", str(key), str(second), "-1")
    assert r.returncode == 0, r.stderr
    bags = json.loads(r.stdout)
    with HPSClient(server.target) as client:
        rows = client.lookup("demo", "item", [key, second, -1])
    assert bags["bags"] == 3 and bags["sources"][1] == "unspecified" and bags["sources"][2] == "default"
    np.testing.assert_allclose(bags["vectors"][0], rows[:2].mean(axis=0), rtol=1e-5, atol=1e-6)
    assert bags["vectors"][1] == [0.0] * len(rows[0])
    r = run_hps("lookup", "--target", server.target, "--model", "demo", "--table", "item", "--offsets", "1", "1")
    assert r.returncode == 1 and "offsets must start at 0" in r.stderr


#: Figures of /v1/stats that are rates, ratios or durations: the JSON may hold them as floats, 0.0 and 1.0 included.
FRACTIONAL = {"hit_rate", "occupancy", "memory_ratio", "bytes_per_row", "rows_per_s", "seconds"}


def test_hps_stats_json_prints_counts_as_integers(server: ServerProcess, model_files: dict) -> None:
    """Rows, hits, capacities, bytes and every other count are JSON integers (before: 18603.0)."""
    with HPSClient(server.target) as client:
        client.lookup("demo", "item", model_files["keys"][:100])
    http_port = yaml.safe_load(model_files["config"].read_text())["server"]["http_port"]
    r = run_hps("stats", "--url", f"http://127.0.0.1:{http_port}", "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    floats: list[str] = []

    def walk(value: object, path: str, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}", str(k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]", key)
        elif isinstance(value, float) and key not in FRACTIONAL and not key.endswith("_s"):
            floats.append(f"{path} = {value}")

    walk(stats, "", "")
    assert not floats, floats
    item = stats["models"]["demo"]["tables"]["item"]
    assert isinstance(item["cache"]["rows"], int) and item["persistent"]["rows"] == ROWS


def test_the_try_line_runs_as_printed(model_files: dict, tmp_path: Path) -> None:
    """hps serve started as make run starts it (``.venv/bin/hps`` from the repository, no venv on PATH) prints a
    ``try:`` line that a shell in the same directory runs as it is, and it answers the imported rows."""
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": free_port(), "http_port": free_port(), "workers": 1},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db")},
        "models": [{"name": "demo", "tables": [{"name": "user", "dim": 8}]}],
    })
    imported = run_hps("import", "--config", str(cfg), "--model", "demo", "--table", "user", str(model_files["hugectr"]))
    assert imported.returncode == 0, imported.stderr
    script = Path(sys.executable).parent / "hps"
    started_as = str(script.relative_to(REPO)) if script.is_relative_to(REPO) else str(script)
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    out = tmp_path / "serve.out"
    with open(out, "wb") as log:
        proc = subprocess.Popen([started_as, "serve", "--config", str(cfg)], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "try:" not in out.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text(errors="replace")[-3000:]
            time.sleep(0.1)
        (line,) = [ln for ln in out.read_text().splitlines() if ln.startswith("try:")]
        command = line.removeprefix("try:").strip()
        assert command.startswith(f"{shlex.quote(started_as)} lookup "), command
        done = subprocess.run(command, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert len(done.stdout.splitlines()) == 3 and "[default]" not in done.stdout, done.stdout  # rows it holds
    finally:
        assert stop_process(proc, 30) == 0


def test_serve_stops_cleanly_on_sigterm(model_files: dict, tmp_path: Path) -> None:
    port = free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": port, "http_port": free_port()},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db")},
        "models": [{"name": "m", "tables": [{"name": "t", "dim": 4}]}],
    })
    srv = ServerProcess(cfg, port).start()
    assert srv.proc is not None
    private = list(Path("/dev/shm").glob(f"hps-node-{srv.proc.pid}-*"))
    assert private, "the node's private store lives on /dev/shm while it serves"
    assert srv.stop() == 0
    assert not any(p.exists() for p in private), "a clean stop leaves nothing of its store in /dev/shm"


def test_a_clean_stop_leaves_no_colocated_store_behind(tmp_path: Path) -> None:
    """With server.local (colocated readers), the store's root, its generation, its current link and its socket
    are all gone after SIGTERM (before: a dangling current link stayed)."""
    port = free_port()
    root = Path("/dev/shm") / f"hps-test-local-{port}"
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": port, "http_port": free_port(), "workers": 1,
                   "local": {"enabled": True, "path": str(root)}},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db")},
        "models": [{"name": "m", "tables": [{"name": "t", "dim": 4}]}],
    })
    srv = ServerProcess(cfg, port).start()
    assert (root / "current").is_symlink() and (root / "grpc.sock").is_socket()
    assert srv.stop() == 0
    assert not root.exists(), sorted(p.name for p in root.iterdir())


def test_invalid_config_exits_2_with_one_line(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "bad.yaml", {"cache": {"ways": "many"}, "models": []})
    r = run_hps("serve", "--config", str(cfg))
    assert r.returncode == 2
    assert "cache.ways" in r.stderr and "Traceback" not in r.stderr
    r = run_hps("serve", "--config", str(tmp_path / "bad.yaml"), env={"HPS_SERVER__GRPC_PORT": "notaport"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = run_hps("serve", "--config", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_import_errors_are_one_line_and_write_nothing(model_files: dict, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", {
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db")},
        "models": [{"name": "m", "tables": [{"name": "t", "dim": 16}]}],
    })
    cases = [
        (tmp_path / "missing.npz", "does not exist"),
        (model_files["dir"] / "item.npz", "dim"),  # dim 32 into a dim-16 table
    ]
    bad = tmp_path / "bad.npz"
    np.savez(bad, keys=np.arange(10), vectors=np.zeros((9, 16), np.float32))
    cases.append((bad, "9"))
    for path, needle in cases:
        r = run_hps("import", "--config", str(cfg), "--model", "m", "--table", "t", str(path))
        assert r.returncode != 0
        assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = run_hps("import", "--config", str(cfg), "--model", "m", "--table", "nope", str(bad))
    assert r.returncode != 0 and "no table 'nope'" in r.stderr
    from hps_service.tiers.rocksdb.tier import RocksDBTier

    tier = RocksDBTier(tmp_path / "db")
    try:
        tier.create_table("m.t", 16)
        assert tier.count("m.t") == 0
    finally:
        tier.close()

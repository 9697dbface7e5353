"""The client-only distribution as an inference service installs it: a fresh virtualenv with nothing but
``pip install ./clients/python`` (grpcio, protobuf, numpy) looks rows up from a running `hps serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers import REPO, ServerProcess, free_port, write_config

TOKEN = "client-pkg-token"
DIM = 16
SERVER_ONLY = ("hps-service", "numba", "rocksdict", "confluent-kafka", "fastapi", "uvicorn", "redis", "pydantic")


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtualenv holding only hps-client and what it depends on."""
    venv = tmp_path_factory.mktemp("client-venv") / "venv"
    # no pip of its own (ensurepip is the slow part): this pip installs into it with --python
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    wheels = venv.parent / "wheels"  # the wheel built here (this venv has the build backend), then installed alone
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), str(REPO / "clients" / "python")], capture_output=True, text=True,
                           timeout=300, env=_env())
    assert built.returncode == 0, built.stderr[-2000:]
    result = _pip(venv, "install", "-q", *map(str, wheels.glob("hps_client-*.whl")), timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return venv


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _pip(venv: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"),
                           "--disable-pip-version-check", *args], capture_output=True, text=True, timeout=timeout,
                          env=_env())


def test_fresh_venv_with_only_the_client_looks_rows_up(client_venv: Path, tmp_path: Path) -> None:
    env = _env()
    listed = _pip(client_venv, "list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert {"hps-client", "grpcio", "protobuf", "numpy"} <= installed
    assert not installed & set(SERVER_ONLY), f"the client pulled in server packages: {installed & set(SERVER_ONLY)}"
    assert installed - {"hps-client", "grpcio", "protobuf", "numpy", "pip", "setuptools", "typing-extensions"} == set()

    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": DIM, "default": {"constant": 0.5}}]}],
    })
    keys = np.arange(100, 140, dtype=np.int64)
    rows = np.random.default_rng(3).random((keys.size, DIM), dtype=np.float32)
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        from hps_client import HPSClient, AsyncHPSClient, NotFoundError
        from hps_client.proto.hps.v1 import embedding_pb2, embedding_pb2_grpc
        assert "hps_service" not in sys.modules
        try:
            import hps_service  # noqa: F401
            raise SystemExit("hps_service is importable in the client-only venv")
        except ImportError:
            pass
        try:
            import hps_client.torch  # noqa: F401
            raise SystemExit("hps_client.torch imported without torch")
        except ImportError as exc:
            assert "pip install 'hps-client[torch]'" in str(exc), exc
        assert "torch" not in sys.modules
        with HPSClient("127.0.0.1:{grpc_port}", timeout=30) as client:
            got = client.lookup_with_sources("demo", "item", np.array({keys.tolist()} + [7]))
            try:
                client.lookup("demo", "nope", [1])
                raise SystemExit("no error for an unknown table")
            except NotFoundError as exc:
                error = str(exc)
        print(json.dumps({{"rows": got.vectors.tolist(), "sources": got.sources.tolist(), "error": error}}))
    """)
    with ServerProcess(cfg, grpc_port):
        put = httpx.put(f"http://127.0.0.1:{http_port}/v1/models/demo/tables/item/embeddings",
                        json={"keys": keys.tolist(), "vectors": rows.tolist(), "version": 1},
                        headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert put.status_code == 200, put.text
        out = subprocess.run([str(client_venv / "bin/python"), "-c", script], capture_output=True, text=True,
                             timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    answer = json.loads(out.stdout)
    np.testing.assert_array_equal(np.array(answer["rows"][:-1], dtype=np.float32), rows)
    assert answer["rows"][-1] == [0.5] * DIM and answer["sources"][-1] == 4
    assert "no table 'nope'" in answer["error"]

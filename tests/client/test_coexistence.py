"""hps-client installs beside the inference stacks it lives in: tritonclient[grpc] (protobuf 6), tensorflow-serving-api
and feast (protobuf 7), and at its own dependency floors (grpcio 1.63.2, protobuf 5.26.1, numpy 1.26).

- Resolution (uv, from PyPI): hps-client plus the newest of each neighbour resolves to that same newest release as
  the neighbour alone: no backtracking, for none of the three.
- Installs: a fresh virtualenv (uv) per case with hps-client's wheel and the neighbour, in which
  tests/client/coexist_lookups.py loads the neighbour's gRPC stubs and ours into one process (every warning an
  error) and runs lookups, an error and the asyncio client against a live ``hps serve``. The floors, tritonclient
  and feast run in ``make test``; tensorflow-serving-api (2 GB with tensorflow) and the variants that run each
  neighbour's whole package import (tens of seconds each) are ``long`` (``make test-coexistence``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers import REPO, ServerProcess, free_port, write_config

TOKEN = "coexist-token"
DIM = 8
#: The neighbour's distribution and the requirement that installs it.
NEIGHBOURS = {"tritonclient": "tritonclient[grpc]", "tensorflow-serving-api": "tensorflow-serving-api",
              "feast": "feast"}
#: hps-client's dependency floors (clients/python/pyproject.toml).
FLOORS = ["grpcio==1.63.2", "protobuf==5.26.1", "numpy==1.26.4"]
LONG = pytest.mark.long
CHECK = Path(__file__).with_name("coexist_lookups.py")


def _uv() -> str:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert found, "uv (a dev dependency) is not installed"
    return found


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=_env())
    assert done.returncode == 0, f"{args[:4]}: {done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("client-wheel")
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
         str(REPO / "clients" / "python"))
    (built,) = out.glob("hps_client-*.whl")
    return built


def _resolve(tmp: Path, name: str, requirements: list[str]) -> dict[str, str]:
    """``{distribution: version}`` that uv resolves ``requirements`` to for this Python."""
    req = tmp / f"{name}.in"
    req.write_text("\n".join(requirements) + "\n")
    out = _run(_uv(), "pip", "compile", "-q", "--no-header", "--no-annotate", "--python", sys.executable,
               str(req), timeout=300).stdout
    pins = dict(re.findall(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(\S+)", out, re.MULTILINE))
    return {k.lower().replace("_", "-"): v for k, v in pins.items()}


@pytest.mark.parametrize("neighbour", sorted(NEIGHBOURS))
def test_the_newest_neighbour_resolves_beside_the_client(neighbour: str, wheel: Path, tmp_path: Path) -> None:
    alone = _resolve(tmp_path, "alone", [NEIGHBOURS[neighbour]])
    together = _resolve(tmp_path, "together", [f"hps-client @ {wheel.as_uri()}", NEIGHBOURS[neighbour]])
    assert together[neighbour] == alone[neighbour], f"{neighbour} backtracked to {together[neighbour]}"
    for shared in ("protobuf", "grpcio", "numpy"):  # the client takes what the neighbour would have had
        if shared in alone:
            assert together[shared] == alone[shared], (shared, together[shared], alone[shared])
    print(f"\n{neighbour} {together[neighbour]}: protobuf {together['protobuf']}, grpcio {together['grpcio']}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, np.ndarray]:
    tmp = tmp_path_factory.mktemp("coexist-server")
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "workers": 1},
        "persistent": {"type": "rocksdb", "path": str(tmp / "db"), "block_cache_mb": 8},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": DIM, "default": {"constant": 0.5}}]}],
    })
    keys = np.arange(100, 140, dtype=np.int64)
    rows = np.random.default_rng(5).random((keys.size, DIM), dtype=np.float32)
    with ServerProcess(cfg, grpc_port) as srv:
        put = httpx.put(f"http://127.0.0.1:{http_port}/v1/models/demo/tables/item/embeddings",
                        json={"keys": keys.tolist(), "vectors": rows.tolist(), "version": 1},
                        headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert put.status_code == 200, put.text
        yield srv.target, rows


def _lookups_in_fresh_venv(case: str, requirements: list[str], wheel: Path, server: tuple[str, np.ndarray],
                           tmp: Path, *extra: str) -> dict:
    venv = tmp / "venv"
    _run(_uv(), "venv", "-q", "--python", sys.executable, str(venv), timeout=120)
    python = str(venv / "bin" / "python")
    _run(_uv(), "pip", "install", "-q", "--python", python, str(wheel), *requirements, timeout=900)
    target, rows = server
    out = _run(python, str(CHECK), target, case, *extra, timeout=600).stdout
    answer = json.loads(out.strip().splitlines()[-1])
    np.testing.assert_array_equal(np.array(answer["rows"][:-1], dtype=np.float32), rows)
    assert answer["rows"][-1] == [0.5] * DIM and answer["sources"][-1] == 4
    np.testing.assert_array_equal(np.array(answer["many"], dtype=np.float32), rows[:3])
    np.testing.assert_array_equal(np.array(answer["aio"], dtype=np.float32), rows[:2])
    assert answer["error"][0] == "NOT_FOUND" and "no table 'nope'" in answer["error"][1]
    print(f"\n{case}: {answer['versions']}")
    return answer


def test_lookups_at_the_dependency_floors(wheel: Path, server: tuple[str, np.ndarray], tmp_path: Path) -> None:
    answer = _lookups_in_fresh_venv("none", FLOORS, wheel, server, tmp_path)
    assert answer["versions"] == {"protobuf": "5.26.1", "grpcio": "1.63.2", "numpy": "1.26.4", "hps-client":
                                  answer["versions"]["hps-client"]}


@pytest.mark.parametrize("neighbour", ["tritonclient", "feast",
                                       pytest.param("tensorflow-serving-api", marks=LONG)])
def test_lookups_beside_the_newest_neighbour(neighbour: str, wheel: Path, server: tuple[str, np.ndarray],
                                             tmp_path: Path) -> None:
    answer = _lookups_in_fresh_venv(neighbour, [NEIGHBOURS[neighbour]], wheel, server, tmp_path)
    assert answer["loaded"]


@LONG
@pytest.mark.parametrize("neighbour", sorted(NEIGHBOURS))
def test_lookups_beside_the_whole_neighbour_package(neighbour: str, wheel: Path, server: tuple[str, np.ndarray],
                                                    tmp_path: Path) -> None:
    _lookups_in_fresh_venv(neighbour, [NEIGHBOURS[neighbour]], wheel, server, tmp_path, "--full-import")

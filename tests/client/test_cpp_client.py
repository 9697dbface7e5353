"""The C++ client (clients/cpp), built by `make cpp-client` against Debian's gRPC C++, looking rows up from a real
`hps serve`: hps_lookup prints what `hps lookup --json` prints, its rows and sources are the Python client's, a
missing model is NOT_FOUND (printed as the Python CLI prints it, exit 1), and its deadline bounds a call to a server
that does not answer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from hps_service.client import HPSClient
from tests.helpers import REPO, ServerProcess, free_port, run_hps, run_make, write_config

HPS_LOOKUP = REPO / "build/cpp/hps_lookup"
TOKEN = "cpp-client-token"
DIM = 8
NAMES = {1: "cache", 2: "volatile", 3: "persistent", 4: "default", 5: "expired"}
#: Values whose shortest repr takes every branch of Python's float formatting (exponents, ".0", -0.0, subnormal).
AWKWARD = [0.1, 1e-05, 3e20, -0.0, 1e16, 123456.7, -1.5e-07, 1e-45]


@pytest.fixture(scope="module")
def hps_lookup() -> Path:
    """`make cpp-client`; skipped only where `make cpp-deps` cannot install the packages (not root, no apt)."""
    deps = run_make("cpp-deps", timeout=600)
    if deps.returncode != 0:
        pytest.skip("the C++ client's packages (libgrpc++-dev, protobuf-compiler-grpc, cmake) cannot be installed "
                    f"here: {(deps.stdout + deps.stderr)[-500:]}")
    built = run_make("cpp-client", timeout=600)
    assert built.returncode == 0, f"make cpp-client failed:\n{built.stdout[-3000:]}{built.stderr[-3000:]}"
    return HPS_LOOKUP


@dataclass
class Served:
    """The running `hps serve`: its process, gRPC target and REST base URL."""

    process: ServerProcess
    target: str
    http: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One serving process (workers: 0), so that stopping it stops every reader of the gRPC port."""
    tmp = tmp_path_factory.mktemp("cpp-client")
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "workers": 0},
        "persistent": {"type": "rocksdb", "path": str(tmp / "db"), "block_cache_mb": 8},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": DIM, "default": {"constant": 0.5}}]}],
    })
    with ServerProcess(cfg, grpc_port) as srv:
        yield Served(srv, srv.target, f"http://127.0.0.1:{http_port}")


def seed(server: Served, keys: list[int], rows: np.ndarray) -> None:
    response = httpx.put(f"{server.http}/v1/models/demo/tables/item/embeddings",
                         json={"keys": keys, "vectors": rows.tolist()}, headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=30)
    assert response.status_code == 200, response.text


def run_cpp(hps_lookup: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(hps_lookup), *args], capture_output=True, text=True, timeout=timeout)


def lookup_args(server: Served, keys: list[int]) -> list[str]:
    return [server.target, "demo", "item", "--", *map(str, keys)]


def test_a_second_build_rebuilds_nothing(hps_lookup: Path) -> None:
    before = hps_lookup.stat().st_mtime_ns
    again = run_make("cpp-client", timeout=120)
    assert again.returncode == 0, again.stderr
    assert "Building" not in again.stdout and "Linking" not in again.stdout, again.stdout
    assert hps_lookup.stat().st_mtime_ns == before


def test_first_lookups_answer_as_the_python_client_does(hps_lookup: Path, server: Served) -> None:
    """Two key sets stored alike, each looked up for the first time: one by hps_lookup, one by the Python client.
    The same levels answer both, and the rows are the ones stored (the default for a key stored nowhere)."""
    rows = np.random.default_rng(7).standard_normal((4, DIM)).astype(np.float32)
    seed(server, [10, 11, 12, 13, 20, 21, 22, 23], np.concatenate([rows, rows]))
    done = run_cpp(hps_lookup, *lookup_args(server, [10, 11, 12, 13, 19]))
    assert done.returncode == 0, done.stderr
    cpp = json.loads(done.stdout)
    with HPSClient(server.target, timeout=30) as client:
        python = client.lookup_with_sources("demo", "item", np.array([20, 21, 22, 23, 29]))
    expected = np.concatenate([rows, np.full((1, DIM), 0.5, np.float32)])
    np.testing.assert_array_equal(np.array(cpp["vectors"], np.float32), expected)
    np.testing.assert_array_equal(python.vectors, expected)
    assert cpp["sources"] == [NAMES.get(int(s), "unspecified") for s in python.sources]
    assert cpp["sources"][-1] == "default" and "cache" not in cpp["sources"]
    assert (cpp["model"], cpp["table"], cpp["dim"], cpp["keys"]) == ("demo", "item", DIM, [10, 11, 12, 13, 19])


def test_output_is_hps_lookup_json_byte_for_byte(hps_lookup: Path, server: Served) -> None:
    """Once every key sits where it stays (after as many lookups as that takes), hps_lookup and `hps lookup --json`
    print the same line, awkward floats, negative and repeated keys included."""
    keys = [-5, 40, 41, 40, 999]
    rows = np.random.default_rng(3).standard_normal((3, DIM)).astype(np.float32)
    rows[1] = AWKWARD
    seed(server, [-5, 40, 41], rows)
    with HPSClient(server.target, timeout=30) as client:
        sources = None
        for _ in range(20):  # until the levels that answer stop changing (admission to the L1 cache)
            answer = client.lookup_with_sources("demo", "item", np.array(keys))
            if sources is not None and np.array_equal(sources, answer.sources):
                break
            sources = answer.sources
    cpp = run_cpp(hps_lookup, *lookup_args(server, keys))
    python = run_hps("lookup", "--target", server.target, "-m", "demo", "-t", "item", "--json", "--",
                     *map(str, keys))
    assert cpp.returncode == 0 and python.returncode == 0, cpp.stderr + python.stderr
    assert cpp.stdout == python.stdout
    got = json.loads(cpp.stdout)
    np.testing.assert_array_equal(np.array(got["vectors"], np.float32)[[0, 1, 2, 3]], rows[[0, 1, 2, 1]])
    assert got["sources"][4] == "default" and got["vectors"][4] == [0.5] * DIM


@pytest.mark.parametrize(("args", "names"), [
    (("absent", "item", "1"), "model 'absent'"),
    (("--model-version", "7", "demo", "item", "1"), "7"),
    (("--label", "canary", "demo", "item", "1"), "canary"),
])
def test_missing_model_version_or_label_is_not_found(hps_lookup: Path, server: Served, args: tuple[str, ...],
                                                     names: str) -> None:
    """Printed as `hps lookup` prints it (the server's message with its code), exit 1."""
    cpp = run_cpp(hps_lookup, *args[:-3], server.target, *args[-3:])
    python = run_hps("lookup", "--target", server.target, *args[:-3], "-m", args[-3], "-t", args[-2], args[-1])
    assert cpp.returncode == 1 and cpp.stdout == ""
    assert cpp.stderr.startswith("error: NOT_FOUND: ") and names in cpp.stderr, cpp.stderr
    assert cpp.stderr.strip() == python.stderr.strip()


def test_deadline_bounds_a_call_to_a_server_that_does_not_answer(hps_lookup: Path, server: Served) -> None:
    """The server stopped (SIGSTOP: the kernel still accepts the connection, nothing answers): --timeout 0.5 ends
    the call with DEADLINE_EXCEEDED after about half a second; resumed, the server answers the same command."""
    proc = server.process.proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        stalled = run_cpp(hps_lookup, "--timeout", "0.5", *lookup_args(server, [1]), timeout=30)
        took = time.monotonic() - started
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert stalled.returncode == 1 and stalled.stderr.startswith("error: DEADLINE_EXCEEDED: "), stalled.stderr
    assert 0.45 <= took < 5, took
    resumed = run_cpp(hps_lookup, "--timeout", "30", *lookup_args(server, [1]))
    assert resumed.returncode == 0, resumed.stderr


def test_bad_command_line_says_what_is_wrong(hps_lookup: Path) -> None:
    bad = run_cpp(hps_lookup, "127.0.0.1:1", "demo", "item", "12x")
    assert bad.returncode == 2 and "key '12x' is not an int64" in bad.stderr and "usage: hps_lookup" in bad.stderr

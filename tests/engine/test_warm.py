"""Ready means warm (issue 14, defect 6): every compiled kernel of the lookup and update paths is compiled (or loaded
from numba's cache) before the server says SERVING, so nothing compiles on a request after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hps_service.admin.importer import write_hugectr_dir
from tests.helpers import REPO, ServerProcess, free_port, run_hps, write_config

#: Kernels no serving path calls from Python, and why.
NOT_ON_A_SERVING_PATH = {
    "hps_service.cache.cpu_kernels.next_tick": "draws a tick for an empty insert, which the table cache never makes",
}


def test_no_kernel_compiles_on_a_serving_path_after_ready(kafka_broker, tmp_path: Path) -> None:
    """A fresh server process drives gRPC lookups, REST reads and writes, Kafka updates and deletes and an import
    after SERVING; no numba kernel of hps_service gains a compiled version meanwhile (before: the key dedup, the hash
    map, the admission sketch and the query of read-only keys compiled on the first requests). And every kernel was
    compiled by the warm-up unless only other kernels call it or it is listed above with a reason: a kernel added
    without a warm-up fails here (list its module's warm-up in hps_service.jit.warmup.WARM_UPS)."""
    probe = subprocess.run(
        [sys.executable, "-m", "tests.engine.serving_probe", kafka_broker.bootstrap, str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert probe.returncode == 0, probe.stderr[-4000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["after_ready"] == {}, json.dumps(result["after_ready"], indent=1)
    cold = set(result["never_compiled"])
    assert cold <= set(NOT_ON_A_SERVING_PATH), sorted(cold - set(NOT_ON_A_SERVING_PATH))


@pytest.mark.long
def test_first_lookup_after_serving_with_a_cold_numba_cache_is_fast(tmp_path: Path) -> None:
    """An empty NUMBA_CACHE_DIR (a new install): hps serve compiles before it says SERVING, and the first 1024-key
    lookup then answers within a 3 s deadline (before: DEADLINE_EXCEEDED; the compile ran inside it)."""
    from hps_service.client import HPSClient

    keys = np.arange(4096, dtype=np.int64) * 3 + 1
    write_hugectr_dir(tmp_path / "model", keys, np.ones((4096, 16), np.float32))
    grpc_port = free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": free_port()},
        "cache": {"backend": "numpy", "capacity": 0.5},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db")},
        "models": [{"name": "m", "tables": [{"name": "t", "dim": 16}]}],
    })
    assert run_hps("import", "--config", str(cfg), "--model", "m", "--table", "t", str(tmp_path / "model")).returncode == 0
    cold = tmp_path / "numba-cache"
    cold.mkdir()
    srv = ServerProcess(cfg, grpc_port, env={"NUMBA_CACHE_DIR": str(cold)})
    srv.start(timeout=900)  # returns once gRPC health says SERVING
    try:
        with HPSClient(srv.target) as client:
            got = client.lookup("m", "t", keys[:1024], timeout=3.0)
    finally:
        srv.stop()
    assert got.shape == (1024, 16)
    # it said so while it compiled, once (the owner, before its workers' fork server loads what it cached)
    log = srv.log()
    assert log.count("compiling serving kernels, first start only") == 1, log[-4000:]
    assert "serving kernels compiled (" in log, log[-4000:]
    indexes = {p.relative_to(cold): p.read_bytes() for p in cold.rglob("*.nbi")}
    assert indexes, "the kernels were compiled into NUMBA_CACHE_DIR"
    # As in the images: those kernels seed an empty NUMBA_CACHE_DIR, and the next server compiles nothing (numba
    # rewrites a kernel's index when it compiles a new version).
    fresh = tmp_path / "fresh-cache"
    srv = ServerProcess(cfg, grpc_port, env={"NUMBA_CACHE_DIR": str(fresh), "HPS_KERNEL_CACHE_SEED": str(cold)})
    srv.start(timeout=300)
    try:
        with HPSClient(srv.target) as client:
            client.lookup("m", "t", keys[:1024], timeout=3.0)
    finally:
        srv.stop()
    assert {p.relative_to(fresh): p.read_bytes() for p in fresh.rglob("*.nbi")} == indexes


def test_seed_kernel_cache_copies_the_build_time_kernels_into_the_writable_cache(tmp_path: Path, monkeypatch) -> None:
    """numba only uses a cache directory it can write to: hps serve copies the image's kernels into NUMBA_CACHE_DIR,
    keeping files already there."""
    from hps_service.jit.warmup import seed_kernel_cache

    seed, target = tmp_path / "seed", tmp_path / "cache"
    (seed / "a").mkdir(parents=True)
    (seed / "a" / "k.nbi").write_bytes(b"index")
    (seed / "a" / "k.1.nbc").write_bytes(b"code")
    (target / "a").mkdir(parents=True)
    (target / "a" / "k.nbi").write_bytes(b"newer index written here")
    monkeypatch.setenv("HPS_KERNEL_CACHE_SEED", str(seed))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(target))
    assert seed_kernel_cache() == 1
    assert (target / "a" / "k.1.nbc").read_bytes() == b"code"
    assert (target / "a" / "k.nbi").read_bytes() == b"newer index written here"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(seed))
    assert seed_kernel_cache() == 0
    monkeypatch.delenv("HPS_KERNEL_CACHE_SEED")
    assert seed_kernel_cache() == 0

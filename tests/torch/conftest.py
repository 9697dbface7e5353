"""One ``hps serve`` (one worker, a colocated store) for the PyTorch and TorchRec modules' tests: model ``m`` with
tables ``a`` and ``b`` (dim 8) and ``c`` (dim 4), every row ``0 .. rows-1`` put with the weights a torch model would
hold (row index = key), and a client of each kind over it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")

from hps_client import HPSClient  # noqa: E402
from hps_service.local import LocalClient  # noqa: E402
from tests.helpers import ServerProcess, free_port, write_config  # noqa: E402

TOKEN = "torch-admin"
TABLES = {"a": (8, 1000), "b": (8, 1000), "c": (4, 600)}


@dataclass
class Served:
    """The running server, its tables' weights (``{table: (rows, dim) float32 tensor}``) and clients."""

    srv: ServerProcess
    http: httpx.Client
    store: Path
    weights: dict[str, torch.Tensor]
    grpc: HPSClient
    local: LocalClient
    clients: dict[str, object] = field(default_factory=dict)


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("torch-served")
    store = Path(tempfile.mkdtemp(prefix="hps-torch-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp / "hps.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "workers": 1,
                   "local": {"enabled": True, "path": str(store)}},
        "cache": {"backend": "numpy", "capacity": 4096},
        "volatile": {"type": "hashmap", "capacity_rows": 10_000},
        "persistent": {"type": "rocksdb", "path": str(tmp / "db"), "block_cache_mb": 8},
        "models": [{"name": "m", "tables": [{"name": t, "dim": dim} for t, (dim, _) in TABLES.items()]}],
    })
    srv = ServerProcess(cfg, grpc_port).start(timeout=120)
    http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60,
                        headers={"Authorization": f"Bearer {TOKEN}"})
    gen = torch.Generator().manual_seed(7)
    weights = {}
    for table, (dim, rows) in TABLES.items():
        weights[table] = torch.randn(rows, dim, generator=gen)
        r = http.put(f"/v1/models/m/tables/{table}/embeddings",
                     json={"keys": list(range(rows)), "vectors": weights[table].tolist(), "version": 1})
        assert r.status_code == 200, r.text
    grpc, local = HPSClient(srv.target, timeout=30), LocalClient(store, timeout=30)
    try:
        yield Served(srv, http, store, weights, grpc, local, {"grpc": grpc, "local": local})
    finally:
        grpc.close()
        local.close()
        http.close()
        srv.stop()
        shutil.rmtree(store, ignore_errors=True)

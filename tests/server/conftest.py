"""In-process HPSServer instances on free ports (gRPC + REST), stopped after their tests."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from hps_service.config import HPSConfig, load_config
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.serve.process import HPSServer
from tests.helpers import free_port

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ITEM_DIM, USER_DIM = 8, 4


def server_config(tmp: Path, token: str | None = TOKEN, **server: Any) -> HPSConfig:
    """Two tables (item: zeros default, user: constant 0.5), embedded tiers under ``tmp``."""
    return load_config(
        None,
        server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "admin_token": token,
                "grpc_workers": 4, "max_batch_keys": 4096, **server},
        cache={"enabled": True, "capacity": 4096},  # the servers these tests run keep an L1
        volatile={"type": "hashmap", "capacity_rows": 100_000},
        persistent={"type": "rocksdb", "path": str(tmp / "rocksdb"), "block_cache_mb": 8},
        models=[{"name": "demo", "tables": [{"name": "item", "dim": ITEM_DIM},
                                             {"name": "user", "dim": USER_DIM, "default": {"constant": 0.5}}]}],
    )


@contextmanager
def running(config: HPSConfig) -> Iterator[HPSServer]:
    """Start an HPSServer; stop it (and close its tiers) on exit."""
    srv = HPSServer(config)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop(grace=1)


def target(srv: HPSServer) -> str:
    return f"127.0.0.1:{srv.grpc_port}"


def base_url(srv: HPSServer) -> str:
    return f"http://127.0.0.1:{srv.http_port}"


def wait_job(http: httpx.Client, job_id: str, timeout: float = 60.0) -> dict:
    """Poll GET /v1/jobs/{id} until the job has finished; returns its final view."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = http.get(f"/v1/jobs/{job_id}").json()
        if view["state"] in ("succeeded", "failed"):
            return view
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} did not finish within {timeout}s")


class OpenStream:
    """A StreamLookup call fed from a queue, so a test controls when each request is sent."""

    def __init__(self, stub: pb_grpc.EmbeddingServiceStub, timeout: float | None = None) -> None:
        self._requests: queue.Queue = queue.Queue()
        self.responses = stub.StreamLookup(self._feed(), timeout=timeout)

    def _feed(self) -> Iterator[pb.LookupRequest]:
        while (request := self._requests.get()) is not None:
            yield request

    def ask(self, request: pb.LookupRequest) -> pb.LookupResponse:
        self._requests.put(request)
        return next(self.responses)

    def close(self) -> None:
        self._requests.put(None)
        for _ in self.responses:
            pass


class HeldLookups:
    """While entered, lookups of ``table`` on an in-process server (``workers: 0``) wait on their handler thread
    until :meth:`release`: how a test takes a unary handler thread (an open stream has a thread of its own)."""

    def __init__(self, srv: HPSServer, table: str = "item") -> None:
        self._engine = srv.engine
        self._table = table
        self._released = threading.Event()
        self._entered = threading.Semaphore(0)

    def __enter__(self) -> HeldLookups:
        original = self._engine.lookup

        def held(model: str, table: str, *args: Any, **kwargs: Any) -> Any:
            if table == self._table:
                self._entered.release()
                self._released.wait(60)
            return original(model, table, *args, **kwargs)

        self._engine.lookup = held
        return self

    def wait_entered(self, timeout: float = 10.0) -> None:
        """Until one more lookup is held on a handler thread."""
        assert self._entered.acquire(timeout=timeout), "no lookup reached a handler thread"

    def release(self) -> None:
        self._released.set()

    def __exit__(self, *exc: object) -> None:
        self.release()
        del self._engine.lookup


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HPSServer]:
    with running(server_config(tmp_path_factory.mktemp("srv"))) as srv:
        yield srv


@pytest.fixture
def http(server: HPSServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url(server), timeout=30) as client:
        yield client

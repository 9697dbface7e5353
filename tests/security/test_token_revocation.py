"""Revoking a token by its file fails closed (issue 57: deleting or emptying a reader's token file left the old token
valid): against a real `hps serve` with workers, a reader whose file is deleted and an admin token whose file is
emptied are refused over gRPC and REST within a few seconds, a token written back is taken again, and the log says
so once per change, never showing a token."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx

from hps_service.client import build_request
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from tests.helpers import ServerProcess, free_port, write_config

RANKER, RANKER_NEW = "revocable-ranker-token-0001", "revocable-ranker-token-0002"
ADMIN, OTHER = "revocable-admin-token-00001", "revocable-other-token-00001"
ROWS = "/v1/models/demo/tables/item/embeddings"


def _until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> float:
    """Seconds until ``check()`` holds (AssertionError after ``timeout``)."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, what
        time.sleep(0.1)
    return time.monotonic() - started


def _replace(path: Path, text: str) -> None:
    """Write ``path`` whole at once, as a Kubernetes Secret is updated."""
    path.with_suffix(".new").write_text(text)
    os.replace(path.with_suffix(".new"), path)


def test_deleted_or_emptied_token_files_revoke_their_tokens(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "ranker").write_text(RANKER + "\n")
    (secrets / "admin").write_text(ADMIN + "\n")
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "workers": 1, "grpc_workers": 2, "auth": "token",
                   "admin_token_file": str(secrets / "admin"),
                   "readers": [{"name": "ranker", "token_file": str(secrets / "ranker"), "models": ["demo"]},
                               {"name": "other", "token": OTHER, "models": ["demo"]}]},
        "cache": {"backend": "numpy", "capacity": 64},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": 4}]}],
    })
    request = build_request("demo", {"item": [1, 2]})
    with ServerProcess(cfg, grpc_port) as srv, grpc.insecure_channel(srv.target) as channel, \
            httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=10) as http:
        stub = pb_grpc.EmbeddingServiceStub(channel)

        def grpc_code(token: str) -> grpc.StatusCode:
            try:
                stub.Lookup(request, timeout=10, metadata=(("authorization", f"Bearer {token}"),))
                return grpc.StatusCode.OK
            except grpc.RpcError as err:
                return err.code()

        def rest_status(token: str) -> int:
            return http.get(ROWS, params={"keys": "1"}, headers={"Authorization": f"Bearer {token}"}).status_code

        def admin_status(token: str) -> int:
            return http.put(ROWS, json={"keys": [1], "vectors": [[1.0] * 4]},
                            headers={"Authorization": f"Bearer {token}"}).status_code

        assert grpc_code(RANKER) == grpc.StatusCode.OK and rest_status(RANKER) == 200 and admin_status(ADMIN) == 200

        # The reader is revoked: its old token refused on both protocols. The worker (gRPC) and the owner (REST) each
        # look at the file on their own clock, so each is given its own few seconds.
        (secrets / "ranker").unlink()
        took = _until(lambda: grpc_code(RANKER) == grpc.StatusCode.UNAUTHENTICATED, "the deleted token still reads")
        took = max(took, _until(lambda: rest_status(RANKER) == 401, "the deleted token still reads over REST"))
        assert grpc_code(OTHER) == grpc.StatusCode.OK  # the other readers read on

        (secrets / "admin").write_text("")  # emptied: the admin API refuses the old admin token
        _until(lambda: admin_status(ADMIN) == 403, "the emptied admin token still writes")
        refused = http.put(ROWS, json={"keys": [1], "vectors": [[1.0] * 4]}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert "server.admin_token_file holds no token" in refused.json()["detail"]
        _until(lambda: grpc_code(ADMIN) == grpc.StatusCode.UNAUTHENTICATED, "the emptied admin token still reads")

        _replace(secrets / "ranker", RANKER_NEW + "\n")  # a new token is taken, the old one still refused
        _until(lambda: grpc_code(RANKER_NEW) == grpc.StatusCode.OK, "the new token is never taken")
        _until(lambda: rest_status(RANKER_NEW) == 200, "the new token is never taken over REST")
        assert grpc_code(RANKER) == grpc.StatusCode.UNAUTHENTICATED and rest_status(RANKER) == 401
        _replace(secrets / "admin", ADMIN + "\n")
        _until(lambda: admin_status(ADMIN) == 200, "the admin token written back is never taken")
        time.sleep(2.5)  # a few more looks at the files: each change is logged once, not every second
        log = srv.log()
    print(f"\nthe deleted reader token was refused {took:.1f} s after its file went")
    for token in (RANKER, RANKER_NEW, ADMIN, OTHER):
        assert token not in log
    for what in ("server.readers[ranker].token_file", "server.admin_token_file"):
        for change in ("no secret until", "holds a secret again"):
            lines = [line for line in log.splitlines() if what in line and change in line]
            by_process = [_process(line) for line in lines]
            assert lines and len(set(by_process)) == len(by_process), (what, change, lines)  # once per process


def _process(line: str) -> str:
    """Which process wrote a log line: a worker (its lines say ``[worker N]``), else the owner."""
    return line.partition("[worker ")[2].partition("]")[0] or "owner"

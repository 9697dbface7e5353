"""A rotated server certificate (its files replaced in place, as kubelet updates a mounted Secret) is served on new
gRPC and REST connections without a restart; a half-written rotation (a key that is not the certificate's) is
ignored until it is whole."""

from __future__ import annotations

import os
import shutil
import ssl
import time
from pathlib import Path

import httpx
import pytest

from hps_client import HPSClient, UnavailableError
from hps_service.config import load_config
from hps_service.serve.process import HPSServer
from tests.helpers import free_port
from tests.security.certs import make_pki


def _install(src_cert: Path, src_key: Path, dest: Path) -> None:
    """Replace ``dest``'s tls.crt and tls.key by renames (readers see the old file or the new one)."""
    for src, name in ((src_cert, "tls.crt"), (src_key, "tls.key")):
        shutil.copy(src, dest / f".{name}.new")
        os.replace(dest / f".{name}.new", dest / name)


def _rest_ok(port: int, ca: Path) -> bool:
    try:
        with httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), timeout=5) as http:
            return http.get(f"https://localhost:{port}/healthz").status_code == 200
    except httpx.ConnectError:
        return False


def _grpc_ok(port: int, ca: Path) -> bool:
    with HPSClient(f"localhost:{port}", tls_ca=ca, timeout=5, retries=0) as client:
        try:
            return client.lookup("demo", "item", [1]).shape == (1, 2)
        except UnavailableError:
            return False


def test_a_rotated_certificate_is_served_without_a_restart(tmp_path: Path) -> None:
    old, new = make_pki(tmp_path / "old"), make_pki(tmp_path / "new")
    live = tmp_path / "tls"
    live.mkdir()
    _install(old.server_cert, old.server_key, live)
    srv = HPSServer(load_config(
        None, server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "workers": 0, "grpc_workers": 2,
                      "tls": {"cert_file": str(live / "tls.crt"), "key_file": str(live / "tls.key")}},
        cache={"backend": "numpy", "capacity": 64}, persistent={"type": "rocksdb", "path": str(tmp_path / "db")},
        models=[{"name": "demo", "tables": [{"name": "item", "dim": 2}]}]))
    srv.start()
    try:
        assert _grpc_ok(srv.grpc_port, old.ca) and _rest_ok(srv.http_port, old.ca)
        assert not _grpc_ok(srv.grpc_port, new.ca) and not _rest_ok(srv.http_port, new.ca)
        # half-way: the new certificate beside the old key is not taken
        shutil.copy(new.server_cert, live / ".tls.crt.new")
        os.replace(live / ".tls.crt.new", live / "tls.crt")
        time.sleep(1.5)  # the files are looked at once a second
        assert _grpc_ok(srv.grpc_port, old.ca) and _rest_ok(srv.http_port, old.ca)
        _install(new.server_cert, new.server_key, live)
        deadline = time.monotonic() + 10
        while not (_grpc_ok(srv.grpc_port, new.ca) and _rest_ok(srv.http_port, new.ca)):
            assert time.monotonic() < deadline, "the rotated certificate was not served within 10 s"
            time.sleep(0.3)
        assert not _grpc_ok(srv.grpc_port, old.ca) and not _rest_ok(srv.http_port, old.ca)
    finally:
        srv.stop(grace=1)



@pytest.fixture(autouse=True)
def _dirs(tmp_path: Path) -> None:
    """make_pki writes into existing directories."""
    for name in ("old", "new"):
        (tmp_path / name).mkdir()

"""TLS and mutual TLS on both listeners (gRPC and REST) from server.tls, with certificates made at test time;
HPSClient, AsyncHPSClient and `hps lookup` connect with their TLS options, and nothing connects without them."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from hps_service.aio_client import AsyncHPSClient
from hps_service.client import HPSClient
from hps_service.config import load_config
from hps_service.errors import InvalidArgumentError, UnavailableError
from hps_service.serve.process import HPSServer
from tests.helpers import free_port, run_hps
from tests.security.certs import PKI, make_pki

DIM = 4


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _server(tmp: Path, tls: dict) -> HPSServer:
    config = load_config(
        None,
        server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "grpc_workers": 2, "tls": tls},
        cache={"backend": "numpy", "capacity": 128},
        volatile={"type": "hashmap", "capacity_rows": 1000},
        persistent={"type": "rocksdb", "path": str(tmp / "db"), "block_cache_mb": 8},
        models=[{"name": "demo", "tables": [{"name": "item", "dim": DIM, "default": {"constant": 0.25}}]}],
    )
    srv = HPSServer(config)
    srv.start()
    return srv


@pytest.fixture(scope="module")
def tls_server(pki: PKI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HPSServer]:
    srv = _server(tmp_path_factory.mktemp("tls"), {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)})
    yield srv
    srv.stop(grace=1)


@pytest.fixture(scope="module")
def mtls_server(pki: PKI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HPSServer]:
    srv = _server(tmp_path_factory.mktemp("mtls"), {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key),
                                                    "client_ca_file": str(pki.ca)})
    yield srv
    srv.stop(grace=1)


def _target(srv: HPSServer) -> str:
    return f"127.0.0.1:{srv.grpc_port}"


def _lookup(srv: HPSServer, **tls: object) -> np.ndarray:
    with HPSClient(_target(srv), timeout=5, retries=0, **tls) as client:  # type: ignore[arg-type]
        return client.lookup("demo", "item", [1, 2, 3])


def _https(srv: HPSServer, ca: Path, cert: Path | None = None, key: Path | None = None) -> httpx.Response:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    with httpx.Client(verify=ctx, timeout=5) as client:
        return client.get(f"https://127.0.0.1:{srv.http_port}/readyz")


def test_tls_grpc_and_rest(tls_server: HPSServer, pki: PKI) -> None:
    assert np.allclose(_lookup(tls_server, tls_ca=pki.ca), 0.25)
    with pytest.raises(UnavailableError):
        _lookup(tls_server)  # plaintext against a TLS port
    with pytest.raises(UnavailableError):
        _lookup(tls_server, tls_ca=pki.other_ca)  # a server certificate we do not trust
    assert _https(tls_server, pki.ca).status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{tls_server.http_port}/readyz", timeout=5)
    with pytest.raises(httpx.ConnectError):
        _https(tls_server, pki.other_ca)

    async def aio() -> np.ndarray:
        async with AsyncHPSClient(_target(tls_server), tls_ca=pki.ca, retries=0) as client:
            return await client.lookup("demo", "item", [5])

    assert np.allclose(asyncio.run(aio()), 0.25)
    out = run_hps("lookup", "--target", _target(tls_server), "-m", "demo", "-t", "item", "--tls-ca", str(pki.ca), "7",
                  timeout=60)
    assert out.returncode == 0 and "[default]" in out.stdout, out.stderr


def test_mutual_tls(mtls_server: HPSServer, pki: PKI) -> None:
    assert np.allclose(_lookup(mtls_server, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key), 0.25)
    with pytest.raises(UnavailableError):
        _lookup(mtls_server, tls_ca=pki.ca)  # no client certificate
    with pytest.raises(UnavailableError):
        _lookup(mtls_server, tls_ca=pki.ca, tls_cert=pki.other_client_cert, tls_key=pki.other_client_key)
    assert _https(mtls_server, pki.ca, pki.client_cert, pki.client_key).status_code == 200
    with pytest.raises(httpx.HTTPError):
        _https(mtls_server, pki.ca)
    with pytest.raises(httpx.HTTPError):
        _https(mtls_server, pki.ca, pki.other_client_cert, pki.other_client_key)
    out = run_hps("lookup", "--target", _target(mtls_server), "-m", "demo", "-t", "item", "--tls-ca", str(pki.ca),
                  "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key), "7", timeout=60)
    assert out.returncode == 0 and "[default]" in out.stdout, out.stderr
    out = run_hps("lookup", "--target", _target(mtls_server), "-m", "demo", "-t", "item", "--tls-ca", str(pki.ca),
                  "7", timeout=60)
    assert out.returncode != 0


def test_bad_tls_material_is_refused(pki: PKI, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="key_file"):
        _server(tmp_path, {"cert_file": str(pki.server_cert), "key_file": str(tmp_path / "missing.key")})
    with pytest.raises(InvalidArgumentError, match="tls_cert and tls_key"):
        HPSClient("127.0.0.1:1", tls_ca=pki.ca, tls_cert=pki.client_cert)
    not_pem = tmp_path / "x.pem"
    not_pem.write_text("hello")
    with pytest.raises(InvalidArgumentError, match="not a PEM"):
        HPSClient("127.0.0.1:1", tls_ca=not_pem)

"""Authenticated reads (server.auth token and mtls) over gRPC, REST, HPSClient and AsyncHPSClient: no credential, a
wrong one, a model the reader may not read, and the right one. Refusals are UNAUTHENTICATED / PERMISSION_DENIED
(REST 401 / 403 with a JSON body), never INTERNAL; health and liveness need nothing; a read token rotated in its
file takes effect without a restart, in the worker processes too."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hps_client import AsyncHPSClient, HPSClient, PermissionDeniedError, UnauthenticatedError, UnavailableError
from hps_service.config import load_config
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.serve.process import HPSServer
from tests.helpers import free_port, run_hps
from tests.security.certs import PKI, make_pki

ADMIN = "admin-token-for-read-auth-tests"
RANKER, ALL = "ranker-read-token-0001", "all-models-read-token-02"
WRONG = "not-a-token-anybody-has-00"
DIM = 4


def _config(tmp: Path, **server) -> dict:
    return dict(
        server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "grpc_workers": 2,
                "admin_token": ADMIN, "grace_period_s": 2, **server},
        cache={"backend": "numpy", "capacity": 128},
        volatile={"type": "hashmap", "capacity_rows": 1000},
        persistent={"type": "rocksdb", "path": str(tmp / "db"), "block_cache_mb": 8},
        models=[{"name": m, "tables": [{"name": "item", "dim": DIM, "default": {"constant": 0.5}}]}
                for m in ("demo", "secret")],
    )


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HPSServer, Path]]:
    """auth token with one worker process (the gRPC port is a worker's, the Unix socket the owner's)."""
    tmp = tmp_path_factory.mktemp("token-auth")
    (tmp / "ranker").write_text(RANKER + "\n")
    srv = HPSServer(load_config(None, **_config(
        tmp, workers=1, auth="token", uds_path=str(tmp / "grpc.sock"),
        readers=[{"name": "ranker", "token_file": str(tmp / "ranker"), "models": ["demo"]},
                 {"name": "all", "token": ALL, "models": ["*"]}])))
    srv.start()
    yield srv, tmp
    srv.stop(grace=1)


def _stub(target: str, credentials: grpc.ChannelCredentials | None = None) -> tuple[grpc.Channel, object]:
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    return channel, pb_grpc.EmbeddingServiceStub(channel)


def _request(model: str) -> pb.LookupRequest:
    return pb.LookupRequest(model=model, tables=[pb.TableKeys(table="item", keys=np.arange(3, dtype="<i8").tobytes())])


def _code(stub, model: str, token: str | None = None) -> grpc.StatusCode:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    try:
        answer = stub.Lookup(_request(model), timeout=10, metadata=metadata)
    except grpc.RpcError as err:
        assert err.details() and "Traceback" not in err.details()
        return err.code()
    assert answer.tables[0].count == 3
    return grpc.StatusCode.OK


def test_token_reads_over_grpc(token_server) -> None:
    srv, tmp = token_server
    channel, stub = _stub(f"127.0.0.1:{srv.grpc_port}")
    with channel:
        assert _code(stub, "demo") == grpc.StatusCode.UNAUTHENTICATED
        assert _code(stub, "demo", WRONG) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(stub, "secret", RANKER) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(stub, "demo", RANKER) == grpc.StatusCode.OK
        assert _code(stub, "secret", ALL) == _code(stub, "secret", ADMIN) == grpc.StatusCode.OK
        with pytest.raises(grpc.RpcError) as refused:
            stub.Lookup(_request("demo"), timeout=10, metadata=[("authorization", f"Basic {RANKER}")])
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED and "read token" in refused.value.details()
        listed = stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=[("authorization", f"Bearer {RANKER}")])
        assert [m.name for m in listed.models] == ["demo"]  # the reader sees only what it may read
        with pytest.raises(grpc.RpcError) as anonymous:
            stub.GetClusterInfo(pb.GetClusterInfoRequest(), timeout=10)
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stream = stub.StreamLookup(iter([_request("demo"), _request("secret")]), timeout=10,
                                   metadata=[("authorization", f"Bearer {RANKER}")])
        assert next(stream).tables[0].count == 3
        with pytest.raises(grpc.RpcError) as streamed:
            next(stream)
        assert streamed.value.code() == grpc.StatusCode.PERMISSION_DENIED and "'secret'" in streamed.value.details()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no credential
    # A colocated reader on the owner's Unix socket is admitted by the socket's file permissions (0600 here).
    assert (tmp / "grpc.sock").stat().st_mode & 0o777 == 0o600
    channel, stub = _stub(f"unix:{tmp / 'grpc.sock'}")
    with channel:
        assert _code(stub, "secret") == grpc.StatusCode.OK


def test_token_reads_over_rest(token_server) -> None:
    srv, _ = token_server
    rows = "/v1/models/{model}/tables/item/embeddings"
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}", timeout=10) as http:
        def get(model: str, token: str | None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return http.get(rows.format(model=model), params={"keys": "1,2"}, headers=headers)

        def post(model: str, token: str | None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return http.post(rows.format(model=model) + ":lookup", json={"keys": [1, 2]}, headers=headers)

        for call in (get, post):
            for model, token, status in (("demo", None, 401), ("demo", WRONG, 401), ("secret", RANKER, 403),
                                         ("demo", RANKER, 200), ("secret", ALL, 200), ("secret", ADMIN, 200)):
                r = call(model, token)
                assert r.status_code == status, (call.__name__, model, token, r.text)
                body = r.json()
                if status == 200:
                    assert body["vectors"] == [[0.5] * DIM] * 2
                else:
                    assert body["status"] == status and body["error"]
                    assert (r.headers.get("www-authenticate") == "Bearer") == (status == 401)
        ranker = {"Authorization": f"Bearer {RANKER}"}
        assert [m["name"] for m in http.get("/v1/models", headers=ranker).json()["models"]] == ["demo"]
        assert http.get("/v1/models/secret", headers=ranker).status_code == 403
        assert http.get("/metrics").status_code == 401  # internal routes on the REST port need a reader
        assert http.get("/metrics", headers=ranker).status_code == 403  # it spans every model: not the ranker's
        assert "hps_lookup" in http.get("/metrics", headers={"Authorization": f"Bearer {ALL}"}).text
        assert http.get("/healthz").status_code == 200 and http.get("/readyz").status_code == 200
        # a read token is no admin token
        assert http.put(rows.format(model="demo"), json={"keys": [1], "vectors": [[1] * DIM]},
                        headers=ranker).status_code == 403


def test_token_reads_through_the_clients(token_server) -> None:
    srv, _ = token_server
    target = f"127.0.0.1:{srv.grpc_port}"
    with HPSClient(target) as anonymous, HPSClient(target, credentials=WRONG) as wrong, \
            HPSClient(target, credentials=RANKER) as ranker:
        with pytest.raises(UnauthenticatedError, match="UNAUTHENTICATED"):
            anonymous.lookup("demo", "item", [1])
        with pytest.raises(UnauthenticatedError, match="invalid read token"):
            wrong.lookup("demo", "item", [1])
        with pytest.raises(PermissionDeniedError, match="may not read model 'secret'"):
            ranker.lookup("secret", "item", [1])
        assert ranker.lookup("demo", "item", [1, 2]).tolist() == [[0.5] * DIM] * 2
        assert ranker.list_models() == {"demo": {"item": DIM}}
        # per-call metadata: the credential of one call
        assert anonymous.lookup("demo", "item", [7], metadata=[("authorization", f"Bearer {RANKER}")]).shape == (1, DIM)
    # gRPC call credentials are sent over TLS only: on this plaintext port the call never leaves the client
    with HPSClient(target, credentials=grpc.access_token_call_credentials(RANKER), retries=0) as tls_only, \
            pytest.raises((UnauthenticatedError, UnavailableError)):
        tls_only.lookup("demo", "item", [1])

    async def aio() -> None:
        async with AsyncHPSClient(target) as anonymous, AsyncHPSClient(target, credentials=RANKER) as ranker:
            with pytest.raises(UnauthenticatedError):
                await anonymous.lookup("demo", "item", [1])
            with pytest.raises(PermissionDeniedError):
                await ranker.lookup("secret", "item", [1])
            assert (await ranker.lookup("demo", "item", [3])).tolist() == [[0.5] * DIM]
            assert (await anonymous.lookup("demo", "item", [3], metadata=[("authorization", f"Bearer {RANKER}")])
                    ).shape == (1, DIM)

    asyncio.run(aio())


def test_hps_lookup_takes_a_token_file(token_server) -> None:
    srv, tmp = token_server
    args = ["lookup", "--target", f"127.0.0.1:{srv.grpc_port}", "-m", "demo", "-t", "item", "--json", "5"]
    refused = run_hps(*args)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr + refused.stdout
    done = run_hps(*args, env={"HPS_TOKEN_FILE": str(tmp / "ranker")})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["vectors"] == [[0.5] * DIM]


def test_a_rotated_token_file_takes_effect_without_a_restart(token_server) -> None:
    srv, tmp = token_server
    rotated = "ranker-rotated-token-0002"
    new = tmp / "ranker.new"
    new.write_text(rotated)
    os.replace(new, tmp / "ranker")  # as kubelet swaps a mounted Secret
    try:
        with HPSClient(f"127.0.0.1:{srv.grpc_port}", credentials=rotated) as client, \
                httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}", timeout=10) as http:
            def taken() -> bool:
                try:
                    client.lookup("demo", "item", [1])  # a worker process
                except UnauthenticatedError:
                    return False
                return http.get("/v1/models/demo", headers={"Authorization": f"Bearer {rotated}"}).status_code == 200

            deadline = time.monotonic() + 10
            while not taken():  # each process looks at the file at most once a second
                assert time.monotonic() < deadline, "a process never took the rotated token"
                time.sleep(0.2)
            assert http.get("/v1/models/demo", headers={"Authorization": f"Bearer {RANKER}"}).status_code == 401
        with HPSClient(f"127.0.0.1:{srv.grpc_port}", credentials=RANKER) as old, \
                pytest.raises(UnauthenticatedError):
            old.lookup("demo", "item", [1])
    finally:
        (tmp / "ranker").write_text(RANKER)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=80))
def test_any_other_authorization_is_refused_cleanly(token_server, header: str) -> None:
    srv, _ = token_server
    header = header.strip()  # what a header can carry
    if header in (f"Bearer {t}" for t in (RANKER, ALL, ADMIN)):
        return
    r = httpx.get(f"http://127.0.0.1:{srv.http_port}/v1/models/demo", headers={"Authorization": header} if header
                  else {}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]
    channel, stub = _stub(f"127.0.0.1:{srv.grpc_port}")
    with channel:
        try:
            stub.Lookup(_request("demo"), timeout=10, metadata=[("authorization", header)])
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
        else:
            raise AssertionError(f"{header!r} was admitted")


# ---- mutual TLS ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mtls_server(pki: PKI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HPSServer]:
    tmp = tmp_path_factory.mktemp("mtls-auth")
    srv = HPSServer(load_config(None, **_config(
        tmp, workers=0, auth="mtls",
        tls={"cert_file": str(pki.server_cert), "key_file": str(pki.server_key), "client_ca_file": str(pki.ca)},
        readers=[{"name": "ranker", "identity": "hps-client", "models": ["demo"]}])))
    srv.start()
    yield srv
    srv.stop(grace=1)


def _tls(pki: PKI, cert: Path | None, key: Path | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(pki.ca.read_bytes(), key.read_bytes() if key else None,
                                        cert.read_bytes() if cert else None)


def test_mtls_reads_over_grpc_rest_and_the_client(mtls_server: HPSServer, pki: PKI) -> None:
    target = f"localhost:{mtls_server.grpc_port}"
    cases = [(None, None, "handshake"), (pki.other_client_cert, pki.other_client_key, "handshake"),
             (pki.stranger_cert, pki.stranger_key, grpc.StatusCode.PERMISSION_DENIED),
             (pki.client_cert, pki.client_key, grpc.StatusCode.OK)]
    for cert, key, expected in cases:
        channel, stub = _stub(target, _tls(pki, cert, key))
        with channel:
            code = _code(stub, "demo")
            assert code == (grpc.StatusCode.UNAVAILABLE if expected == "handshake" else expected), (cert, code)
            if expected == grpc.StatusCode.OK:
                assert _code(stub, "secret") == grpc.StatusCode.PERMISSION_DENIED
    url = f"https://localhost:{mtls_server.http_port}/v1/models/{{model}}/tables/item/embeddings?keys=1"
    for cert, key, expected in cases:
        context = ssl.create_default_context(cafile=str(pki.ca))
        if cert is not None:
            context.load_cert_chain(cert, key)
        with httpx.Client(verify=context, timeout=10) as http:
            try:
                status = http.get(url.format(model="demo")).status_code
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                status = "handshake"
            assert status == {"handshake": "handshake", grpc.StatusCode.PERMISSION_DENIED: 403,
                              grpc.StatusCode.OK: 200}[expected], cert
            if expected == grpc.StatusCode.OK:
                denied = http.get(url.format(model="secret"))
                assert denied.status_code == 403 and "may not read model 'secret'" in denied.json()["error"]
            if expected == grpc.StatusCode.PERMISSION_DENIED:
                assert "'stranger' is not one of server.readers" in http.get(url.format(model="demo")).json()["error"]
    with HPSClient(target, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key) as ranker, \
            HPSClient(target, tls_ca=pki.ca, tls_cert=pki.stranger_cert, tls_key=pki.stranger_key) as stranger:
        assert ranker.lookup("demo", "item", [1]).tolist() == [[0.5] * DIM]
        with pytest.raises(PermissionDeniedError):
            ranker.lookup("secret", "item", [1])
        with pytest.raises(PermissionDeniedError, match="not one of server.readers"):
            stranger.lookup("demo", "item", [1])

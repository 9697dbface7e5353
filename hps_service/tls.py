"""TLS material from files: gRPC server and channel credentials and uvicorn's SSL settings.

One place reads certificates so the gRPC listener, the REST listener and the clients agree on what a configured
``server.tls`` (or a client's ``tls_ca``/``tls_cert``/``tls_key``) means: optional mutual TLS when a client CA is set.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import grpc

from hps_service.config import TLSConfig
from hps_service.errors import InvalidArgumentError


def read_pem(path: str | Path, what: str) -> bytes:
    """The bytes of a PEM file; InvalidArgumentError naming ``what`` when it cannot be read."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(f"{what} {p} cannot be read: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise InvalidArgumentError(f"{what} {p} is not a PEM file")
    return data


def grpc_server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """Server credentials from ``server.tls``; with ``client_ca_file`` a client certificate is required."""
    key = read_pem(tls.key_file, "server.tls.key_file")
    cert = read_pem(tls.cert_file, "server.tls.cert_file")
    ca = read_pem(tls.client_ca_file, "server.tls.client_ca_file") if tls.client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def uvicorn_ssl_options(tls: TLSConfig) -> dict[str, Any]:
    """uvicorn.Config keyword arguments that serve HTTPS from ``server.tls`` (client certificates when a CA is set)."""
    for path, what in ((tls.cert_file, "cert_file"), (tls.key_file, "key_file"), (tls.client_ca_file, "client_ca_file")):
        if path is not None:
            read_pem(path, f"server.tls.{what}")
    options: dict[str, Any] = {"ssl_certfile": str(tls.cert_file), "ssl_keyfile": str(tls.key_file)}
    if tls.client_ca_file is not None:
        options.update(ssl_ca_certs=str(tls.client_ca_file), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


def grpc_channel_credentials(
    ca_file: str | Path | None = None, cert_file: str | Path | None = None, key_file: str | Path | None = None
) -> grpc.ChannelCredentials:
    """Client credentials: trust ``ca_file`` (system roots when None), present ``cert_file``/``key_file`` for mTLS."""
    if (cert_file is None) != (key_file is None):
        raise InvalidArgumentError("a client certificate needs both tls_cert and tls_key")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca_file, "tls_ca") if ca_file is not None else None,
        private_key=read_pem(key_file, "tls_key") if key_file is not None else None,
        certificate_chain=read_pem(cert_file, "tls_cert") if cert_file is not None else None,
    )

"""TLS material from files: gRPC server and channel credentials and uvicorn's SSL settings.

One place reads certificates so the gRPC listener, the REST listener and the clients agree on what a configured
``server.tls`` (or a client's ``tls_ca``/``tls_cert``/``tls_key``) means: optional mutual TLS when a client CA is set.
"""

from __future__ import annotations

import ssl
from typing import Any

import grpc

from hps_client.tls import grpc_channel_credentials, read_pem
from hps_service.config import TLSConfig

__all__ = ["grpc_channel_credentials", "grpc_server_credentials", "read_pem", "uvicorn_ssl_options"]


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

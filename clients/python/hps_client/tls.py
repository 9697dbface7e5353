"""TLS material for the client: PEM files read once, turned into gRPC channel credentials."""

from __future__ import annotations

from pathlib import Path

import grpc

from hps_client.errors import InvalidArgumentError


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


def channel_credentials(
    tls_ca: str | Path | None, tls_cert: str | Path | None, tls_key: str | Path | None, tls: bool
) -> grpc.ChannelCredentials | None:
    """TLS credentials when any TLS option is given, else None (plaintext)."""
    if not (tls or tls_ca or tls_cert or tls_key):
        return None
    return grpc_channel_credentials(tls_ca, tls_cert, tls_key)

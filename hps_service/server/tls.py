"""TLS material from files: gRPC server and channel credentials and uvicorn's SSL settings, reloaded on rotation.

One place reads certificates so the gRPC listener, the REST listener and the clients agree on what a configured
``server.tls`` (or a client's ``tls_ca``/``tls_cert``/``tls_key``) means: optional mutual TLS when a client CA is set.
A rotated certificate (a Kubernetes Secret updated in place, cert-manager renewing it) is picked up without a
restart: gRPC asks before each handshake whether the files changed (looked at at most every second), and the REST
port's SSL context is loaded again on its event loop when they do. A half-written rotation (a key that does not match
its certificate) is ignored until it is whole; connections already open keep their certificate.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from typing import Any

import grpc

from hps_client.tls import grpc_channel_credentials, read_pem
from hps_service.config import TLSConfig
from hps_service.config.secrets import file_signature
from hps_service.errors import InvalidArgumentError

__all__ = ["SSLContextReloader", "grpc_channel_credentials", "grpc_server_credentials", "read_pem",
           "uvicorn_ssl_options"]

log = logging.getLogger(__name__)
#: How often the certificate files are looked at for a change.
RELOAD_CHECK_S = 1.0


class _Material:
    """server.tls's files: their bytes as last read, and whether they changed since."""

    def __init__(self, tls: TLSConfig) -> None:
        self.tls = tls
        self._paths = [p for p in (tls.cert_file, tls.key_file, tls.client_ca_file) if p is not None]
        self.signature = self._signature()
        self.key, self.cert, self.ca = self._read()
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def _signature(self) -> tuple[tuple[int, int, int, int] | None, ...]:
        return tuple(file_signature(p) for p in self._paths)

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        tls = self.tls
        key = read_pem(tls.key_file, "server.tls.key_file")
        cert = read_pem(tls.cert_file, "server.tls.cert_file")
        ca = read_pem(tls.client_ca_file, "server.tls.client_ca_file") if tls.client_ca_file else None
        try:  # the pair must match before it replaces the one in use
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(tls.cert_file, tls.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise InvalidArgumentError(f"server.tls: {tls.key_file} is not the key of {tls.cert_file}: "
                                       f"{getattr(exc, 'reason', None) or exc}") from None
        return key, cert, ca

    def reload(self) -> bool:
        """Whether the files changed (looked at most every RELOAD_CHECK_S) and were read again, whole."""
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_S:
            return False
        with self._lock:
            if now - self._checked < RELOAD_CHECK_S:
                return False
            self._checked = now
            signature = self._signature()
            if signature == self.signature:
                return False
            try:
                self.key, self.cert, self.ca = self._read()
            except InvalidArgumentError as exc:
                log.warning("server.tls changed but cannot be used yet (the current certificate stays): %s", exc)
                return False
            self.signature = signature
        log.info("server.tls: certificate reloaded from %s", self.tls.cert_file)
        return True

    def grpc_config(self) -> Any:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], root_certificates=self.ca)


def grpc_server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """Server credentials from ``server.tls``, following its files; with ``client_ca_file`` a client certificate is
    required."""
    material = _Material(tls)
    return grpc.dynamic_ssl_server_credentials(  # the fetcher returns None for "unchanged" (grpc's docs; not its stubs)
        material.grpc_config(), lambda: material.grpc_config() if material.reload() else None,  # type: ignore[arg-type, return-value]  # None: unchanged
        require_client_authentication=material.ca is not None)


def uvicorn_ssl_options(tls: TLSConfig) -> dict[str, Any]:
    """uvicorn.Config keyword arguments that serve HTTPS from ``server.tls`` (client certificates when a CA is set)."""
    for path, what in ((tls.cert_file, "cert_file"), (tls.key_file, "key_file"), (tls.client_ca_file, "client_ca_file")):
        if path is not None:
            read_pem(path, f"server.tls.{what}")
    options: dict[str, Any] = {"ssl_certfile": str(tls.cert_file), "ssl_keyfile": str(tls.key_file)}
    if tls.client_ca_file is not None:
        options.update(ssl_ca_certs=str(tls.client_ca_file), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


class SSLContextReloader:
    """Loads ``server.tls`` again into the REST port's SSL context when its files change, on the port's event loop
    (where every handshake of that context happens, so none sees it half-changed). A new client CA is added to the
    ones trusted; one removed stays trusted until the restart (OpenSSL cannot drop a CA from a context)."""

    def __init__(self, tls: TLSConfig, context: ssl.SSLContext, loop: asyncio.AbstractEventLoop) -> None:
        self._material = _Material(tls)
        self._context = context
        self._loop = loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hps-tls-reload", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(RELOAD_CHECK_S):
            if self._material.reload():
                self._loop.call_soon_threadsafe(self._load)

    def _load(self) -> None:
        tls = self._material.tls
        try:
            self._context.load_cert_chain(tls.cert_file, tls.key_file)
            if tls.client_ca_file is not None:
                self._context.load_verify_locations(tls.client_ca_file)
        except (ssl.SSLError, OSError) as exc:  # replaced again meanwhile: the next change loads it
            log.warning("server.tls: the REST port keeps its certificate: %s", exc)

    def stop(self) -> None:
        self._stop.set()

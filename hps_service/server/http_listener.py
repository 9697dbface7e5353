"""An HTTP port served by uvicorn on its own thread and event loop: the REST port and the probe port.

Under ``server.tls`` it serves HTTPS, gives each request the identities of the client certificate it verified (for
``server.auth: mtls``), and follows a rotated certificate without a restart.
"""

from __future__ import annotations

import threading
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from hps_service.config import TLSConfig
from hps_service.errors import UnavailableError
from hps_service.runtime.sockets import bound_socket
from hps_service.server.tls import SSLContextReloader, uvicorn_ssl_options
from hps_service.server.tls_peer import PeerIdentityProtocol


class HttpListener:
    """uvicorn serving ``app`` on ``host:port`` (bound before this returns; port 0 picks one: see ``port``)."""

    def __init__(self, app: ASGIApp, host: str, port: int, what: str, tls: TLSConfig | None = None) -> None:
        sock = bound_socket(host, port, f"the {what}")
        self.port: int = sock.getsockname()[1]
        options: dict[str, Any] = {}
        if tls is not None:
            options = {**uvicorn_ssl_options(tls), "http": PeerIdentityProtocol}
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", log_config=None,
                                timeout_graceful_shutdown=5, **options)
        config.load()
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name=f"hps-{what}",
                                        daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                sock.close()
                raise UnavailableError(f"the {what} {host}:{self.port} failed to start")
            self._thread.join(0.01)
        self._reloader: SSLContextReloader | None = None
        if tls is not None and config.ssl is not None:
            self._reloader = SSLContextReloader(tls, config.ssl, self._server.servers[0].get_loop())

    def close(self, timeout: float = 0.5) -> None:
        """Stop accepting, let requests in flight finish (uvicorn's graceful shutdown), within ``timeout``."""
        if self._reloader is not None:
            self._reloader.stop()
        self._server.should_exit = True
        self._thread.join(max(timeout, 0.5))

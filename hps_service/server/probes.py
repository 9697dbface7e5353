"""A plaintext HTTP listener for Kubernetes probes (``server.probe_port``): ``/healthz`` and ``/readyz`` only.

kubelet cannot present a client certificate, so with (mutual) TLS on the REST and gRPC ports every probe would fail;
this port answers the same readiness as ``/readyz`` and carries no data.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hps_service.errors import UnavailableError
from hps_service.server.rest import Readiness


class ProbeServer:
    """Answers GET /healthz (200) and GET /readyz (200 or 503 with the reasons) on its own thread."""

    def __init__(self, host: str, port: int, readiness: Readiness) -> None:
        def respond(handler: BaseHTTPRequestHandler) -> None:
            if handler.path == "/healthz":
                code, body = 200, {"status": "ok"}
            elif handler.path == "/readyz":
                not_ready, details = readiness()
                code = 503 if not_ready else 200
                body = {"ready": not not_ready, "not_ready": not_ready, **details}
            else:
                code, body = 404, {"error": "only /healthz and /readyz are served on the probe port"}
            data = json.dumps(body).encode()
            handler.send_response(code)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (the stdlib's name)
                respond(self)

            def log_message(self, *args: object) -> None:
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise UnavailableError(f"cannot bind the probe port {host}:{port}: {exc}") from None
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="hps-probes", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

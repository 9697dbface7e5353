"""TCP sockets bound before their server takes them (a port 0 resolved, a bind failure reported as the port's)."""

from __future__ import annotations

import socket

from hps_service.errors import UnavailableError


def bound_socket(host: str, port: int, what: str, option: int = socket.SO_REUSEADDR) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``option`` set; UnavailableError naming ``what`` when it cannot be.

    Made with ``IPPROTO_TCP`` (not 0): asyncio sets TCP_NODELAY only on such sockets' connections, and without it
    each answer's body waits for the ACK of its headers (40 ms of a client's delayed ACK: /healthz took 48 ms)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, option, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UnavailableError(f"cannot bind {what} to {host}:{port}: {exc.strerror}") from None
    return sock

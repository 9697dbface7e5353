"""A large body sent where no route takes it (a path no route serves, a method the route does not take) is answered
at its headers and its connection closed, the rest never read (issue 57: the server read all 60 MiB of each to reach
the next request's headers, while /healthz waited). The refusals that the gatekeeper makes at the headers are pinned
by test_serve_boundaries.py."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from pathlib import Path

from tests.helpers import ServerProcess, free_port, write_config

MiB = 1 << 20
SIZE = 60 * MiB


def _send(port: int, method: str, path: str) -> tuple[int, float, int]:
    """Send the headers of a ``SIZE``-byte body, then the body, reading what comes back, until the server closes
    the connection or the whole body is sent: (status, seconds to the status line, body bytes the server took).
    A server that closes with the body unread resets the connection; the answer it sent before is still read."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: hps\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {SIZE}\r\n\r\n".encode())
    sock.setblocking(False)
    chunk, sent, answer, answered_after = b"1," * (32 << 10), 0, b"", 0.0
    started = time.perf_counter()
    closed = False

    def receive() -> None:
        nonlocal answer, answered_after, closed
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except ConnectionResetError:
            data = b""
        if not data:
            closed = True
        elif not answer:
            answered_after = time.perf_counter() - started
        answer += data

    try:
        while sent < SIZE and not closed and time.perf_counter() - started < 20:
            try:
                sent += sock.send(chunk[: SIZE - sent])
            except BlockingIOError:
                time.sleep(0.001)
            except (BrokenPipeError, ConnectionResetError):
                break  # closed by the server: what it is for
            receive()
        sock.settimeout(5)  # what the server answered before it closed
        while not closed and not answer.startswith(b"HTTP/1.1 "):
            try:
                receive()
            except (TimeoutError, OSError):
                break
    finally:
        sock.close()
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, answered_after, sent


def test_bodies_no_route_takes_are_refused_at_their_headers(tmp_path: Path) -> None:
    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "workers": 0, "grpc_workers": 2,
                   "admin_token": "unrouted-admin-token-1234"},
        "cache": {"backend": "numpy", "capacity": 64},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": 4}]}],
    })
    cases = [("POST", "/v1/no-such-route", 404), ("PATCH", "/v1/models", 405), ("POST", "/healthz", 405),
             ("PUT", "/v1/stats", 405)]
    latencies: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=10)
        while not stop.is_set():
            started = time.perf_counter()
            conn.request("GET", "/healthz")
            assert conn.getresponse().read() == b'{"status":"ok"}'
            latencies.append(time.perf_counter() - started)
            time.sleep(0.005)
        conn.close()

    with ServerProcess(cfg, grpc_port):
        results: list[tuple[str, int, tuple[int, float, int]]] = []
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for method, path, expected in cases:  # 4 at once, as the issue sent them
            threads = [threading.Thread(target=lambda m=method, p=path, e=expected: results.append(
                (f"{m} {p}", e, _send(http_port, m, p)))) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        stop.set()
        sampler.join(10)
    assert len(results) == 4 * len(cases)
    worst = max(r[2][1] for r in results)
    print(f"\n{len(results)} bodies of 60 MiB where no route takes them: answered in at most {worst * 1000:.0f} ms, "
          f"the server took at most {max(r[2][2] for r in results) / MiB:.1f} MiB of one; /healthz max "
          f"{max(latencies) * 1000:.0f} ms over {len(latencies)} calls")
    for case, expected, (status, answered_after, sent) in results:
        assert status == expected, case
        assert answered_after < 1.0, (case, answered_after)
        assert sent < 16 * MiB, f"{case}: the server read {sent / MiB:.1f} MiB of a body it had refused"
    assert max(latencies) < 0.5

"""A gRPC peer that sends calls and never reads a byte of what the server answers: HTTP/2 frames written by hand on a
plain socket (a gRPC client library always reads its answers), so a test can see what the server holds for it."""

from __future__ import annotations

import socket
import struct
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS = 0x0, 0x1, 0x4
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4


def _length(n: int) -> bytes:
    """An HPACK string length (7-bit prefix integer, no Huffman coding)."""
    if n < 127:
        return bytes([n])
    out = [127]
    n -= 127
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    return bytes([*out, n])


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field as an HPACK literal without indexing, its name new."""
    return b"\x00" + _length(len(name)) + name + _length(len(value)) + value


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


class UnreadingPeer:
    """One connection to ``host:port`` with a receive buffer as small as the kernel allows, never read."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((host, port))
        self.authority = f"{host}:{port}".encode()
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0, b""))
        time.sleep(0.05)  # the server's SETTINGS have been sent: acknowledged unread, so it never times them out
        self.sock.sendall(frame(SETTINGS, ACK, 0, b""))
        self._next_stream = 1

    def call(self, path: str, message: bytes) -> None:
        """Start a unary call of ``path`` with one request ``message`` (at most 16 KiB, one DATA frame)."""
        stream = self._next_stream
        self._next_stream += 2
        block = b"".join(_literal(k, v) for k, v in (
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()), (b":authority", self.authority),
            (b"content-type", b"application/grpc"), (b"te", b"trailers")))
        body = b"\x00" + struct.pack(">I", len(message)) + message
        self.sock.sendall(frame(HEADERS, END_HEADERS, stream, block) + frame(DATA, END_STREAM, stream, body))

    def close(self) -> None:
        self.sock.close()

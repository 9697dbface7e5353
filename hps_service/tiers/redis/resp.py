"""Redis wire protocol (RESP) framing: small commands, and whole batches of bulk strings built with numpy.

A batch's fields and values become one ``(n, width)`` uint8 array, so a put of many rows is framed without a
Python loop per key.
"""

from __future__ import annotations

import numpy as np

_CRLF = np.frombuffer(b"\r\n", dtype=np.uint8)


def resp_command(*args: bytes) -> bytes:
    """One small command in the Redis wire protocol (RESP)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def resp_bulk_columns(n: int, *columns: np.ndarray) -> np.ndarray:
    """Per row, each ``(n, width)`` uint8 column as a RESP bulk string: one ``(n, total)`` uint8 array, no Python loop."""
    pieces = []
    for col in columns:
        head = np.frombuffer(b"$%d\r\n" % col.shape[1], dtype=np.uint8)
        pieces += [np.broadcast_to(head, (n, head.size)), col, np.broadcast_to(_CRLF, (n, 2))]
    return np.concatenate(pieces, axis=1)


def key_bytes(keys: np.ndarray) -> np.ndarray:
    """Keys as ``codec.encode_keys`` stores them (8-byte big-endian), as an ``(n, 8)`` uint8 array."""
    return np.ascontiguousarray(keys, dtype=">i8").view(np.uint8).reshape(-1, 8)

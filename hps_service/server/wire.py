"""Protobuf wire encoding of ``hps.v1.LookupResponse``, written straight from the engine's arrays.

Building the message through the protobuf runtime copies each table's vectors three times (``tobytes``,
the field assignment, ``SerializeToString``); encoding the few field headers by hand and joining them with
the arrays' buffers copies the payload once. The bytes are exactly what ``LookupResponse.SerializeToString``
would produce for the same fields (pinned by tests/server/test_wire.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# field number << 3 | wire type (0 varint, 2 length-delimited)
_RESPONSE_MODEL = b"\x0a"
_RESPONSE_TABLES = b"\x12"
_RESPONSE_REQUEST_ID = b"\x18"
_TABLE_NAME = b"\x0a"
_TABLE_DIM = b"\x10"
_TABLE_COUNT = b"\x18"
_TABLE_VECTORS = b"\x22"
_TABLE_SOURCES = b"\x2a"


def varint(value: int) -> bytes:
    """Base-128 varint of a non-negative integer."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_field(tag: bytes, payload_len: int) -> bytes:
    return tag + varint(payload_len)


def encode_table(name: str, vectors: np.ndarray, sources: np.ndarray) -> list[bytes | memoryview]:
    """The parts of one TableVectors submessage (header bytes and zero-copy views of the arrays)."""
    count, dim = vectors.shape
    name_bytes = name.encode()
    parts: list[bytes | memoryview] = []
    if name_bytes:
        parts.append(_len_field(_TABLE_NAME, len(name_bytes)) + name_bytes)
    if dim:
        parts.append(_TABLE_DIM + varint(dim))
    if count:
        parts.append(_TABLE_COUNT + varint(count))
    vec = np.ascontiguousarray(vectors, dtype="<f4")
    if vec.nbytes:
        parts.append(_len_field(_TABLE_VECTORS, vec.nbytes))
        parts.append(memoryview(vec).cast("B"))
    src = np.ascontiguousarray(sources, dtype=np.uint8)
    if src.nbytes:
        parts.append(_len_field(_TABLE_SOURCES, src.nbytes))
        parts.append(memoryview(src).cast("B"))
    return parts


def encode_lookup_response(
    model: str, request_id: int, tables: Sequence[tuple[str, np.ndarray, np.ndarray]]
) -> bytes:
    """A serialized LookupResponse from ``(table, vectors (n, dim) float32, sources (n,) uint8)`` triples."""
    parts: list[bytes | memoryview] = []
    model_bytes = model.encode()
    if model_bytes:
        parts.append(_len_field(_RESPONSE_MODEL, len(model_bytes)) + model_bytes)
    for name, vectors, sources in tables:
        sub = encode_table(name, vectors, sources)
        parts.append(_len_field(_RESPONSE_TABLES, sum(len(p) for p in sub)))
        parts.extend(sub)
    if request_id:
        parts.append(_RESPONSE_REQUEST_ID + varint(request_id))
    return b"".join(parts)

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
_RESPONSE_VERSION = b"\x20"
_TABLE_NAME = b"\x0a"
_TABLE_DIM = b"\x10"
_TABLE_COUNT = b"\x18"
_TABLE_VECTORS = b"\x22"
_TABLE_SOURCES = b"\x2a"
_TABLE_STORAGE = b"\x30"
_TABLE_POOLED = b"\x38\x01"  # pooled = true (field 7, varint 1)


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


def encode_table(name: str, vectors: np.ndarray, sources: np.ndarray, dim: int | None = None,
                 storage: int = 0, pooled: bool = False) -> list[bytes | memoryview]:
    """The parts of one TableVectors submessage (header bytes and zero-copy views of the arrays); ``vectors`` are
    stored rows of rows of ``dim`` values when ``storage`` (an hps.v1.RowStorage) is not FP32; ``pooled``: one row
    per bag."""
    count, width = vectors.shape
    dim = width if dim is None else dim
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
        parts.append(vec.data.cast("B"))
    src = np.ascontiguousarray(sources, dtype=np.uint8)
    if src.nbytes:
        parts.append(_len_field(_TABLE_SOURCES, src.nbytes))
        parts.append(src.data.cast("B"))
    if storage:
        parts.append(_TABLE_STORAGE + varint(storage))
    if pooled:
        parts.append(_TABLE_POOLED)
    return parts


def encode_lookup_response(
    model: str, request_id: int, tables: Sequence[tuple[str, np.ndarray, np.ndarray]],
    stored: Sequence[tuple[int, int]] | None = None, version: int = 0, pooled: Sequence[bool] | None = None,
) -> bytes:
    """A serialized LookupResponse from ``(table, vectors (n, dim) float32, sources (n,) uint8)`` triples;
    ``stored``: per table, ``(dim, storage)`` of stored rows in ``vectors`` (a precision = stored answer);
    ``version``: the model version that answered; ``pooled``: per table, whether its rows are one per bag."""
    parts: list[bytes | memoryview] = []
    model_bytes = model.encode()
    if model_bytes:
        parts.append(_len_field(_RESPONSE_MODEL, len(model_bytes)) + model_bytes)
    for i, (name, vectors, sources) in enumerate(tables):
        dim, storage = stored[i] if stored is not None else (None, 0)
        sub = encode_table(name, vectors, sources, dim, storage, pooled is not None and pooled[i])
        parts.append(_len_field(_RESPONSE_TABLES, sum(len(p) for p in sub)))
        parts.extend(sub)
    if request_id:
        parts.append(_RESPONSE_REQUEST_ID + varint(request_id))
    if version:
        parts.append(_RESPONSE_VERSION + varint(version))
    return b"".join(parts)


#: Where the rows of a response start in a :class:`ResponseBuffer` (a cache line: the rows are copied in whole lines).
_ALIGN = 64


class ResponseBuffer:
    """A thread's reused buffer for a one-table LookupResponse whose rows and sources the lookup writes in place:
    the field headers go around them, and the only copy after the lookup is the one into the ``bytes`` gRPC
    sends. Byte for byte what :func:`encode_lookup_response` gives for the same fields."""

    def __init__(self) -> None:
        self._buf = bytearray(_ALIGN)
        self._base = np.frombuffer(self._buf, np.uint8).ctypes.data
        self._headers: dict[tuple[str, str, int, int, int, int, bool], tuple[bytes, bytes, bytes]] = {}
        self._start = 0
        self._size = 0
        #: The last layout's fields and views: a call of the same shape finds its field headers still in place
        #: (a lookup writes only the rows and sources), so it takes the views as they are.
        self._last: tuple[str, str, int, int, int | None, int, int, int, bool] | None = None
        self._views: tuple[np.ndarray, np.ndarray] | None = None

    def _parts(self, model: str, table: str, n: int, dim: int, words: int, storage: int,
               pooled: bool) -> tuple[bytes, bytes, bytes]:
        key = (model, table, n, dim, words, storage, pooled)
        parts = self._headers.get(key)
        if parts is None:
            name = table.encode()
            vec_len = 4 * n * words
            sub = ((_len_field(_TABLE_NAME, len(name)) + name if name else b"") + _TABLE_DIM + varint(dim)
                   + _TABLE_COUNT + varint(n) + _len_field(_TABLE_VECTORS, vec_len))
            tail = _len_field(_TABLE_SOURCES, n)
            after = (_TABLE_STORAGE + varint(storage) if storage else b"") + (_TABLE_POOLED if pooled else b"")
            sub_len = len(sub) + vec_len + len(tail) + n + len(after)
            model_bytes = model.encode()
            head = ((_len_field(_RESPONSE_MODEL, len(model_bytes)) + model_bytes if model_bytes else b"")
                    + _len_field(_RESPONSE_TABLES, sub_len) + sub)
            parts = (head, tail, after)
            if len(self._headers) > 1024:
                self._headers.clear()
            self._headers[key] = parts
        return parts

    def layout(self, model: str, table: str, n: int, dim: int, request_id: int, words: int | None = None,
               storage: int = 0, version: int = 0, pooled: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Lay out the response of ``n`` rows of ``dim`` (``n`` >= 1) answered by model version ``version``; returns
        writable views of its rows (C-contiguous float32 ``(n, dim)``, or ``(n, words)`` stored rows of RowStorage
        ``storage``) and sources (uint8 ``(n,)``), to be filled before :meth:`finish`. ``pooled``: the rows are one
        per bag."""
        last = (model, table, n, dim, words, storage, request_id, version, pooled)
        if last == self._last and self._views is not None:
            return self._views
        words = dim if words is None else words
        head, tail, after = self._parts(model, table, n, dim, words, storage, pooled)
        trailer = after + (_RESPONSE_REQUEST_ID + varint(request_id) if request_id else b"")
        if version:
            trailer += _RESPONSE_VERSION + varint(version)
        length = len(head) + 4 * n * words + len(tail) + n + len(trailer)
        if len(self._buf) < length + _ALIGN:
            self._buf = bytearray(max(length + _ALIGN, 2 * len(self._buf)))
            self._base = np.frombuffer(self._buf, np.uint8).ctypes.data
        buf = self._buf
        start = -(self._base + len(head)) % _ALIGN
        rows_at = start + len(head)
        sources_at = rows_at + 4 * n * words + len(tail)
        size = start + length
        buf[start:rows_at] = head
        buf[sources_at - len(tail):sources_at] = tail
        buf[sources_at + n:size] = trailer
        self._start, self._size = start, size
        rows = np.frombuffer(buf, dtype="<f4", count=n * words, offset=rows_at).reshape(n, words)
        sources = np.frombuffer(buf, dtype=np.uint8, count=n, offset=sources_at)
        self._last, self._views = last, (rows, sources)
        return rows, sources

    def finish(self) -> bytes:
        """The encoded response laid out last (a copy: the buffer is reused by the thread's next call)."""
        return bytes(memoryview(self._buf)[self._start:self._size])

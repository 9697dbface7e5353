"""Requests and answers on the wire: keys as packed little-endian int64, rows as packed float32 (zero-copy views)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from hps_client.errors import HPSError, InternalError, InvalidArgumentError, error_for
from hps_client.proto.hps.v1 import embedding_pb2 as pb
from hps_client.rows import STORAGE_NAMES, StoredAnswer, StoredRows, row_words


@dataclass(slots=True)
class TableAnswer:
    """Rows of one table in the order asked, and the level that answered each key (hps.v1.Source)."""

    vectors: np.ndarray
    sources: np.ndarray


def as_error(err: grpc.RpcError) -> HPSError:
    """The client error of a failed call: the status code's class, with ``.code`` and ``.details`` (the message
    names both)."""
    details = err.details() or ""
    if err.code() == grpc.StatusCode.UNAVAILABLE and "backend unhealthy" in details:
        details += " (no replica is accepting calls: each is starting, bootstrapping or draining; see its /readyz)"
    return error_for(err.code(), details)


_INT64 = np.dtype("<i8")


def as_keys(keys: np.ndarray | Sequence[int]) -> np.ndarray:
    """Keys as a contiguous little-endian int64 array; InvalidArgumentError when they are not 1-D integers."""
    if type(keys) is np.ndarray and keys.dtype is _INT64 and keys.ndim == 1 and keys.flags.c_contiguous:
        return keys  # the usual call, answered without NumPy's dtype checks (a third of a 256-key local read)
    arr = np.asarray(keys)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"keys must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(f"keys must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype="<i8")



def encode_keys(keys: np.ndarray | Sequence[int]) -> bytes:
    """Keys as packed little-endian int64 bytes."""
    return as_keys(keys).tobytes()


def decode_answer(tv: pb.TableVectors | WireTable) -> TableAnswer:
    """A TableVectors message as NumPy arrays (zero-copy views of the message bytes)."""
    if tv.storage:
        raise InternalError(f"table '{tv.table}': the server answered {STORAGE_NAMES.get(tv.storage, tv.storage)} "
                            "rows to a request for float32 rows")
    vectors = np.frombuffer(tv.vectors, dtype="<f4").reshape(tv.count, tv.dim)
    sources = np.frombuffer(tv.sources, dtype=np.uint8)
    return TableAnswer(vectors=vectors, sources=sources)


def decode_stored(tv: pb.TableVectors | WireTable) -> StoredAnswer:
    """A TableVectors message of a ``precision = stored`` lookup as its stored rows (zero-copy views)."""
    storage = STORAGE_NAMES.get(tv.storage)
    if storage is None:
        raise InternalError(f"table '{tv.table}': rows stored as RowStorage {tv.storage}, which this client does "
                            "not know (upgrade hps-client)")
    return StoredAnswer(rows=StoredRows.from_bytes(storage, tv.dim, tv.count, tv.vectors),
                        sources=np.frombuffer(tv.sources, dtype=np.uint8))


def build_request(model: str, tables: Mapping[str, np.ndarray | Sequence[int]],
                  precision: pb.Precision = pb.PRECISION_FP32, version: int | None = None,
                  label: str = "") -> pb.LookupRequest:
    """One LookupRequest for several tables of ``model`` (``precision``: an hps.v1.Precision), of its ``version``
    (0: the model as configured) or the one ``label`` names (neither: its label ``production``, else the model as
    configured)."""
    return pb.LookupRequest(model=model, tables=[pb.TableKeys(table=t, keys=encode_keys(k)) for t, k in tables.items()],
                            precision=precision, label=label, **version_field(version))


def version_field(version: int | None) -> dict[str, int]:
    """The ``version`` field of a LookupRequest as constructor arguments: none when unset (it has presence)."""
    return {} if version is None else {"version": version}


@dataclass(slots=True)
class WireTable:
    """One ``hps.v1.TableVectors`` of a response, its ``vectors`` and ``sources`` views of the response's bytes."""

    table: str = ""
    dim: int = 0
    count: int = 0
    vectors: memoryview | bytes = b""
    sources: memoryview | bytes = b""
    storage: int = 0
    pooled: bool = False


@dataclass(slots=True)
class WireResponse:
    """A parsed ``hps.v1.LookupResponse``: the fields of the protobuf message clients read, without copying rows."""

    model: str
    tables: list[WireTable]
    request_id: int
    version: int = 0


def _varint(buf: bytes, i: int, end: int) -> tuple[int, int]:
    """The base-128 varint at ``buf[i]`` and the index after it."""
    value = shift = 0
    while i < end:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            break
    raise ValueError("a varint is truncated or longer than 10 bytes")


def _field(buf: bytes, i: int, end: int) -> tuple[int, int, int, int]:
    """The field at ``buf[i]``: ``(number, wire type, value or payload start, index after it)``; a length-delimited
    payload is ``buf[start:after]``."""
    key, i = _varint(buf, i, end)
    number, kind = key >> 3, key & 7
    if kind == 0:
        value, i = _varint(buf, i, end)
        return number, kind, value, i
    if kind == 2:
        size, i = _varint(buf, i, end)
        if i + size > end:
            raise ValueError(f"field {number} runs {i + size - end} bytes past its message")
        return number, kind, i, i + size
    width = {1: 8, 5: 4}.get(kind)
    if width is None or i + width > end:
        raise ValueError(f"field {number} has wire type {kind}, which a LookupResponse does not use, or is truncated")
    return number, kind, 0, i + width


def _table(buf: bytes, view: memoryview, i: int, end: int) -> WireTable:
    tv = WireTable()
    while i < end:
        number, kind, value, after = _field(buf, i, end)
        if kind == 2 and number == 1:
            tv.table = str(view[value:after], "utf-8")
        elif kind == 2 and number == 4:
            tv.vectors = view[value:after]
        elif kind == 2 and number == 5:
            tv.sources = view[value:after]
        elif kind == 0 and number == 2:
            tv.dim = value & 0xFFFFFFFF
        elif kind == 0 and number == 3:
            tv.count = value & 0xFFFFFFFF
        elif kind == 0 and number == 6:
            tv.storage = value & 0xFFFFFFFF
        elif kind == 0 and number == 7:
            tv.pooled = bool(value)
        i = after
    width = tv.dim if tv.pooled else row_words(STORAGE_NAMES.get(tv.storage, "fp32"), tv.dim)
    if len(tv.vectors) != 4 * tv.count * width or len(tv.sources) != tv.count:
        raise ValueError(f"table '{tv.table}': {len(tv.vectors)} bytes of vectors and {len(tv.sources)} of sources "
                         f"for {tv.count} rows of dim {tv.dim} ({4 * width} bytes each)")
    return tv


def parse_lookup_response(data: bytes) -> WireResponse:
    """A serialized LookupResponse read field by field, as protobuf would (unknown fields skipped, the last of a
    repeated scalar kept); the rows stay in ``data`` (``np.frombuffer`` views, no copy). ValueError when malformed
    (gRPC then fails the call with INTERNAL, as for any response it cannot deserialize)."""
    view = memoryview(data)
    out = WireResponse("", [], 0)
    i, end = 0, len(data)
    while i < end:
        number, kind, value, after = _field(data, i, end)
        if kind == 2 and number == 2:
            out.tables.append(_table(data, view, value, after))
        elif kind == 2 and number == 1:
            out.model = str(view[value:after], "utf-8")
        elif kind == 0 and number == 3:
            out.request_id = value & 0xFFFFFFFFFFFFFFFF
        elif kind == 0 and number == 4:
            out.version = value & 0xFFFFFFFF
        i = after
    return out

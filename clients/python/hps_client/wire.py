"""Requests and answers on the wire: keys as packed little-endian int64, rows as packed float32 (zero-copy views)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from hps_client.errors import HPSError, InvalidArgumentError, error_for
from hps_client.proto.hps.v1 import embedding_pb2 as pb


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


def as_keys(keys: np.ndarray | Sequence[int]) -> np.ndarray:
    """Keys as a contiguous little-endian int64 array; InvalidArgumentError when they are not 1-D integers."""
    arr = np.asarray(keys)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"keys must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(f"keys must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype="<i8")


def encode_keys(keys: np.ndarray | Sequence[int]) -> bytes:
    """Keys as packed little-endian int64 bytes."""
    return as_keys(keys).tobytes()


def decode_answer(tv: pb.TableVectors) -> TableAnswer:
    """A TableVectors message as NumPy arrays (zero-copy views of the message bytes)."""
    vectors = np.frombuffer(tv.vectors, dtype="<f4").reshape(tv.count, tv.dim)
    sources = np.frombuffer(tv.sources, dtype=np.uint8)
    return TableAnswer(vectors=vectors, sources=sources)


def build_request(model: str, tables: Mapping[str, np.ndarray | Sequence[int]]) -> pb.LookupRequest:
    """One LookupRequest for several tables of ``model``."""
    return pb.LookupRequest(model=model, tables=[pb.TableKeys(table=t, keys=encode_keys(k)) for t, k in tables.items()])

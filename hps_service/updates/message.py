"""The update message: encode numpy batches into ``hps.v1.EmbeddingUpdate`` and decode them back, validated."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from hps_client.rows import STORAGE_CODES, STORAGE_NAMES
from hps_service.proto.hps.v1.update_pb2 import EmbeddingUpdate
from hps_service.rows.formats import row_format

#: Largest serialized update message the publisher produces (the broker's usual per-message limit is ~1 MiB).
MAX_MESSAGE_BYTES = 1 << 20
#: Room reserved in a message for the protobuf field headers, model and table names.
_MESSAGE_OVERHEAD_BYTES = 1024
_STEP_BITS = 32
_STEP_MASK = (1 << _STEP_BITS) - 1


class MalformedUpdateError(ValueError):
    """A consumed message cannot be applied; the message says why (it goes to the dead-letter topic)."""


def make_version(generation: int, step: int) -> int:
    """A row version from a trainer's (generation, step): ``(generation << 32) | step``, monotonic in both."""
    if not 0 <= step <= _STEP_MASK:
        raise ValueError(f"step must be in [0, 2**32), got {step}")
    if not 0 <= generation < (1 << 31):
        raise ValueError(f"generation must be in [0, 2**31), got {generation}")
    return (generation << _STEP_BITS) | step


def split_version(version: int) -> tuple[int, int]:
    """The (generation, step) a version was made from."""
    return version >> _STEP_BITS, version & _STEP_MASK


def topic_name(model: str, topic_prefix: str = "hps") -> str:
    """The update topic of ``model``: ``<prefix>.<model>``."""
    return f"{topic_prefix}.{model}"


def dlq_topic_name(topic: str) -> str:
    """The dead-letter topic that malformed messages of ``topic`` go to."""
    return f"{topic}.dlq"


def rows_per_message(dim: int, precision: str = "fp32") -> int:
    """How many rows of width ``dim``, published as ``precision`` rows, fit in one message of at most
    MAX_MESSAGE_BYTES."""
    per_row = 8 + 8 + 4 * row_format(precision, dim).words  # key + version + stored row
    return max(1, (MAX_MESSAGE_BYTES - _MESSAGE_OVERHEAD_BYTES) // per_row)


def encode_update(
    model: str,
    table: str,
    keys: np.ndarray,
    vectors: np.ndarray,
    versions: np.ndarray,
    delete_keys: np.ndarray | None = None,
    delete_versions: np.ndarray | None = None,
    purge_tombstones_below: int = 0,
    precision: str = "fp32",
    model_version: int = 0,
) -> bytes:
    """Serialize one message; arrays are written as packed little-endian bytes (already validated by the caller).
    ``precision`` fp16 / bf16 / int8 encodes the float32 ``vectors`` as rows of that format (a smaller log); the
    consumer decodes them and stores them in the table's own format. ``model_version`` > 0: rows of that version."""
    dim = int(vectors.shape[1]) if vectors.ndim == 2 else 0
    fmt = row_format(precision, dim)
    msg = EmbeddingUpdate(
        model=model,
        table=table,
        dim=dim,
        keys=np.ascontiguousarray(keys, dtype="<i8").tobytes(),
        vectors=np.ascontiguousarray(fmt.encode(vectors), dtype="<f4").tobytes(),
        versions=np.ascontiguousarray(versions, dtype="<i8").tobytes(),
        produced_at_ns=time.time_ns(),
        storage=STORAGE_CODES[precision] if len(keys) else 0,
    )
    if purge_tombstones_below:
        msg.purge_tombstones_below = purge_tombstones_below
    if model_version:
        msg.model_version = model_version
    if delete_keys is not None and len(delete_keys):
        msg.delete_keys = np.ascontiguousarray(delete_keys, dtype="<i8").tobytes()
        msg.delete_versions = np.ascontiguousarray(delete_versions, dtype="<i8").tobytes()
    encoded: bytes = msg.SerializeToString()
    return encoded


@dataclass(slots=True)
class DecodedUpdate:
    """One consumed message as arrays (views over the message bytes; read-only)."""

    model: str
    table: str
    dim: int
    keys: np.ndarray  # (n,) int64
    vectors: np.ndarray  # (n, dim) float32 (decoded when the message carried fp16 / bf16 / int8 rows)
    versions: np.ndarray  # (n,) int64
    delete_keys: np.ndarray  # (m,) int64
    delete_versions: np.ndarray  # (m,) int64
    produced_at_ns: int
    purge_tombstones_below: int = 0  # > 0: an admin purge of the table's tombstones older than this version
    model_version: int = 0  # > 0: the rows are of that version of the model


def _int64s(data: bytes, what: str) -> np.ndarray:
    if len(data) % 8:
        raise MalformedUpdateError(f"{what} has {len(data)} bytes, not a multiple of 8")
    return np.frombuffer(data, dtype="<i8")


def decode_update(payload: bytes | None) -> DecodedUpdate:
    """Parse and structurally check one message (sizes agree, rows finite); raises MalformedUpdateError."""
    if not payload:
        raise MalformedUpdateError("empty message")
    msg = EmbeddingUpdate()
    try:
        msg.ParseFromString(payload)
    except DecodeError as exc:
        raise MalformedUpdateError(f"not an EmbeddingUpdate protobuf: {exc}") from None
    if not msg.model or not msg.table:
        raise MalformedUpdateError("model and table must be set")
    keys = _int64s(msg.keys, "keys")
    versions = _int64s(msg.versions, "versions")
    n = len(keys)
    if len(versions) != n:
        raise MalformedUpdateError(f"{n} keys but {len(versions)} versions")
    dim = int(msg.dim)
    storage = STORAGE_NAMES.get(int(msg.storage))
    if storage is None:
        raise MalformedUpdateError(f"unknown row storage {int(msg.storage)} (known: {sorted(STORAGE_NAMES)})")
    if n:
        if dim <= 0:
            raise MalformedUpdateError(f"{n} rows with dim {dim}")
        fmt = row_format(storage, dim)
        if len(msg.vectors) != n * fmt.words * 4:
            raise MalformedUpdateError(f"{n} {storage} rows of dim {dim} need {n * fmt.words * 4} vector bytes, got "
                                       f"{len(msg.vectors)}")
        vectors = fmt.decoded(np.frombuffer(msg.vectors, dtype="<f4").reshape(n, fmt.words))
        if not np.isfinite(vectors).all():
            raise MalformedUpdateError("rows contain NaN or infinity")
    else:
        if msg.vectors:
            raise MalformedUpdateError("vector bytes without keys")
        vectors = np.empty((0, max(dim, 0)), dtype=np.float32)
    delete_keys = _int64s(msg.delete_keys, "delete_keys")
    delete_versions = _int64s(msg.delete_versions, "delete_versions")
    if len(delete_keys) != len(delete_versions):
        raise MalformedUpdateError(f"{len(delete_keys)} delete keys but {len(delete_versions)} delete versions")
    purge = int(msg.purge_tombstones_below)
    if purge < 0:
        raise MalformedUpdateError(f"purge_tombstones_below must be >= 0, got {purge}")
    if purge and (n or len(delete_keys)):
        raise MalformedUpdateError("a tombstone purge carries no rows or deletes")
    if n == 0 and len(delete_keys) == 0 and not purge:
        raise MalformedUpdateError("message carries neither rows nor deletes")
    return DecodedUpdate(
        model=msg.model,
        table=msg.table,
        dim=dim,
        keys=keys,
        vectors=vectors,
        versions=versions,
        delete_keys=delete_keys,
        delete_versions=delete_versions,
        produced_at_ns=int(msg.produced_at_ns),
        purge_tombstones_below=purge,
        model_version=int(msg.model_version),
    )

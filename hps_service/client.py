"""Python client that inference services use: NumPy keys in, NumPy rows out, over gRPC.

    client = HPSClient("127.0.0.1:8500")
    rows = client.lookup("demo", "item", np.array([1, 2, 3]))   # (3, dim) float32
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from hps_service.errors import (
    HPSError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.tls import grpc_channel_credentials

_ERRORS: dict[grpc.StatusCode, type[HPSError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
}

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_retries", 0),
]


class LookupError_(HPSError):
    """A lookup failed with a status the client does not map to a narrower error."""


#: Codes after which a call is tried again, on the next replica: every call of the clients is a read, and these
#: mean the server did not answer it (down, draining, or cancelling calls as it shuts down in a rolling update).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


def _as_error(err: grpc.RpcError) -> HPSError:
    code = err.code()
    cls = _ERRORS.get(code, LookupError_)
    return cls(f"{code.name}: {err.details()}")


@dataclass(slots=True)
class TableAnswer:
    """Rows of one table in the order asked, and the level that answered each key (hps.v1.Source)."""

    vectors: np.ndarray
    sources: np.ndarray


def channel_credentials(
    tls_ca: str | Path | None, tls_cert: str | Path | None, tls_key: str | Path | None, tls: bool
) -> grpc.ChannelCredentials | None:
    """TLS credentials when any TLS option is given, else None (plaintext)."""
    if not (tls or tls_ca or tls_cert or tls_key):
        return None
    return grpc_channel_credentials(tls_ca, tls_cert, tls_key)


def encode_keys(keys: np.ndarray | Sequence[int]) -> bytes:
    """Keys as packed little-endian int64 bytes."""
    arr = np.asarray(keys)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"keys must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(f"keys must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype="<i8").tobytes()


def decode_answer(tv: pb.TableVectors) -> TableAnswer:
    """A TableVectors message as NumPy arrays (zero-copy views of the message bytes)."""
    vectors = np.frombuffer(tv.vectors, dtype="<f4").reshape(tv.count, tv.dim)
    sources = np.frombuffer(tv.sources, dtype=np.uint8)
    return TableAnswer(vectors=vectors, sources=sources)


def build_request(model: str, tables: Mapping[str, np.ndarray | Sequence[int]]) -> pb.LookupRequest:
    return pb.LookupRequest(model=model, tables=[pb.TableKeys(table=t, keys=encode_keys(k)) for t, k in tables.items()])


class HPSClient:
    """Synchronous client over one or several replica targets (round robin), retrying UNAVAILABLE and CANCELLED
    (see :data:`RETRYABLE`) with backoff."""

    def __init__(
        self,
        targets: str | Iterable[str],
        timeout: float | None = 5.0,
        retries: int = 3,
        backoff_s: float = 0.05,
        *,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        tls: bool = False,
    ) -> None:
        """``tls_ca`` (or ``tls=True`` for the system roots) turns TLS on; ``tls_cert``/``tls_key`` add a client
        certificate for servers that require mutual TLS."""
        self.targets = [targets] if isinstance(targets, str) else list(targets)
        if not self.targets:
            raise InvalidArgumentError("HPSClient needs at least one target host:port")
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        creds = channel_credentials(tls_ca, tls_cert, tls_key, tls)
        self._channels = [
            grpc.secure_channel(t, creds, options=_CHANNEL_OPTIONS) if creds is not None
            else grpc.insecure_channel(t, options=_CHANNEL_OPTIONS)
            for t in self.targets
        ]
        self._stubs = [pb_grpc.EmbeddingServiceStub(c) for c in self._channels]
        self._next = itertools.count()
        self._lock = threading.Lock()

    def _stub(self) -> pb_grpc.EmbeddingServiceStub:
        with self._lock:
            i = next(self._next)
        return self._stubs[i % len(self._stubs)]

    def _call(self, method: str, request: object, timeout: float | None) -> object:
        timeout = self.timeout if timeout is None else timeout
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return getattr(self._stub(), method)(request, timeout=timeout)
            except grpc.RpcError as err:
                if err.code() not in RETRYABLE or attempt == self.retries:
                    raise _as_error(err) from None
                time.sleep(delay * (1 + random.random()))
                delay *= 2
        raise AssertionError("unreachable")

    def lookup(self, model: str, table: str, keys: np.ndarray | Sequence[int], timeout: float | None = None) -> np.ndarray:
        """Rows of ``keys`` as an (n, dim) float32 array, in the order asked."""
        return self.lookup_with_sources(model, table, keys, timeout).vectors

    def lookup_with_sources(
        self, model: str, table: str, keys: np.ndarray | Sequence[int], timeout: float | None = None
    ) -> TableAnswer:
        """Rows of ``keys`` and, per key, which level answered (1 cache, 2 volatile, 3 persistent, 4 default)."""
        return self.lookup_many(model, {table: keys}, timeout)[table]

    def lookup_many(
        self, model: str, tables: Mapping[str, np.ndarray | Sequence[int]], timeout: float | None = None
    ) -> dict[str, TableAnswer]:
        """Several tables of one model in one request: ``{table: TableAnswer}``."""
        response = self._call("Lookup", build_request(model, tables), timeout)
        return {tv.table: decode_answer(tv) for tv in response.tables}  # type: ignore[attr-defined]

    def list_models(self, timeout: float | None = None) -> dict[str, dict[str, int]]:
        """``{model: {table: dim}}`` of the models the server serves."""
        response = self._call("ListModels", pb.ListModelsRequest(), timeout)
        return {m.name: {t.name: t.dim for t in m.tables} for m in response.models}  # type: ignore[attr-defined]

    def close(self) -> None:
        for c in self._channels:
            c.close()

    def __enter__(self) -> HPSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

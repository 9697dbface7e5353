"""Synchronous client that inference services use: NumPy keys in, NumPy rows out, over one gRPC channel.

    client = HPSClient("dns:///hps-headless.ml.svc:8500")       # every replica behind one name
    rows = client.lookup("demo", "item", np.array([1, 2, 3]))   # (3, dim) float32
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from hps_client.channel import channel_options, channel_target
from hps_client.errors import UnavailableError
from hps_client.proto.hps.v1 import embedding_pb2 as pb
from hps_client.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_client.tls import channel_credentials
from hps_client.wire import TableAnswer, as_error, build_request, decode_answer


class HPSClient:
    """One channel over every replica of ``targets``: gRPC's ``round_robin`` spreads calls, its retry policy
    retries UNAVAILABLE (a replica down or draining) on another one, and ``timeout`` bounds each call as a whole,
    retries included."""

    def __init__(
        self,
        targets: str | Iterable[str],
        timeout: float | None = 5.0,
        retries: int = 3,
        backoff_s: float = 0.05,
        *,
        options: Sequence[tuple[str, Any]] | None = None,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        tls: bool = False,
    ) -> None:
        """``targets``: a gRPC target (``host:port``, ``dns:///name:port``) or a list of ``host:port`` replicas.
        ``retries`` (at most 4) and ``backoff_s`` shape the retry policy; ``options`` adds or overrides channel
        options. ``tls_ca`` (or ``tls=True`` for the system roots) turns TLS on; ``tls_cert``/``tls_key`` add a
        client certificate for servers that require mutual TLS."""
        self.target = channel_target(targets)
        self.targets = [targets] if isinstance(targets, str) else list(targets)
        self.timeout = timeout
        self.retries = retries
        opts = channel_options(retries, backoff_s, options)
        creds = channel_credentials(tls_ca, tls_cert, tls_key, tls)
        self._channel = (grpc.secure_channel(self.target, creds, options=opts) if creds is not None
                         else grpc.insecure_channel(self.target, options=opts))
        self._stub = pb_grpc.EmbeddingServiceStub(self._channel)

    def _call(self, method: str, request: object, timeout: float | None) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as err:
            raise as_error(err) from None

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the channel has a connection (UnavailableError after ``timeout`` seconds)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise UnavailableError(f"no replica of {self.target} reachable within {timeout} s") from None

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
        return {tv.table: decode_answer(tv) for tv in response.tables}

    def list_models(self, timeout: float | None = None) -> dict[str, dict[str, int]]:
        """``{model: {table: dim}}`` of the models the server serves."""
        response = self._call("ListModels", pb.ListModelsRequest(), timeout)
        return {m.name: {t.name: t.dim for t in m.tables} for m in response.models}

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> HPSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Synchronous client that inference services use: NumPy keys in, NumPy rows out.

    client = HPSClient("dns:///hps-headless.ml.svc:8500")       # every replica behind one name
    rows = client.lookup("demo", "item", np.array([1, 2, 3]))   # (3, dim) float32

    # a sharded fleet: one name (or several endpoints) per shard, in any order
    client = HPSClient(["dns:///hps-shard-0-headless.ml.svc:8500", "dns:///hps-shard-1-headless.ml.svc:8500"])

    # a colocated server's shared store, read in this process (hits at memory speed, misses over its socket)
    client = HPSClient("local:///dev/shm/hps")

    # threads' small lookups merged into one call while calls are in flight (at most 200 us of waiting)
    client = HPSClient("dns:///hps-headless.ml.svc:8500", coalesce_window_s=200e-6)

    # many lookups over one StreamLookup call, answered in order
    for answer in client.lookup_stream(StreamRequest("demo", {"item": keys}) for keys in batches):
        answer.request_id, answer.tables["item"].vectors
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from hps_client.attempts import HedgingPolicy
from hps_client.bags import Bags
from hps_client.base import BaseClient, Keys, answer_into, cluster_of, models_of, rows_into
from hps_client.calls import Call, Ready
from hps_client.channel import Metadata, channel_options
from hps_client.coalescing import DEFAULT_MAX_KEYS
from hps_client.grpc_transport import GrpcTransport
from hps_client.routing import whole_target
from hps_client.rows import StoredAnswer
from hps_client.streams import DEFAULT_IN_FLIGHT, StreamAnswer, StreamRequest
from hps_client.thread_coalescing import CoalescingTransport
from hps_client.tls import channel_credentials
from hps_client.transport import Transport, is_local, local_transport
from hps_client.wire import TableAnswer


class HPSClient(BaseClient):
    """A client over one or several targets: replicas of one unsharded service, or the shards of a sharded fleet
    (see :mod:`hps_client.grpc_transport`); or, for a ``local:///PATH`` target, a colocated server's shared store
    (the transport hps-service registers: an inference process in the server's pod reading its store).

    ``metadata`` is sent on every call (e.g. a token), after which each call's own ``metadata=`` follows;
    ``interceptors`` (``grpc.UnaryUnaryClientInterceptor`` and friends) wrap every channel. For tracing, OpenTelemetry's
    ``GrpcInstrumentorClient().instrument()`` instruments every channel the client opens (it sends the W3C
    ``traceparent``; it reads the global tracer provider); its ``client_interceptor()`` is not a gRPC interceptor and
    cannot be passed here. ``hedging`` (a :class:`HedgingPolicy` or gRPC's ``hedgingPolicy`` dict) sends a second
    copy of a slow unsharded lookup to another replica (see :mod:`hps_client.attempts`). ``coalesce_window_s`` > 0
    merges small lookups that threads make while calls are in flight into one call (see
    :mod:`hps_client.thread_coalescing`). ``transport`` replaces the one the targets would pick (any
    :class:`~hps_client.transport.Transport`, used as it is).
    """

    def __init__(
        self,
        targets: str | Iterable[str] = "",
        timeout: float | None = 5.0,
        retries: int = 3,
        backoff_s: float = 0.05,
        *,
        options: Sequence[tuple[str, Any]] | None = None,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        tls: bool = False,
        metadata: Metadata | None = None,
        interceptors: Sequence[Any] | None = None,
        hedging: HedgingPolicy | Mapping[str, Any] | None = None,
        health_check: bool = True,
        credentials: str | grpc.CallCredentials | None = None,
        transport: Transport | None = None,
        coalesce_window_s: float = 0.0,
        coalesce_max_keys: int = DEFAULT_MAX_KEYS,
    ) -> None:
        """``targets``: a gRPC target (``host:port``, ``dns:///name:port``) or a list of them: ``host:port``
        replicas, or for a sharded fleet the replicas or ``dns:///`` names of its shards, in any order; or
        ``local:///PATH``. ``retries`` (at most 4) and ``backoff_s`` shape the retry policy; ``options`` adds or
        overrides channel options. ``tls_ca`` (or ``tls=True`` for the system roots) turns TLS on;
        ``tls_cert``/``tls_key`` add a client certificate for servers that require mutual TLS. ``metadata``,
        ``interceptors`` and ``hedging``: see the class; ``health_check=False`` for servers older than 0.2 (no
        ``accepting`` health service). ``credentials``: for ``server.auth: token``, a read token (sent as
        ``authorization: Bearer`` metadata on every call) or gRPC call credentials (which gRPC sends over TLS only).
        ``coalesce_window_s`` (0: off) and ``coalesce_max_keys``: how long a lookup waits for others, and the keys
        of a merged call at most (gRPC targets only)."""
        super().__init__(timeout, metadata, credentials)
        self.targets = [targets] if isinstance(targets, str) else list(targets)
        self.target = None if is_local(targets) else whole_target(self.targets)
        self.retries = retries
        if transport is not None:
            self.transport = transport
        elif is_local(targets):
            assert isinstance(targets, str)
            self.transport = local_transport(targets, tuple(interceptors or ()), retries, backoff_s)
        else:
            self.transport = GrpcTransport(
                self.targets, channel_options(retries, backoff_s, options, health_check=health_check),
                channel_credentials(tls_ca, tls_cert, tls_key, tls), tuple(interceptors or ()),
                HedgingPolicy.parse(hedging) if hedging is not None else None, self._call_credentials, self.metadata)
            if coalesce_window_s:
                self.transport = CoalescingTransport(self.transport, coalesce_window_s, coalesce_max_keys)

    def _handle(self, call: Call[Any]) -> Any:
        return self.transport.handle(call)

    def lookup(self, model: str, table: str, keys: Keys, timeout: float | None = None, *,
               metadata: Metadata | None = None, out: np.ndarray | None = None, version: int | None = None,
               label: str = "") -> np.ndarray:
        """Rows of ``keys`` as an (n, dim) float32 array, in the order asked (a read-only view of the response);
        copied into ``out`` when given (a writable C-contiguous float32 ``(n, dim)`` array the caller owns). Read
        from the model's ``version``, or the one ``label`` names (neither: its label ``production``, else the
        model as configured); each lookup method takes these two."""
        rows: np.ndarray = self.transport.handle(self._rows(model, table, keys, timeout, metadata, version, label, out))
        return rows_into(out, rows)

    def lookup_with_sources(self, model: str, table: str, keys: Keys, timeout: float | None = None, *,
                            metadata: Metadata | None = None, out: np.ndarray | None = None,
                            version: int | None = None, label: str = "") -> TableAnswer:
        """Rows of ``keys`` and, per key, which level answered (1 cache, 2 volatile, 3 persistent, 4 default,
        5 expired); the rows in ``out`` when given, as :meth:`lookup`."""
        call = self._lookup(model, {table: keys}, timeout, metadata, version, label, out=out)
        answer: TableAnswer = self._handle(call)[table]
        return answer_into(out, answer)

    def lookup_many(self, model: str, tables: Mapping[str, Keys], timeout: float | None = None, *,
                    metadata: Metadata | None = None, version: int | None = None,
                    label: str = "") -> dict[str, TableAnswer]:
        """Several tables of one model in one request: ``{table: TableAnswer}``; ``metadata`` follows the client's
        on this call."""
        answers: dict[str, TableAnswer] = self._handle(self._lookup(model, tables, timeout, metadata, version, label))
        return answers

    def lookup_bags(self, model: str, table: str, keys: Keys, offsets: Keys, combiner: str = "sum",
                    weights: np.ndarray | Sequence[float] | None = None, timeout: float | None = None, *,
                    metadata: Metadata | None = None, version: int | None = None, label: str = "",
                    out: np.ndarray | None = None) -> np.ndarray:
        """One row per bag of ``keys``, float32 ``(bags, dim)``: the ``"sum"`` or ``"mean"`` of each bag's rows,
        pooled by the server (only the pooled rows travel). ``offsets`` are each bag's start in ``keys``, as torch's
        ``embedding_bag`` with ``include_last_offset=False`` (the first 0, none decreasing; an empty bag is a zero
        row); ``weights``, one per key, only with ``"sum"`` (torch's ``per_sample_weights``). A key no tier holds adds
        its default row. Into ``out`` when given, as :meth:`lookup`."""
        call = self._bags(model, {table: Bags(keys, offsets, combiner, weights)}, timeout, metadata, version, label,
                          out)
        answer: TableAnswer = self._handle(call)[table]
        return rows_into(out, answer.vectors)

    def lookup_bags_many(self, model: str, tables: Mapping[str, Bags], timeout: float | None = None, *,
                         metadata: Metadata | None = None, version: int | None = None,
                         label: str = "") -> dict[str, TableAnswer]:
        """Pooled lookups of several tables of one model in one request: ``{table: TableAnswer}`` with a row and the
        deepest level that answered any of its keys per bag (:class:`~hps_client.Bags` says each table's bags)."""
        answers: dict[str, TableAnswer] = self._handle(self._bags(model, tables, timeout, metadata, version, label))
        return answers

    def lookup_stored(self, model: str, table: str, keys: Keys, timeout: float | None = None, *,
                      metadata: Metadata | None = None, version: int | None = None, label: str = "") -> StoredAnswer:
        """Rows of ``keys`` as the table stores them (``precision = stored``: fp16, bf16 or int8 rows with their
        scales, up to 4x fewer bytes than float32), for a caller that decodes them itself; ``.rows.to_float32()``
        gives what :meth:`lookup` answers."""
        answer: StoredAnswer = self._handle(self._lookup(model, {table: keys}, timeout, metadata, version, label,
                                                         stored=True))[table]
        return answer

    def lookup_stream(self, requests: Iterable[StreamRequest], timeout: float | None = None, *,
                      metadata: Metadata | None = None,
                      max_in_flight: int = DEFAULT_IN_FLIGHT) -> Iterator[StreamAnswer]:
        """The answers of ``requests`` over one ``StreamLookup`` call, in the order asked, each with its
        ``request_id``; at most ``max_in_flight`` requests are sent ahead of their answers (``requests`` is read as
        room frees, on gRPC's thread). ``timeout`` bounds the whole stream (default: none). A failed request ends
        the stream and is raised after the answers before it; the server's stream limit raises StreamLimitError.
        One server answers a stream: FailedPreconditionError for a sharded fleet."""
        answers: Iterator[StreamAnswer] = self._handle(self._stream(requests, timeout, metadata, max_in_flight))
        return answers

    def list_models(self, timeout: float | None = None, *,
                    metadata: Metadata | None = None) -> dict[str, dict[str, int]]:
        """``{model: {table: dim}}`` of the models the server serves."""
        return models_of(self._handle(self._list_models(timeout, metadata)))

    def cluster_info(self, timeout: float | None = None, *, metadata: Metadata | None = None) -> dict[str, Any]:
        """GetClusterInfo of one target: shards, its shard, partitions, readiness (as a dict)."""
        return cluster_of(self._handle(self._cluster_info(timeout, metadata)))

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the server answers (UnavailableError after ``timeout`` seconds)."""
        self._handle(Ready(self._deadline(timeout), None))

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> HPSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

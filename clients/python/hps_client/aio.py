"""asyncio client: the same API as HPSClient, awaited, over grpc.aio (sharded fleets included).

    async with AsyncHPSClient("dns:///hps-headless.ml.svc:8500") as client:
        rows = await client.lookup("demo", "item", np.array([1, 2, 3]))   # (3, dim) float32
        # concurrent small lookups go out as one call and are split back (coalesce_window_s=0: off)
        many = await asyncio.gather(*(client.lookup("demo", "item", [k, k + 1]) for k in range(200)))
        async for answer in client.lookup_stream(StreamRequest("demo", {"item": keys}) for keys in batches):
            answer.request_id, answer.tables["item"].vectors
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import grpc
import numpy as np

from hps_client.aio_coalescing import AsyncCoalescingTransport
from hps_client.aio_transport import AsyncGrpcTransport
from hps_client.attempts import HedgingPolicy
from hps_client.bags import Bags
from hps_client.base import BaseClient, Keys, answer_into, cluster_of, models_of, rows_into
from hps_client.calls import Call, Ready
from hps_client.channel import Metadata, channel_options
from hps_client.coalescing import DEFAULT_MAX_KEYS, DEFAULT_WINDOW_S
from hps_client.errors import InvalidArgumentError
from hps_client.rows import StoredAnswer
from hps_client.streams import DEFAULT_IN_FLIGHT, StreamAnswer, StreamRequest
from hps_client.tls import channel_credentials
from hps_client.transport import AsyncTransport, is_local
from hps_client.wire import TableAnswer


class AsyncHPSClient(BaseClient):
    """Replicas or shards as in HPSClient: one grpc.aio channel per replica set, balanced and retried by gRPC;
    a sharded batch is split by shard and its parts awaited concurrently. Small lookups that tasks make together
    go out as one call, split back to each caller (see :mod:`hps_client.aio_coalescing`). ``transport`` replaces the
    gRPC one (any :class:`~hps_client.transport.AsyncTransport`, used as it is)."""

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
        transport: AsyncTransport | None = None,
        coalesce_window_s: float = DEFAULT_WINDOW_S,
        coalesce_max_keys: int = DEFAULT_MAX_KEYS,
    ) -> None:
        """Targets, retry, channel, TLS, metadata, hedging, health-check options and ``credentials`` as in HPSClient;
        ``interceptors`` are grpc.aio client interceptors (e.g. OpenTelemetry's ``aio_client_interceptors()``).
        ``coalesce_window_s`` (0: off): how long a lookup waits for others while calls are in flight;
        ``coalesce_max_keys``: the keys of a merged call at most (a larger lookup goes out on its own)."""
        super().__init__(timeout, metadata, credentials)
        self.targets = [targets] if isinstance(targets, str) else list(targets)
        self.retries = retries
        if transport is not None:
            self.transport = transport
        elif is_local(targets):
            raise InvalidArgumentError(f"{targets}: colocated reads answer in the calling thread; use HPSClient "
                                       "(an asyncio client gains nothing from them over its socket)")
        else:
            self.transport = AsyncGrpcTransport(
                self.targets, channel_options(retries, backoff_s, options, health_check=health_check),
                channel_credentials(tls_ca, tls_cert, tls_key, tls), tuple(interceptors or ()),
                HedgingPolicy.parse(hedging) if hedging is not None else None, self._call_credentials, self.metadata)
            if coalesce_window_s:
                self.transport = AsyncCoalescingTransport(self.transport, coalesce_window_s, coalesce_max_keys)

    async def _handle(self, call: Call[Any]) -> Any:
        return await self.transport.handle(call)

    async def lookup(self, model: str, table: str, keys: Keys, timeout: float | None = None, *,
                     metadata: Metadata | None = None, out: np.ndarray | None = None, version: int | None = None,
                     label: str = "") -> np.ndarray:
        """Rows of ``keys`` as an (n, dim) float32 array, in the order asked; copied into ``out`` when given, as
        :meth:`hps_client.HPSClient.lookup`."""
        rows: np.ndarray = await self._handle(self._rows(model, table, keys, timeout, metadata, version, label, out))
        return rows_into(out, rows)

    async def lookup_with_sources(self, model: str, table: str, keys: Keys, timeout: float | None = None, *,
                                  metadata: Metadata | None = None, out: np.ndarray | None = None,
                                  version: int | None = None, label: str = "") -> TableAnswer:
        """Rows of ``keys`` and, per key, which level answered (1 cache, 2 volatile, 3 persistent, 4 default,
        5 expired)."""
        answers = await self._handle(self._lookup(model, {table: keys}, timeout, metadata, version, label, out=out))
        return answer_into(out, answers[table])

    async def lookup_many(self, model: str, tables: Mapping[str, Keys], timeout: float | None = None, *,
                          metadata: Metadata | None = None, version: int | None = None,
                          label: str = "") -> dict[str, TableAnswer]:
        """Several tables of one model in one request: ``{table: TableAnswer}``."""
        answers: dict[str, TableAnswer] = await self._handle(self._lookup(model, tables, timeout, metadata, version,
                                                                          label))
        return answers

    async def lookup_bags(self, model: str, table: str, keys: Keys, offsets: Keys, combiner: str = "sum",
                    weights: np.ndarray | Sequence[float] | None = None, timeout: float | None = None, *,
                    metadata: Metadata | None = None, version: int | None = None, label: str = "",
                    out: np.ndarray | None = None) -> np.ndarray:
        """One row per bag of ``keys``, float32 ``(bags, dim)``: the ``"sum"`` or ``"mean"`` of each bag's rows,
        pooled by the server (only the pooled rows travel). ``offsets`` are each bag's start in ``keys``, as torch's
        ``embedding_bag`` with ``include_last_offset=False`` (the first 0, none decreasing; an empty bag is a zero
        row); ``weights``, one per key, only with ``"sum"`` (torch's ``per_sample_weights``). A key no tier holds adds
        its default row. Into ``out`` when given, as :meth:`hps_client.HPSClient.lookup_bags`."""
        call = self._bags(model, {table: Bags(keys, offsets, combiner, weights)}, timeout, metadata, version, label,
                          out)
        answer: TableAnswer = (await self._handle(call))[table]
        return rows_into(out, answer.vectors)

    async def lookup_bags_many(self, model: str, tables: Mapping[str, Bags], timeout: float | None = None, *,
                         metadata: Metadata | None = None, version: int | None = None,
                         label: str = "") -> dict[str, TableAnswer]:
        """Pooled lookups of several tables of one model in one request: ``{table: TableAnswer}`` with a row and the
        deepest level that answered any of its keys per bag (:class:`~hps_client.Bags` says each table's bags)."""
        answers: dict[str, TableAnswer] = await self._handle(self._bags(model, tables, timeout, metadata, version,
                                                                        label))
        return answers

    async def lookup_stored(self, model: str, table: str, keys: Keys, timeout: float | None = None, *,
                            metadata: Metadata | None = None, version: int | None = None,
                            label: str = "") -> StoredAnswer:
        """Rows of ``keys`` as the table stores them, as :meth:`hps_client.HPSClient.lookup_stored`."""
        answers = await self._handle(self._lookup(model, {table: keys}, timeout, metadata, version, label, stored=True))
        answer: StoredAnswer = answers[table]
        return answer

    async def lookup_stream(self, requests: Iterable[StreamRequest] | AsyncIterable[StreamRequest],
                            timeout: float | None = None, *, metadata: Metadata | None = None,
                            max_in_flight: int = DEFAULT_IN_FLIGHT) -> AsyncIterator[StreamAnswer]:
        """The answers of ``requests`` (an iterable or an async iterable) over one ``StreamLookup`` call, in order,
        as :meth:`hps_client.HPSClient.lookup_stream`; leaving the ``async for`` early ends the stream."""
        answers = await self._handle(self._stream(requests, timeout, metadata, max_in_flight))
        try:
            async for answer in answers:
                yield answer
        finally:
            await answers.aclose()

    async def list_models(self, timeout: float | None = None, *,
                          metadata: Metadata | None = None) -> dict[str, dict[str, int]]:
        """``{model: {table: dim}}`` of the models the server serves."""
        return models_of(await self._handle(self._list_models(timeout, metadata)))

    async def cluster_info(self, timeout: float | None = None, *,
                           metadata: Metadata | None = None) -> dict[str, Any]:
        """GetClusterInfo of one target: shards, its shard, partitions, readiness (as a dict)."""
        return cluster_of(await self._handle(self._cluster_info(timeout, metadata)))

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Until the server answers (UnavailableError after ``timeout`` seconds)."""
        await self._handle(Ready(self._deadline(timeout), None))

    async def close(self) -> None:
        await self.transport.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

"""asyncio client over grpc.aio: the same API as HPSClient, awaited.

    async with AsyncHPSClient(["10.0.0.1:8500", "10.0.0.2:8500"]) as client:
        rows = await client.lookup("demo", "item", np.array([1, 2, 3]))   # (3, dim) float32
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Self

import grpc
import numpy as np

from hps_service.client import (
    _CHANNEL_OPTIONS,
    RETRYABLE,
    TableAnswer,
    _as_error,
    build_request,
    channel_credentials,
    decode_answer,
)
from hps_service.errors import InvalidArgumentError
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc


class AsyncHPSClient:
    """Replica targets taken in round robin; UNAVAILABLE and CANCELLED are retried on the next target with jittered
    backoff.

    Channels open on first use, inside the running event loop (grpc.aio channels belong to one loop).
    """

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
        """TLS options as in HPSClient: ``tls_ca`` (or ``tls=True``), plus ``tls_cert``/``tls_key`` for mutual TLS."""
        self._credentials = channel_credentials(tls_ca, tls_cert, tls_key, tls)
        self.targets = [targets] if isinstance(targets, str) else list(targets)
        if not self.targets:
            raise InvalidArgumentError("AsyncHPSClient needs at least one target host:port")
        if retries < 0 or backoff_s < 0:
            raise InvalidArgumentError("retries and backoff_s must be >= 0")
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[pb_grpc.EmbeddingServiceStub] = []
        self._next = itertools.count()

    def _stub(self) -> pb_grpc.EmbeddingServiceStub:
        if not self._stubs:
            self._channels = [
                grpc.aio.secure_channel(t, self._credentials, options=_CHANNEL_OPTIONS)
                if self._credentials is not None
                else grpc.aio.insecure_channel(t, options=_CHANNEL_OPTIONS)
                for t in self.targets
            ]
            self._stubs = [pb_grpc.EmbeddingServiceStub(c) for c in self._channels]
        return self._stubs[next(self._next) % len(self._stubs)]

    async def _call(self, method: str, request: object, timeout: float | None) -> object:
        timeout = self.timeout if timeout is None else timeout
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return await getattr(self._stub(), method)(request, timeout=timeout)
            except grpc.aio.AioRpcError as err:
                if err.code() not in RETRYABLE or attempt == self.retries:
                    raise _as_error(err) from None
                await asyncio.sleep(delay * (1 + random.random()))
                delay *= 2
        raise AssertionError("unreachable")

    async def lookup(
        self, model: str, table: str, keys: np.ndarray | Sequence[int], timeout: float | None = None
    ) -> np.ndarray:
        """Rows of ``keys`` as an (n, dim) float32 array, in the order asked."""
        return (await self.lookup_with_sources(model, table, keys, timeout)).vectors

    async def lookup_with_sources(
        self, model: str, table: str, keys: np.ndarray | Sequence[int], timeout: float | None = None
    ) -> TableAnswer:
        """Rows of ``keys`` and, per key, which level answered (1 cache, 2 volatile, 3 persistent, 4 default)."""
        return (await self.lookup_many(model, {table: keys}, timeout))[table]

    async def lookup_many(
        self, model: str, tables: Mapping[str, np.ndarray | Sequence[int]], timeout: float | None = None
    ) -> dict[str, TableAnswer]:
        """Several tables of one model in one request: ``{table: TableAnswer}``."""
        response = await self._call("Lookup", build_request(model, tables), timeout)
        return {tv.table: decode_answer(tv) for tv in response.tables}  # type: ignore[attr-defined]

    async def list_models(self, timeout: float | None = None) -> dict[str, dict[str, int]]:
        """``{model: {table: dim}}`` of the models the server serves."""
        response = await self._call("ListModels", pb.ListModelsRequest(), timeout)
        return {m.name: {t.name: t.dim for t in m.tables} for m in response.models}  # type: ignore[attr-defined]

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, [], []
        for c in channels:
            await c.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

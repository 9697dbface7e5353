"""asyncio client over grpc.aio: the same API as HPSClient, awaited.

    async with AsyncHPSClient("dns:///hps-headless.ml.svc:8500") as client:
        rows = await client.lookup("demo", "item", np.array([1, 2, 3]))   # (3, dim) float32
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import grpc
import numpy as np

from hps_client.channel import channel_options, channel_target
from hps_client.proto.hps.v1 import embedding_pb2 as pb
from hps_client.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_client.tls import channel_credentials
from hps_client.wire import TableAnswer, as_error, build_request, decode_answer


class AsyncHPSClient:
    """One grpc.aio channel over every replica, balanced and retried by gRPC as in HPSClient.

    The channel opens on first use, inside the running event loop (grpc.aio channels belong to one loop).
    """

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
        """Targets, retry, channel and TLS options as in HPSClient."""
        self._credentials = channel_credentials(tls_ca, tls_cert, tls_key, tls)
        self.target = channel_target(targets)
        self.targets = [targets] if isinstance(targets, str) else list(targets)
        self.timeout = timeout
        self.retries = retries
        self._options = channel_options(retries, backoff_s, options)
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.EmbeddingServiceStub | None = None

    def _get_stub(self) -> pb_grpc.EmbeddingServiceStub:
        if self._stub is None:
            self._channel = (
                grpc.aio.secure_channel(self.target, self._credentials, options=self._options)
                if self._credentials is not None
                else grpc.aio.insecure_channel(self.target, options=self._options)
            )
            self._stub = pb_grpc.EmbeddingServiceStub(self._channel)
        return self._stub

    async def _call(self, method: str, request: object, timeout: float | None) -> Any:
        try:
            return await getattr(self._get_stub(), method)(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.aio.AioRpcError as err:
            raise as_error(err) from None

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
        return {tv.table: decode_answer(tv) for tv in response.tables}

    async def list_models(self, timeout: float | None = None) -> dict[str, dict[str, int]]:
        """``{model: {table: dim}}`` of the models the server serves."""
        response = await self._call("ListModels", pb.ListModelsRequest(), timeout)
        return {m.name: {t.name: t.dim for t in m.tables} for m in response.models}

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

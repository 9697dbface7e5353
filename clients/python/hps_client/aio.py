"""asyncio client over grpc.aio: the same API as HPSClient, awaited, sharded fleets included.

    async with AsyncHPSClient("dns:///hps-headless.ml.svc:8500") as client:
        rows = await client.lookup("demo", "item", np.array([1, 2, 3]))   # (3, dim) float32
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import grpc
import numpy as np

from hps_client.attempts import HedgingPolicy, call_hedged_async, retry_elsewhere
from hps_client.call_auth import read_credentials
from hps_client.channel import Metadata, channel_options, merge_metadata
from hps_client.errors import FailedPreconditionError, UnavailableError
from hps_client.proto.hps.v1 import embedding_pb2 as pb
from hps_client.routing import (
    CLUSTER_INFO,
    PROBE_TIMEOUT_S,
    ShardPart,
    ShardRoutes,
    ShardShape,
    check_same_shape,
    remaining,
    shard_channel_targets,
    shard_error,
    shard_unavailable,
    split_batch,
    whole_target,
)
from hps_client.rows import StoredAnswer
from hps_client.stub import EmbeddingStub
from hps_client.tls import channel_credentials
from hps_client.wire import TableAnswer, WireResponse, as_error, build_request, decode_answer, decode_stored, into


class AsyncHPSClient:
    """Replicas or shards as in HPSClient: one grpc.aio channel per replica set, balanced and retried by gRPC;
    a sharded batch is split by shard and its parts awaited concurrently.

    Channels open on first use, inside the running event loop (grpc.aio channels belong to one loop).
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
        metadata: Metadata | None = None,
        interceptors: Sequence[Any] | None = None,
        hedging: HedgingPolicy | Mapping[str, Any] | None = None,
        health_check: bool = True,
        credentials: str | grpc.CallCredentials | None = None,
    ) -> None:
        """Targets, retry, channel, TLS, metadata, hedging, health-check options and ``credentials`` as in HPSClient;
        ``interceptors`` are grpc.aio client interceptors (e.g. OpenTelemetry's ``aio_client_interceptors()``)."""
        self._credentials = channel_credentials(tls_ca, tls_cert, tls_key, tls)
        self.targets = [targets] if isinstance(targets, str) else list(targets)
        self.target = whole_target(self.targets)
        self.timeout = timeout
        self.retries = retries
        token, self._call_credentials = read_credentials(credentials)
        self.metadata = merge_metadata(token, metadata)
        self.hedging = HedgingPolicy.parse(hedging) if hedging is not None else None
        self._interceptors = list(interceptors or ()) or None
        self._options = channel_options(retries, backoff_s, options, health_check=health_check)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._routes: ShardRoutes | None = None
        self._unsharded = False
        self._watchers: dict[int, asyncio.Task] = {}
        self._learning: asyncio.Lock | None = None  # one coroutine learns the shard map at a time

    # ---- channels -----------------------------------------------------------------------------------------
    def _auth(self, metadata: Metadata | None) -> dict[str, Any]:
        """The keyword arguments that carry a call's metadata and the client's call credentials."""
        return {"metadata": metadata, "credentials": self._call_credentials}

    def _open(self, target: str) -> EmbeddingStub:
        channel = self._channels.get(target)
        if channel is None:
            channel = (grpc.aio.secure_channel(target, self._credentials, options=self._options,
                                               interceptors=self._interceptors)
                       if self._credentials is not None
                       else grpc.aio.insecure_channel(target, options=self._options, interceptors=self._interceptors))
            self._channels[target] = channel
        return EmbeddingStub(channel)

    def _get_stub(self) -> EmbeddingStub | None:
        return self._open(self.target) if self.target is not None else None

    async def _any_stub(self, deadline: float | None) -> EmbeddingStub:
        stub = self._get_stub()
        if stub is not None:
            return stub
        routes = await self._learn(deadline)
        stubs = [s for shard in sorted(routes.stubs) for s in routes.stubs[shard]] if routes else []
        if not stubs:
            raise UnavailableError(f"none of the targets {', '.join(self.targets)} answered")
        return stubs[0]

    async def _call(self, method: str, request: object, timeout: float | None, metadata: Metadata | None) -> Any:
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return await getattr(await self._any_stub(deadline), method)(
                request, timeout=remaining(deadline), **self._auth(merge_metadata(self.metadata, metadata)))
        except grpc.aio.AioRpcError as err:
            raise as_error(err) from None

    # ---- the shard map ------------------------------------------------------------------------------------
    async def cluster_info(self, timeout: float | None = None, *,
                           metadata: Metadata | None = None) -> dict[str, Any]:
        """GetClusterInfo of one target: shards, its shard, partitions, readiness (as a dict)."""
        info = await self._call("GetClusterInfo", CLUSTER_INFO, timeout, metadata)
        return {"shards": info.shards, "shard": info.shard, "partitions": info.partitions,
                "partitioner": info.partitioner, "owned_partitions": list(info.owned_partitions),
                "topic_partitions": dict(info.topic_partitions), "ready": info.ready,
                "not_ready": list(info.not_ready)}

    async def _learn(self, deadline: float | None) -> ShardRoutes | None:
        """The sharded routes, learned on first use; None: call through the one channel, as unsharded."""
        if self._unsharded:
            return None
        if self._routes is not None:
            return self._routes
        if self._learning is None:
            self._learning = asyncio.Lock()
        async with self._learning:
            if self._unsharded or self._routes is not None:  # another call learned it meanwhile
                return self._routes
            return await self._learn_locked(deadline)

    async def _learn_locked(self, deadline: float | None) -> ShardRoutes | None:
        stub = self._get_stub()
        if stub is not None:
            try:
                info = await stub.GetClusterInfo(CLUSTER_INFO, timeout=remaining(deadline, PROBE_TIMEOUT_S),
                                                 **self._auth(self.metadata))
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self._unsharded = True
                return None
            if info.shards <= 1:
                self._unsharded = True
                return None
        probes = [self._open(t).GetClusterInfo(CLUSTER_INFO, timeout=remaining(deadline, PROBE_TIMEOUT_S),
                                               **self._auth(self.metadata)) for t in self.targets]
        answers = await asyncio.gather(*probes, return_exceptions=True)
        infos = {i: a for i, a in enumerate(answers) if isinstance(a, pb.ClusterInfo)}
        errors: dict[int, grpc.aio.AioRpcError] = {}
        for i, a in enumerate(answers):
            if isinstance(a, grpc.aio.AioRpcError):
                errors[i] = a
            elif not isinstance(a, pb.ClusterInfo):
                raise a
        if not infos:
            if stub is not None:
                return None
            raise UnavailableError("no target answered GetClusterInfo: " + "; ".join(
                f"{self.targets[i]}: {e.code().name}: {e.details()}" for i, e in errors.items()))
        shape = check_same_shape({i: ShardShape.of(info) for i, info in infos.items()}, self.targets)
        self._routes = routes = self._build(shape, {i: int(info.shard) for i, info in infos.items()})
        in_use = {t for ts in routes.targets.values() for t in ts} | {self.target}
        for i in infos:  # a probe channel no route uses (its replica is in a joined channel): closed
            channel = self._channels.pop(self.targets[i], None) if self.targets[i] not in in_use else None
            if channel is not None:
                await channel.close()
        for i in errors:
            if i not in self._watchers:
                self._watchers[i] = asyncio.get_running_loop().create_task(self._watch(i))
        return self._routes

    def _build(self, shape: ShardShape, known: dict[int, int]) -> ShardRoutes:
        targets = shard_channel_targets(self.targets, known)
        stubs = {shard: [self._open(t) for t in ts] for shard, ts in targets.items()}
        return ShardRoutes(shape=shape, known=dict(known), targets=targets, stubs=stubs)

    async def _watch(self, i: int) -> None:
        """Add target ``i`` (down when first asked) to its shard's routes as soon as it answers."""
        try:
            info = await self._open(self.targets[i]).GetClusterInfo(CLUSTER_INFO, wait_for_ready=True,
                                                                    **self._auth(self.metadata))
        except grpc.aio.AioRpcError:
            return
        finally:
            self._watchers.pop(i, None)
        routes = self._routes
        if routes is not None and ShardShape.of(info) == routes.shape:
            self._routes = self._build(routes.shape, {**routes.known, i: int(info.shard)})

    def _forget(self) -> None:
        self._routes = None
        self._unsharded = False

    # ---- lookups ------------------------------------------------------------------------------------------
    async def lookup(
        self, model: str, table: str, keys: np.ndarray | Sequence[int], timeout: float | None = None, *,
        metadata: Metadata | None = None, out: np.ndarray | None = None, version: int | None = None, label: str = "",
    ) -> np.ndarray:
        """Rows of ``keys`` as an (n, dim) float32 array, in the order asked; copied into ``out`` when given, as
        :meth:`hps_client.HPSClient.lookup`."""
        answer = await self.lookup_with_sources(model, table, keys, timeout, metadata=metadata, version=version,
                                                label=label)
        return into(out, answer).vectors

    async def lookup_with_sources(
        self, model: str, table: str, keys: np.ndarray | Sequence[int], timeout: float | None = None, *,
        metadata: Metadata | None = None, version: int | None = None, label: str = "",
    ) -> TableAnswer:
        """Rows of ``keys`` and, per key, which level answered (1 cache, 2 volatile, 3 persistent, 4 default, 5 expired)."""
        answers = await self.lookup_many(model, {table: keys}, timeout, metadata=metadata, version=version, label=label)
        return answers[table]

    async def lookup_many(
        self, model: str, tables: Mapping[str, np.ndarray | Sequence[int]], timeout: float | None = None, *,
        metadata: Metadata | None = None, version: int | None = None, label: str = "",
    ) -> dict[str, TableAnswer]:
        """Several tables of one model in one request: ``{table: TableAnswer}``."""
        return await self._lookup_tables(model, tables, timeout, metadata, stored=False, version=version, label=label)

    async def lookup_stored(self, model: str, table: str, keys: np.ndarray | Sequence[int],
                            timeout: float | None = None, *, metadata: Metadata | None = None, version: int | None = None,
                            label: str = "") -> StoredAnswer:
        """Rows of ``keys`` as the table stores them, as :meth:`hps_client.HPSClient.lookup_stored`."""
        answer: StoredAnswer = (await self._lookup_tables(model, {table: keys}, timeout, metadata, stored=True,
                                                          version=version, label=label))[table]
        return answer

    async def _lookup_tables(self, model: str, tables: Mapping[str, np.ndarray | Sequence[int]],
                             timeout: float | None, metadata: Metadata | None, stored: bool, version: int | None = None,
                             label: str = "") -> dict[str, Any]:
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        md = merge_metadata(self.metadata, metadata)
        precision = pb.PRECISION_STORED if stored else pb.PRECISION_FP32
        decode = decode_stored if stored else decode_answer
        for attempt in range(2):
            try:
                routes = await self._learn(deadline)
                if routes is None:
                    stub = self._get_stub()
                    assert stub is not None
                    request = build_request(model, tables, precision, version, label)
                    response = await self._lookup_unsharded(stub, request, deadline, md)
                    return {tv.table: decode(tv) for tv in response.tables}
                split = split_batch(model, tables, routes.shape, fallback_shard=min(routes.stubs, default=0),
                                    precision=precision, version=version, label=label)
                total = sum(split.sizes)
                if len(split.parts) == 1:
                    return split.merge([await self._answer(routes, split.parts[0], deadline, total, md)], stored)
                tasks = [asyncio.ensure_future(self._answer(routes, part, deadline, total, md))
                         for part in split.parts]
                try:
                    responses = await asyncio.gather(*tasks)
                finally:
                    for task in tasks:
                        task.cancel()  # a no-op for finished calls; stops the others when one shard failed
                return split.merge(responses, stored)
            except FailedPreconditionError:
                if attempt:
                    raise
                self._forget()  # a server refused keys of another shard: the fleet changed; learn it again
        raise AssertionError("unreachable")

    async def _lookup_unsharded(self, stub: EmbeddingStub, request: pb.LookupRequest,
                         deadline: float | None, metadata: Metadata | None) -> WireResponse:
        """One Lookup over the channel of every replica, hedged when the client has a policy."""
        try:
            if self.hedging is None:
                return await stub.Lookup(request, timeout=remaining(deadline), **self._auth(metadata))
            return await call_hedged_async(
                lambda: stub.Lookup(request, timeout=remaining(deadline), **self._auth(metadata)), self.hedging, deadline)
        except grpc.aio.AioRpcError as err:
            raise as_error(err) from None

    async def _answer(self, routes: ShardRoutes, part: ShardPart, deadline: float | None,
                      total: int, metadata: Metadata | None) -> WireResponse:
        """The part's answer from the shard's channels in turn (after UNAVAILABLE, or an overloaded replica's
        RESOURCE_EXHAUSTED); UnavailableError naming the shard when none does."""
        detail = "none of the client's targets serves this shard"
        for stub in routes.stubs_from(part.shard):
            try:
                return await stub.Lookup(part.request, timeout=remaining(deadline), **self._auth(metadata))
            except grpc.aio.AioRpcError as err:
                if not retry_elsewhere(err):
                    raise shard_error(part.shard, routes.shape, err) from None
                detail = f"{err.code().name}: {err.details()}"
        raise shard_unavailable(part.shard, routes.shape, part.keys, total, routes.targets.get(part.shard, []),
                                detail)

    async def list_models(self, timeout: float | None = None, *,
                          metadata: Metadata | None = None) -> dict[str, dict[str, int]]:
        """``{model: {table: dim}}`` of the models the server serves."""
        response = await self._call("ListModels", pb.ListModelsRequest(), timeout, metadata)
        return {m.name: {t.name: t.dim for t in m.tables} for m in response.models}

    async def close(self) -> None:
        watchers, self._watchers = self._watchers, {}
        for task in watchers.values():
            task.cancel()
        channels, self._channels = self._channels, {}
        self._routes = None
        for c in channels.values():
            await c.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

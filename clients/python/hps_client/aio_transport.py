"""The asyncio gRPC transport of :class:`hps_client.AsyncHPSClient`: grpc.aio channels to replicas or shards as
:mod:`hps_client.grpc_transport`'s, a sharded batch split by shard and its parts awaited concurrently.

Channels open on first use, inside the running event loop (grpc.aio channels belong to one loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, TypeVar

import grpc

from hps_client.aio_streams import stream_answers_async
from hps_client.attempts import HedgingPolicy, call_hedged_async, retry_elsewhere
from hps_client.bags import answers_of
from hps_client.calls import Call, ClusterInfo, ListModels, Lookup, Ready, Rows, Stream
from hps_client.channel import Metadata
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
    stream_refused_sharded,
    whole_target,
)
from hps_client.stub import EmbeddingStub
from hps_client.wire import WireResponse, as_error

R = TypeVar("R")


class AsyncGrpcTransport:
    """Calls over grpc.aio channels to ``targets`` (see the module docstring)."""

    def __init__(self, targets: Sequence[str], options: Sequence[tuple[str, Any]],
                 credentials: grpc.ChannelCredentials | None = None, interceptors: Sequence[Any] = (),
                 hedging: HedgingPolicy | None = None, call_credentials: grpc.CallCredentials | None = None,
                 metadata: Metadata | None = None) -> None:
        """As :class:`hps_client.grpc_transport.GrpcTransport`; ``interceptors`` are grpc.aio client interceptors
        (e.g. OpenTelemetry's ``aio_client_interceptors()``)."""
        self._credentials = credentials
        self.targets = list(targets)
        self.target = whole_target(self.targets)
        self.hedging = hedging
        self._metadata = metadata
        self._call_credentials = call_credentials
        self._interceptors = list(interceptors) or None
        self._options = list(options)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._routes: ShardRoutes | None = None
        self._unsharded = False
        self._watchers: dict[int, asyncio.Task[None]] = {}
        self._learning: asyncio.Lock | None = None  # one coroutine learns the shard map at a time

    async def handle(self, call: Call[R]) -> R:
        """The answer of ``call`` (the transport's one method)."""
        answer: Any
        match call:
            case Rows():
                answer = (await self._lookup(call.as_lookup()))[call.table].vectors
            case Lookup():
                answer = await self._lookup(call)
            case ListModels():
                answer = await self._call("ListModels", pb.ListModelsRequest(), call)
            case ClusterInfo():
                answer = await self._call("GetClusterInfo", CLUSTER_INFO, call)
            case Stream():
                stub = await self._stream_stub(call.deadline)
                answer = stream_answers_async(stub, call.requests, call.max_in_flight, call.deadline,
                                              **self._auth(call.metadata))
            case Ready():
                answer = await self._any_stub(call.deadline)
                channel = self._channels.get(self.target) if self.target is not None else None
                if channel is not None:
                    await asyncio.wait_for(channel.channel_ready(), remaining(call.deadline))
                answer = None
            case _:
                raise TypeError(f"{type(call).__name__} is not a call this transport answers")
        return answer

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

    async def _call(self, method: str, request: object, call: Call[Any]) -> Any:
        try:
            return await getattr(await self._any_stub(call.deadline), method)(
                request, timeout=remaining(call.deadline), **self._auth(call.metadata))
        except grpc.aio.AioRpcError as err:
            raise as_error(err) from None

    async def _stream_stub(self, deadline: float | None) -> EmbeddingStub:
        """The stub a stream goes over: one server's; FailedPreconditionError for a sharded fleet."""
        routes = await self._learn(deadline)
        if routes is not None:
            if routes.shape.shards > 1:
                raise stream_refused_sharded(routes.shape)
            return await self._any_stub(deadline)
        stub = self._get_stub()
        assert stub is not None
        return stub

    # ---- the shard map ------------------------------------------------------------------------------------
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
                                                 **self._auth(self._metadata))
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self._unsharded = True
                return None
            if info.shards <= 1:
                self._unsharded = True
                return None
        probes = [self._open(t).GetClusterInfo(CLUSTER_INFO, timeout=remaining(deadline, PROBE_TIMEOUT_S),
                                               **self._auth(self._metadata)) for t in self.targets]
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
                                                                    **self._auth(self._metadata))
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

    async def _lookup(self, call: Lookup) -> dict[str, Any]:
        """The answer of a Lookup: one call over every replica, or the batch split over the shards."""
        stored, deadline, md = call.stored, call.deadline, call.metadata
        for attempt in range(2):
            try:
                routes = await self._learn(deadline)
                if routes is None:
                    stub = self._get_stub()
                    assert stub is not None
                    response = await self._lookup_unsharded(stub, call.request(), deadline, md)
                    return answers_of(response.tables, call.stored, call.pooling)
                split = split_batch(call.model, call.tables, routes.shape, fallback_shard=min(routes.stubs, default=0),
                                    precision=call.precision, version=call.version, label=call.label,
                                    pooling=call.pooling)
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

    async def close(self) -> None:
        watchers, self._watchers = self._watchers, {}
        for task in watchers.values():
            task.cancel()
        channels, self._channels = self._channels, {}
        self._routes = None
        for c in channels.values():
            await c.close()

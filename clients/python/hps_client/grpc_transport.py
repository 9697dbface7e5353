"""The gRPC transport of :class:`hps_client.HPSClient`: channels to the replicas of an unsharded service, or to the
shards of a sharded fleet (learned from GetClusterInfo on first use), over which each call goes.

Unsharded, one channel spans every replica: gRPC's ``round_robin`` spreads calls, its retry policy retries
UNAVAILABLE (a replica down or draining) on another one, and the call's deadline bounds it as a whole. Sharded, each
batch is split by shard (``partition(key) % shards``), the parts go to their shards concurrently (one channel per
shard over its replicas, balanced and retried the same way) and the answer comes back in the order asked. A shard
none of whose replicas answers raises UnavailableError naming it. ``hedging`` sends a second copy of a slow
unsharded lookup to another replica (see :mod:`hps_client.attempts`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, TypeVar

import grpc

from hps_client.attempts import HedgingPolicy, call_hedged, retry_elsewhere
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
from hps_client.streams import stream_answers
from hps_client.stub import EmbeddingStub
from hps_client.wire import WireResponse, as_error

R = TypeVar("R")


class GrpcTransport:
    """Calls over gRPC channels to ``targets`` (see the module docstring)."""

    def __init__(self, targets: Sequence[str], options: Sequence[tuple[str, Any]],
                 credentials: grpc.ChannelCredentials | None = None, interceptors: Sequence[Any] = (),
                 hedging: HedgingPolicy | None = None, call_credentials: grpc.CallCredentials | None = None,
                 metadata: Metadata | None = None) -> None:
        """``options``: the channels' options; ``credentials``: TLS (None: plaintext); ``call_credentials`` go with
        every call; ``metadata``: what the client sends on its own calls (shard probes)."""
        self.targets = list(targets)
        self.target = whole_target(self.targets)
        self.hedging = hedging
        self._metadata = metadata
        self._call_credentials = call_credentials
        self._interceptors = tuple(interceptors)
        self._options = list(options)
        self._creds = credentials
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.RLock()
        self._learning = threading.Lock()  # one thread learns the shard map at a time
        self._stub = self._open(self.target) if self.target is not None else None
        #: The one channel over every target (None for several named targets, e.g. a dns:/// name per shard).
        self._channel = self._channels.get(self.target) if self.target is not None else None
        self._routes: ShardRoutes | None = None
        self._unsharded = False
        self._watching: dict[int, grpc.Future] = {}
        #: targets whose shard (and shard map) a watcher learned since the routes were built
        self._found: dict[int, tuple[int, ShardShape]] = {}
        self._closed = False

    def handle(self, call: Call[R]) -> R:
        """The answer of ``call`` (the transport's one method)."""
        answer: Any
        match call:
            case Rows():
                answer = self._lookup(call.as_lookup())[call.table].vectors
            case Lookup():
                answer = self._lookup(call)
            case ListModels():
                answer = self._call("ListModels", pb.ListModelsRequest(), call)
            case ClusterInfo():
                answer = self._call("GetClusterInfo", CLUSTER_INFO, call)
            case Stream():
                answer = stream_answers(self._stream_stub(call.deadline).StreamLookup, call.requests,
                                        call.max_in_flight, call.deadline, **self._auth(call.metadata))
            case Ready():
                self._wait_ready(call.deadline)
                answer = None
            case _:
                raise TypeError(f"{type(call).__name__} is not a call this transport answers")
        return answer

    # ---- channels -----------------------------------------------------------------------------------------
    def _auth(self, metadata: Metadata | None) -> dict[str, Any]:
        """The keyword arguments that carry a call's metadata and the client's call credentials."""
        return {"metadata": metadata, "credentials": self._call_credentials}

    def _open(self, target: str) -> EmbeddingStub:
        """A stub over the channel of ``target`` (one channel per distinct target, kept until close)."""
        with self._lock:
            channel = self._channels.get(target)
            if channel is None:
                channel = (grpc.secure_channel(target, self._creds, options=self._options) if self._creds is not None
                           else grpc.insecure_channel(target, options=self._options))
                if self._interceptors:
                    channel = grpc.intercept_channel(channel, *self._interceptors)
                self._channels[target] = channel
        return EmbeddingStub(channel)

    def _any_stub(self, deadline: float | None) -> EmbeddingStub:
        if self._stub is not None:
            return self._stub
        routes = self._learn(deadline)
        stubs = [s for shard in sorted(routes.stubs) for s in routes.stubs[shard]] if routes else []
        if not stubs:
            raise UnavailableError(f"none of the targets {', '.join(self.targets)} answered")
        return stubs[0]

    def _call(self, method: str, request: object, call: Call[Any]) -> Any:
        try:
            return getattr(self._any_stub(call.deadline), method)(request, timeout=remaining(call.deadline),
                                                                 **self._auth(call.metadata))
        except grpc.RpcError as err:
            raise as_error(err) from None

    def _stream_stub(self, deadline: float | None) -> EmbeddingStub:
        """The stub a stream goes over: one server's; FailedPreconditionError for a sharded fleet."""
        routes = self._learn(deadline)
        if routes is not None:
            if routes.shape.shards > 1:
                raise stream_refused_sharded(routes.shape)
            return self._any_stub(deadline)
        assert self._stub is not None
        return self._stub

    def _wait_ready(self, deadline: float | None) -> None:
        """Block until the channel has a connection (UnavailableError at ``deadline``)."""
        channel = self._channel
        if channel is None:
            self._any_stub(deadline)
            return
        try:
            grpc.channel_ready_future(channel).result(timeout=remaining(deadline))
        except grpc.FutureTimeoutError:
            raise UnavailableError(f"no replica of {self.target} reachable in time") from None

    # ---- the shard map ------------------------------------------------------------------------------------
    def _learn(self, deadline: float | None) -> ShardRoutes | None:
        """The sharded routes, learned on first use; None: call through the one channel, as unsharded."""
        if self._unsharded:
            return None
        routes = self._routes
        if routes is not None:
            if self._found:
                with self._lock:
                    routes = self._with_found()
            return routes
        with self._learning:
            if self._unsharded or self._routes is not None:  # another thread learned it meanwhile
                return self._routes
            if self._stub is not None:
                try:
                    info = self._stub.GetClusterInfo(CLUSTER_INFO, timeout=remaining(deadline, PROBE_TIMEOUT_S),
                                                     **self._auth(self._metadata))
                except grpc.RpcError as err:
                    if err.code() == grpc.StatusCode.UNIMPLEMENTED:  # a server from before shards
                        self._unsharded = True
                    return None  # unreachable now: this call goes the unsharded way; learn on the next one
                if info.shards <= 1:
                    self._unsharded = True
                    return None
            return self._learn_targets(deadline)

    def _learn_targets(self, deadline: float | None) -> ShardRoutes | None:
        """Ask every target its shard (concurrently) and build one channel per shard."""
        stubs = {i: EmbeddingStub(self._probe_channel(t)) for i, t in enumerate(self.targets)}
        futures = {i: s.GetClusterInfo.future(CLUSTER_INFO, timeout=remaining(deadline, PROBE_TIMEOUT_S),
                                              **self._auth(self._metadata)) for i, s in stubs.items()}
        infos: dict[int, pb.ClusterInfo] = {}
        errors: dict[int, str] = {}
        for i, fut in futures.items():
            try:
                infos[i] = fut.result()
            except grpc.RpcError as err:
                errors[i] = f"{err.code().name}: {err.details()}"
        if not infos:
            if self._stub is not None:
                return None
            raise UnavailableError("no target answered GetClusterInfo: "
                                   + "; ".join(f"{self.targets[i]}: {e}" for i, e in errors.items()))
        shape = check_same_shape({i: ShardShape.of(info) for i, info in infos.items()}, self.targets)
        routes = self._build(shape, {i: int(info.shard) for i, info in infos.items()})
        with self._lock:
            self._routes = routes
            in_use = {t for ts in routes.targets.values() for t in ts} | {self.target}
            for i in infos:  # a probe channel no route uses (its replica is in a joined channel): closed
                channel = self._channels.get(self.targets[i])
                if self.targets[i] not in in_use and channel is not None:
                    del self._channels[self.targets[i]]
                    channel.close()
        for i in errors:
            if i not in self._watching:
                self._watch(i)
        return routes

    def _probe_channel(self, target: str) -> grpc.Channel:
        self._open(target)
        return self._channels[target]

    def _build(self, shape: ShardShape, known: dict[int, int]) -> ShardRoutes:
        targets = shard_channel_targets(self.targets, known)
        stubs = {shard: [self._open(t) for t in ts] for shard, ts in targets.items()}
        return ShardRoutes(shape=shape, known=dict(known), targets=targets, stubs=stubs)

    def _watch(self, i: int) -> None:
        """Learn the shard of target ``i`` (down when first asked) as soon as it answers."""
        stub = EmbeddingStub(self._probe_channel(self.targets[i]))
        fut = stub.GetClusterInfo.future(CLUSTER_INFO, wait_for_ready=True, **self._auth(self._metadata))

        def done(f: grpc.Future) -> None:
            if f.cancelled() or f.exception() is not None:
                return
            info = f.result()
            with self._lock:
                self._watching.pop(i, None)
                self._found[i] = (int(info.shard), ShardShape.of(info))

        with self._lock:
            if self._closed:
                fut.cancel()
                return
            self._watching[i] = fut
        fut.add_done_callback(done)

    def _with_found(self) -> ShardRoutes:
        """The routes with the targets that watchers found since added (called with the lock held)."""
        routes = self._routes
        assert routes is not None
        if self._found:
            found, self._found = self._found, {}
            added = {i: shard for i, (shard, shape) in found.items() if shape == routes.shape}
            if added:
                self._routes = routes = self._build(routes.shape, {**routes.known, **added})
        return routes

    def _forget(self) -> None:
        """Learn the shard map again on the next call (a server said a key is not its shard's)."""
        with self._lock:
            self._routes = None
            self._unsharded = False
            self._found = {}

    def _lookup(self, call: Lookup) -> dict[str, Any]:
        """The answer of a Lookup: one call over every replica, or the batch split over the shards."""
        for attempt in range(2):
            try:
                routes = self._learn(call.deadline)
                if routes is None:
                    assert self._stub is not None
                    response = self._lookup_unsharded(self._stub, call.request(), call.deadline, call.metadata)
                    return answers_of(response.tables, call.stored, call.pooling)
                return self._lookup_sharded(routes, call)
            except FailedPreconditionError:
                if attempt:
                    raise
                self._forget()  # a server refused keys of another shard: the fleet changed; learn it again
        raise AssertionError("unreachable")

    def _lookup_unsharded(self, stub: EmbeddingStub, request: pb.LookupRequest, deadline: float | None,
                   metadata: Metadata | None) -> WireResponse:
        """One Lookup over the channel of every replica, hedged when the client has a policy."""
        try:
            if self.hedging is None:
                return stub.Lookup(request, timeout=remaining(deadline), **self._auth(metadata))
            return call_hedged(lambda: stub.Lookup.future(request, timeout=remaining(deadline), **self._auth(metadata)),
                               self.hedging, deadline)
        except grpc.RpcError as err:
            raise as_error(err) from None

    def _lookup_sharded(self, routes: ShardRoutes, call: Lookup) -> dict[str, Any]:
        """The batch split by shard, the parts asked concurrently, the answers merged in the order asked."""
        deadline, metadata, precision = call.deadline, call.metadata, call.precision
        split = split_batch(call.model, call.tables, routes.shape, fallback_shard=min(routes.stubs, default=0),
                            precision=precision, version=call.version, label=call.label, pooling=call.pooling)
        total = sum(split.sizes)
        calls: list[tuple[ShardPart, list[EmbeddingStub], grpc.Future | None]] = []
        try:
            for part in split.parts:
                stubs = routes.stubs_from(part.shard)
                concurrent = len(split.parts) > 1 and stubs  # one part: called in _answer, no future needed
                fut = (stubs[0].Lookup.future(part.request, timeout=remaining(deadline), **self._auth(metadata))
                       if concurrent else None)
                calls.append((part, stubs, fut))
            responses = [self._answer(routes, part, stubs, fut, deadline, total, metadata)
                         for part, stubs, fut in calls]
        finally:
            for _, _, fut in calls:
                if fut is not None:
                    fut.cancel()  # a no-op for finished calls; stops the others when one shard failed
        return split.merge(responses, stored=precision == pb.PRECISION_STORED)

    def _answer(self, routes: ShardRoutes, part: ShardPart, stubs: list[EmbeddingStub],
                fut: grpc.Future | None, deadline: float | None, total: int,
                metadata: Metadata | None) -> WireResponse:
        """The part's answer: its call, else the shard's other channels in turn (after UNAVAILABLE, or an
        overloaded replica's RESOURCE_EXHAUSTED); UnavailableError naming the shard when none answers."""
        detail = "none of the client's targets serves this shard"
        for i, stub in enumerate(stubs):
            try:
                if i == 0 and fut is not None:
                    return fut.result()
                return stub.Lookup(part.request, timeout=remaining(deadline), **self._auth(metadata))
            except grpc.RpcError as err:
                if not retry_elsewhere(err):
                    raise shard_error(part.shard, routes.shape, err) from None
                detail = f"{err.code().name}: {err.details()}"
        raise shard_unavailable(part.shard, routes.shape, part.keys, total, routes.targets.get(part.shard, []),
                                detail)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            watching, self._watching = self._watching, {}
            channels, self._channels = self._channels, {}
        for fut in watching.values():
            fut.cancel()
        for channel in channels.values():
            channel.close()

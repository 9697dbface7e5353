"""Synchronous client that inference services use: NumPy keys in, NumPy rows out, over gRPC.

    client = HPSClient("dns:///hps-headless.ml.svc:8500")       # every replica behind one name
    rows = client.lookup("demo", "item", np.array([1, 2, 3]))   # (3, dim) float32

    # a sharded fleet: one name (or several endpoints) per shard, in any order
    client = HPSClient(["dns:///hps-shard-0-headless.ml.svc:8500", "dns:///hps-shard-1-headless.ml.svc:8500"])
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from hps_client.attempts import HedgingPolicy, call_hedged, retry_elsewhere
from hps_client.call_auth import read_credentials
from hps_client.channel import Metadata, channel_options, merge_metadata
from hps_client.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
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

#: Targets ``local:///PATH`` map a colocated server's shared store at PATH (see :class:`HPSClient`).
LOCAL_SCHEME = "local://"


#: The entry point group where a package registers the class that ``local://`` targets are read with.
READERS_GROUP = "hps_client.readers"


def colocated_reader(target: str) -> Any:
    """The class registered for ``local://`` reads (hps-service registers its LocalClient), loaded by entry point so
    that this distribution imports no server code; InvalidArgumentError when no installed package registers one."""
    found = entry_points(group=READERS_GROUP, name="local")
    if not found:
        raise InvalidArgumentError(f"{target}: colocated reads need the hps-service package "
                                   f"(pip install hps-service), not only hps-client")
    return next(iter(found)).load()


class HPSClient:
    """A client over one or several targets: replicas of one unsharded service, or the shards of a sharded fleet
    (learned from GetClusterInfo on first use).

    Unsharded, one channel spans every replica: gRPC's ``round_robin`` spreads calls, its retry policy retries
    UNAVAILABLE (a replica down or draining) on another one, and ``timeout`` bounds each call as a whole. Sharded,
    each batch is split by shard (``partition(key) % shards``), the parts go to their shards concurrently (one
    channel per shard over its replicas, balanced and retried the same way) and the answer comes back in the order
    asked. A shard none of whose replicas answers raises UnavailableError naming it.

    ``HPSClient("local:///dev/shm/hps")`` gives a colocated reader instead (``hps_service.local.LocalClient``): an
    inference process in the server's pod reading its shared store. The reader is the one an installed package
    registers under the entry point group ``hps_client.readers`` (name ``local``): ``hps-service`` does.

    ``metadata`` is sent on every call (e.g. a token), after which each call's own ``metadata=`` follows;
    ``interceptors`` (``grpc.UnaryUnaryClientInterceptor`` and friends) wrap every channel. For tracing, OpenTelemetry's
    ``GrpcInstrumentorClient().instrument()`` instruments every channel the client opens (it sends the W3C
    ``traceparent``; it reads the global tracer provider); its ``client_interceptor()`` is not a gRPC interceptor and
    cannot be passed here. ``hedging`` (a
    :class:`HedgingPolicy` or gRPC's ``hedgingPolicy`` dict) sends a second copy of a slow unsharded lookup to
    another replica (see :mod:`hps_client.attempts`).
    """

    def __new__(cls, targets: str | Iterable[str] = "", *args: Any, **kwargs: Any) -> Any:
        if isinstance(targets, str) and targets.startswith(LOCAL_SCHEME):
            reader = colocated_reader(targets)
            timeout = kwargs.get("timeout", args[0] if args else 5.0)
            passed = {k: kwargs[k] for k in ("metadata", "interceptors") if kwargs.get(k) is not None}
            return reader(targets[len(LOCAL_SCHEME):] or "/dev/shm/hps", timeout, **passed)
        return super().__new__(cls)

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
        """``targets``: a gRPC target (``host:port``, ``dns:///name:port``) or a list of them: ``host:port``
        replicas, or for a sharded fleet the replicas or ``dns:///`` names of its shards, in any order.
        ``retries`` (at most 4) and ``backoff_s`` shape the retry policy; ``options`` adds or overrides channel
        options. ``tls_ca`` (or ``tls=True`` for the system roots) turns TLS on; ``tls_cert``/``tls_key`` add a
        client certificate for servers that require mutual TLS. ``metadata``, ``interceptors`` and ``hedging``: see
        the class; ``health_check=False`` for servers older than 0.2 (no ``accepting`` health service).
        ``credentials``: for ``server.auth: token``, a read token (sent as ``authorization: Bearer`` metadata on
        every call) or gRPC call credentials (which gRPC sends over TLS only)."""
        self.targets = [targets] if isinstance(targets, str) else list(targets)
        self.target = whole_target(self.targets)
        self.timeout = timeout
        self.retries = retries
        token, self._call_credentials = read_credentials(credentials)
        self.metadata = merge_metadata(token, metadata)
        self.hedging = HedgingPolicy.parse(hedging) if hedging is not None else None
        self._interceptors = tuple(interceptors or ())
        self._options = channel_options(retries, backoff_s, options, health_check=health_check)
        self._creds = channel_credentials(tls_ca, tls_cert, tls_key, tls)
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

    def _call(self, method: str, request: object, timeout: float | None, metadata: Metadata | None) -> Any:
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return getattr(self._any_stub(deadline), method)(request, timeout=remaining(deadline),
                                                            **self._auth(merge_metadata(self.metadata, metadata)))
        except grpc.RpcError as err:
            raise as_error(err) from None

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the channel has a connection (UnavailableError after ``timeout`` seconds)."""
        channel = self._channel
        if channel is None:
            self._any_stub(None if timeout is None else time.monotonic() + timeout)
            return
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise UnavailableError(f"no replica of {self.target} reachable within {timeout} s") from None

    # ---- the shard map ------------------------------------------------------------------------------------
    def cluster_info(self, timeout: float | None = None, *, metadata: Metadata | None = None) -> dict[str, Any]:
        """GetClusterInfo of one target: shards, its shard, partitions, readiness (as a dict)."""
        info = self._call("GetClusterInfo", CLUSTER_INFO, timeout, metadata)
        return {"shards": info.shards, "shard": info.shard, "partitions": info.partitions,
                "partitioner": info.partitioner, "owned_partitions": list(info.owned_partitions),
                "topic_partitions": dict(info.topic_partitions), "ready": info.ready,
                "not_ready": list(info.not_ready)}

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
                                                     **self._auth(self.metadata))
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
                                              **self._auth(self.metadata)) for i, s in stubs.items()}
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
        fut = stub.GetClusterInfo.future(CLUSTER_INFO, wait_for_ready=True, **self._auth(self.metadata))

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

    # ---- lookups ------------------------------------------------------------------------------------------
    def lookup(self, model: str, table: str, keys: np.ndarray | Sequence[int], timeout: float | None = None, *,
               metadata: Metadata | None = None, out: np.ndarray | None = None, version: int | None = None,
               label: str = "") -> np.ndarray:
        """Rows of ``keys`` as an (n, dim) float32 array, in the order asked (a read-only view of the response);
        copied into ``out`` when given (a writable C-contiguous float32 ``(n, dim)`` array the caller owns). Read
        from the model's ``version``, or the one ``label`` names (neither: its label ``production``, else the
        model as configured); each lookup method takes these two."""
        answer = self.lookup_with_sources(model, table, keys, timeout, metadata=metadata, version=version, label=label)
        return into(out, answer).vectors

    def lookup_with_sources(
        self, model: str, table: str, keys: np.ndarray | Sequence[int], timeout: float | None = None, *,
        metadata: Metadata | None = None, version: int | None = None, label: str = "",
    ) -> TableAnswer:
        """Rows of ``keys`` and, per key, which level answered (1 cache, 2 volatile, 3 persistent, 4 default, 5 expired)."""
        return self.lookup_many(model, {table: keys}, timeout, metadata=metadata, version=version, label=label)[table]

    def lookup_many(
        self, model: str, tables: Mapping[str, np.ndarray | Sequence[int]], timeout: float | None = None, *,
        metadata: Metadata | None = None, version: int | None = None, label: str = "",
    ) -> dict[str, TableAnswer]:
        """Several tables of one model in one request: ``{table: TableAnswer}``; ``metadata`` follows the client's
        on this call."""
        return self._lookup_tables(model, tables, timeout, metadata, stored=False, version=version, label=label)

    def lookup_stored(self, model: str, table: str, keys: np.ndarray | Sequence[int], timeout: float | None = None,
                      *, metadata: Metadata | None = None, version: int | None = None, label: str = "") -> StoredAnswer:
        """Rows of ``keys`` as the table stores them (``precision = stored``: fp16, bf16 or int8 rows with their
        scales, up to 4x fewer bytes than float32), for a caller that decodes them itself; ``.rows.to_float32()``
        gives what :meth:`lookup` answers."""
        answer: StoredAnswer = self._lookup_tables(model, {table: keys}, timeout, metadata, stored=True,
                                                   version=version, label=label)[table]
        return answer

    def _lookup_tables(self, model: str, tables: Mapping[str, np.ndarray | Sequence[int]], timeout: float | None,
                       metadata: Metadata | None, stored: bool, version: int | None = None,
                       label: str = "") -> dict[str, Any]:
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        md = merge_metadata(self.metadata, metadata)
        precision = pb.PRECISION_STORED if stored else pb.PRECISION_FP32
        decode = decode_stored if stored else decode_answer
        for attempt in range(2):
            try:
                routes = self._learn(deadline)
                if routes is None:
                    assert self._stub is not None
                    request = build_request(model, tables, precision, version, label)
                    response = self._lookup_unsharded(self._stub, request, deadline, md)
                    return {tv.table: decode(tv) for tv in response.tables}
                return self._lookup_sharded(routes, model, tables, deadline, md, precision, version, label)
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

    def _lookup_sharded(self, routes: ShardRoutes, model: str, tables: Mapping[str, np.ndarray | Sequence[int]],
                        deadline: float | None, metadata: Metadata | None, precision: pb.Precision,
                        version: int | None = None, label: str = "") -> dict[str, Any]:
        split = split_batch(model, tables, routes.shape, fallback_shard=min(routes.stubs, default=0),
                            precision=precision, version=version, label=label)
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

    def list_models(self, timeout: float | None = None, *,
                    metadata: Metadata | None = None) -> dict[str, dict[str, int]]:
        """``{model: {table: dim}}`` of the models the server serves."""
        response = self._call("ListModels", pb.ListModelsRequest(), timeout, metadata)
        return {m.name: {t.name: t.dim for t in m.tables} for m in response.models}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            watching, self._watching = self._watching, {}
            channels, self._channels = self._channels, {}
        for fut in watching.values():
            fut.cancel()
        for channel in channels.values():
            channel.close()

    def __enter__(self) -> HPSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

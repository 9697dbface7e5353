"""gRPC EmbeddingService: translates protobuf requests to ReadEngine calls and domain errors to status codes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from hps_client.rows import STORAGE_CODES
from hps_service.config import ServerConfig
from hps_service.engine.api import ReadEngine
from hps_service.engine.bags import Bags
from hps_service.errors import DeadlineExceededError, HPSError, InvalidArgumentError, ResourceExhaustedError
from hps_service.fleet.sharding import ShardMap
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.runtime.gate import ServingGate
from hps_service.server.auth import Authenticator, Principal
from hps_service.server.bag_requests import request_bags
from hps_service.server.grpc_auth import grpc_principal
from hps_service.server.metrics import ServerMetrics
from hps_service.server.registration import Registrar
from hps_service.server.request_parsing import MalformedRequest, tolerant_parser
from hps_service.server.status import NO_RETRY, status_for
from hps_service.server.wire import ResponseBuffer, encode_lookup_response

log = logging.getLogger(__name__)


def check_deadline(context: grpc.ServicerContext) -> None:
    """Refuse work whose deadline has already passed (it would be thrown away by the caller)."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExceededError(f"the deadline passed {-remaining * 1000:.1f} ms before the lookup began")


#: The full name of the streaming lookup method.
STREAM_LOOKUP = "/hps.v1.EmbeddingService/StreamLookup"


def add_embedding_service(servicer: EmbeddingServicer, server: grpc.Server | Registrar) -> None:
    """Register ``servicer`` as hps.v1.EmbeddingService, with request parsing that refuses bad bytes cleanly (on a
    :class:`~hps_service.server.registration.Registrar`, StreamLookup runs on the stream lane)."""
    handlers = {
        # lookups answer with LookupResponse bytes already encoded by server.wire (no serializer)
        "Lookup": grpc.unary_unary_rpc_method_handler(
            servicer.Lookup, request_deserializer=tolerant_parser(pb.LookupRequest), response_serializer=None),
        "StreamLookup": grpc.stream_stream_rpc_method_handler(
            servicer.StreamLookup, request_deserializer=tolerant_parser(pb.LookupRequest),
            response_serializer=None),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=tolerant_parser(pb.ListModelsRequest),
            response_serializer=pb.ListModelsResponse.SerializeToString),
        "GetModel": grpc.unary_unary_rpc_method_handler(
            servicer.GetModel, request_deserializer=tolerant_parser(pb.GetModelRequest),
            response_serializer=pb.ModelInfo.SerializeToString),
        "GetClusterInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetClusterInfo, request_deserializer=tolerant_parser(pb.GetClusterInfoRequest),
            response_serializer=pb.ClusterInfo.SerializeToString),
    }
    service = pb.DESCRIPTOR.services_by_name["EmbeddingService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def refusal(err: Exception) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The status code, message and trailing metadata a failed call answers with: a domain error's own, else
    INTERNAL (logged, never a stack trace to the caller)."""
    if isinstance(err, HPSError):
        # a limit of the request: no replica would take it
        return status_for(err), str(err), NO_RETRY if isinstance(err, ResourceExhaustedError) else ()
    log.error("unexpected error serving a lookup", exc_info=err)
    return grpc.StatusCode.INTERNAL, "internal error; see the server log", ()


def _model_info(engine: ReadEngine, name: str) -> pb.ModelInfo:
    m = engine.model(name)
    return pb.ModelInfo(name=m.name, tables=[pb.TableInfo(name=t.name, dim=t.dim) for t in m.tables])


class EmbeddingServicer(pb_grpc.EmbeddingServiceServicer):
    """The hps.v1.EmbeddingService implementation."""

    def __init__(
        self,
        engine: ReadEngine,
        limits: ServerConfig,
        gate: ServingGate,
        metrics: ServerMetrics | None = None,
        shard_map: ShardMap | None = None,
        cluster_info: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """``shard_map`` refuses keys of other shards (FAILED_PRECONDITION); ``cluster_info`` answers
        GetClusterInfo (the fields of hps.v1.ClusterInfo)."""
        self.engine = engine
        self.limits = limits
        self.gate = gate
        self.metrics = metrics if metrics is not None else ServerMetrics(None)
        self.shard_map = shard_map if shard_map is not None else ShardMap()
        self.cluster_info = cluster_info
        #: None with server.auth none: the hot path then pays one attribute test for it.
        self.auth = Authenticator(limits) if limits.auth != "none" else None
        self._local = threading.local()

    def lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext | None = None,
               status: list[Any] | None = None) -> bytes:
        """Answer one LookupRequest as serialized LookupResponse bytes (raises domain errors); with ``context``,
        the deadline is checked per table; a pooled request marks ``status`` (its timer's) so."""
        self.gate.check()
        if isinstance(request, MalformedRequest):
            raise request.error()
        if not request.model:
            raise InvalidArgumentError("model name is empty")
        tables = request.tables
        if not tables:
            raise InvalidArgumentError("the request names no table")
        if len(tables) > self.limits.max_tables_per_request:
            raise ResourceExhaustedError(
                f"{len(tables)} tables in one request exceeds "
                f"server.max_tables_per_request={self.limits.max_tables_per_request}"
            )
        keys = [tk.keys for tk in tables]  # each access to a bytes field makes a new bytes object: once
        total = 0
        for tk, raw in zip(tables, keys):
            if len(raw) % 8:
                raise InvalidArgumentError(
                    f"table '{tk.table}': keys is {len(raw)} bytes, not a multiple of 8 (packed int64)"
                )
            total += len(raw) // 8
        if total > self.limits.max_batch_keys:
            raise ResourceExhaustedError(
                f"{total} keys in one request exceeds server.max_batch_keys={self.limits.max_batch_keys}"
            )
        bags = request_bags(tables, keys, self.limits.max_batch_keys)
        if self.shard_map.sharded:  # every table before any lookup: a misrouted request does no work
            for tk, raw in zip(tables, keys):
                self.shard_map.check(np.frombuffer(raw, dtype="<i8"), f"keys of table '{tk.table}'")
        stored = request.precision == pb.PRECISION_STORED
        if request.precision and not stored:
            raise InvalidArgumentError(f"precision {request.precision} is neither PRECISION_FP32 (0) nor "
                                       f"PRECISION_STORED (1)")
        self.metrics.observe_keys(total)
        if bags is not None:
            self.metrics.observe_bags(sum(b.count for b in bags if b is not None))
            if status is not None:
                status[1] = True
        # one version answers every table of the request, resolved once (a label switch lands before or after it)
        served, version = self.engine.resolve(request.model, request.version if request.HasField("version") else None,
                                              request.label)
        if len(keys) == 1 and (total if bags is None else bags[0] is not None and bags[0].count):
            return self._lookup_one(request, tables[0].table, keys[0], served, version, context, stored,
                                    None if bags is None else bags[0])
        answers = []
        shapes = []
        for i, (tk, raw) in enumerate(zip(tables, keys)):
            if context is not None:
                check_deadline(context)
            table_bags = None if bags is None else bags[i]
            asked = np.frombuffer(raw, dtype="<i8")
            res = (self.engine.lookup(served, tk.table, asked, stored=stored) if table_bags is None
                   else self.engine.lookup_bags(served, tk.table, asked, table_bags))
            answers.append((tk.table, res.vectors, res.sources))
            if stored:
                t = self.engine.table(served, tk.table)
                shapes.append((t.dim, STORAGE_CODES[t.storage] if table_bags is None else 0))
        return encode_lookup_response(request.model, request.request_id, answers, shapes if stored else None,
                                      version, None if bags is None else [b is not None for b in bags])

    def _lookup_one(self, request: pb.LookupRequest, table: str, keys: bytes, served: str, version: int,
                    context: grpc.ServicerContext | None, stored: bool = False, bags: Bags | None = None) -> bytes:
        """One table (the usual request) of ``served`` (the model or one of its versions), its ``keys`` the packed
        int64 bytes: the lookup writes its rows and sources straight into this thread's reused response buffer, so
        an all-hit batch goes from the request's key bytes to the response's row bytes in one compiled pass and one
        copy out; a pooled one pools straight into it."""
        if context is not None:
            check_deadline(context)
        t = self.engine.table(served, table)
        try:
            buf: ResponseBuffer = self._local.buffer
        except AttributeError:
            buf = self._local.buffer = ResponseBuffer()
        n = len(keys) // 8
        if bags is not None:
            rows, sources = buf.layout(request.model, table, bags.count, t.dim, request.request_id, version=version,
                                       pooled=True)
            self.engine.lookup_bags(served, table, np.frombuffer(keys, dtype="<i8"), bags, rows, sources)
            return buf.finish()
        if stored:
            rows, sources = buf.layout(request.model, table, n, t.dim, request.request_id, t.format.words,
                                       STORAGE_CODES[t.storage], version)
        else:
            rows, sources = buf.layout(request.model, table, n, t.dim, request.request_id, version=version)
        self.engine.lookup(served, table, np.frombuffer(keys, dtype="<i8"), rows, sources, stored)
        return buf.finish()

    def _abort(self, context: grpc.ServicerContext, err: Exception) -> None:
        code, message, trailers = refusal(err)
        if trailers:
            context.set_trailing_metadata(trailers)
        context.abort(code, message)

    def serve_one(self, method: str, request: pb.LookupRequest, context: grpc.ServicerContext,
                  principal: Principal | None = None) -> bytes:
        """Check the caller (``principal``, else from ``context``) and the deadline, answer, count and time the
        request; raises what :func:`refusal` turns into a status (counted so)."""
        with self.metrics.observe(method) as status:
            try:
                if self.auth is not None:
                    self._allowed(request, context, principal)
                return self.lookup(request, context, status)
            except Exception as err:  # translated to a status code, never a stack trace to the caller
                status[0] = status_for(err).name if isinstance(err, HPSError) else grpc.StatusCode.INTERNAL.name
                raise

    def _serve_one(self, method: str, request: pb.LookupRequest, context: grpc.ServicerContext,
                   principal: Principal | None = None) -> bytes:
        """:meth:`serve_one`, its errors as status codes."""
        try:
            return self.serve_one(method, request, context, principal)
        except Exception as err:
            self._abort(context, err)
            raise  # unreachable: abort raises

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> bytes:
        return self._serve_one("Lookup", request, context)

    def StreamLookup(
        self, request_iterator: Iterator[pb.LookupRequest], context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        principal = None
        if self.auth is not None:  # the stream's metadata and certificate are its own: resolved once
            try:
                principal = grpc_principal(self.auth, context)
            except HPSError as err:
                self._abort(context, err)
        for request in request_iterator:
            yield self._serve_one("StreamLookup", request, context, principal)

    def stream_refused(self, method: str) -> None:
        """Count a StreamLookup the stream lane refused (at server.max_streams or max_streams_per_caller) as one
        RESOURCE_EXHAUSTED request; the other streaming methods are not lookups."""
        if method == STREAM_LOOKUP:
            with self.metrics.observe("StreamLookup") as status:
                status[0] = grpc.StatusCode.RESOURCE_EXHAUSTED.name

    def _allowed(self, request: object, context: grpc.ServicerContext, principal: Principal | None) -> Principal:
        """The caller, if ``server.auth`` admits it and it may read the request's model (when it names one)."""
        assert self.auth is not None
        principal = principal if principal is not None else grpc_principal(self.auth, context)
        model = getattr(request, "model", "")
        if model:
            principal.check_model(model)
        return principal

    def _caller(self, request: object, context: grpc.ServicerContext) -> Principal | None:
        """For the metadata calls: the caller (None with auth none), or the call aborted with the refusal."""
        if isinstance(request, MalformedRequest):
            self._abort(context, request.error())
        if self.auth is None:
            return None
        try:
            return self._allowed(request, context, None)
        except HPSError as err:
            self._abort(context, err)
            raise  # unreachable: abort raises

    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        caller = self._caller(request, context)
        return pb.ListModelsResponse(models=[_model_info(self.engine, m.name) for m in self.engine.models()
                                             if caller is None or caller.may_read(m.name)])

    def GetClusterInfo(self, request: pb.GetClusterInfoRequest, context: grpc.ServicerContext) -> pb.ClusterInfo:
        self._caller(request, context)
        if self.cluster_info is not None:
            return pb.ClusterInfo(**self.cluster_info())
        m = self.shard_map
        return pb.ClusterInfo(shards=m.shards, shard=m.shard, partitions=m.partitions, partitioner="murmur2",
                              owned_partitions=m.owned_partitions(), ready=self.gate.is_open)

    def GetModel(self, request: pb.GetModelRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        self._caller(request, context)
        try:
            return _model_info(self.engine, request.model)
        except Exception as err:
            self._abort(context, err)
            raise

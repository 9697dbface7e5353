"""The EmbeddingService stub the clients call: Lookup answers are parsed by :func:`wire.parse_lookup_response`, so a
response's rows reach the caller as views of the bytes gRPC received (the generated stub's protobuf parse copies them
once more and builds a message per table)."""

from __future__ import annotations

from typing import Any

from hps_client.proto.hps.v1 import embedding_pb2 as pb
from hps_client.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_client.wire import parse_lookup_response

LOOKUP = "/hps.v1.EmbeddingService/Lookup"
STREAM_LOOKUP = "/hps.v1.EmbeddingService/StreamLookup"


class EmbeddingStub(pb_grpc.EmbeddingServiceStub):
    """The generated stub (sync or ``grpc.aio`` channel), with ``Lookup`` and ``StreamLookup`` answering
    :class:`wire.WireResponse` objects."""

    def __init__(self, channel: Any) -> None:
        super().__init__(channel)
        self.Lookup = channel.unary_unary(LOOKUP, request_serializer=pb.LookupRequest.SerializeToString,
                                          response_deserializer=parse_lookup_response, _registered_method=True)
        self.StreamLookup = channel.stream_stream(
            STREAM_LOOKUP, request_serializer=pb.LookupRequest.SerializeToString,
            response_deserializer=parse_lookup_response, _registered_method=True)

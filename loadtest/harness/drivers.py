"""Clients the load generator drives: hps.v1 Lookup over grpc.aio (our server or the transport floor) and the
plain Redis Cluster baseline. Each turns one pre-drawn batch into one call and says how it ended.

Requests are serialised once before the run (the pool is cycled), so the timed path is the call itself plus
decoding the answer into NumPy rows, which any real client pays too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import grpc
import numpy as np

from hps_service.client import _CHANNEL_OPTIONS, build_request
from hps_service.engine import Source
from hps_service.errors import InvalidArgumentError
from hps_service.proto.hps.v1 import embedding_pb2 as pb

LOOKUP_METHOD = "/hps.v1.EmbeddingService/Lookup"

#: Status codes beyond gRPC's (0..16) for failures seen on the client side.
CLIENT_ERROR = 100
BAD_RESPONSE = 101
STATUS_NAMES: dict[int, str] = {code.value[0]: code.name for code in grpc.StatusCode}
STATUS_NAMES.update({CLIENT_ERROR: "CLIENT_ERROR", BAD_RESPONSE: "BAD_RESPONSE"})


@dataclass(frozen=True)
class CallResult:
    """How one call ended: status (0 = OK), keys answered and how many of them the L1 cache answered
    (-1 when the backend does not say)."""

    status: int
    keys: int
    cache_hits: int = -1


class Driver(Protocol):
    """One backend as the worker loop sees it."""

    async def open(self) -> None:
        """Connect (inside the worker's event loop)."""

    async def call(self, i: int) -> CallResult:
        """Send batch ``i`` of the pool (modulo its size) and wait for the whole answer."""

    async def close(self) -> None:
        """Close connections."""


@dataclass
class GrpcLookupDriver:
    """hps.v1.EmbeddingService/Lookup over one grpc.aio channel; every table of a request gets ``batch`` keys."""

    target: str
    model: str
    tables: list[str]
    pool: np.ndarray  # (batches, tables * batch) int64
    timeout_s: float = 10.0
    #: Connections to open (calls go round them): a node's worker processes share the port with SO_REUSEPORT,
    #: which spreads connections, not calls, so one connection would load one worker.
    channels: int = 1
    _requests: list[bytes] = field(default_factory=list, init=False)
    _channel: grpc.aio.Channel | None = field(default=None, init=False)
    _lookup: grpc.aio.UnaryUnaryMultiCallable | None = field(default=None, init=False)
    _more: list[tuple[grpc.aio.Channel, grpc.aio.UnaryUnaryMultiCallable]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if not self.tables:
            raise InvalidArgumentError("a lookup needs at least one table")
        per_table = np.split(self.pool, len(self.tables), axis=1)
        self._requests = [
            build_request(self.model, {t: keys[i] for t, keys in zip(self.tables, per_table)}).SerializeToString()
            for i in range(self.pool.shape[0])
        ]

    async def open(self) -> None:
        options = [*_CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)] if self.channels > 1 else _CHANNEL_OPTIONS
        for _ in range(self.channels):
            channel = grpc.aio.insecure_channel(self.target, options=options)
            # Raw bytes out (pre-serialised), a parsed LookupResponse back: the decode is part of the client's cost.
            lookup = channel.unary_unary(
                LOOKUP_METHOD, request_serializer=None, response_deserializer=pb.LookupResponse.FromString
            )
            await channel.channel_ready()
            self._more.append((channel, lookup))
        self._channel, self._lookup = self._more[0]

    async def call(self, i: int) -> CallResult:
        assert self._lookup is not None, "open() first"
        lookup = self._lookup if len(self._more) < 2 else self._more[i % len(self._more)][1]
        try:
            response = await lookup(self._requests[i % len(self._requests)], timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            return CallResult(err.code().value[0], 0)
        keys = hits = 0
        for tv in response.tables:
            vectors = np.frombuffer(tv.vectors, dtype="<f4")
            sources = np.frombuffer(tv.sources, dtype=np.uint8)
            if vectors.shape[0] != tv.count * tv.dim or sources.shape[0] != tv.count:
                return CallResult(BAD_RESPONSE, 0)
            keys += tv.count
            hits += int(np.count_nonzero(sources == Source.CACHE))
        return CallResult(0, keys, hits)

    async def close(self) -> None:
        for channel, _ in self._more:
            await channel.close()
        self._more, self._channel, self._lookup = [], None, None

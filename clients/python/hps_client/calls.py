"""The calls a client hands its transport: what to ask, by when, with which metadata (the transport seam's request,
as an HTTP request is httpx's). The client builds and checks them once (:mod:`hps_client.base`); a transport
(gRPC, asyncio gRPC, the colocated store) answers them."""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from hps_client.bags import Pooling, table_keys
from hps_client.channel import Metadata
from hps_client.proto.hps.v1 import embedding_pb2 as pb
from hps_client.rows import StoredAnswer
from hps_client.streams import StreamRequest
from hps_client.wire import TableAnswer, version_field

R = TypeVar("R")


@dataclass(slots=True)
class Call(Generic[R]):
    """A call whose answer is an ``R``: ``deadline`` (``time.monotonic()`` seconds, None: none) and ``metadata``
    (the client's and the call's, merged) apply to every kind."""

    deadline: float | None
    metadata: Metadata | None


@dataclass(slots=True)
class Lookup(Call[dict[str, Any]]):
    """Rows of several tables of one model: ``{table: TableAnswer}`` (``stored``: ``{table: StoredAnswer}``) in the
    order asked. ``tables`` holds contiguous int64 keys; ``out`` (one table only) is where the caller wants the
    rows, which a transport may write directly."""

    model: str
    tables: dict[str, np.ndarray]
    version: int | None = None
    label: str = ""
    stored: bool = False
    out: np.ndarray | None = None
    #: The pooled tables' bags (their answers are one row per bag).
    pooling: dict[str, Pooling] | None = None

    @property
    def precision(self) -> pb.Precision:
        return pb.PRECISION_STORED if self.stored else pb.PRECISION_FP32

    def request(self) -> pb.LookupRequest:
        """The ``hps.v1.LookupRequest`` of this call."""
        pooling = self.pooling or {}
        return pb.LookupRequest(model=self.model, tables=[table_keys(t, k, pooling.get(t)) for t, k in
                                                          self.tables.items()],
                                precision=self.precision, label=self.label, **version_field(self.version))


@dataclass(slots=True)
class Rows(Call[np.ndarray]):
    """The float32 rows of one table's keys, ``(n, dim)`` in the order asked (no sources): the commonest call, kept
    apart so that a transport that can answer it in one step (the colocated store) does."""

    model: str
    table: str
    keys: np.ndarray
    version: int | None = None
    label: str = ""
    out: np.ndarray | None = None

    def as_lookup(self) -> Lookup:
        return Lookup(self.deadline, self.metadata, self.model, {self.table: self.keys}, self.version, self.label,
                      out=self.out)


@dataclass(slots=True)
class Stream(Call[Any]):
    """Lookups over one ``StreamLookup`` call, at most ``max_in_flight`` ahead of their answers: an iterator of
    :class:`~hps_client.streams.StreamAnswer` in the order asked (an async iterator from an asyncio transport);
    ``deadline`` bounds the whole stream."""

    requests: Iterable[StreamRequest] | AsyncIterable[StreamRequest]
    max_in_flight: int


@dataclass(slots=True)
class ListModels(Call[pb.ListModelsResponse]):
    """The models the server serves."""


@dataclass(slots=True)
class ClusterInfo(Call[pb.ClusterInfo]):
    """The shard map and readiness of one server."""


@dataclass(slots=True)
class Ready(Call[None]):
    """Answered once the transport can reach a server (UnavailableError at the deadline)."""


#: The answer of a Lookup, per table.
Answer = TableAnswer | StoredAnswer

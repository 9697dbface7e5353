"""What the sync and asyncio clients share (httpx's ``BaseClient``): their settings, and the public lookup API
written once as calls to build (checked here) and answers to shape. Each twin only hands the call to its transport."""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from hps_client.bags import Bags, pooling_of
from hps_client.buffers import check_out
from hps_client.call_auth import read_credentials
from hps_client.calls import ClusterInfo, ListModels, Lookup, Rows, Stream
from hps_client.channel import Metadata, merge_metadata
from hps_client.errors import InvalidArgumentError
from hps_client.proto.hps.v1 import embedding_pb2 as pb
from hps_client.streams import StreamRequest, check_in_flight
from hps_client.wire import TableAnswer, as_keys

Keys = np.ndarray | Sequence[int]


class BaseClient:
    """Settings of a client (the default timeout, the metadata sent on every call) and the calls it makes."""

    def __init__(self, timeout: float | None, metadata: Metadata | None,
                 credentials: str | grpc.CallCredentials | None) -> None:
        """``credentials``: a read token (sent as ``authorization: Bearer`` metadata on every call) or gRPC call
        credentials (which the gRPC transports send, over TLS only)."""
        self.timeout = timeout
        token, self._call_credentials = read_credentials(credentials)
        self.metadata = merge_metadata(token, metadata)

    def _deadline(self, timeout: float | None) -> float | None:
        timeout = self.timeout if timeout is None else timeout
        return None if timeout is None else time.monotonic() + timeout

    def _rows(self, model: str, table: str, keys: Keys, timeout: float | None, metadata: Metadata | None,
              version: int | None, label: str, out: np.ndarray | None) -> Rows:
        return Rows(self._deadline(timeout), merge_metadata(self.metadata, metadata) if metadata else self.metadata,
                    model, table, as_keys(keys), version, label, out)

    def _lookup(self, model: str, tables: Mapping[str, Keys], timeout: float | None, metadata: Metadata | None,
                version: int | None, label: str, stored: bool = False, out: np.ndarray | None = None) -> Lookup:
        if not model:
            raise InvalidArgumentError("model name is empty")
        if not tables:
            raise InvalidArgumentError("the request names no table")
        return Lookup(self._deadline(timeout), merge_metadata(self.metadata, metadata), model,
                      {name: as_keys(keys) for name, keys in tables.items()}, version, label, stored, out)

    def _bags(self, model: str, tables: Mapping[str, Bags], timeout: float | None, metadata: Metadata | None,
              version: int | None, label: str, out: np.ndarray | None = None) -> Lookup:
        call = self._lookup(model, {name: bags.keys for name, bags in tables.items()}, timeout, metadata, version, label,
                            out=out)
        call.pooling = {name: pooling_of(bags.offsets, bags.combiner, bags.weights) for name, bags in tables.items()}
        return call

    def _stream(self, requests: Iterable[StreamRequest] | AsyncIterable[StreamRequest], timeout: float | None,
                metadata: Metadata | None, max_in_flight: int) -> Stream:
        """A stream's call: ``timeout`` bounds the whole stream (None: none, whatever the client's default)."""
        return Stream(None if timeout is None else time.monotonic() + timeout,
                      merge_metadata(self.metadata, metadata), requests, check_in_flight(max_in_flight))

    def _list_models(self, timeout: float | None, metadata: Metadata | None) -> ListModels:
        return ListModels(self._deadline(timeout), merge_metadata(self.metadata, metadata))

    def _cluster_info(self, timeout: float | None, metadata: Metadata | None) -> ClusterInfo:
        return ClusterInfo(self._deadline(timeout), merge_metadata(self.metadata, metadata))


def rows_into(out: np.ndarray | None, rows: np.ndarray) -> np.ndarray:
    """``rows``, in the caller's ``out`` when one was given (a transport may have written them there already)."""
    if out is None or rows is out:
        return rows
    np.copyto(check_out(out, *rows.shape), rows)
    return out


def answer_into(out: np.ndarray | None, answer: TableAnswer) -> TableAnswer:
    """``answer`` with its rows in the caller's ``out`` when one was given."""
    if out is None or answer.vectors is out:
        return answer
    return TableAnswer(rows_into(out, answer.vectors), answer.sources)


def models_of(response: pb.ListModelsResponse) -> dict[str, dict[str, int]]:
    """``{model: {table: dim}}`` of a ListModels answer."""
    return {m.name: {t.name: t.dim for t in m.tables} for m in response.models}


def cluster_of(info: pb.ClusterInfo) -> dict[str, Any]:
    """A GetClusterInfo answer as a dict: shards, this shard, partitions, readiness."""
    return {"shards": info.shards, "shard": info.shard, "partitions": info.partitions,
            "partitioner": info.partitioner, "owned_partitions": list(info.owned_partitions),
            "topic_partitions": dict(info.topic_partitions), "ready": info.ready,
            "not_ready": list(info.not_ready)}

"""Routing a batch over a sharded fleet: which shard each target serves (from GetClusterInfo), the batch split by
shard (vectorised: one hash, one stable argsort per table), and the shards' answers put back in the order asked.

The I/O lives in HPSClient and AsyncHPSClient; this module is the part they share.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from hps_client.bags import Pooling, add_parts, answer_pooled, shard_pooling, table_keys
from hps_client.channel import channel_target
from hps_client.errors import FailedPreconditionError, HPSError, InternalError, InvalidArgumentError, UnavailableError
from hps_client.partitioning import shard_ids
from hps_client.proto.hps.v1 import embedding_pb2 as pb
from hps_client.stub import EmbeddingStub
from hps_client.wire import WireResponse, WireTable, as_error, as_keys, decode_answer, decode_stored, version_field


@dataclass(frozen=True, slots=True)
class ShardShape:
    """S shards over P partitions: key k is served by shard ``partition(k) % S``."""

    shards: int
    partitions: int

    @classmethod
    def of(cls, info: pb.ClusterInfo) -> ShardShape:
        return cls(shards=max(1, info.shards), partitions=max(1, info.partitions))


@dataclass(slots=True)
class ShardPart:
    """The request to one shard and, per table (in request order), where its keys sit in the batch asked (None:
    the part is the whole batch, in the order asked)."""

    shard: int
    request: pb.LookupRequest
    positions: list[np.ndarray] | None
    keys: int
    #: Per pooled table, the bags of its share of the keys (summed by the shard).
    pooling: dict[str, Pooling] | None = None


@dataclass(slots=True)
class SplitBatch:
    """A batch split by shard; ``merge`` reassembles the parts' answers in the order asked."""

    tables: list[str]
    sizes: list[int]
    parts: list[ShardPart]
    #: The pooled tables' bags, as the caller asked them (each part asks its shard for sums of its share).
    pooling: dict[str, Pooling] = field(default_factory=dict)

    def merge(self, responses: Sequence[WireResponse], stored: bool = False) -> dict[str, Any]:
        """``{table: TableAnswer}`` (``stored``: ``{table: StoredAnswer}``) with every key's row and source where it
        was asked (duplicates included), or for a pooled table every bag's."""
        decode = decode_stored if stored else decode_answer
        if len(self.parts) == 1 and self.parts[0].positions is None:  # one shard: its answer as it is (no copy)
            out = {}
            for i, (table, n) in enumerate(zip(self.tables, self.sizes)):
                tv = _table_of(responses[0], i, table)
                pooling = self.pooling.get(table)
                if tv.count != (n if pooling is None or not tv.pooled else pooling.count):
                    raise InternalError(f"shard {self.parts[0].shard} answered {tv.count} rows for table '{table}', "
                                       f"asked {n}")
                out[table] = decode(tv) if pooling is None else answer_pooled(tv, decode_answer(tv), pooling)
            return out
        out = {}
        for i, (table, n) in enumerate(zip(self.tables, self.sizes)):
            answers = [_table_of(r, i, table) for r in responses]
            pooling = self.pooling.get(table)
            if pooling is not None:  # each shard summed its share of every bag
                shares = []
                for part, tv in zip(self.parts, answers):
                    assert part.pooling is not None
                    shares.append(answer_pooled(tv, decode_answer(tv), part.pooling[table]))
                out[table] = add_parts(shares, pooling, n)
                continue
            shaped = max(answers, key=lambda tv: tv.count)  # a part with no key of the table may say dim 0
            width = len(shaped.vectors) // shaped.count if shaped.count else 0
            rows = np.empty((n, width), dtype=np.uint8)
            sources = np.empty(n, dtype=np.uint8)
            for part, tv in zip(self.parts, answers):
                assert part.positions is not None
                pos = part.positions[i]
                if tv.count != pos.shape[0] or (pos.shape[0] and (tv.dim, tv.storage) != (shaped.dim, shaped.storage)):
                    raise InternalError(f"shard {part.shard} answered {tv.count} rows of dim {tv.dim} for table "
                                       f"'{table}', asked {pos.shape[0]} of dim {shaped.dim}")
                if pos.shape[0]:
                    rows[pos] = np.frombuffer(tv.vectors, dtype=np.uint8).reshape(tv.count, width)
                    sources[pos] = np.frombuffer(tv.sources, dtype=np.uint8)
            out[table] = decode(WireTable(table, shaped.dim, n, rows.reshape(-1).data, sources.data,
                                          shaped.storage))
        return out


def _table_of(response: WireResponse, i: int, table: str) -> WireTable:
    if i >= len(response.tables) or response.tables[i].table != table:
        raise InternalError(f"a shard's answer lacks table '{table}'")
    return response.tables[i]


def split_batch(model: str, tables: Mapping[str, np.ndarray | Sequence[int]], shape: ShardShape,
                fallback_shard: int = 0, precision: pb.Precision = pb.PRECISION_FP32, version: int | None = None,
                label: str = "", pooling: Mapping[str, Pooling] | None = None) -> SplitBatch:
    """One request per shard holding keys of the batch; every part names every table (possibly with no keys), so
    each answer carries each table's dim. A batch with no key at all goes to ``fallback_shard``. Each part names
    the model ``version`` or ``label`` (each shard resolves a label itself). A pooled table (``pooling``) asks each
    shard for the sums of its share of every bag."""
    names = list(tables)
    pooling = dict(pooling or {})
    arrays = [as_keys(tables[t]) for t in names]
    sizes = [int(a.shape[0]) for a in arrays]
    ids = [shard_ids(arr, shape.partitions, shape.shards) for arr in arrays]
    counts = np.zeros(shape.shards, dtype=np.int64)
    for shard in ids:
        counts += np.bincount(shard, minlength=shape.shards)
    used = [int(s) for s in np.flatnonzero(counts)]
    if len(used) <= 1:  # every key on one shard (always so when unsharded): the batch as it is, to that shard
        request = pb.LookupRequest(model=model, tables=[table_keys(t, a, pooling.get(t)) for t, a in zip(names, arrays)],
                                   precision=precision, label=label, **version_field(version))
        return SplitBatch(tables=names, sizes=sizes, parts=[
            ShardPart(shard=used[0] if used else fallback_shard, request=request, positions=None, keys=sum(sizes))],
            pooling=pooling)
    per_table = []  # (order, starts) per table
    for shard in ids:
        order = np.argsort(shard, kind="stable")  # uint16: a radix sort
        starts = np.zeros(shape.shards + 1, dtype=np.int64)
        np.cumsum(np.bincount(shard, minlength=shape.shards), out=starts[1:])
        per_table.append((order, starts))
    parts = []
    for s in used:
        positions = [order[starts[s] : starts[s + 1]] for order, starts in per_table]
        shares = {t: shard_pooling(pooling[t], size, shard == s)
                  for t, size, shard in zip(names, sizes, ids) if t in pooling}
        request = pb.LookupRequest(model=model, tables=[
            # a pooled table's keys in their order (each bag's share stays together), a plain one's by position
            table_keys(t, arr[shard == s] if t in shares else arr[pos].astype("<i8", copy=False), shares.get(t))
            for t, arr, pos, shard in zip(names, arrays, positions, ids)
        ], precision=precision, label=label, **version_field(version))
        parts.append(ShardPart(shard=s, request=request, positions=positions, keys=int(counts[s]),
                               pooling=shares or None))
    return SplitBatch(tables=names, sizes=sizes, parts=parts, pooling=pooling)


def is_endpoint(target: str) -> bool:
    """Whether ``target`` is a plain ``host:port`` (not a ``dns:///``, ``ipv4:``, ``unix:`` ... target)."""
    if "://" in target or target.startswith(("ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")):
        return False
    host, sep, port = target.rpartition(":")
    return bool(sep and host and port.isdigit())


def whole_target(targets: Sequence[str]) -> str | None:
    """One gRPC target over all ``targets`` (a single one as it is; several ``host:port`` as one ``ipv4:``
    target), or None when they cannot share a channel (several names with schemes, e.g. one ``dns:///`` per shard)."""
    if len(targets) == 1:
        return channel_target(targets[0])
    if not all(is_endpoint(t) for t in targets):
        return None
    return channel_target(targets)


def shard_channel_targets(targets: Sequence[str], shard_of_target: Mapping[int, int]) -> dict[int, list[str]]:
    """Per shard, the gRPC targets of its replicas: its ``host:port`` targets joined into one (so gRPC's
    round_robin balances them and its retry policy fails over between them), each other target on its own."""
    endpoints: dict[int, list[str]] = {}
    named: dict[int, list[str]] = {}
    for i, shard in sorted(shard_of_target.items()):
        (endpoints if is_endpoint(targets[i]) else named).setdefault(shard, []).append(targets[i])
    out: dict[int, list[str]] = {}
    for shard in sorted(set(endpoints) | set(named)):
        joined = [channel_target(endpoints[shard])] if shard in endpoints else []
        out[shard] = joined + named.get(shard, [])
    return out


def check_same_shape(shapes: Mapping[int, ShardShape], targets: Sequence[str]) -> ShardShape:
    """The one shard shape all answering targets agree on; InvalidArgumentError naming them when they differ."""
    distinct = set(shapes.values())
    if len(distinct) > 1:
        described = ", ".join(f"{targets[i]}: {s.shards} shards over {s.partitions} partitions"
                              for i, s in sorted(shapes.items()))
        raise InvalidArgumentError(f"the targets disagree on the shard map ({described}); give targets of one fleet")
    return distinct.pop()


def shard_unavailable(shard: int, shape: ShardShape, part_keys: int, total_keys: int, targets: Sequence[str],
                      detail: str) -> UnavailableError:
    """The error of a batch that needed a shard no replica of which answered."""
    where = ", ".join(targets) if targets else "none of the client's targets serves it"
    return UnavailableError(
        f"shard {shard} of {shape.shards} is unavailable: no replica answered ({part_keys} of the {total_keys} keys "
        f"asked are on it; its targets: {where}): {detail}"
    )


#: The longest a call waits for the targets' GetClusterInfo answers before it goes on without them.
PROBE_TIMEOUT_S = 2.0
#: The request of every GetClusterInfo call.
CLUSTER_INFO = pb.GetClusterInfoRequest()


def remaining(deadline: float | None, cap: float | None = None) -> float | None:
    """Seconds left before ``deadline`` (monotonic), at most ``cap``; None for no deadline and no cap."""
    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    if cap is None:
        return left
    return cap if left is None else min(left, cap)


def stream_refused_sharded(shape: ShardShape) -> HPSError:
    """Why a stream is not opened over a sharded fleet (each of its requests would need every shard)."""
    return FailedPreconditionError(
        f"lookup_stream sends every request to one server, and the client's targets are a sharded fleet of "
        f"{shape.shards} shards: use lookup or lookup_many, which split each batch by shard")


def shard_error(shard: int, shape: ShardShape, err: grpc.RpcError) -> HPSError:
    """A shard's failed answer as the client error of its status, naming the shard."""
    error = as_error(err)
    return type(error)(f"shard {shard} of {shape.shards}: {error}", code=error.code, details=error.details)


@dataclass
class ShardRoutes:
    """What the client learned of a sharded fleet: the shape, each target's shard, and per shard its stubs."""

    shape: ShardShape
    known: dict[int, int]
    targets: dict[int, list[str]]
    stubs: dict[int, list[EmbeddingStub]]
    turn: dict[int, itertools.count] = field(default_factory=dict)

    def stubs_from(self, shard: int) -> list[EmbeddingStub]:
        """The shard's stubs, starting at the next in turn (round robin when a shard has several channels)."""
        stubs = self.stubs.get(shard, [])
        if len(stubs) < 2:
            return stubs
        start = next(self.turn.setdefault(shard, itertools.count())) % len(stubs)
        return stubs[start:] + stubs[:start]

"""Pooled lookups on the client's side: the bags a caller asks for (:class:`Bags`), how they travel in a
``TableKeys``, how they split over the shards of a fleet (each shard sums its part of every bag; the client adds
the parts and divides by the whole bag's length for a mean), and the pooling a client does itself when a server
answers one row per key (one from before pooled lookups)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps_client.errors import InvalidArgumentError
from hps_client.proto.hps.v1 import embedding_pb2 as pb
from hps_client.wire import TableAnswer, WireTable, decode_answer, decode_stored

#: Combiners by name, as hps.v1.Combiner numbers them.
COMBINERS = {"sum": pb.COMBINER_SUM, "mean": pb.COMBINER_MEAN}


@dataclass(frozen=True)
class Bags:
    """One table's bags for :meth:`hps_client.HPSClient.lookup_bags_many`: ``keys``, ``offsets`` (each bag's start
    in ``keys``, as torch's ``embedding_bag`` with ``include_last_offset=False``), ``combiner`` (``"sum"`` or
    ``"mean"``) and ``weights`` (one per key, ``"sum"`` only; None: all 1)."""

    keys: np.ndarray | Sequence[int]
    offsets: np.ndarray | Sequence[int]
    combiner: str = "sum"
    weights: np.ndarray | Sequence[float] | None = None


@dataclass(frozen=True, slots=True)
class Pooling:
    """A table's bags as a call carries them: int64 ``offsets``, an hps.v1.Combiner, float32 ``weights`` or None."""

    offsets: np.ndarray
    combiner: pb.Combiner
    weights: np.ndarray | None

    @property
    def count(self) -> int:
        return int(self.offsets.shape[0])

    def lengths(self, n_keys: int) -> np.ndarray:
        """The number of keys of each bag."""
        return np.diff(np.append(self.offsets, n_keys))


def pooling_of(offsets: np.ndarray | Sequence[int], combiner: str, weights: np.ndarray | Sequence[float] | None
               ) -> Pooling:
    """Bags as arrays of the wire's types; InvalidArgumentError for an unknown combiner or offsets that are not 1-D
    integers (the server checks the rest: order, bounds, weights' length)."""
    code = COMBINERS.get(combiner)
    if code is None:
        raise InvalidArgumentError(f"combiner {combiner!r} is neither 'sum' nor 'mean'")
    arr = np.asarray(offsets)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidArgumentError(f"offsets must be 1-D integers, got {arr.dtype} of shape {arr.shape}")
    w = None if weights is None else np.ascontiguousarray(weights, dtype="<f4")
    return Pooling(np.ascontiguousarray(arr, dtype="<i8"), code, w)


def table_keys(table: str, keys: np.ndarray, pooling: Pooling | None) -> pb.TableKeys:
    """The ``TableKeys`` of a table's keys, with its bags when pooled."""
    if pooling is None:
        return pb.TableKeys(table=table, keys=keys.tobytes())
    return pb.TableKeys(table=table, keys=keys.tobytes(), offsets=pooling.offsets.tobytes(), combiner=pooling.combiner,
                        weights=b"" if pooling.weights is None else pooling.weights.tobytes())


def pool(answer: TableAnswer, pooling: Pooling) -> TableAnswer:
    """One row per bag from one row per key (what a server from before pooled lookups answers), pooled as the
    server would: float32 sums in key order, divided by the bag's length for a mean; the deepest source per bag."""
    rows, n = answer.vectors, answer.vectors.shape[0]
    lengths = pooling.lengths(n)
    if pooling.weights is not None:
        rows = rows * pooling.weights[:, None]
    out = np.zeros((pooling.count, rows.shape[1]), dtype=np.float32)
    sources = np.zeros(pooling.count, dtype=np.uint8)
    full = np.flatnonzero(lengths > 0)
    if full.shape[0]:
        out[full] = np.add.reduceat(rows, pooling.offsets[full], axis=0, dtype=np.float32)
        sources[full] = np.maximum.reduceat(answer.sources, pooling.offsets[full])
        if pooling.combiner == pb.COMBINER_MEAN:
            out[full] /= lengths[full, None].astype(np.float32)
    return TableAnswer(out, sources)


def shard_pooling(pooling: Pooling, n_keys: int, in_shard: np.ndarray) -> Pooling:
    """The part of every bag on one shard (``in_shard``: the mask of its keys), to be summed there: its bags keep
    their number (empty where none of a bag's keys is on the shard) and their weights."""
    bag_of_key = np.repeat(np.arange(pooling.count), pooling.lengths(n_keys))
    per_bag = np.bincount(bag_of_key[in_shard], minlength=pooling.count)
    offsets = np.zeros(pooling.count, dtype="<i8")
    np.cumsum(per_bag[:-1], out=offsets[1:])
    weights = None if pooling.weights is None else np.ascontiguousarray(pooling.weights[in_shard])
    return Pooling(offsets, pb.COMBINER_SUM, weights)


def add_parts(parts: Sequence[TableAnswer], pooling: Pooling, n_keys: int) -> TableAnswer:
    """The shards' sums of their parts of every bag added up (divided by each bag's whole length for a mean); the
    deepest source of any part per bag."""
    out = np.zeros((pooling.count, parts[0].vectors.shape[1] if parts else 0), dtype=np.float32)
    sources = np.zeros(pooling.count, dtype=np.uint8)
    for part in parts:
        out += part.vectors
        np.maximum(sources, part.sources, out=sources)
    if pooling.combiner == pb.COMBINER_MEAN:
        lengths = pooling.lengths(n_keys)
        full = lengths > 0
        out[full] /= lengths[full, None].astype(np.float32)
    return TableAnswer(out, sources)


def answers_of(tables: Sequence[WireTable | pb.TableVectors], stored: bool,
               pooling: Mapping[str, Pooling] | None) -> dict[str, Any]:
    """A response's tables decoded (``stored``: as stored rows), the pooled ones one row per bag."""
    decode = decode_stored if stored else decode_answer
    if not pooling:
        return {tv.table: decode(tv) for tv in tables}
    return {tv.table: decode(tv) if tv.table not in pooling else answer_pooled(tv, decode_answer(tv),
                                                                              pooling[tv.table]) for tv in tables}


def answer_pooled(tv: WireTable | pb.TableVectors, answer: TableAnswer, pooling: Pooling) -> TableAnswer:
    """A table's answer to a pooled request: as it is when the server pooled it, else pooled here."""
    return answer if tv.pooled else pool(answer, pooling)

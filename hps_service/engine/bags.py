"""Pooled lookups (bags): each bag of keys answers one row, the sum or the mean of its keys' rows, as torch's
``embedding_bag`` (``include_last_offset=False``) and TorchRec's pooled embeddings do.

The keys of the whole request are deduplicated first (a key shared by many bags is read once), read through the
same hierarchy and rules as a plain lookup (L1, the volatile and persistent tiers, defaults, TTL, decoding of fp16,
bf16 and int8 rows) into a buffer of this thread reused from call to call, then pooled in one compiled pass into
the answer: float32 accumulation in key order, whatever the table's storage. Each bag's source is the deepest
level that answered any of its keys (an empty bag's is SOURCE_UNSPECIFIED, 0).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numba
import numpy as np

from hps_service.engine.levels import LookupResult
from hps_service.engine.table import ServedTable
from hps_service.errors import InvalidArgumentError, ResourceExhaustedError
from hps_service.jit.views import read_only_view
from hps_service.keys import distinct_with_inverse

#: Combiners, as hps.v1.Combiner numbers them (0: no pooling).
SUM, MEAN = 1, 2
COMBINERS = {"sum": SUM, "mean": MEAN}
#: Rows of a thread's reused buffer of unique keys kept between calls (a larger call allocates its own).
SCRATCH_ROWS = 1 << 16


@dataclass(frozen=True, slots=True)
class Bags:
    """Checked bags of a request: ``offsets`` (int64 bag starts), ``combiner`` (:data:`SUM` or :data:`MEAN`) and
    ``weights`` (float32 per key, or None: all 1)."""

    offsets: np.ndarray
    combiner: int
    weights: np.ndarray | None

    @property
    def count(self) -> int:
        return int(self.offsets.shape[0])


def check_bags(n_keys: int, offsets: np.ndarray, combiner: int, weights: np.ndarray | None, max_bags: int,
               what: str = "") -> Bags:
    """The bags of ``n_keys`` keys, checked; InvalidArgumentError (ResourceExhaustedError for too many bags) naming
    the field and the problem. Empty bags are valid (offsets ``[0, 0, 0]`` over no keys: three zero rows)."""
    where = f"{what}: " if what else ""
    if combiner not in (SUM, MEAN):
        raise InvalidArgumentError(f"{where}combiner {combiner} is neither SUM (1) nor MEAN (2)")
    if offsets.dtype != np.int64 or offsets.ndim != 1:
        raise InvalidArgumentError(f"{where}offsets must be 1-D int64, got {offsets.dtype} of shape {offsets.shape}")
    bags = offsets.shape[0]
    if bags > max_bags:
        raise ResourceExhaustedError(f"{where}{bags} bags in one request exceeds server.max_batch_keys={max_bags}")
    if bags == 0:
        if n_keys:
            raise InvalidArgumentError(f"{where}offsets is empty but there are {n_keys} keys: every key needs a bag")
    else:
        if offsets[0] != 0:
            raise InvalidArgumentError(f"{where}offsets must start at 0, got {int(offsets[0])}")
        steps = np.diff(offsets)
        if steps.shape[0] and int(steps.min()) < 0:
            at = int(np.argmax(steps < 0)) + 1
            raise InvalidArgumentError(f"{where}offsets go backwards at bag {at} ({int(offsets[at - 1])} then "
                                       f"{int(offsets[at])})")
        if int(offsets[-1]) > n_keys:
            raise InvalidArgumentError(f"{where}offsets end at {int(offsets[-1])}, past the {n_keys} keys")
    if weights is not None:
        if combiner != SUM:
            raise InvalidArgumentError(f"{where}weights go with combiner SUM only (torch's per_sample_weights)")
        if weights.dtype != np.float32 or weights.ndim != 1:
            raise InvalidArgumentError(f"{where}weights must be 1-D float32, got {weights.dtype}")
        if weights.shape[0] != n_keys:
            raise InvalidArgumentError(f"{where}{weights.shape[0]} weights for {n_keys} keys: one weight per key")
        if not np.isfinite(weights).all():
            raise InvalidArgumentError(f"{where}weights contain NaN or infinite values")
    return Bags(offsets, combiner, weights)


@numba.njit(cache=True, nogil=True)
def _pool(rows: np.ndarray, sources: np.ndarray, inverse: np.ndarray, offsets: np.ndarray, weights: np.ndarray,
          weighted: bool, mean: bool, out: np.ndarray, bag_sources: np.ndarray) -> None:
    # One pass over the keys in order: each bag's rows added into its answer row (float32, as torch accumulates),
    # times the key's weight; divided by the bag's length for the mean; the deepest source kept per bag.
    n = inverse.shape[0]
    bags = offsets.shape[0]
    dim = out.shape[1]
    for b in range(bags):
        start = offsets[b]
        end = offsets[b + 1] if b + 1 < bags else n
        acc = out[b]
        for d in range(dim):
            acc[d] = np.float32(0.0)
        deepest = np.uint8(0)
        for i in range(start, end):
            u = inverse[i]
            row = rows[u]
            if weighted:
                w = weights[i]
                for d in range(dim):
                    acc[d] += row[d] * w
            else:
                for d in range(dim):
                    acc[d] += row[d]
            if sources[u] > deepest:
                deepest = sources[u]
        if mean and end > start:
            scale = np.float32(end - start)
            for d in range(dim):
                acc[d] /= scale
        bag_sources[b] = deepest


class TableLookups(Protocol):
    """What pooling needs of an engine: its plain lookup and its tables' dims."""

    def lookup(self, model: str, table: str, keys: np.ndarray, out: np.ndarray | None = None,
               sources: np.ndarray | None = None, stored: bool = False) -> LookupResult: ...

    def table(self, model: str, table: str) -> ServedTable: ...


class BagReader:
    """Pools the rows that ``lookup(keys, out, sources)`` answers (an engine's plain lookup of one table) into
    bags, through a buffer of each thread's own."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _scratch(self, u: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
        if u > SCRATCH_ROWS:
            return np.empty((u, dim), dtype=np.float32), np.empty(u, dtype=np.uint8)
        held = getattr(self._local, "buffers", None)
        if held is None or held[0].shape[1] != dim or held[0].shape[0] < u:
            rows = max(u, 1024)
            held = self._local.buffers = (np.empty((min(2 * rows, SCRATCH_ROWS), dim), dtype=np.float32),
                                          np.empty(min(2 * rows, SCRATCH_ROWS), dtype=np.uint8))
        return held[0][:u], held[1][:u]

    def pool_table(self, engine: TableLookups, model: str, table: str, keys: np.ndarray, bags: Bags,
                   out: np.ndarray | None = None, sources: np.ndarray | None = None) -> LookupResult:
        """:meth:`pool` of ``engine``'s lookups of ``model.table`` (what an engine's ``lookup_bags`` answers)."""

        def rows(unique: np.ndarray, into: np.ndarray, answered: np.ndarray) -> LookupResult:
            return engine.lookup(model, table, unique, into, answered)

        return self.pool(rows, keys, engine.table(model, table).dim, bags, out, sources)

    def pool(self, lookup: Callable[[np.ndarray, np.ndarray, np.ndarray], LookupResult], keys: np.ndarray,
             dim: int, bags: Bags, out: np.ndarray | None = None,
             bag_sources: np.ndarray | None = None) -> LookupResult:
        """One row per bag into ``out`` (``(bags, dim)`` float32) and the deepest source per bag into
        ``bag_sources``; ``keys`` as checked by :func:`check_bags` (int64, contiguous)."""
        out = np.empty((bags.count, dim), dtype=np.float32) if out is None else out
        bag_sources = np.empty(bags.count, dtype=np.uint8) if bag_sources is None else bag_sources
        if bags.count == 0:
            return LookupResult(out, bag_sources)
        if keys.shape[0] == 0:
            out.fill(0.0)
            bag_sources.fill(0)
            return LookupResult(out, bag_sources)
        uniq, inverse = distinct_with_inverse(keys)
        rows, sources = self._scratch(uniq.shape[0], dim)
        lookup(uniq, rows, sources)
        weights = bags.weights if bags.weights is not None else _NO_WEIGHTS
        _pool(read_only_view(rows), read_only_view(sources), read_only_view(inverse), read_only_view(bags.offsets),
              read_only_view(weights), bags.weights is not None, bags.combiner == MEAN, out, bag_sources)
        return LookupResult(out, bag_sources)


_NO_WEIGHTS = read_only_view(np.ones(1, dtype=np.float32))


def warm_up_kernels() -> None:
    """Compile (or load) the pooling kernel for the types the serving paths pass (see :mod:`hps_service.jit.warmup`)."""
    reader = BagReader()
    keys = np.array([3, 1, 3], dtype=np.int64)

    def lookup(asked: np.ndarray, out: np.ndarray, sources: np.ndarray) -> LookupResult:
        out[:] = asked[:, None]
        sources.fill(1)
        return LookupResult(out, sources)

    offsets = np.array([0, 2], dtype=np.int64)
    for weights in (None, np.ones(3, dtype=np.float32)):
        for combiner in (SUM, MEAN) if weights is None else (SUM,):
            reader.pool(lookup, keys, 4, check_bags(3, offsets, combiner, weights, 8))

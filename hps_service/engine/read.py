"""The read path: L1, then the tiers below for what it missed (deduplicated), then the default; promotion.

A lookup asks each tier only for the keys still missing, promotes rows found in L3 into L2 and offers the
stored rows it fetched to L1 (where and when they enter is the cache's decision).
"""

from __future__ import annotations

import numpy as np

from hps_service.engine import ttl
from hps_service.engine.defaults import default_rows
from hps_service.engine.levels import (
    CACHE,
    DEFAULT,
    NO_ROW_VERSION,
    PERSISTENT,
    VOLATILE,
    Fetched,
    LookupResult,
)
from hps_service.engine.promote import Promote
from hps_service.engine.table import ServedTable
from hps_service.jit.views import read_only_view
from hps_service.keys import as_keys, first_occurrences, unique_with_inverse
from hps_service.tiers.base import LaneRead, ReadTier
from hps_service.tiers.hashmap.lane import check_answer


class Reader:
    """Answers lookups of served tables through L1, the volatile tier, the persistent tier and the default."""

    def __init__(self, volatile: ReadTier | None, persistent: ReadTier | None, max_batch_keys: int,
                 promote: Promote | None = None) -> None:
        """``promote`` has rows found in L3 written into L2 (None: none are: a reader that cannot write its tier)."""
        self.volatile = volatile
        self.persistent = persistent
        self.max_batch_keys = max_batch_keys
        self.promote = promote

    def lookup(self, t: ServedTable, keys: np.ndarray, out: np.ndarray | None = None,
               sources: np.ndarray | None = None, stored: bool = False) -> LookupResult:
        """Rows of ``keys`` in request order (duplicates included) and the level that answered each; written into
        ``out`` (C-contiguous float32 ``(n, dim)``) and ``sources`` (uint8 ``(n,)``) when given, e.g. views of a
        response being encoded, so an all-hit batch is copied once, from L1 into the response. ``stored``: the
        rows as the table stores them, ``(n, t.format.words)`` (a default row encoded in that format). A table with
        ``ttl_s`` answers expired rows with the default (see :mod:`hps_service.engine.ttl`)."""
        if t.ttl_s is not None:
            return ttl.lookup(self._lookup, t, as_keys(keys, self.max_batch_keys), out, sources, stored)
        return self._lookup(t, keys, out, sources, stored)

    def _lookup(self, t: ServedTable, keys: np.ndarray, out: np.ndarray | None = None,
                sources: np.ndarray | None = None, stored: bool = False) -> LookupResult:
        keys = as_keys(keys, self.max_batch_keys)
        n = keys.shape[0]
        if out is None:
            out = np.empty((n, t.format.words if stored else t.dim), dtype=np.float32)
        if sources is None:
            sources = np.empty(n, dtype=np.uint8)
        lane = self._lane(t, stored)
        if lane is not None:
            miss_idx = self._through_lane(t, lane, keys, out, sources, stored)
            if miss_idx.shape[0] == 0:
                return LookupResult(out, sources)
            return self._below(t, keys, miss_idx, out, sources, stored, PERSISTENT, 0.0, 0)
        fetched_at = t.cache.generation() if t.cache is not None else 0
        missed, batch_hit_rate = self._from_cache(t, keys, out, sources, stored)
        if batch_hit_rate == 1.0:
            return LookupResult(out, sources)
        start = VOLATILE
        if missed is not None and self._fills(t, stored):
            # the rows are answered as stored: the volatile tier fills L1's holes in place, no dedupe, no copies
            missed = self._fill_volatile(t, keys, missed, out, sources, batch_hit_rate, fetched_at)
            start = PERSISTENT
        if missed is not None and missed.shape[0] == 0:
            return LookupResult(out, sources)
        return self._below(t, keys, missed, out, sources, stored, start, batch_hit_rate, fetched_at)

    def _lane(self, t: ServedTable, stored: bool) -> LaneRead | None:
        """The volatile tier's compiled pass over ``t`` where it answers the lookup: no L1 in front of it and the
        rows answered as stored (None: the general path)."""
        if t.cache is not None or self.volatile is None or not (stored or t.format.identity):
            return None
        if t.lane is None:  # a table's rows stay where its tier id says: asked once
            t.lane = self.volatile.lane(t.id)
        return t.lane

    def _through_lane(self, t: ServedTable, lane: LaneRead, keys: np.ndarray, out: np.ndarray, sources: np.ndarray,
                      stored: bool) -> np.ndarray:
        """The volatile tier's rows of ``keys`` into ``out`` in one compiled pass; a key a complete table does not
        hold answers the default here. Returns the indices of the keys left for the tiers below."""
        n = keys.shape[0]
        check_answer(out, sources, n, t.format.words)
        miss = np.empty(n, dtype=np.intp)
        hits, complete = lane(read_only_view(keys), out, sources, miss)
        t.count("volatile", hits, n - hits)
        miss_idx = miss[: n - hits]
        if complete and hits < n:
            vectors = default_rows(t.default, keys[miss_idx], t.dim)
            out[miss_idx] = t.format.encode(vectors, written_s=0) if stored and not t.format.identity else vectors
            sources[miss_idx] = DEFAULT
            t.count_defaults(n - hits)
            return miss_idx[:0]
        return miss_idx

    def _below(self, t: ServedTable, keys: np.ndarray, miss_idx: np.ndarray | None, out: np.ndarray,
               sources: np.ndarray, stored: bool, start: int, batch_hit_rate: float, fetched_at: int) -> LookupResult:
        """The rows of ``keys[miss_idx]`` (None: every key) from the tiers from ``start`` down, deduplicated, into
        ``out``; offered to L1."""
        miss_keys = keys if miss_idx is None else keys[miss_idx]
        uniq, inverse = unique_with_inverse(miss_keys)
        got = self.fetch_below(t, uniq, start=start)
        rows = got.stored_rows(t.format) if stored else got.vectors
        if miss_idx is None:
            np.take(rows, inverse, axis=0, out=out)
            np.take(got.sources, inverse, out=sources)
        else:
            out[miss_idx] = rows[inverse]
            sources[miss_idx] = got.sources[inverse]
        if t.cache is not None:
            held = got.sources != DEFAULT
            if held.all():
                t.cache.admit(uniq, got.stored, got.versions, batch_hit_rate, fetched_at=fetched_at)
            elif held.any():
                t.cache.admit(uniq[held], got.stored[held], got.versions[held], batch_hit_rate,
                              fetched_at=fetched_at)
        return LookupResult(out, sources)

    def _fill_volatile(self, t: ServedTable, keys: np.ndarray, miss_idx: np.ndarray, out: np.ndarray,
                       sources: np.ndarray, batch_hit_rate: float, fetched_at: int) -> np.ndarray:
        """The volatile tier's rows of the keys L1 missed, written into ``out`` where L1 left them out (``out``
        holds stored rows: fp32, or the stored format asked), counted per key as L1 counts and offered to L1 once
        per distinct key; returns the indices it did not hold either."""
        assert self.volatile is not None
        m = miss_idx.shape[0]
        versions = np.empty(m, dtype=np.int64)
        found = np.empty(m, dtype=np.bool_)
        n_found = self.volatile.fill(t.id, keys, miss_idx, out, versions, found)
        t.count("volatile", n_found, m - n_found)
        if n_found == 0:
            return miss_idx
        filled = miss_idx if n_found == m else miss_idx[found]
        sources[filled] = VOLATILE
        if t.cache is not None:
            first = first_occurrences(keys, miss_idx, found)
            at = miss_idx[first]
            t.cache.admit(keys[at], out[at], versions[first], batch_hit_rate, fetched_at=fetched_at)
        return miss_idx[~found]

    def _fills(self, t: ServedTable, stored: bool) -> bool:
        """Whether the volatile tier can fill L1's holes in place: the answer holds rows as stored (fp32, or the
        stored format asked), so no decode stands between the tier and the answer."""
        return self.volatile is not None and (stored or t.format.identity)

    @staticmethod
    def _from_cache(t: ServedTable, keys: np.ndarray, out: np.ndarray, sources: np.ndarray, stored: bool = False,
                    hit: np.ndarray | None = None) -> tuple[np.ndarray | None, float]:
        """L1's rows of ``keys`` into ``out`` (decoded, or ``stored`` as they are): the indices it missed (None: all
        of them) and its hit rate. ``hit``: L1 was already read into ``out`` (fp32 rows), this is its hit mask."""
        n = keys.shape[0]
        if t.cache is None or not n:
            return None, 0.0
        fmt = t.format
        if hit is None and (fmt.identity or stored):
            hit = t.cache.lookup(keys, out)
        elif hit is None:  # L1 holds stored rows: gather them, then decode the batch into out
            words = np.empty((n, fmt.words), dtype=np.float32)
            hit = t.cache.lookup(keys, words)
            fmt.decode(words, out)
        n_hit = int(np.count_nonzero(hit))
        t.count("cache", n_hit, n - n_hit)
        sources.fill(CACHE)
        if n_hit == n:
            return np.empty(0, dtype=np.intp), 1.0
        return np.flatnonzero(~hit), n_hit / n

    def lookup_held(self, t: ServedTable, keys: np.ndarray, out: np.ndarray, sources: np.ndarray,
                    stored: bool = False, hit: np.ndarray | None = None) -> np.ndarray:
        """The rows L1 and the volatile tier hold, into ``out`` and ``sources`` (no promotion, admission or
        default; ``stored``: as the table stores them); returns the indices of the keys neither holds, for the
        process that reads the tiers below (a colocated reader of a node's store asks its server for them). A table
        with ``ttl_s`` answers the expired rows it holds with the default (see :mod:`hps_service.engine.ttl`).
        ``hit``: the caller already read L1's fp32 rows into ``out`` (a table without ``ttl_s``), with this mask."""
        if t.ttl_s is not None:
            if hit is not None:
                raise ValueError("a table with ttl_s reads L1 through its expiry check, not from a caller's read")
            return ttl.lookup_held(self._lookup_held, t, keys, out, sources, stored)
        return self._lookup_held(t, keys, out, sources, stored, hit)

    def _lookup_held(self, t: ServedTable, keys: np.ndarray, out: np.ndarray, sources: np.ndarray,
                     stored: bool = False, hit: np.ndarray | None = None) -> np.ndarray:
        lane = self._lane(t, stored)
        if lane is not None:
            return self._through_lane(t, lane, as_keys(keys), out, sources, stored)
        miss_idx, hit_rate = self._from_cache(t, keys, out, sources, stored, hit)
        if hit_rate == 1.0:
            return miss_idx if miss_idx is not None else np.empty(0, dtype=np.intp)
        if miss_idx is not None and self._fills(t, stored):
            assert self.volatile is not None
            m = miss_idx.shape[0]
            found = np.empty(m, dtype=np.bool_)
            if self.volatile.fill(t.id, keys, miss_idx, out, np.empty(m, dtype=np.int64), found):
                sources[miss_idx[found]] = VOLATILE
            return miss_idx[~found]
        asked = keys if miss_idx is None else keys[miss_idx]
        got = self.fetch_below(t, asked, count=False, through=VOLATILE)
        held = got.sources != DEFAULT
        at = np.flatnonzero(held) if miss_idx is None else miss_idx[held]
        out[at] = (got.stored if stored else got.vectors)[held]
        sources[at] = VOLATILE
        return np.flatnonzero(~held) if miss_idx is None else miss_idx[~held]

    def fetch_below(self, t: ServedTable, keys: np.ndarray, count: bool = True, through: int = PERSISTENT,
                    start: int = VOLATILE) -> Fetched:
        """Rows and versions of unique ``keys`` from volatile, then persistent, then the default; promotes L3 hits
        to L2. ``count``: add to the table's per-level counters (lookups do; the cache's own reads do not).
        ``through=VOLATILE`` stops above the persistent tier: what it misses is left DEFAULT, with no row;
        ``start=PERSISTENT`` skips the volatile tier (which a lookup already asked)."""
        read_at = t.write_generation()
        m = keys.shape[0]
        rows: np.ndarray | None = None
        versions: np.ndarray | None = None
        src = np.empty(m, dtype=np.uint8)
        src.fill(DEFAULT)
        pending: np.ndarray | None = None  # indices still unanswered; None: all of them
        for level, code, tier in (("volatile", VOLATILE, self.volatile), ("persistent", PERSISTENT, self.persistent)):
            if tier is None or code > through or code < start:
                continue
            asked = keys if pending is None else keys[pending]
            got = tier.get(t.id, asked)
            n_found = int(np.count_nonzero(got.found))
            if count:
                t.count(level, n_found, asked.shape[0] - n_found)
            if n_found == 0:
                continue
            if pending is None and n_found == m:  # the common case: one tier holds every key asked
                rows, versions = got.vectors, got.versions
                src.fill(code)
            else:
                if rows is None or versions is None:
                    rows = np.empty((m, t.format.words), dtype=np.float32)
                    versions = np.full(m, NO_ROW_VERSION, dtype=np.int64)
                hit_idx = np.flatnonzero(got.found) if pending is None else pending[got.found]
                rows[hit_idx] = got.vectors[got.found]
                versions[hit_idx] = got.versions[got.found]
                src[hit_idx] = code
            if code == PERSISTENT and self.volatile is not None and self.promote is not None:
                self.promote(t, asked[got.found], got.vectors[got.found], got.versions[got.found], read_at)
            pending = np.flatnonzero(~got.found) if pending is None else pending[~got.found]
            if pending.shape[0] == 0:
                break
        if rows is None or versions is None:
            rows = np.empty((m, t.format.words), dtype=np.float32)
            versions = np.full(m, NO_ROW_VERSION, dtype=np.int64)
        vectors = t.format.decoded(rows)  # the stored rows themselves for fp32
        if (pending is None or pending.shape[0]) and through == PERSISTENT:
            missing = slice(None) if pending is None else pending
            vectors[missing] = default_rows(t.default, keys[missing], t.dim)
            if count:
                t.count_defaults(m if pending is None else int(pending.shape[0]))
        return Fetched(vectors, versions, src, rows)

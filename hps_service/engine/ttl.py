"""Row TTL (``tables[].ttl_s``): a row not written for longer than its table's TTL is answered with the default and
``SOURCE_EXPIRED``.

A TTL table stores each row *stamped*: one trailing word holding its write time, uint32 seconds since the Unix epoch
(see :mod:`hps_service.rows.formats`). The stamp travels with the row through every tier, L1, snapshots and
conversions (they copy stored rows as they are), and the write time is the update message's ``produced_at_ns``, so
every replica stores the same stamp for the same write; a put or an import over REST takes this server's clock.

A lookup of a TTL table (:func:`lookup`, :func:`lookup_held`: called by :class:`hps_service.engine.read.Reader` for
the owner, a node's workers and colocated readers alike) reads the stored rows, compares each stamp with this
process's clock now, decodes the rest and answers an expired row with the default. To the second: a row stamped
``w`` is answered until ``now - w > ttl_s`` (``now`` the clock's whole seconds). Expired rows are then removed by the
owner's sweeper (:mod:`hps_service.engine.expiry_sweep`). ``precision = PRECISION_STORED`` on a TTL table is
refused (InvalidArgumentError): its stored rows carry the stamp, which no client decodes.

Tests move time by replacing :data:`clock`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hps_service.engine.defaults import default_rows
from hps_service.engine.levels import DEFAULT, EXPIRED, LookupResult
from hps_service.engine.table import ServedTable
from hps_service.errors import InvalidArgumentError
from hps_service.rows import row_format

#: The wall clock (seconds since the epoch) that stamps puts and imports and that lookups compare stamps with.
clock: Callable[[], float] = time.time

#: ``read(t, keys, out, sources, stored)``: the reader's own lookup (``Reader.lookup`` without the TTL check).
Read = Callable[[ServedTable, np.ndarray, np.ndarray, np.ndarray, bool], Any]


def now_s() -> int:
    """Whole seconds since the epoch, by :data:`clock`."""
    return int(clock())


def message_time_s(produced_at_ns: int) -> int:
    """The write time of the rows of an update message produced at ``produced_at_ns`` (a message without one,
    hand-made: this replica's clock, the only case where replicas may disagree)."""
    return produced_at_ns // 1_000_000_000 if produced_at_ns > 0 else now_s()


def write_times(n: int, written_s: np.ndarray | int | None) -> np.ndarray:
    """``n`` write times, int64 seconds: ``written_s`` (one, or one per row), else now."""
    return np.broadcast_to(np.asarray(now_s() if written_s is None else written_s, dtype=np.int64), (n,))


def expired_mask(t: ServedTable, stored: np.ndarray, now: int | None = None) -> np.ndarray:
    """Which of ``t``'s stamped rows ``(n, words)`` are older than its TTL at ``now`` (None: the clock now)."""
    assert t.ttl_s is not None
    cutoff = np.int64((now_s() if now is None else now) - t.ttl_s)
    return t.format.stamps(stored) < cutoff


def _refuse_stored(t: ServedTable) -> None:
    raise InvalidArgumentError(f"table {t.name} has ttl_s: its stored rows carry their write time, so it answers "
                               "precision fp32 only (PRECISION_FP32)")


def _answer(t: ServedTable, keys: np.ndarray, words: np.ndarray, held: np.ndarray, out: np.ndarray,
            sources: np.ndarray, defaults: bool = True) -> None:
    """Decode ``words`` into ``out``; expired rows and (``defaults``) rows not ``held`` get the default (computed,
    not decoded from a stored form), expired ones the source EXPIRED."""
    t.format.decode(words, out)
    expired = held & expired_mask(t, words)
    fill = (~held | expired) if defaults else expired
    if fill.any():
        at = np.flatnonzero(fill)
        out[at] = default_rows(t.default, keys[at], t.dim)
        n_expired = int(np.count_nonzero(expired))
        if n_expired:
            sources[expired] = EXPIRED
            t.count_defaults(n_expired)


def lookup(read: Read, t: ServedTable, keys: np.ndarray, out: np.ndarray | None, sources: np.ndarray | None,
           stored: bool) -> LookupResult:
    """What ``Reader.lookup`` answers for a TTL table: its stored rows read by ``read``, expired ones replaced."""
    if stored:
        _refuse_stored(t)
    n = keys.shape[0]
    words = np.empty((n, t.format.words), dtype=np.float32)
    got = read(t, keys, words, sources if sources is not None else np.empty(n, dtype=np.uint8), True)
    if out is None:
        out = np.empty((n, t.dim), dtype=np.float32)
    _answer(t, keys, words, got.sources != DEFAULT, out, got.sources)
    return LookupResult(out, got.sources)


def lookup_held(read_held: Read, t: ServedTable, keys: np.ndarray, out: np.ndarray, sources: np.ndarray,
                stored: bool) -> np.ndarray:
    """What ``Reader.lookup_held`` answers for a TTL table (the indices neither L1 nor the volatile tier holds);
    an expired row it holds is answered here, with the default and EXPIRED."""
    if stored:
        _refuse_stored(t)
    words = np.empty((keys.shape[0], t.format.words), dtype=np.float32)
    missing: np.ndarray = read_held(t, keys, words, sources, True)
    held = np.ones(keys.shape[0], dtype=bool)
    held[missing] = False
    words[missing] = 0  # not read: decoded as zeros, then left to the caller
    defaulted = held & (sources == DEFAULT)  # a key a complete table does not hold: its default, not a stored row
    _answer(t, keys, words, held & ~defaulted, out, sources, defaults=False)
    if defaulted.any():
        out[defaulted] = default_rows(t.default, keys[defaulted], t.dim)
    return missing


def check_stamping(tier: Any, t: ServedTable) -> None:
    """InvalidArgumentError when ``tier`` holds ``t``'s rows stamped while ``t`` has no ``ttl_s``, or the other way
    round (the rows' width says which): ttl_s is a property of a table's stored rows, fixed while it holds any."""
    tables = getattr(tier, "tables", None)
    width = tables().get(t.id) if callable(tables) else None
    other = row_format(t.storage, t.dim, not t.format.stamped)
    if width is not None and width != t.format.words and width == other.words:
        change = "set on" if t.ttl_s is not None else "removed from"
        raise InvalidArgumentError(
            f"table {t.id} holds rows {'without' if t.ttl_s is not None else 'with'} their write times: ttl_s cannot "
            f"be {change} a table that holds rows (each of its rows is one word wider with it); keep the table as it "
            "was, or import it again into an empty store")

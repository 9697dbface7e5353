"""The levels of the hierarchy and what a lookup answers: per key a row and the level (``Source``) it came from."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hps_service.rows.formats import RowFormat


class Source(IntEnum):
    """Which level answered a key; the values are those of the ``hps.v1.Source`` protobuf enum."""

    CACHE = 1
    VOLATILE = 2
    PERSISTENT = 3
    DEFAULT = 4
    #: Stored, but not written for longer than the table's ``ttl_s``: answered with the default.
    EXPIRED = 5


#: The Source codes as plain ints for array operations (NumPy converts an IntEnum member through its slow path).
CACHE, VOLATILE, PERSISTENT, DEFAULT, EXPIRED = (int(s) for s in (Source.CACHE, Source.VOLATILE, Source.PERSISTENT,
                                                                  Source.DEFAULT, Source.EXPIRED))
#: The levels that count hits and misses, top to bottom.
LEVELS = ("cache", "volatile", "persistent")
#: The version reported for a key no tier holds (answered with the default): older than any write.
NO_ROW_VERSION = int(np.iinfo(np.int64).min)


@dataclass(slots=True)
class LookupResult:
    """What a lookup answers, in the order asked."""

    vectors: np.ndarray  # (n, dim) float32
    sources: np.ndarray  # (n,) uint8 Source values


@dataclass(slots=True)
class Fetched:
    """Rows of unique keys read below L1: one entry per key, in the order asked."""

    vectors: np.ndarray  # (m, dim) float32: the stored row, else the table default
    versions: np.ndarray  # (m,) int64: the stored row's version, NO_ROW_VERSION where the default answered
    sources: np.ndarray  # (m,) uint8 Source values (VOLATILE, PERSISTENT or DEFAULT)
    stored: np.ndarray  # (m, words): the rows as the tiers store them (see hps_service.rows); undefined at DEFAULT

    def stored_rows(self, fmt: RowFormat) -> np.ndarray:
        """The rows as ``fmt`` stores them, the default rows encoded (what a ``precision = stored`` lookup answers)."""
        if fmt.identity:
            return self.vectors
        at = np.flatnonzero(self.sources == DEFAULT)
        if not at.shape[0]:
            return self.stored
        rows = self.stored.copy()
        rows[at] = fmt.encode(self.vectors[at], written_s=0)
        return rows

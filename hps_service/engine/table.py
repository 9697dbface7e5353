"""One served table: its config, its L1 cache, its per-level counters and its write guard."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hps_service.cache.protocol import FetchBelow, TableCache
from hps_service.cache.table_cache import WarmKeys
from hps_service.config import DefaultSpec
from hps_service.config.base import Storage
from hps_service.engine.ingest_admission import IngestFilter
from hps_service.engine.levels import LEVELS
from hps_service.engine.write_guard import WriteGuard
from hps_service.rows import RowFormat, row_format
from hps_service.shm.counters import ThreadSlots
from hps_service.tiers.base import LaneRead, table_id

#: Index of each level's hits in a thread's counts (its misses follow); the defaults come last.
_LEVEL_INDEX = {level: 2 * i for i, level in enumerate(LEVELS)}
_DEFAULTS = 2 * len(LEVELS)


class LevelCounters(Protocol):
    """Where a table's lookups count their hits and misses per level and the keys answered with the default."""

    def add(self, level: str, hits: int, misses: int) -> None: ...

    def add_defaults(self, n: int) -> None: ...

    def totals(self) -> tuple[dict[str, int], dict[str, int], int]:
        """(hits per level, misses per level, defaults answered)."""
        ...


class TableCounters(ThreadSlots):
    """Hits and misses per level and defaults answered, of one table, in this process.

    Each thread adds to its own list of counts (a :class:`~hps_service.shm.counters.ThreadSlots` slot), so a lookup
    takes no lock and no count is lost; a read sums the lists. ``lock`` only guards the list of lists.
    """

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lambda n: [0] * (_DEFAULTS + 1), lock)

    def add(self, level: str, hits: int, misses: int) -> None:
        counts = self.mine()
        i = _LEVEL_INDEX[level]
        counts[i] += hits
        counts[i + 1] += misses

    def add_defaults(self, n: int) -> None:
        self.mine()[_DEFAULTS] += n

    def totals(self) -> tuple[dict[str, int], dict[str, int], int]:
        """(hits per level, misses per level, defaults answered), summed over threads."""
        threads = self.slots()
        sums = [sum(col) for col in zip(*threads, strict=True)] if threads else [0] * (_DEFAULTS + 1)
        hits = {level: sums[i] for level, i in _LEVEL_INDEX.items()}
        misses = {level: sums[i + 1] for level, i in _LEVEL_INDEX.items()}
        return hits, misses, sums[_DEFAULTS]


@dataclass(slots=True)
class Conversion:
    """The copy a running conversion writes: its tier id and its row format (``source``: the table's), and why it
    stopped, once a write could not be re-encoded (a value beyond fp16's range)."""

    id: str
    format: RowFormat
    source: RowFormat
    error: str | None = None

    def reencode(self, stored: np.ndarray) -> np.ndarray:
        """Rows stored in the table's format -> the same rows in the copy's format (write times kept)."""
        written = self.source.stamps(stored) if self.source.stamped else None
        return self.format.encode(self.source.decoded(stored), written)


@dataclass
class ServedTable:
    """One table of a loaded model, with its L1 cache and counters."""

    model: str
    name: str
    dim: int
    default: DefaultSpec
    cache: TableCache | None = None
    #: Serialises the writers of this table and stamps what they wrote (shared with the table it replaced).
    guard: WriteGuard = field(default_factory=WriteGuard)
    #: Guards table metadata (the counters' list of threads); never taken by a lookup once its thread counted.
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Where lookups count: a :class:`TableCounters` of this process (a node's worker puts shared memory's instead).
    counters: LevelCounters = field(init=False)
    #: The write generation a reader stamps its reads with (None: the guard's; a node's worker reads the owner's).
    published_generation: Callable[[], int] | None = None
    #: How the tiers and L1 store its rows (they hold ``format.words`` words a row; lookups answer ``dim`` floats).
    storage: Storage = "fp32"
    #: The tier id its rows are stored under ("": ``model.table``; see :mod:`hps_service.engine.stored_tables`).
    stored_as: str = ""
    #: A conversion to another format in progress: every write of the table reaches its copy too.
    converting: Conversion | None = None
    #: Which new keys its puts may store (None: every one; see :mod:`hps_service.engine.ingest_admission`).
    ingest: IngestFilter | None = None
    #: Seconds a row lives after its write (None: for ever); its rows are stored stamped with their write time and
    #: lookups answer older ones with the default (see :mod:`hps_service.engine.ttl`).
    ttl_s: int | None = None
    #: The volatile tier's compiled pass over the table, once a lookup found it has one (see ``Reader``).
    lane: LaneRead | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.counters = TableCounters(self.lock)

    def write_generation(self) -> int:
        """The generation of the table's writes now: rows read after this are checked against writes since."""
        if self.published_generation is not None:
            return self.published_generation()
        return self.guard.generation

    @property
    def format(self) -> RowFormat:
        return row_format(self.storage, self.dim, self.ttl_s is not None)

    @property
    def id(self) -> str:
        """The tier id of the table's rows."""
        return self.stored_as or table_id(self.model, self.name)

    def count(self, level: str, hits: int, misses: int) -> None:
        """Add to this thread's hits and misses of ``level`` (no lock)."""
        self.counters.add(level, hits, misses)

    def count_defaults(self, n: int) -> None:
        """Add to this thread's count of keys answered with the default (no lock)."""
        self.counters.add_defaults(n)


#: Builds the L1 cache of a table, or None: ``factory(table, fetch_below, warm_keys)``.
CacheFactory = Callable[[ServedTable, FetchBelow, WarmKeys | None], TableCache | None]

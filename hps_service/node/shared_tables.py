"""A served table over the node's shared store, as a process that is not its owner reads it (a gRPC worker, or a
colocated reader): its rows' format and tier id from the manifest, the owner's write generation, its L1's shared
arrays, and (for a worker) its own rows of the table counters. Built in one place for both."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps_service.config import TableConfig
from hps_service.config.base import served_name
from hps_service.engine.levels import LEVELS
from hps_service.engine.table import ServedTable
from hps_service.errors import NotFoundError
from hps_service.node.shared_l1 import Offer, SharedL1Reader
from hps_service.node.store.node_store import T_L1_GEN, T_WRITE_GEN
from hps_service.node.store.view import StoreView
from hps_service.shm.counters import TABLE_DEFAULTS, TABLE_HITS, TABLE_MISSES, ThreadRows

_LEVEL = {name: i for i, name in enumerate(LEVELS)}


class PublishedGeneration:
    """A generation the owner publishes in a table's control array (its writes', or its L1's): ``read()`` it."""

    def __init__(self, control: np.ndarray, index: int) -> None:
        self._control = control
        self._index = index

    def read(self) -> int:
        return int(self._control[self._index])


class SharedTableCounters:
    """A table's per-level counts of this worker, in its rows of the store's shared counters (the owner sums them)."""

    def __init__(self, counters: np.ndarray, process: int) -> None:
        self._rows = ThreadRows(counters, process)
        self._process = counters[process]

    def add(self, level: str, hits: int, misses: int) -> None:
        row = self._rows.row()
        i = _LEVEL[level]
        row[TABLE_HITS + i] += hits
        row[TABLE_MISSES + i] += misses

    def add_defaults(self, n: int) -> None:
        self._rows.row()[TABLE_DEFAULTS] += n

    def totals(self) -> tuple[dict[str, int], dict[str, int], int]:
        """(hits per level, misses per level, defaults answered) of this worker's threads."""
        sums = self._process.sum(axis=0)
        hits = {level: int(sums[TABLE_HITS + i]) for level, i in _LEVEL.items()}
        misses = {level: int(sums[TABLE_MISSES + i]) for level, i in _LEVEL.items()}
        return hits, misses, int(sums[TABLE_DEFAULTS])


@dataclass(eq=False)
class StoreTable(ServedTable):
    """A served table read from the shared store: the store's serial of the table, which the owner knows it by."""

    serial: int = 0
    #: Its L1 as read from the store (also its ``cache``), None without one.
    shared_l1: SharedL1Reader | None = None


def table_config(manifest: Mapping[str, Any], model: str, table: str) -> TableConfig:
    """The config of table ``table`` of served model ``model`` (a model or ``model#vN``) in the store's manifest."""
    for mc in manifest.get("models", ()):
        if served_name(mc["name"], int(mc.get("version", 0))) == model:
            for tc in mc["tables"]:
                if tc["name"] == table:
                    return TableConfig.model_validate(tc)
    raise NotFoundError(f"the store's manifest has no table '{table}' of {model}")


def table_over_store(view: StoreView, serial: int, *, touch: bool,
                     offer: Callable[[StoreTable], Offer] | None = None, process: int | None = None) -> StoreTable:
    """Table ``serial`` of the mapped store, its default and lifetime as its model's config says. ``touch``: the
    reader's L1 hits count for LRU/LFU (a worker's mapping is writable there); ``offer(table)``: where the rows it
    fetched below L1 go (to the owner), None for none; ``process``: its row of the table counters (a worker's), None
    to count in this process."""
    tv = view.table(serial)
    tc = table_config(view.manifest, tv.model, tv.table)
    t = StoreTable(model=tv.model, name=tv.table, dim=tv.dim, default=tc.default, serial=serial, storage=tv.storage,
                   stored_as=tv.stored_as, ttl_s=tc.ttl_s,
                   published_generation=PublishedGeneration(tv.control, T_WRITE_GEN).read)
    if tv.counters is not None and process is not None:
        t.counters = SharedTableCounters(tv.counters, process)
    entry = view.manifest["tables"][str(serial)].get("l1")
    if tv.l1 is not None and entry is not None:
        t.cache = t.shared_l1 = SharedL1Reader(tv.l1, entry, PublishedGeneration(tv.control, T_L1_GEN).read,
                                               offer(t) if offer is not None else None, touch=touch)
    return t

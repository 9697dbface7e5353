"""Where a table's rows live in the tiers, and in which format: the table's tier id and its records.

A table is stored under ``model.table`` until it moves: a conversion to another format
(:mod:`hps_service.engine.convert`) writes the new format under a new id, ``model.table@N``, and a table registered
again after its rows were dropped (a version dropped and added again) starts under a new id too. Ids are never
reused (``generation/model.table`` records the highest N handed out), so nothing that keeps a table by its id (a
worker's mapping of the hash map, a RocksDB secondary's column family, a cache) can take a new table for a dropped
one. Where a table moved, the persistent tier's metadata says so (``stored_as/model.table``), so that a restart
serves the rows where and in the format they are stored, whatever the config's ``tables[].storage`` says. While a
conversion runs, ``converting/model.table`` names its target, so that a restart in the middle drops the half-built
copy.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from hps_service.errors import NotFoundError
from hps_service.rows import storage_key
from hps_service.tiers.base import Tier, TierCapability, table_id, tier_can

log = logging.getLogger(__name__)

#: Separates a table's name from its conversion count in a tier id (never in a model or table name).
GENERATION_MARK = "@"


def stored_as_key(name: str) -> str:
    """The metadata entry naming the tier id that ``name`` (``model.table``) is stored under, once converted."""
    return f"stored_as/{name}"


def converting_key(name: str) -> str:
    """The metadata entry naming the tier id a running conversion of ``name`` writes."""
    return f"converting/{name}"


def generation_key(name: str) -> str:
    """The metadata entry holding the highest generation the tier ids of ``name`` (``model.table``) reached: present
    once a table of that name moved or was dropped."""
    return f"generation/{name}"


def generation_of(stored_id: str) -> int:
    """How many moves ``stored_id`` is from the table's first id (0 for ``model.table``)."""
    _, mark, n = stored_id.partition(GENERATION_MARK)
    return int(n) if mark else 0


def name_of(stored_id: str) -> str:
    """The table name (``model.table``) a tier id belongs to."""
    return stored_id.partition(GENERATION_MARK)[0]


@dataclass(frozen=True, slots=True)
class StoredTable:
    """A table's tier id, the format recorded for it (None: no record), and whether it moved from ``model.table``
    (a conversion, or a registration after a drop)."""

    id: str
    storage: str | None
    converted: bool

    def serving_storage(self, configured: str) -> str:
        """The format its rows are served in: the record of a moved table wins over ``configured``
        (tables[].storage)."""
        return self.storage if self.converted and self.storage is not None else configured


def _get(tier: Tier | None, key: str) -> str | None:
    if tier is None:
        return None
    value = tier.metadata(key).get(key)
    return None if value is None else value.decode()


def stored_table(persistent: Tier | None, model: str, table: str) -> StoredTable:
    """Where ``model.table`` is stored: its converted id and format where a conversion recorded one, else
    ``model.table`` with whatever format its rows were recorded in (None: none recorded)."""
    name = table_id(model, table)
    converted_to = _get(persistent, stored_as_key(name))
    tier_id = converted_to or name
    return StoredTable(tier_id, _get(persistent, storage_key(tier_id)), converted_to is not None)


def stored_id(persistent: Tier | None, model: str, table: str) -> str:
    """The tier id that ``model.table``'s rows are stored under in ``persistent`` (snapshots and imports use it)."""
    return stored_table(persistent, model, table).id


class TableNames:
    """Hands out the tier ids of a store's tables so that none is ever used twice (see the module's docstring).
    Kept in ``persistent``'s metadata, else, with no persistent tier, for this process's life (a store of the hash
    map alone lives no longer). A read-only persistent tier moves nothing: it serves what its writer recorded."""

    def __init__(self, persistent: Tier | None) -> None:
        self._tier = persistent
        self._writable = tier_can(persistent, TierCapability.WRITES)
        self._lock = threading.Lock()
        self._highest: dict[str, int] = {}  # name -> highest generation, with no persistent tier
        self._moved: dict[str, str] = {}  # name -> tier id, with no persistent tier

    def stored(self, model: str, table: str) -> StoredTable:
        """Where ``model.table`` is stored now (:func:`stored_table`, or this process's record)."""
        moved = self._moved.get(table_id(model, table))
        return StoredTable(moved, None, True) if moved is not None else stored_table(self._tier, model, table)

    def claim(self, model: str, table: str) -> StoredTable:
        """Where a table being registered (or imported) stores its rows: where it is stored now, or under a fresh id
        (recorded as where it is stored) when an earlier table of that name was dropped."""
        name = table_id(model, table)
        with self._lock:
            current = self.stored(model, table)
            if current.converted or self._generation(name) is None or (self._tier is not None and not self._writable):
                return current
            fresh = self._new_id(name, current.id)
            self._move(name, fresh)
        log.info("%s was dropped before: its rows are stored under %s from now on", name, fresh)
        return StoredTable(fresh, None, True)

    def new_id(self, name: str, current: str) -> str:
        """A tier id that no table of ``name`` (now stored under ``current``) ever had: a conversion's copy."""
        with self._lock:
            return self._new_id(name, current)

    def moved(self, name: str, stored_id: str) -> None:
        """Record that ``name``'s rows are stored under ``stored_id`` from now on (a conversion's switch)."""
        with self._lock:
            self._move(name, stored_id)

    def retire(self, stored_id: str) -> None:
        """Note that the rows under ``stored_id`` are being dropped, so that its name's next table gets a fresh id.
        Called before the rows go: a stop half-way still never serves the id again."""
        name = name_of(stored_id)
        with self._lock:
            self._record(name, max(self._generation(name) or 0, generation_of(stored_id)))
            if self._tier is None:
                if self._moved.get(name) == stored_id:
                    del self._moved[name]
            elif self._writable and _get(self._tier, stored_as_key(name)) == stored_id:
                self._tier.set_metadata(stored_as_key(name), None)

    def _generation(self, name: str) -> int | None:
        if self._tier is None:
            return self._highest.get(name)
        held = _get(self._tier, generation_key(name))
        return None if held is None else int(held)

    def _record(self, name: str, generation: int) -> None:
        if self._tier is None:
            self._highest[name] = generation
        elif self._writable:
            self._tier.set_metadata(generation_key(name), str(generation).encode())

    def _move(self, name: str, stored_id: str) -> None:
        if self._tier is None:
            self._moved[name] = stored_id
        else:
            self._tier.set_metadata(stored_as_key(name), stored_id.encode())

    def _new_id(self, name: str, current: str) -> str:
        generation = max(self._generation(name) or 0, generation_of(current)) + 1
        self._record(name, generation)
        return f"{name}{GENERATION_MARK}{generation}"


def metadata_keys(model: str, tables: dict[str, StoredTable]) -> list[str]:
    """The metadata entries that describe how ``model``'s tables (name -> where stored) are stored (a snapshot
    carries them)."""
    keys = []
    for table, st in tables.items():
        if st.converted:
            keys.append(stored_as_key(table_id(model, table)))
        keys.append(storage_key(st.id))
    return keys


def drop_abandoned(persistent: Tier | None, model: str, table: str) -> None:
    """Drop the half-built copy of a conversion that a stop interrupted (its record says which), and the record."""
    name = table_id(model, table)
    target = _get(persistent, converting_key(name))
    if persistent is None or target is None or TierCapability.WRITES not in persistent.capabilities:
        return
    if target != stored_table(persistent, model, table).id:
        try:
            persistent.drop_table(target)
        except NotFoundError:  # never created: the conversion stopped before its first write
            pass
        persistent.set_metadata(storage_key(target), None)
        log.warning("dropped %s, the copy of %s an interrupted conversion left", target, name)
    persistent.set_metadata(converting_key(name), None)

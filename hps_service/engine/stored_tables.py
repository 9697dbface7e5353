"""Where a table's rows live in the tiers, and in which format: the table's tier id and its records.

A table is stored under ``model.table`` until it is converted to another format (:mod:`hps_service.engine.convert`).
A conversion writes the new format under a new id, ``model.table@N`` (N counts the conversions), and then records
in the persistent tier's metadata that the table is stored there (``stored_as/model.table``), so that a restart
serves the converted rows in their format whatever the config's ``tables[].storage`` says. While a conversion runs,
``converting/model.table`` names its target, so that a restart in the middle drops the half-built copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hps_service.errors import NotFoundError
from hps_service.rows import storage_key
from hps_service.tiers.base import Tier, TierCapability, table_id

log = logging.getLogger(__name__)

#: Separates a table's name from its conversion count in a tier id (never in a model or table name).
GENERATION_MARK = "@"


def stored_as_key(name: str) -> str:
    """The metadata entry naming the tier id that ``name`` (``model.table``) is stored under, once converted."""
    return f"stored_as/{name}"


def converting_key(name: str) -> str:
    """The metadata entry naming the tier id a running conversion of ``name`` writes."""
    return f"converting/{name}"


def generation_of(stored_id: str) -> int:
    """How many conversions ``stored_id`` is from the table's first id (0 for ``model.table``)."""
    _, mark, n = stored_id.partition(GENERATION_MARK)
    return int(n) if mark else 0


def next_stored_id(name: str, current: str) -> str:
    """The tier id a conversion of ``name``, now stored under ``current``, writes."""
    return f"{name}{GENERATION_MARK}{generation_of(current) + 1}"


@dataclass(frozen=True, slots=True)
class StoredTable:
    """A table's tier id, the format recorded for it (None: no record), and whether a conversion moved it."""

    id: str
    storage: str | None
    converted: bool

    def serving_storage(self, configured: str) -> str:
        """The format its rows are served in: a conversion's record wins over ``configured`` (tables[].storage)."""
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

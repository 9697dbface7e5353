"""Converting a served table to another row format while it is served (``POST .../tables/{t}:convert``).

The table's rows are re-encoded into a copy under a new tier id (see :mod:`hps_service.engine.stored_tables`):

1. the copy is created and attached to the served table, so that from then on every write of the table reaches it
   too, in the same persistent write (:func:`hps_service.engine.write.copy_write`);
2. the stored entries, rows and tombstones, are copied a stretch at a time, each under the table's write lock, so a
   stretch is read as it is now and no write interleaves with its copy. Lookups are answered from the old format
   throughout;
3. the switch records the copy as where the table is stored, and the model is registered again: the new table
   reads the copy (its L1 and hash map filled anew), every later write reaches it alone;
4. the old rows are dropped from RocksDB and the in-process hash map once lookups in flight have finished.

The copy converges to the table whatever writes run meanwhile: writes reach both under the same version rules, and
a stretch copied under the lock overwrites what such writes left in the copy with the table's own state of it. A
stop before the switch leaves the old table served and the copy is dropped at the next start; a stop after it
serves the copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hps_service.engine.registry import record_storage
from hps_service.engine.stored_tables import converting_key, stored_id
from hps_service.engine.table import Conversion, ServedTable
from hps_service.errors import FailedPreconditionError, NotFoundError, UnavailableError
from hps_service.rows import row_format, storage_key
from hps_service.tiers.base import Tier, TierCapability, table_id

if TYPE_CHECKING:
    from hps_service.engine.engine import LookupEngine

log = logging.getLogger(__name__)

#: Entries copied per stretch: one stretch holds the table's write lock (and the interpreter) for a few milliseconds.
STRETCH_ENTRIES = 2048
#: How long the old rows outlive the switch, so that lookups which resolved the old table finish reading them (one
#: slower than that finds them gone and reads the table again where it is now: see ``LookupEngine.lookup``).
DROP_GRACE_S = 5.0


@dataclass
class ConvertProgress:
    """What a conversion reports as it goes: entries to copy (an estimate: rows and tombstones when it started)
    and entries copied."""

    report: Callable[[int, int], None] = lambda total, done: None


def conversion_tier(engine: LookupEngine) -> Tier:
    """The persistent tier a conversion copies in, or UnavailableError naming why there is none."""
    tier = engine.persistent
    if tier is None or TierCapability.SCAN not in tier.capabilities:
        raise UnavailableError("converting a table needs persistent.type rocksdb: its rows are copied from there")
    if TierCapability.WRITES not in tier.capabilities:
        raise UnavailableError("converting a table needs a writable persistent tier, but persistent.read_only is true")
    return tier


def check_conversion(engine: LookupEngine, model: str, table: str, storage: str) -> ServedTable:
    """The served table if it can be converted to ``storage`` now; else the error that says why not."""
    conversion_tier(engine)
    t = engine.table(model, table)
    row_format(storage, t.dim)  # InvalidArgumentError for an unknown format
    if t.storage == storage:
        raise FailedPreconditionError(f"table {model}.{table} is already stored as {storage}")
    if t.converting is not None and t.converting.error is None:
        raise FailedPreconditionError(f"table {model}.{table} is being converted to {t.converting.format.storage}")
    return t


def convert_table(engine: LookupEngine, model: str, table: str, storage: str,
                  progress: ConvertProgress | None = None) -> dict[str, Any]:
    """Re-encode ``model.table`` as ``storage`` while it is served, then serve the copy; returns what was done."""
    progress = progress or ConvertProgress()
    tier = conversion_tier(engine)
    name = table_id(model, table)
    started = time.monotonic()
    with engine.writing(model, table) as t:
        check_conversion(engine, model, table, storage)
        fmt = row_format(storage, t.dim, t.format.stamped)  # a TTL table's copy keeps its rows' write times
        conv = Conversion(engine.names.new_id(name, t.id), fmt, t.format)
        tier.set_metadata(converting_key(name), conv.id.encode())  # first: a stop after it drops the copy
        tier.create_table(conv.id, fmt.words)
        record_storage(tier, conv.id, storage)
        t.converting = conv
        total = tier.count(t.id) + int(tier.stats(t.id).extra.get("tombstones", 0))
    log.info("converting %s from %s to %s into %s (%d entries)", name, t.storage, storage, conv.id, total)
    try:
        copied = _copy(engine, tier, t, conv, total, progress)
        _switch(engine, tier, t, conv)
    except BaseException:
        _abandon(tier, t, conv)
        raise
    switched = time.monotonic()
    time.sleep(DROP_GRACE_S)
    _drop_old(engine, tier, t)
    log.info("%s is stored as %s in %s (%d entries copied in %.1f s)", name, storage, conv.id, copied,
             switched - started)
    return {"from": t.storage, "to": storage, "stored_as": conv.id, "entries_copied": copied,
            "rows_stored": tier.count(conv.id), "copy_s": round(switched - started, 3)}


def _served(t: ServedTable, current: ServedTable, conv: Conversion) -> None:
    """FailedPreconditionError when the conversion cannot go on: the table was replaced, or a write stopped it."""
    if current is not t:
        raise FailedPreconditionError(f"table {t.model}.{t.name} was registered again during its conversion")
    if conv.error is not None:
        raise FailedPreconditionError(conv.error)


def _copy(engine: LookupEngine, tier: Tier, t: ServedTable, conv: Conversion, total: int,
          progress: ConvertProgress) -> int:
    """Copy every stored entry of ``t`` into the copy, a stretch at a time under the table's write lock."""
    after: int | None = None
    copied = 0
    while True:
        with engine.writing(t.model, t.name) as current:
            _served(t, current, conv)
            entries = tier.scan(t.id, after, STRETCH_ENTRIES)
            n = int(entries.keys.shape[0])
            if n:
                tier.write([entries.write(conv.id, conv.reencode(entries.vectors[entries.live]))])
        copied += n
        progress.report(max(total, copied), copied)
        if n < STRETCH_ENTRIES:
            return copied
        after = int(entries.keys[-1])


def _switch(engine: LookupEngine, tier: Tier, t: ServedTable, conv: Conversion) -> None:
    """Record the copy as where the table is stored, then serve it (the model is registered again)."""
    name = table_id(t.model, t.name)
    with engine.writing(t.model, t.name) as current:
        _served(t, current, conv)
        engine.names.moved(name, conv.id)
        tier.set_metadata(converting_key(name), None)
        if engine.volatile is not None:  # writes reach the copy alone from here: the old table is complete no more
            engine.volatile.lose_complete(t.id)
    served = engine.model(t.model)
    engine.register_model(served.model_copy(update={"tables": [
        tc.model_copy(update={"storage": conv.format.storage}) if tc.name == t.name else tc for tc in served.tables]}))


def _abandon(tier: Tier, t: ServedTable, conv: Conversion) -> None:
    """Detach and drop a copy the conversion will not switch to (the table stays as it was)."""
    name = table_id(t.model, t.name)
    t.converting = None
    if stored_id(tier, t.model, t.name) == conv.id:
        return  # the switch was recorded: the copy is the table now
    try:
        try:
            tier.drop_table(conv.id)
        except NotFoundError:
            pass
        tier.set_metadata(storage_key(conv.id), None)
        tier.set_metadata(converting_key(name), None)
    except Exception:  # the store is closing: the next start drops the copy (its record says which)
        log.warning("the copy %s of %s is left for the next start to drop", conv.id, name, exc_info=True)
    log.warning("the conversion of %s stopped; it is served as it was", name)


def _drop_old(engine: LookupEngine, tier: Tier, old: ServedTable) -> None:
    """Free the rows the table was stored as before the switch: its RocksDB column family and hash-map table."""
    old.converting = None
    tier.drop_table(old.id)
    tier.set_metadata(storage_key(old.id), None)
    volatile = engine.volatile
    if volatile is not None and volatile.in_process:  # a shared Redis may still serve replicas not converted yet
        try:
            volatile.drop_table(old.id)
        except NotFoundError:
            pass

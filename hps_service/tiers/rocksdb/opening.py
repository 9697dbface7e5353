"""How the RocksDB tier opens its store: every column family, as a writer, a read-only instance or a secondary; a
read-only or secondary instance lists the primary's column families first, and lists them afresh when the primary
drops one before the open (a version dropped, a conversion's old rows)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rocksdict import AccessType, Options, Rdict

from hps_service.errors import UnavailableError
from hps_service.tiers.rocksdb.layout import META_CF, POSITIONS_CF

#: Opens of a read-only or secondary instance tried while the primary drops a column family it listed.
_OPEN_TRIES = 5


def open_store(path: Path, options: Callable[[bool], Options], read_only: bool,
               secondary_path: Path | None) -> tuple[Rdict, list[str]]:
    """The store at ``path`` opened with every column family, and their names; ``options(pin)`` gives the options
    of the DB (``pin``) and of each column family. ``secondary_path``: open a secondary instance, its files there."""
    tries = 1
    while True:
        column_families, access = _families(path, options, read_only, secondary_path)
        try:
            db = Rdict(str(path), options(True), column_families=column_families, access_type=access)
        except Exception as exc:  # rocksdict raises bare Exception for I/O and lock errors
            if read_only and "Column family not found" in str(exc) and tries < _OPEN_TRIES:
                tries += 1
                continue
            raise UnavailableError(f"cannot open RocksDB at {path}: {exc}") from exc
        return db, list(column_families)


def _families(path: Path, options: Callable[[bool], Options], read_only: bool,
              secondary_path: Path | None) -> tuple[dict[str, Options], AccessType]:
    """The column families to open, with their options, and the access type."""
    existing = set(Rdict.list_cf(str(path), options(False))) if (path / "CURRENT").exists() else set()
    column_families = {name: options(False) for name in existing | {META_CF, POSITIONS_CF}}
    if secondary_path is not None:
        column_families = {name: opts for name, opts in column_families.items() if name in existing}
        Path(secondary_path).mkdir(parents=True, exist_ok=True)
        return column_families, AccessType.secondary(str(secondary_path))
    if read_only:
        return {name: opts for name, opts in column_families.items() if name in existing}, \
            AccessType.read_only(False)
    return column_families, AccessType.read_write()

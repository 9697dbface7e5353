"""L3 persistent tier: every row of every table in RocksDB (rocksdict, raw mode), one column family per table.

Keys are 8-byte big-endian (so byte order is unsigned key order), values ``codec`` rows
(``<version i8><dim f4>``) or tombstones (``<version i8>``, left by a versioned delete). A metadata column
family keeps each table's dim and its exact counts of rows and tombstones, so a reopened store knows its
tables without the config.

Tombstones stay until a newer put replaces them or :meth:`RocksDBTier.purge_tombstones` sweeps those below
a version (16 bytes of key and value each before RocksDB's own per-entry overhead and compression). Batches go through one multi-get / one WriteBatch each;
per-row calls into rocksdict are driven by ``map`` (C-level iteration), never by a Python loop of ours.
"""

from __future__ import annotations

import gc
import logging
import shutil
import threading
from collections.abc import Callable, Collection, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from rocksdict import Cache, DbClosedError, Options, Rdict, WriteBatch, WriteOptions

from hps_service.errors import InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.keys import as_keys
from hps_service.tiers.base import (
    Positions,
    Rows,
    StoredEntries,
    TableWrite,
    Tier,
    TierCapability,
    TierStats,
    WriteResult,
)
from hps_service.tiers.codec import decode_rows, encode_keys
from hps_service.tiers.rocksdb.files import IMPORT_CHUNK_ROWS, FileOperations
from hps_service.tiers.rocksdb.flush import FileEvents, Flusher
from hps_service.tiers.rocksdb.layout import (
    APP_PREFIX,
    META_CF,
    POSITIONS_CF,
    RESERVED_CFS,
    drain,
    int_value,
    meta_key,
    parse_position_key,
    position_key,
)
from hps_service.tiers.rocksdb.opening import open_store
from hps_service.tiers.rocksdb.options import tuned_options
from hps_service.tiers.rocksdb.recovery import Recovery, gated
from hps_service.tiers.rocksdb.scan import live_keys, scan_entries
from hps_service.tiers.rocksdb.staging import WriteHook, WriteStaging

log = logging.getLogger(__name__)

_MiB = 1 << 20

__all__ = ["IMPORT_CHUNK_ROWS", "META_CF", "POSITIONS_CF", "RESERVED_CFS", "RocksDBTier", "WriteHook"]


class RocksDBTier(Tier):
    """RocksDB-backed tier: durable, versioned, tuned for batched point lookups. It owns the open store and builds
    its parts over it: the write batches (:class:`WriteStaging`), the whole-file operations (:class:`FileOperations`)
    and the reopen after a failed write (:class:`Recovery`)."""

    kind = "persistent"
    #: A read-only or secondary instance lacks WRITES (see :meth:`__init__`).
    capabilities = (TierCapability.WRITES | TierCapability.CHECKPOINT | TierCapability.EXPORT
                    | TierCapability.BULK_IMPORT | TierCapability.SCAN)

    def __init__(
        self,
        path: Path,
        read_only: bool = False,
        block_cache_mb: int = 256,
        sync_writes: bool = True,
        row_cache_mb: int = 0,
        secondary_path: Path | None = None,
        on_write: WriteHook | None = None,
        max_total_wal_mb: int = 256,
        write_buffer_mb: float = 64.0,
        file_events: FileEvents | None = None,
    ) -> None:
        """Open (or create) the store at ``path``; every existing table reopens with the tuned options.

        ``secondary_path``: open as a RocksDB secondary instance (read-only, another process's view of a primary
        the owner writes; its own files go there) that sees the primary's writes after :meth:`catch_up`.
        ``on_write(table, keys)`` is called after every write batch reached the store, with the keys it wrote
        (None: too many to list, e.g. an import): how a secondary's reader knows which keys it may hold stale.
        ``max_total_wal_mb``, ``write_buffer_mb``: the write-ahead logs' bound and a table's memtable size
        (``persistent.*``), which this tier's flush policy keeps (:mod:`hps_service.tiers.rocksdb.flush`);
        ``file_events`` is told around the flushes a secondary's catch-up cannot follow.
        """
        if block_cache_mb < 0 or row_cache_mb < 0:
            raise InvalidArgumentError("block_cache_mb and row_cache_mb must be >= 0")
        self.path = Path(path)
        self.secondary = secondary_path is not None
        self._secondary_path = secondary_path
        read_only = read_only or self.secondary
        self.read_only = read_only
        if read_only:
            self.capabilities = type(self).capabilities & ~TierCapability.WRITES
        self.sync_writes = sync_writes
        self._lock = threading.RLock()  # writes; a reopen after a write error (from a write) takes it too
        self._staging = WriteStaging(self, self._lock, on_write)
        self._files = FileOperations(self, self._staging)
        self._write_buffer_bytes = int(write_buffer_mb * _MiB)
        self._max_total_wal_bytes = int(max_total_wal_mb * _MiB)
        self._flusher = None if read_only else Flusher(
            self.path, self._write_buffer_bytes, self._max_total_wal_bytes, file_events)
        self._recovery = Recovery(self, self.path, self._lock, self._flusher)
        self._block_cache = Cache(block_cache_mb * _MiB) if block_cache_mb else None
        self._row_cache = Cache(row_cache_mb * _MiB) if row_cache_mb else None
        # Batches are written unsynced, then the WAL is synced with flush_wal, which rocksdict runs with the GIL
        # released; a write with sync=True would hold the GIL through the fsync and stall every lookup thread.
        self._write_opts = WriteOptions()
        self._write_opts.sync = False
        if read_only and not (self.path / "CURRENT").exists():
            raise UnavailableError(f"no RocksDB store at {self.path} to open read-only")
        self.path.mkdir(parents=True, exist_ok=True)
        self._closed = False
        self._open()
        if not read_only:  # SST files of an import that a crash interrupted (never ingested)
            drain(map(partial(shutil.rmtree, ignore_errors=True), self.path.glob("import-*")))

    def _open(self) -> None:
        """Open the store's every column family and attach its tables (at start, and again after a write error)."""
        self._db, names = open_store(self.path, self._options, self.read_only, self._secondary_path)
        self._attach_all(names)

    def _attach_all(self, names: list[str]) -> None:
        """Take the column families ``names`` of the open store in use: metadata, positions, tables."""
        self._meta = self._db.get_column_family(META_CF) if META_CF in names else None
        self._positions = self._db.get_column_family(POSITIONS_CF) if POSITIONS_CF in names else None
        self._dims: dict[str, int] = {}
        self._cfs: dict[str, Rdict] = {}
        self._handles: dict[str, object] = {}
        for name in names:
            if name in RESERVED_CFS:
                continue
            dim = self._meta_int("dim", name)
            if dim is not None:
                self._attach(name, dim)
        if self._flusher is not None:
            assert self._meta is not None and self._positions is not None
            self._flusher.attach(self._db, self._write_opts, self.sync_writes,
                                 {**self._cfs, META_CF: self._meta, POSITIONS_CF: self._positions})

    # ---- options and metadata -------------------------------------------------------------------------

    def _options(self, pin: bool = False) -> Options:
        """This store's options for the DB and each column family (see :func:`tuned_options`)."""
        return tuned_options(self._block_cache, self._row_cache, self._write_buffer_bytes,
                             self._max_total_wal_bytes, pin)

    def _write(self, batch: WriteBatch, families: Sequence[str] = (META_CF,)) -> None:
        """Apply ``batch`` (writing to ``families``) atomically; with ``sync_writes`` it is on disk (WAL fsynced) when
        this returns; then the flush policy switches what it filled. Caller holds the lock. A failure leaves the
        store refusing writes until :meth:`Recovery.heal` reopens it."""
        assert self._flusher is not None
        self._flusher.pin(batch)
        size = batch.size_in_bytes()
        try:
            self._db.write(batch, self._write_opts)
            if self.sync_writes:
                self._db.flush_wal(True)
            self._flusher.written(size, families)  # a switch and its marker (a write too)
        except Exception as exc:  # rocksdict raises bare Exception for I/O errors (ENOSPC)
            raise self._recovery.failure.failed(exc) from None  # (its message has it; its traceback holds the batch)

    def _meta_int(self, kind: str, table: str) -> int | None:
        if self._meta is None:
            return None
        raw = self._meta.get(meta_key(kind, table))
        return None if raw is None else int.from_bytes(raw, "little", signed=True)

    def _attach(self, table: str, dim: int) -> None:
        self._cfs[table] = self._db.get_column_family(table)
        self._handles[table] = self._db.get_column_family_handle(table)
        self._dims[table] = dim

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError(f"RocksDB tier at {self.path} is closed")
        if self._recovery.down:
            raise UnavailableError(f"RocksDB at {self.path} is closed after its write error "
                                   f"({self._recovery.failure.error}) until it reopens")

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise UnavailableError(f"cannot {what}: RocksDB at {self.path} is opened read-only")
        if self._recovery.failure.error is not None and not self._closed:
            self._recovery.heal()
        self._check_open()

    def _table(self, table: str) -> tuple[Rdict, int]:
        self._check_open()
        try:
            return self._cfs[table], self._dims[table]
        except KeyError:
            raise NotFoundError(f"table {table} does not exist in the persistent tier") from None

    # ---- Tier interface -------------------------------------------------------------------------------

    def tables(self) -> dict[str, int]:
        """Every table this store holds, with its dim."""
        return dict(self._dims)

    def create_table(self, table: str, dim: int) -> None:
        """Create the column family of ``table`` (idempotent); an existing table must have the same dim."""
        self._check_open()
        if not table or table in RESERVED_CFS:
            raise InvalidArgumentError(f"invalid table name {table!r}")
        if not 1 <= int(dim) <= 16384:
            raise InvalidArgumentError(f"dim must be in [1, 16384], got {dim}")
        with self._lock:
            stored = self._dims.get(table)
            if stored is not None:
                if stored != dim:
                    raise InvalidArgumentError(f"table {table} has dim {stored} in the store, not {dim}")
                return
            self._check_writable(f"create table {table}")
            self._db.create_column_family(table, self._options())
            batch = WriteBatch(raw_mode=True)
            meta = self._db.get_column_family_handle(META_CF)
            batch.put(meta_key("dim", table), int_value(dim), meta)
            batch.put(meta_key("count", table), int_value(0), meta)
            self._write(batch)
            self._attach(table, int(dim))
            if self._flusher is not None:
                self._flusher.add_family(table, self._cfs[table])

    @gated
    def get(self, table: str, keys: np.ndarray) -> Rows:
        """One multi-get for the whole batch; missing keys come back with ``found == False``."""
        cf, dim = self._table(table)
        keys = as_keys(keys)
        if keys.size == 0:
            return Rows.empty(0, dim)
        return decode_rows(cf.get(encode_keys(keys)), dim)

    @gated
    def accepts(self, table: str, keys: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """Where a put would be written, this store's tombstones included."""
        return self._staging.accepts_puts(table, keys, versions)

    def catch_up(self) -> None:
        """A secondary instance: apply what the primary wrote since the last catch-up (about 1-2 ms even when
        nothing changed, so readers call it when they know of writes they need, not per read)."""
        self._check_open()
        if not self.secondary:
            raise InvalidArgumentError(f"RocksDB at {self.path} is not opened as a secondary instance")
        with self._lock:
            self._db.try_catch_up_with_primary()

    def put(self, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """Write rows whose version is >= the stored row's (> a tombstone's), in one synced batch; return the mask."""
        self._check_writable(f"write to {table}")
        self._table(table)
        with self._lock:
            batch, deltas = WriteBatch(raw_mode=True), dict[tuple[str, str], int]()
            written = self._staging.stage_put(batch, table, keys, vectors, versions, deltas)
            self._staging.commit(batch, deltas)
        return written

    def delete(self, table: str, keys: np.ndarray, versions: np.ndarray | None = None) -> int:
        """Remove ``keys`` in one WriteBatch; returns how many live rows were removed.

        With ``versions``: rows not newer than the delete become tombstones at its version (an absent key gets
        one, an older tombstone is raised). Without: rows and tombstones alike are removed.
        """
        self._check_writable(f"delete from {table}")
        self._table(table)
        with self._lock:
            batch, deltas = WriteBatch(raw_mode=True), dict[tuple[str, str], int]()
            removed = self._staging.stage_delete(batch, table, keys, versions, deltas)
            self._staging.commit(batch, deltas)
        return removed

    def purge_tombstones(self, table: str, below_version: int) -> int:
        """Remove the tombstones of ``table`` whose version is below ``below_version``; returns how many.

        A tombstone only matters while a put older than it can still arrive (a replay of the update log), so
        ``below_version`` is the oldest version any producer or log can still deliver. Scans the whole table
        without blocking writers.
        """
        self._check_writable(f"purge tombstones of {table}")
        return self._staging.purge_tombstones(table, below_version)

    # ---- grouped writes with positions, metadata ------------------------------------------------------

    stores_positions = True

    def write(self, writes: Sequence[TableWrite], positions: Positions | None = None) -> list[WriteResult]:
        """Every table's puts and deletes and ``positions`` in one synced WriteBatch: after a crash the stored
        positions never run ahead of the stored rows (nor behind them)."""
        self._check_writable("write")
        for w in writes:
            self._table(w.table)
        with self._lock:
            batch, deltas = WriteBatch(raw_mode=True), dict[tuple[str, str], int]()
            results = []
            for w in writes:
                written = (self._staging.stage_put(batch, w.table, w.keys, w.vectors, w.versions, deltas)
                           if w.keys.shape[0] else np.zeros(0, dtype=bool))
                removed = (self._staging.stage_delete(batch, w.table, w.delete_keys, w.delete_versions, deltas)
                           if w.delete_keys.shape[0] else 0)
                results.append(WriteResult(written=written, removed=removed))
            if positions:
                handle = self._db.get_column_family_handle(POSITIONS_CF)
                for (source, partition), offset in positions.items():
                    batch.put(position_key(source, partition), int_value(offset), handle)
            self._staging.commit(batch, deltas)
        return results

    @gated
    def positions(self) -> dict[tuple[str, int], int]:
        """The positions stored with the rows: ``(source, partition) -> next offset``."""
        self._check_open()
        if self._positions is None:
            return {}
        return {parse_position_key(k): int.from_bytes(v, "little", signed=True) for k, v in self._positions.items()}

    @gated
    def metadata(self, prefix: str = "") -> dict[str, bytes]:
        """Entries stored with :meth:`set_metadata` whose key starts with ``prefix``."""
        self._check_open()
        if self._meta is None:
            return {}
        start = (APP_PREFIX + prefix).encode()
        out = {}
        for key, value in self._meta.items(from_key=start):
            if not key.startswith(start):
                break
            out[key[len(APP_PREFIX):].decode()] = value
        return out

    def set_metadata(self, key: str, value: bytes | None) -> bool:
        """Store ``value`` under ``key`` in the metadata column family (synced), or remove it with None."""
        self._check_writable(f"store metadata {key}")
        assert self._meta is not None
        with self._lock:
            batch = WriteBatch(raw_mode=True)
            handle = self._db.get_column_family_handle(META_CF)
            if value is None:
                batch.delete((APP_PREFIX + key).encode(), handle)
            else:
                batch.put((APP_PREFIX + key).encode(), bytes(value), handle)
            self._write(batch)
        return True

    @gated
    def tombstones(self, table: str) -> int:
        """Tombstones held for ``table`` (exact, from the metadata CF)."""
        self._table(table)
        return self._meta_int("tombstones", table) or 0

    @gated
    def count(self, table: str) -> int:
        """Exact count of live rows (tombstones excluded) kept in the metadata CF.

        put/delete write it in the same batch as the rows; bulk_import writes it right after the ingest
        (a crash between the two leaves it low by the import's new rows).
        """
        self._table(table)
        return self._meta_int("count", table) or 0

    @gated
    def stats(self, table: str) -> TierStats:
        """Rows plus RocksDB's own size figures for the table."""
        cf, _ = self._table(table)
        extra: dict[str, float] = {
            "estimate_num_keys": int(cf.property_int_value("rocksdb.estimate-num-keys") or 0),
            "sst_bytes": int(cf.property_int_value("rocksdb.total-sst-files-size") or 0),
            "memtable_bytes": int(cf.property_int_value("rocksdb.cur-size-all-mem-tables") or 0),
            "tombstones": int(self.tombstones(table)),
        }
        if self._block_cache is not None:
            extra["block_cache_bytes"] = int(self._block_cache.get_usage())
        if self._row_cache is not None:
            extra["row_cache_bytes"] = int(self._row_cache.get_usage())
        return TierStats(rows=self.count(table), capacity=None, extra=extra)

    @gated
    def memory_bytes(self) -> dict[str, int]:
        """What this instance holds in memory: its memtables (every column family) and its block cache's usage."""
        self._check_open()
        cache = int(self._block_cache.get_usage()) if self._block_cache is not None else 0
        return {"memtables": self._memtable_bytes(), "block_cache": cache}

    def _memtable_bytes(self) -> int:
        families = [*self._cfs.values(), *(cf for cf in (self._meta, self._positions) if cf is not None)]
        return sum(int(cf.property_int_value("rocksdb.cur-size-all-mem-tables") or 0) for cf in families)

    @gated
    def scan_keys(self, table: str, limit: int) -> np.ndarray:
        """The first ``limit`` keys of live rows in store order (unsigned key order; tombstones skipped)."""
        cf, _ = self._table(table)
        if limit <= 0:
            return np.zeros(0, dtype=np.int64)
        return live_keys(cf, limit, bool(self.tombstones(table)))

    # ---- whole files: checkpoint, export, adopt, bulk import (rocksdb/files.py) -----------------------

    def checkpoint(self, dest: Path) -> None:
        """A consistent, hard-linked snapshot of the whole store at ``dest`` (which must not exist)."""
        self._files.checkpoint(dest)

    def export(
        self, dest: Path, tables: Sequence[str], sources: Collection[str], metadata_keys: Collection[str] = ()
    ) -> dict[str, Any]:
        """A checkpoint at ``dest`` that holds only ``tables``, the positions of ``sources`` and the metadata entries
        ``metadata_keys``: ``{"tables": {table: {"dim", "rows", "tombstones"}}, "positions": {...}}``."""
        return self._files.export(dest, tables, sources, metadata_keys)

    def adopt(self, src: Path) -> list[str]:
        """Copy every table, metadata entry and position of the store at ``src`` (none of its tables here yet) into
        this one, rows as stored; returns the tables."""
        return self._files.adopt(src)

    def bulk_import(self, table: str, keys: np.ndarray, vectors: np.ndarray, version: int = 0,
                    progress: Callable[[int], None] | None = None) -> int:
        """Write rows as sorted SST files ingested at once (all or nothing, never over a newer stored row or a
        tombstone at or above ``version``); returns rows written. ``progress(rows_done)`` after each file."""
        return self._files.bulk_import(table, keys, vectors, version, progress)

    def scan(self, table: str, after: int | None, limit: int) -> StoredEntries:
        """Up to ``limit`` entries, rows and tombstones, that follow key ``after`` in unsigned key order."""
        cf, dim = self._table(table)
        return scan_entries(cf, dim, after, limit)

    def drop_table(self, table: str) -> None:
        """Drop the table's column family and its metadata."""
        self._check_writable(f"drop table {table}")
        self._table(table)
        with self._lock:
            self._cfs.pop(table)
            self._handles.pop(table)
            self._dims.pop(table)
            if self._flusher is not None:
                self._flusher.drop_family(table)
            self._db.drop_column_family(table)
            batch = WriteBatch(raw_mode=True)
            meta = self._db.get_column_family_handle(META_CF)
            batch.delete(meta_key("dim", table), meta)
            batch.delete(meta_key("count", table), meta)
            batch.delete(meta_key("tombstones", table), meta)
            self._write(batch)

    @gated
    def healthy(self) -> bool:
        """Open, writing (no write error outstanding), and answering a property read."""
        if self._closed or self._recovery.down or self._recovery.failure.error is not None:
            return False
        try:
            return self._db.property_value("rocksdb.num-running-compactions") is not None
        except Exception:  # noqa: BLE001  rocksdict raises bare Exception on a closed or broken DB
            return False

    def close(self) -> None:
        """Flush nothing extra (writes are in the WAL) and release the files and the lock."""
        if self._closed:
            return
        if self._flusher is not None:
            self._flusher.close()
        with self._lock:
            self._closed = True
            if not self._recovery.down:
                self._close_db()

    def _close_db(self) -> bool:
        """Release the open store (every column family object first: the DB closes only once none is left);
        whether it closed: rocksdict keeps it open when the flush its close makes fails, and then it stays in use."""
        names = [*self._cfs, META_CF, POSITIONS_CF]
        if self._flusher is not None:
            self._flusher.detach()
        self._cfs.clear()
        self._handles.clear()
        self._meta = self._positions = None
        gc.collect()  # a failed write's batch (it holds column family handles) in a traceback's reference cycle
        try:
            self._db.close()
        except Exception as exc:  # noqa: BLE001  (rocksdict raises bare Exception; the write error again)
            try:
                self._db.property_value("rocksdb.num-running-compactions")
            except DbClosedError:
                return True
            log.warning("RocksDB at %s could not be closed: %s; it stays open", self.path, str(exc))
            self._attach_all(names)
            return False
        return True

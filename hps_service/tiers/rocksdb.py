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

import shutil
import threading
import uuid
from collections import deque
from collections.abc import Callable
from functools import partial
from itertools import compress, islice, repeat
from pathlib import Path

import numpy as np
from rocksdict import (
    AccessType,
    BlockBasedOptions,
    Cache,
    Checkpoint,
    DataBlockIndexType,
    IngestExternalFileOptions,
    Options,
    Rdict,
    SstFileWriter,
    WriteBatch,
    WriteOptions,
)

from hps_service.errors import InvalidArgumentError, NotFoundError, UnavailableError
from hps_service.keys import as_keys
from hps_service.tiers.base import Rows, Tier, TierStats, delete_versions, max_version_per_key
from hps_service.tiers.codec import (
    ABSENT,
    LIVE,
    TOMBSTONE,
    TOMBSTONE_BYTES,
    decode_rows,
    decode_states,
    encode_keys,
    encode_rows,
    encode_tombstones,
)

#: Column family holding ``dim:<table>``, ``count:<table>`` and ``tombstones:<table>`` entries (int64 LE values).
META_CF = "__hps_meta__"
#: Rows per SST file written by :meth:`RocksDBTier.bulk_import` (one progress report per file).
IMPORT_CHUNK_ROWS = 262_144
#: Entries read per step by :meth:`RocksDBTier.scan_keys` and :meth:`RocksDBTier.purge_tombstones`.
SCAN_CHUNK = 65_536
_MiB = 1 << 20


def _meta_key(kind: str, table: str) -> bytes:
    return f"{kind}:{table}".encode()


def _int_value(value: int) -> bytes:
    return int(value).to_bytes(8, "little", signed=True)


def _drain(iterator) -> None:
    """Run an iterator of side effects to completion at C speed."""
    deque(iterator, maxlen=0)


class RocksDBTier(Tier):
    """RocksDB-backed tier: durable, versioned, tuned for batched point lookups."""

    kind = "persistent"

    def __init__(
        self,
        path: Path,
        read_only: bool = False,
        block_cache_mb: int = 256,
        sync_writes: bool = True,
        row_cache_mb: int = 0,
    ) -> None:
        """Open (or create) the store at ``path``; every existing table reopens with the tuned options."""
        if block_cache_mb < 0 or row_cache_mb < 0:
            raise InvalidArgumentError("block_cache_mb and row_cache_mb must be >= 0")
        self.path = Path(path)
        self.read_only = read_only
        self.sync_writes = sync_writes
        self._lock = threading.Lock()
        self._block_cache = Cache(block_cache_mb * _MiB) if block_cache_mb else None
        self._row_cache = Cache(row_cache_mb * _MiB) if row_cache_mb else None
        # Batches are written unsynced, then the WAL is synced with flush_wal, which rocksdict runs with the GIL
        # released; a write with sync=True would hold the GIL through the fsync and stall every lookup thread.
        self._write_opts = WriteOptions()
        self._write_opts.sync = False
        if read_only and not (self.path / "CURRENT").exists():
            raise UnavailableError(f"no RocksDB store at {self.path} to open read-only")
        self.path.mkdir(parents=True, exist_ok=True)
        existing = (
            set(Rdict.list_cf(str(self.path), self._options())) if (self.path / "CURRENT").exists() else set()
        )
        column_families = {name: self._options() for name in existing | {META_CF}}
        if read_only:
            column_families = {name: opts for name, opts in column_families.items() if name in existing}
            access = AccessType.read_only(False)
        else:
            access = AccessType.read_write()
        try:
            self._db = Rdict(
                str(self.path), self._options(), column_families=column_families, access_type=access
            )
        except Exception as exc:  # rocksdict raises bare Exception for I/O and lock errors
            raise UnavailableError(f"cannot open RocksDB at {self.path}: {exc}") from exc
        self._closed = False
        if not read_only:  # SST files of an import that a crash interrupted (never ingested)
            _drain(map(partial(shutil.rmtree, ignore_errors=True), self.path.glob("import-*")))
        self._meta = self._db.get_column_family(META_CF) if META_CF in column_families else None
        self._dims: dict[str, int] = {}
        self._cfs: dict[str, Rdict] = {}
        self._handles: dict[str, object] = {}
        for name in column_families:
            if name in (META_CF, "default"):
                continue
            dim = self._meta_int("dim", name)
            if dim is not None:
                self._attach(name, dim)

    # ---- options and metadata -------------------------------------------------------------------------

    def _options(self) -> Options:
        """Options for the DB and each column family (rocksdict forgets table options not passed per CF)."""
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        table = BlockBasedOptions()
        if self._block_cache is not None:
            table.set_block_cache(self._block_cache)
        else:
            table.disable_cache()
        table.set_bloom_filter(10, False)
        table.set_cache_index_and_filter_blocks(True)
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        table.set_data_block_index_type(DataBlockIndexType.binary_and_hash())
        table.set_data_block_hash_ratio(0.75)
        opts.set_block_based_table_factory(table)
        if self._row_cache is not None:
            opts.set_row_cache(self._row_cache)
        opts.set_level_compaction_dynamic_level_bytes(True)
        return opts

    def _write(self, batch: WriteBatch) -> None:
        """Apply ``batch`` atomically; with ``sync_writes`` it is on disk (WAL fsynced) when this returns."""
        self._db.write(batch, self._write_opts)
        if self.sync_writes:
            self._db.flush_wal(True)

    def _meta_int(self, kind: str, table: str) -> int | None:
        if self._meta is None:
            return None
        raw = self._meta.get(_meta_key(kind, table))
        return None if raw is None else int.from_bytes(raw, "little", signed=True)

    def _attach(self, table: str, dim: int) -> None:
        self._cfs[table] = self._db.get_column_family(table)
        self._handles[table] = self._db.get_column_family_handle(table)
        self._dims[table] = dim

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError(f"RocksDB tier at {self.path} is closed")

    def _check_writable(self, what: str) -> None:
        self._check_open()
        if self.read_only:
            raise UnavailableError(f"cannot {what}: RocksDB at {self.path} is opened read-only")

    def _table(self, table: str) -> tuple[Rdict, int]:
        self._check_open()
        try:
            return self._cfs[table], self._dims[table]
        except KeyError:
            raise NotFoundError(f"table {table} does not exist in the persistent tier") from None

    @staticmethod
    def _vectors(vectors: np.ndarray, n: int, dim: int, table: str) -> np.ndarray:
        arr = np.asarray(vectors)
        if arr.ndim != 2 or arr.shape[0] != n or arr.shape[1] != dim:
            raise InvalidArgumentError(f"vectors for {table} must have shape ({n}, {dim}), got {arr.shape}")
        return arr.astype(np.float32, copy=False)

    # ---- Tier interface -------------------------------------------------------------------------------

    def tables(self) -> dict[str, int]:
        """Every table this store holds, with its dim."""
        return dict(self._dims)

    def create_table(self, table: str, dim: int) -> None:
        """Create the column family of ``table`` (idempotent); an existing table must have the same dim."""
        self._check_open()
        if not table or table in (META_CF, "default"):
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
            batch.put(_meta_key("dim", table), _int_value(dim), meta)
            batch.put(_meta_key("count", table), _int_value(0), meta)
            self._write(batch)
            self._attach(table, int(dim))

    def get(self, table: str, keys: np.ndarray) -> Rows:
        """One multi-get for the whole batch; missing keys come back with ``found == False``."""
        cf, dim = self._table(table)
        keys = as_keys(keys)
        if keys.size == 0:
            return Rows.empty(0, dim)
        return decode_rows(cf.get(encode_keys(keys)), dim)

    @staticmethod
    def _stored_states(cf: Rdict, encoded_keys: list[bytes], dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(codec state, stored version) of the encoded keys, read with one multi-get."""
        return decode_states(cf.get(encoded_keys), dim)

    @staticmethod
    def _accepts(states: np.ndarray, stored: np.ndarray, offered: np.ndarray | int) -> np.ndarray:
        """Where a put at ``offered`` may be written: absent, a row not newer, or a tombstone strictly older."""
        return np.where(
            states == LIVE, offered >= stored, np.where(states == TOMBSTONE, offered > stored, True)
        )

    def _add_counts(self, batch: WriteBatch, table: str, rows: int, tombstones: int) -> None:
        """Adjust the row and tombstone counts of ``table`` inside ``batch`` (caller holds the lock)."""
        meta = self._db.get_column_family_handle(META_CF)
        if rows:
            count = max(0, (self._meta_int("count", table) or 0) + rows)
            batch.put(_meta_key("count", table), _int_value(count), meta)
        if tombstones:
            count = max(0, (self._meta_int("tombstones", table) or 0) + tombstones)
            batch.put(_meta_key("tombstones", table), _int_value(count), meta)

    def put(self, table: str, keys: np.ndarray, vectors: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """Write rows whose version is >= the stored row's (> a tombstone's), in one synced batch; return the mask."""
        self._check_writable(f"write to {table}")
        cf, dim = self._table(table)
        keys = as_keys(keys)
        n = keys.size
        vectors = self._vectors(vectors, n, dim, table)
        offered = np.asarray(versions, dtype=np.int64)
        if offered.shape not in ((), (n,)):
            raise InvalidArgumentError(f"versions for {table} must have shape ({n},), got {offered.shape}")
        offered = np.broadcast_to(offered, (n,))
        if n == 0:
            return np.zeros(0, dtype=bool)
        encoded = encode_keys(keys)
        with self._lock:
            states, stored = self._stored_states(cf, encoded, dim)
            written = self._accepts(states, stored, offered)
            idx = np.flatnonzero(written)
            if idx.size:
                batch = WriteBatch(raw_mode=True)
                handle = self._handles[table]
                sel_keys = encoded if idx.size == n else encode_keys(keys[idx])
                values = encode_rows(vectors[idx], offered[idx])
                _drain(map(batch.put, sel_keys, values, repeat(handle)))
                replaced = states[idx]
                self._add_counts(
                    batch,
                    table,
                    rows=int(np.count_nonzero(replaced != LIVE)),
                    tombstones=-int(np.count_nonzero(replaced == TOMBSTONE)),
                )
                self._write(batch)
        return written

    def delete(self, table: str, keys: np.ndarray, versions: np.ndarray | None = None) -> int:
        """Remove ``keys`` in one WriteBatch; returns how many live rows were removed.

        With ``versions``: rows not newer than the delete become tombstones at its version (an absent key gets
        one, an older tombstone is raised). Without: rows and tombstones alike are removed.
        """
        self._check_writable(f"delete from {table}")
        cf, dim = self._table(table)
        keys = as_keys(keys)
        tomb_versions = delete_versions(versions, keys.size)
        if keys.size == 0:
            return 0
        if tomb_versions is None:
            keys = np.unique(keys)
        else:
            keys, tomb_versions = max_version_per_key(keys, tomb_versions)
        encoded = encode_keys(keys)
        with self._lock:
            states, stored = self._stored_states(cf, encoded, dim)
            live = states == LIVE
            batch = WriteBatch(raw_mode=True)
            handle = self._handles[table]
            if tomb_versions is None:
                removed = int(np.count_nonzero(live))
                _drain(map(batch.delete, encoded, repeat(handle)))
                self._add_counts(
                    batch, table, rows=-removed, tombstones=-int(np.count_nonzero(states == TOMBSTONE))
                )
            else:
                removing = live & (stored <= tomb_versions)
                raising = (states == TOMBSTONE) & (stored < tomb_versions)
                new_tombstones = removing | (states == ABSENT)
                removed = int(np.count_nonzero(removing))
                idx = np.flatnonzero(new_tombstones | raising)
                if idx.size == 0:
                    return 0
                sel_keys = encoded if idx.size == keys.size else encode_keys(keys[idx])
                _drain(map(batch.put, sel_keys, encode_tombstones(tomb_versions[idx]), repeat(handle)))
                self._add_counts(
                    batch, table, rows=-removed, tombstones=int(np.count_nonzero(new_tombstones))
                )
            self._write(batch)
        return removed

    def purge_tombstones(self, table: str, below_version: int) -> int:
        """Remove the tombstones of ``table`` whose version is below ``below_version``; returns how many.

        A tombstone only matters while a put older than it can still arrive (a replay of the update log), so
        ``below_version`` is the oldest version any producer or log can still deliver. Scans the whole table
        without blocking writers: each scanned chunk's candidates are checked again under the write lock.
        """
        self._check_writable(f"purge tombstones of {table}")
        cf, dim = self._table(table)
        handle = self._handles[table]
        purged = 0
        items = cf.items()
        while chunk := list(islice(items, SCAN_CHUNK)):
            keys, values = zip(*chunk)
            lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
            candidates = list(compress(keys, (lengths == TOMBSTONE_BYTES).tolist()))
            if not candidates:
                continue
            with self._lock:
                states, stored = self._stored_states(cf, candidates, dim)
                purge = (states == TOMBSTONE) & (stored < below_version)
                n_purge = int(np.count_nonzero(purge))
                if not n_purge:
                    continue
                batch = WriteBatch(raw_mode=True)
                _drain(map(batch.delete, compress(candidates, purge.tolist()), repeat(handle)))
                self._add_counts(batch, table, rows=0, tombstones=-n_purge)
                self._write(batch)
            purged += n_purge
        return purged

    def tombstones(self, table: str) -> int:
        """Tombstones held for ``table`` (exact, from the metadata CF)."""
        self._table(table)
        return self._meta_int("tombstones", table) or 0

    def count(self, table: str) -> int:
        """Exact count of live rows (tombstones excluded) kept in the metadata CF.

        put/delete write it in the same batch as the rows; bulk_import writes it right after the ingest
        (a crash between the two leaves it low by the import's new rows).
        """
        self._table(table)
        return self._meta_int("count", table) or 0

    def stats(self, table: str) -> TierStats:
        """Rows plus RocksDB's own size figures for the table."""
        cf, _ = self._table(table)
        extra = {
            "estimate_num_keys": float(cf.property_int_value("rocksdb.estimate-num-keys") or 0),
            "sst_bytes": float(cf.property_int_value("rocksdb.total-sst-files-size") or 0),
            "memtable_bytes": float(cf.property_int_value("rocksdb.cur-size-all-mem-tables") or 0),
            "tombstones": float(self.tombstones(table)),
        }
        if self._block_cache is not None:
            extra["block_cache_bytes"] = float(self._block_cache.get_usage())
        if self._row_cache is not None:
            extra["row_cache_bytes"] = float(self._row_cache.get_usage())
        return TierStats(rows=self.count(table), capacity=None, extra=extra)

    def scan_keys(self, table: str, limit: int) -> np.ndarray:
        """The first ``limit`` keys of live rows in store order (unsigned key order; tombstones skipped)."""
        cf, _ = self._table(table)
        if limit <= 0:
            return np.zeros(0, dtype=np.int64)
        if not self.tombstones(table):
            raw = b"".join(islice(cf.keys(), limit))
            return np.frombuffer(raw, dtype=">i8").astype(np.int64)
        found: list[np.ndarray] = []
        need = limit
        items = cf.items()
        while need > 0 and (chunk := list(islice(items, max(need, 1024)))):
            keys, values = zip(*chunk)
            live = np.fromiter(map(len, values), dtype=np.int64, count=len(values)) != TOMBSTONE_BYTES
            got = np.frombuffer(b"".join(keys), dtype=">i8")[live][:need].astype(np.int64)
            found.append(got)
            need -= got.size
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    def drop_table(self, table: str) -> None:
        """Drop the table's column family and its metadata."""
        self._check_writable(f"drop table {table}")
        self._table(table)
        with self._lock:
            self._cfs.pop(table)
            self._handles.pop(table)
            self._dims.pop(table)
            self._db.drop_column_family(table)
            batch = WriteBatch(raw_mode=True)
            meta = self._db.get_column_family_handle(META_CF)
            batch.delete(_meta_key("dim", table), meta)
            batch.delete(_meta_key("count", table), meta)
            batch.delete(_meta_key("tombstones", table), meta)
            self._write(batch)

    def healthy(self) -> bool:
        """Open and answering a property read."""
        if self._closed:
            return False
        try:
            return self._db.property_value("rocksdb.num-running-compactions") is not None
        except Exception:  # noqa: BLE001  rocksdict raises bare Exception on a closed or broken DB
            return False

    def checkpoint(self, dest: Path) -> None:
        """A consistent, hard-linked snapshot of the whole store at ``dest`` (which must not exist)."""
        self._check_open()
        dest = Path(dest)
        if dest.exists():
            raise InvalidArgumentError(f"checkpoint destination {dest} already exists")
        dest.parent.mkdir(parents=True, exist_ok=True)
        Checkpoint(self._db).create_checkpoint(str(dest))

    def close(self) -> None:
        """Flush nothing extra (writes are in the WAL) and release the files and the lock."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._cfs.clear()
            self._handles.clear()
            self._meta = None
            self._db.close()

    # ---- bulk import ----------------------------------------------------------------------------------

    def bulk_import(
        self,
        table: str,
        keys: np.ndarray,
        vectors: np.ndarray,
        version: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Write rows as sorted SST files and ingest them atomically; returns how many rows this import wrote.

        Atomic: rows are checked (finite) while the SST files are written, and all files are ingested in one
        call at the end, so a failure leaves the table as it was. Duplicate keys: the last occurrence wins.
        Rows already stored with a newer version are kept, so an import never takes a row backwards, and a
        tombstone at or above ``version`` keeps its key deleted.
        ``progress(rows_done)`` is called after each SST file.
        """
        self._check_writable(f"import into {table}")
        cf, dim = self._table(table)
        keys = as_keys(keys)
        vectors = self._vectors(vectors, keys.size, dim, table)
        if keys.size == 0:
            return 0
        order = np.argsort(keys.view(np.uint64), kind="stable")
        sorted_keys = keys.view(np.uint64)[order]
        last = np.ones(order.size, dtype=bool)
        last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
        order = order[last]
        tmp = self.path / f"import-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            with self._lock:
                count_before = self._meta_int("count", table) or 0
                tombstones_before = self._meta_int("tombstones", table) or 0
                files, written, new_rows, replaced_tombstones = [], 0, 0, 0
                for start in range(0, order.size, IMPORT_CHUNK_ROWS):
                    chunk = order[start : start + IMPORT_CHUNK_ROWS]
                    chunk_vectors = vectors[chunk]
                    bad = np.flatnonzero(~np.isfinite(chunk_vectors).all(axis=1))
                    if bad.size:
                        raise InvalidArgumentError(
                            f"row {int(chunk[bad[0]])} has NaN or inf values; nothing imported"
                        )
                    encoded = encode_keys(keys[chunk])
                    if count_before or tombstones_before:
                        states, stored = self._stored_states(cf, encoded, dim)
                        keep = self._accepts(states, stored, version)
                        new_rows += int(np.count_nonzero(keep & (states != LIVE)))
                        replaced_tombstones += int(np.count_nonzero(keep & (states == TOMBSTONE)))
                        if not keep.all():
                            chunk, chunk_vectors = chunk[keep], chunk_vectors[keep]
                            encoded = encode_keys(keys[chunk])
                    else:
                        new_rows += chunk.size
                    if chunk.size:
                        values = encode_rows(chunk_vectors, np.full(chunk.size, version, dtype=np.int64))
                        sst = tmp / f"{len(files):06d}.sst"
                        writer = SstFileWriter(self._options())
                        writer.open(str(sst))
                        _drain(map(writer.__setitem__, encoded, values))
                        writer.finish()
                        files.append(str(sst))
                        written += chunk.size
                    if progress is not None:
                        progress(min(start + IMPORT_CHUNK_ROWS, order.size))
                if files:
                    ingest = IngestExternalFileOptions()
                    ingest.set_move_files(True)
                    cf.ingest_external_file(files, ingest)
                if new_rows or replaced_tombstones:
                    batch = WriteBatch(raw_mode=True)
                    self._add_counts(batch, table, rows=new_rows, tombstones=-replaced_tombstones)
                    self._write(batch)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return written

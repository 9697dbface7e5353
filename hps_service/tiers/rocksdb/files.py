"""The RocksDB tier's operations on whole files of a live store: checkpoints, exports of some of its tables, adopting
another store's tables, and bulk imports as ingested SST files (:class:`FileOperations`, which the tier builds)."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Collection, Sequence
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rocksdict import AccessType, Checkpoint, IngestExternalFileOptions, Rdict, SstFileWriter, WriteBatch

from hps_service.errors import InvalidArgumentError
from hps_service.keys import as_keys
from hps_service.tiers.codec import LIVE, TOMBSTONE, encode_keys, encode_rows
from hps_service.tiers.rocksdb.layout import (
    APP_PREFIX,
    META_CF,
    POSITIONS_CF,
    RESERVED_CFS,
    drain,
    meta_key,
    parse_position_key,
)
from hps_service.tiers.rocksdb.staging import WriteStaging, accepts, checked_vectors, stored_states

if TYPE_CHECKING:
    from hps_service.tiers.rocksdb.tier import RocksDBTier

#: Rows per SST file written by :meth:`FileOperations.bulk_import` (one progress report per file).
IMPORT_CHUNK_ROWS = 262_144


class FileOperations:
    """Checkpoint, export, adopt and bulk import of a :class:`RocksDBTier`'s store: under its write lock, around its
    flush policy, their counts staged by its :class:`WriteStaging`."""

    def __init__(self, tier: RocksDBTier, staging: WriteStaging) -> None:
        self._tier = tier
        self._staging = staging

    def checkpoint(self, dest: Path) -> None:
        """A consistent, hard-linked snapshot of the whole store at ``dest`` (which must not exist)."""
        self._tier._check_open()
        dest = Path(dest)
        if dest.exists():
            raise InvalidArgumentError(f"checkpoint destination {dest} already exists")
        dest.parent.mkdir(parents=True, exist_ok=True)
        flusher = self._tier._flusher
        if flusher is None:  # a read-only instance: no flush, no secondary to tell
            Checkpoint(self._tier._db).create_checkpoint(str(dest))
            return
        with self._tier._lock:  # flushed beforehand, so that the checkpoint's own flush (all announced) is short
            flusher.switch(flusher.filled())
        flusher.wait_flushed()
        with flusher.announced(), self._tier._lock:
            Checkpoint(self._tier._db).create_checkpoint(str(dest))
            flusher.mark(flusher.families())

    def ingest(self, table: str, files: list[str]) -> None:
        """Ingest sorted SST files into ``table`` (moved, not copied); the flush RocksDB makes of an overlapping
        memtable is announced and marked as the flush policy's own are, and the secondaries open afresh after it:
        one that only caught up kept answering rows replayed from before the ingest for seconds (make history:
        2705 stale reads after three imports), while a fresh open replays only the logs past the ingest's flush."""
        assert self._tier._flusher is not None
        ingest = IngestExternalFileOptions()
        ingest.set_move_files(True)
        with self._tier._lock, self._tier._flusher.announced(reopened=True, drops_logs=False):
            self._tier._cfs[table].ingest_external_file(files, ingest)
            self._tier._flusher.mark([table])
        self._staging.wrote(table, None)

    def export(
        self, dest: Path, tables: Sequence[str], sources: Collection[str], metadata_keys: Collection[str] = ()
    ) -> dict[str, Any]:
        """A checkpoint at ``dest`` that holds only ``tables``, the positions of ``sources`` and the metadata entries
        ``metadata_keys``: a consistent copy of those rows with the positions they were applied up to.

        Returns ``{"tables": {table: {"dim", "rows", "tombstones"}}, "positions": {(source, partition): offset}}``.
        """
        self.checkpoint(dest)
        keep = set(tables)
        opts = self._tier._options()
        names = Rdict.list_cf(str(dest), opts)
        db = Rdict(str(dest), opts, column_families={n: self._tier._options() for n in names},
                   access_type=AccessType.read_write())
        try:
            for name in names:
                if name not in RESERVED_CFS and name not in keep:
                    db.drop_column_family(name)
            meta = db.get_column_family(META_CF)
            wanted_app = {(APP_PREFIX + k).encode() for k in metadata_keys}
            stale = []
            meta_keys = list(meta.keys())
            for key in meta_keys:
                kind, _, name = key.decode().partition(":")
                if (kind == APP_PREFIX[:-1] and key not in wanted_app) or (
                        kind in ("dim", "count", "tombstones") and name not in keep):
                    stale.append(key)
            drain(map(meta.delete, stale))
            positions = db.get_column_family(POSITIONS_CF) if POSITIONS_CF in names else None
            kept_positions: dict[tuple[str, int], int] = {}
            if positions is not None:
                for key, value in list(positions.items()):
                    source, partition = parse_position_key(key)
                    if source in sources:
                        kept_positions[(source, partition)] = int.from_bytes(value, "little", signed=True)
                    else:
                        positions.delete(key)
            described = {}
            for name in sorted(keep & set(names)):
                def meta_int(kind: str, table: str = name) -> int:
                    raw = meta.get(meta_key(kind, table))
                    return 0 if raw is None else int.from_bytes(raw, "little", signed=True)
                described[name] = {"dim": meta_int("dim"), "rows": meta_int("count"), "tombstones": meta_int("tombstones")}
            db.flush()
        finally:
            db.close()
        return {"tables": described, "positions": kept_positions}

    def adopt(self, src: Path) -> list[str]:
        """Copy every table, metadata entry and position of the store at ``src`` into this one, rows as stored
        (versions and tombstones included), as sorted SST files ingested per table. The tables must not exist
        here yet (this merges a restored snapshot into a store that holds other models). Returns the tables."""
        self._tier._check_writable("adopt a store")
        other = type(self._tier)(src, read_only=True, block_cache_mb=8)
        try:
            clash = sorted(set(other.tables()) & set(self._tier._dims))
            if clash:
                raise InvalidArgumentError(f"cannot adopt {src}: tables {', '.join(clash)} exist here already")
            for table, dim in other.tables().items():
                self._tier.create_table(table, dim)
                tmp = self._tier.path / f"import-{uuid.uuid4().hex}"
                tmp.mkdir()
                try:
                    files: list[str] = []
                    items = other._cfs[table].items()
                    while chunk := list(islice(items, IMPORT_CHUNK_ROWS)):
                        sst = tmp / f"{len(files):06d}.sst"
                        writer = SstFileWriter(self._tier._options())
                        writer.open(str(sst))
                        drain(map(writer.__setitem__, *zip(*chunk)))
                        writer.finish()
                        files.append(str(sst))
                    if files:
                        self.ingest(table, files)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                with self._tier._lock:
                    batch = WriteBatch(raw_mode=True)
                    self._staging.stage_counts(batch, {("count", table): other.count(table),
                                                       ("tombstones", table): other.tombstones(table)})
                    self._staging.commit(batch, {})
            for key, value in other.metadata().items():
                self._tier.set_metadata(key, value)
            if other.positions():
                self._tier.write([], other.positions())
            return sorted(other.tables())
        finally:
            other.close()


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
        self._tier._check_writable(f"import into {table}")
        cf, dim = self._tier._table(table)
        keys = as_keys(keys)
        vectors = checked_vectors(vectors, keys.size, dim, table)
        if keys.size == 0:
            return 0
        order = np.argsort(keys.view(np.uint64), kind="stable")
        sorted_keys = keys.view(np.uint64)[order]
        last = np.ones(order.size, dtype=bool)
        last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
        order = order[last]
        tmp = self._tier.path / f"import-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            with self._tier._lock:
                count_before = self._tier._meta_int("count", table) or 0
                tombstones_before = self._tier._meta_int("tombstones", table) or 0
                files: list[str] = []
                written, new_rows, replaced_tombstones = 0, 0, 0
                for start in range(0, order.size, IMPORT_CHUNK_ROWS):
                    chunk = order[start : start + IMPORT_CHUNK_ROWS]
                    chunk_vectors = vectors[chunk]  # stored rows, copied bit for bit (the engine checked them)
                    encoded = encode_keys(keys[chunk])
                    if count_before or tombstones_before:
                        states, stored = stored_states(cf, encoded, dim)
                        keep = accepts(states, stored, version)
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
                        writer = SstFileWriter(self._tier._options())
                        writer.open(str(sst))
                        drain(map(writer.__setitem__, encoded, values))
                        writer.finish()
                        files.append(str(sst))
                        written += chunk.size
                    if progress is not None:
                        progress(min(start + IMPORT_CHUNK_ROWS, order.size))
                if files:
                    self.ingest(table, files)
                if new_rows or replaced_tombstones:
                    batch = WriteBatch(raw_mode=True)
                    self._staging.add_counts(batch, table, rows=new_rows, tombstones=-replaced_tombstones)
                    self._tier._write(batch)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return written

"""Importing the rows of a file (:mod:`hps_service.rows.sources`) a batch at a time, so memory holds one batch
whatever the file's size: ``hps import``, the REST import job and the model repository all go through here.

An import into a table that is served reads the file twice: a first pass checks every row (finite, readable to
its end) and writes nothing, so a bad file never leaves a table half-imported; the second writes it, each batch
one RocksDB ingest. A version from the repository is imported once (it is not served before its import ends, and
a failed one is dropped whole).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hps_service.engine.registry import record_storage
from hps_service.errors import InvalidArgumentError, UnavailableError
from hps_service.fleet.sharding import ShardMap
from hps_service.rows import row_format
from hps_service.rows.sources import RowSource
from hps_service.tiers.base import Tier

#: Rows per batch: 64 MiB of 64-wide float32 rows.
BATCH_ROWS = 262_144
#: ``write(keys, vectors)`` -> rows written.
WriteBatch = Callable[[np.ndarray, np.ndarray], int]
#: ``progress(rows done, rows in all)``.
Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class ImportCounts:
    """What an import did: rows read from the file, written, and left to the other shards."""

    rows_read: int
    rows_written: int
    rows_skipped_other_shards: int

    def as_json(self) -> dict[str, int]:
        return {"rows_read": self.rows_read, "rows_written": self.rows_written,
                "rows_skipped_other_shards": self.rows_skipped_other_shards}


def check_dim(source: RowSource, table: str, dim: int) -> None:
    """InvalidArgumentError unless the file's rows are ``dim`` wide."""
    if source.dim != dim:
        raise InvalidArgumentError(f"table {table} has dim {dim} but {source.path} has dim {source.dim}")


def verify(source: RowSource, batch_rows: int = BATCH_ROWS, progress: Progress | None = None) -> None:
    """Read every row once, writing nothing: InvalidArgumentError naming the first row that holds NaN or inf, or the
    stretch that cannot be read."""
    done = 0
    for _, vectors in source.batches(batch_rows):
        bad = np.flatnonzero(~np.isfinite(vectors).all(axis=1))
        if bad.size:
            raise InvalidArgumentError(f"{source.path}: row {done + int(bad[0])} has NaN or inf values")
        done += vectors.shape[0]
        if progress is not None:
            progress(done, source.rows)


def import_rows(source: RowSource, write: WriteBatch, shard_map: ShardMap | None = None,
                progress: Progress | None = None, batch_rows: int = BATCH_ROWS,
                stopping: Callable[[], bool] | None = None) -> ImportCounts:
    """Write every row of ``source`` that this shard owns with ``write``, a batch at a time (UnavailableError
    between two batches once ``stopping()`` says so)."""
    shard_map = shard_map if shard_map is not None else ShardMap()
    read = written = skipped = 0
    for keys, vectors in source.batches(batch_rows):
        if stopping is not None and stopping():
            raise UnavailableError(f"the import of {source.path} stopped after {read} rows: the server is stopping")
        read += keys.shape[0]
        keys, vectors, other = shard_map.keep_owned(keys, vectors)
        skipped += other
        if keys.shape[0]:
            written += write(keys, vectors)
        if progress is not None:
            progress(read, source.rows)
    return ImportCounts(read, written, skipped)


def tier_writer(tier: Tier, table_id: str, dim: int, storage: str, version: int = 0,
                written_s: int | None = None, mirror: Tier | None = None) -> WriteBatch:
    """A :data:`WriteBatch` into ``table_id`` of ``tier`` (created, its format recorded), each batch encoded as
    ``storage`` (stamped with ``written_s`` for a table with ``ttl_s``) and bulk-loaded; ``mirror`` (the volatile
    tier, for a table no one serves yet) takes the same rows, so that it needs no preload."""
    fmt = row_format(storage, dim, stamped=written_s is not None)
    tier.create_table(table_id, fmt.words)
    record_storage(tier, table_id, storage)
    if mirror is not None:
        mirror.create_table(table_id, fmt.words)

    def write(keys: np.ndarray, vectors: np.ndarray) -> int:
        bad = np.flatnonzero(~np.isfinite(vectors).all(axis=1))
        if bad.size:
            raise InvalidArgumentError(f"a row of key {int(keys[bad[0]])} has NaN or inf values")
        stored = fmt.encode(vectors, written_s)
        written = int(tier.bulk_import(table_id, keys, stored, version=version))
        if mirror is not None:
            last = keys.shape[0] - 1 - np.unique(keys[::-1], return_index=True)[1]  # the last row of each key
            mirror.put(table_id, keys[last], stored[last], np.full(last.shape[0], version, np.int64))
        return written

    return write

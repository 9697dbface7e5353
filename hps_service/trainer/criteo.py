"""Criteo-format click logs read as a stream of batches: the Kaggle/Terabyte TSV, or Parquet with the same columns.

A row is ``label``, 13 integer features ``I1``..``I13`` and 26 categorical features ``C1``..``C26``; any field may be
empty. Files are read block by block with pyarrow, never whole. Features become model inputs the same way for
training and for serving:

- ``I<n>``: ``log(1 + max(x, 0))`` (as in Facebook's DLRM), an empty field is 0.
- ``timestamp`` (Parquet only, optional): the event time, a timestamp or integer Unix seconds.
- ``C<n>`` as text (TSV, Parquet strings): the key is the 64-bit FNV-1a hash of the value's UTF-8 bytes (offset
  basis 0xcbf29ce484222325, prime 0x100000001b3), read as a signed int64; an empty or null field hashes the empty
  string. ``C<n>`` as Parquet integers: the value is the key.

The sparse fields are the model's tables of the same names (a model may use a subset of ``C1``..``C26``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, overload

import numpy as np
from numba import njit

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.data import Batch

if TYPE_CHECKING:  # pyarrow ships no type information: these names are Any to mypy, and say what is meant
    import pyarrow as pa
    from pyarrow import csv

LABEL = "label"
TIME = "timestamp"  # optional: when the sample happened (progressive validation reports AUC per day)
DENSE_FIELDS = tuple(f"I{i}" for i in range(1, 14))
SPARSE_FIELDS = tuple(f"C{i}" for i in range(1, 27))
COLUMNS = (LABEL, *DENSE_FIELDS, *SPARSE_FIELDS)
FileFormat = Literal["criteo", "parquet"]

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


@njit(cache=True, nogil=True)
def _fnv1a_offsets(data: np.ndarray, offsets: np.ndarray, valid: np.ndarray, out: np.ndarray) -> None:
    for i in range(out.shape[0]):
        h = _FNV_OFFSET
        if valid[i]:
            for j in range(offsets[i], offsets[i + 1]):
                h = (h ^ np.uint64(data[j])) * _FNV_PRIME
        out[i] = h


def fnv1a64(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """FNV-1a 64 of every string of a pyarrow string array (nulls hash as ""), as int64 keys."""
    import pyarrow as pa

    arr = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if pa.types.is_large_string(arr.type) or pa.types.is_string(arr.type):
        arr = arr.cast(pa.large_string())
    else:
        raise InvalidArgumentError(f"fnv1a64 needs strings, got {arr.type}")
    n = len(arr)
    out = np.empty(n, dtype=np.uint64)
    if n == 0:
        return out.view(np.int64)
    validity, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64, count=arr.offset + n + 1)[arr.offset:]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, dtype=np.uint8)
    valid = arr.is_valid().to_numpy(zero_copy_only=False).astype(np.bool_)
    _fnv1a_offsets(data, offsets, valid, out)
    return out.view(np.int64)


def dense_transform(values: np.ndarray) -> np.ndarray:
    """``log(1 + max(x, 0))`` of raw integer features (NaN for empty fields becomes 0), float32."""
    x = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0)
    return np.log1p(np.maximum(x, 0.0)).astype(np.float32)


def _column_keys(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    import pyarrow as pa

    col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_integer(col.type):
        return col.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return fnv1a64(col)
    if pa.types.is_null(col.type):
        return np.full(len(col), np.uint64(_FNV_OFFSET)).view(np.int64)
    raise InvalidArgumentError(f"categorical column of type {col.type}: expected strings or integers")


def encode(table: pa.Table | pa.RecordBatch, sparse_fields: Sequence[str], require_label: bool = True) -> Batch:
    """A pyarrow Table/RecordBatch of Criteo columns -> a Batch (labels, transformed dense, int64 keys (n, 1)).

    Without ``require_label`` a table may lack the label column (rows to score): the labels are then zeros.
    """
    import pyarrow as pa

    names = set(table.schema.names)
    wanted = (LABEL, *DENSE_FIELDS, *sparse_fields) if require_label or LABEL in names else (*DENSE_FIELDS,
                                                                                                *sparse_fields)
    missing = [c for c in wanted if c not in names]
    if missing:
        raise InvalidArgumentError(f"data has no column(s) {missing}; Criteo columns are {LABEL}, I1..I13, C1..C26")
    n = table.num_rows
    dense = np.empty((n, len(DENSE_FIELDS)), dtype=np.float32)
    for j, name in enumerate(DENSE_FIELDS):
        col = table.column(name)
        col = col.cast(pa.float64()) if not pa.types.is_floating(col.type) else col
        dense[:, j] = dense_transform(col.to_numpy(zero_copy_only=False))
    if LABEL in names:
        labels = np.array(table.column(LABEL).cast(pa.float32()).fill_null(0.0).to_numpy(zero_copy_only=False))
    else:
        labels = np.zeros(n, dtype=np.float32)
    if n and not np.isin(labels, (0.0, 1.0)).all():
        raise InvalidArgumentError("labels must be 0 or 1")
    sparse = {name: _column_keys(table.column(name)).reshape(n, 1) for name in sparse_fields}
    return Batch(dense=dense, sparse=sparse, labels=labels.astype(np.float32, copy=False),
                 time=_event_times(table) if TIME in names else None)


def _event_times(table: pa.Table | pa.RecordBatch) -> np.ndarray:
    """The optional ``timestamp`` column as int64 Unix seconds (a timestamp type, or integer seconds)."""
    import pyarrow as pa

    col = table.column(TIME)
    if pa.types.is_timestamp(col.type):
        col = col.cast(pa.timestamp("s", tz=col.type.tz))
    return col.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def expand_paths(paths: Sequence[str | Path]) -> list[Path]:
    """Files named, with directories expanded to their files in name order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")))
        elif p.is_file():
            out.append(p)
        else:
            raise InvalidArgumentError(f"data file {p} does not exist")
    if not out:
        raise InvalidArgumentError("no data files given")
    return out


def tsv_options(block_rows: int) -> tuple[csv.ReadOptions, csv.ParseOptions, csv.ConvertOptions]:
    """pyarrow csv (read, parse, convert) options of the Criteo TSV layout: no header, tabs, no quoting."""
    import pyarrow as pa
    from pyarrow import csv

    types = {LABEL: pa.int8(), **{c: pa.float64() for c in DENSE_FIELDS}, **{c: pa.string() for c in SPARSE_FIELDS}}
    return (csv.ReadOptions(column_names=list(COLUMNS), block_size=max(1 << 16, block_rows * 200)),
            csv.ParseOptions(delimiter="\t", quote_char=False),
            csv.ConvertOptions(column_types=types, strings_can_be_null=True))


def _tsv_batches(path: Path, block_rows: int) -> Iterator[pa.RecordBatch]:
    from pyarrow import csv

    read, parse, convert = tsv_options(block_rows)
    yield from csv.open_csv(path, read_options=read, parse_options=parse, convert_options=convert)


def _parquet_batches(path: Path, block_rows: int, columns: list[str]) -> Iterator[pa.RecordBatch]:
    import pyarrow.parquet as pq

    yield from pq.ParquetFile(path).iter_batches(batch_size=block_rows, columns=columns)


@dataclass
class CriteoFiles:
    """A stream of fixed-size batches over Criteo-format files, resumable at any row."""

    paths: list[Path]
    file_format: FileFormat
    sparse_fields: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.file_format not in ("criteo", "parquet"):
            raise InvalidArgumentError(f"file format must be criteo or parquet, got {self.file_format!r}")
        unknown = [f for f in self.sparse_fields if f not in SPARSE_FIELDS]
        if unknown:
            raise InvalidArgumentError(
                f"table(s) {unknown} are not Criteo categorical fields: name the model's tables C1..C26"
            )

    def record_batches(self, block_rows: int) -> Iterator[pa.RecordBatch]:
        """pyarrow record batches of about ``block_rows`` rows, file after file, with the columns the model reads."""
        columns = [LABEL, *DENSE_FIELDS, *self.sparse_fields]
        for path in self.paths:
            try:
                if self.file_format == "criteo":
                    for rb in _tsv_batches(path, block_rows):
                        yield rb.select(columns)
                else:
                    import pyarrow.parquet as pq

                    timed = TIME in pq.read_schema(path).names
                    yield from _parquet_batches(path, block_rows, [*columns, TIME] if timed else columns)
            except (OSError, ValueError) as exc:  # pyarrow's parse errors are ValueError subclasses
                raise InvalidArgumentError(f"cannot read {path} as {self.file_format}: {exc}") from None

    def tables(self, batch_size: int, skip_rows: int = 0) -> Iterator[pa.Table]:
        """Raw pyarrow tables of ``batch_size`` rows (the last may be shorter), starting ``skip_rows`` rows in."""
        import pyarrow as pa

        if batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")
        pending: list[pa.RecordBatch] = []
        held = 0
        to_skip = skip_rows
        for rb in self.record_batches(max(batch_size, 4096)):
            if to_skip:
                if rb.num_rows <= to_skip:
                    to_skip -= rb.num_rows
                    continue
                rb = rb.slice(to_skip)
                to_skip = 0
            pending.append(rb)
            held += rb.num_rows
            while held >= batch_size:
                table = pa.Table.from_batches(pending)
                yield table.slice(0, batch_size)
                rest = table.slice(batch_size)
                pending = rest.to_batches() if rest.num_rows else []
                held -= batch_size
        if held:
            yield pa.Table.from_batches(pending)

    def batches(self, batch_size: int, skip_rows: int = 0) -> Iterator[Batch]:
        """Encoded batches of ``batch_size`` rows (the last may be shorter), starting ``skip_rows`` rows in."""
        for table in self.tables(batch_size, skip_rows):
            yield encode(table, self.sparse_fields)

    def head(self, rows: int) -> Batch:
        """The first ``rows`` rows as one batch (fewer if the files are shorter)."""
        return next(iter(self.batches(rows)))

    @overload
    def count_rows(self, exact: Literal[True] = True) -> int: ...

    @overload
    def count_rows(self, exact: bool) -> int | None: ...

    def count_rows(self, exact: bool = True) -> int | None:
        """Rows the files hold: from Parquet metadata, or (``exact``) a pass counting TSV lines; else None."""
        if self.file_format == "parquet":
            import pyarrow.parquet as pq

            return sum(pq.ParquetFile(p).metadata.num_rows for p in self.paths)
        if not exact:
            return None
        return sum(_count_lines(p) for p in self.paths)


def _count_lines(path: Path) -> int:
    """Lines of a text file (a last line without a newline counts), read in 8 MiB blocks."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 23):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")

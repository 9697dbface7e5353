"""Rows to import, read a batch at a time from the files they live in, so an import holds one batch in memory:

* ``.npz``: arrays ``keys`` (integers, ``(n,)``) and ``vectors`` (numbers, ``(n, dim)``), stored or compressed;
* ``.parquet``: columns ``key`` (integers) and ``vector`` (a list of numbers per row, all of one length), read
  with pyarrow a record batch at a time;
* ``.safetensors``: tensors ``keys`` and ``vectors``, or a table's weights by name, and ``.pt`` / ``.pth``, a torch
  state_dict holding them (:mod:`hps_service.rows.torch_weights`), read a slice at a time;
* a HugeCTR sparse model directory: ``key`` (int64 little-endian) and ``emb_vector`` (float32 rows), mapped.

Opening a source reads its header, footer or sizes only, and refuses a file cut short (a zip without its directory,
a Parquet file without its footer, a member or tensor shorter than its header says), one of the wrong shape, or
one without rows, naming the file and the problem. The rows themselves are checked as they are read.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from hps_service.errors import InvalidArgumentError
from hps_service.rows.torch_weights import SAFETENSORS_SUFFIX, STATE_DICT_SUFFIXES, WeightsSource, is_torch_weights

#: The file name endings of the row files, and what a HugeCTR directory holds.
SUFFIXES = (".npz", ".parquet", SAFETENSORS_SUFFIX, *STATE_DICT_SUFFIXES)
HUGECTR_FILES = ("key", "emb_vector")
Batch = tuple[np.ndarray, np.ndarray]


class RowSource(Protocol):
    """Rows of one table in a file: how many, their width, and the rows a batch at a time."""

    path: Path
    rows: int
    dim: int

    def batches(self, size: int) -> Iterator[Batch]:
        """``(keys int64 (m,), vectors float32 (m, dim))`` of at most ``size`` rows each, in file order."""
        ...


def _refuse(path: Path, problem: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{path}: {problem}")


def _check_kinds(path: Path, keys_dtype: np.dtype, rows_dtype: np.dtype) -> None:
    if keys_dtype.kind not in "iu":
        raise _refuse(path, f"keys must be integers, got {keys_dtype}")
    if rows_dtype.kind not in "fiu":
        raise _refuse(path, f"vectors must be numbers, got {rows_dtype}")


def _check_counts(path: Path, keys: int, rows: int) -> None:
    if keys == 0:
        raise _refuse(path, "holds no rows")
    if keys != rows:
        raise _refuse(path, f"{keys} keys but {rows} vectors")


def _as_batch(keys: np.ndarray, vectors: np.ndarray) -> Batch:
    return (np.ascontiguousarray(keys, dtype=np.int64),
            np.ascontiguousarray(vectors, dtype=np.float32))


@dataclass
class _NpyMember:
    """One ``.npy`` member of a zip: its shape, dtype, and the stream past its header."""

    shape: tuple[int, ...]
    dtype: np.dtype
    stream: IO[bytes]

    def read(self, count: int) -> np.ndarray:
        """The next ``count`` values, flat; InvalidArgumentError when the member ends first."""
        want = count * self.dtype.itemsize
        data = self.stream.read(want)
        if len(data) != want:
            raise InvalidArgumentError(f"it ends {want - len(data)} bytes short of what its header says")
        return np.frombuffer(data, dtype=self.dtype)


@dataclass
class NpzSource:
    """A ``.npz`` with ``keys`` and ``vectors``, streamed member by member (compressed ones too)."""

    path: Path
    rows: int = 0
    dim: int = 0

    def __post_init__(self) -> None:
        with self._open() as (keys, vectors):
            if len(keys.shape) != 1:
                raise _refuse(self.path, f"keys must be 1-D, got shape {keys.shape}")
            if len(vectors.shape) != 2:
                raise _refuse(self.path, f"vectors must be 2-D (rows, dim), got shape {vectors.shape}")
            _check_kinds(self.path, keys.dtype, vectors.dtype)
            _check_counts(self.path, keys.shape[0], vectors.shape[0])
            self.rows, self.dim = int(keys.shape[0]), int(vectors.shape[1])

    def _member(self, archive: zipfile.ZipFile, name: str, held: ExitStack) -> _NpyMember:
        if name + ".npy" not in archive.namelist():
            raise _refuse(self.path, f"lacks the array {name} (needs keys and vectors)")
        info = archive.getinfo(name + ".npy")
        stream = held.enter_context(archive.open(info))
        try:
            version = np.lib.format.read_magic(stream)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(stream)
        except (ValueError, OSError, zipfile.BadZipFile) as exc:
            raise _refuse(self.path, f"{name} is not a NumPy array: {exc}") from None
        if dtype.hasobject or (fortran and len(shape) > 1):
            raise _refuse(self.path, f"{name} must be a C-ordered array of numbers")
        if info.file_size < int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise _refuse(self.path, f"{name} holds {info.file_size} bytes, fewer than its shape {shape} needs")
        return _NpyMember(tuple(int(d) for d in shape), dtype, stream)

    @contextmanager
    def _open(self) -> Iterator[tuple[_NpyMember, _NpyMember]]:
        try:
            archive = zipfile.ZipFile(self.path)
        except (OSError, zipfile.BadZipFile) as exc:
            raise _refuse(self.path, f"is not a readable .npz file (cut short?): {exc}") from None
        with archive, ExitStack() as held:
            yield self._member(archive, "keys", held), self._member(archive, "vectors", held)

    def batches(self, size: int) -> Iterator[Batch]:
        with self._open() as (keys, vectors):
            for start in range(0, self.rows, size):
                n = min(size, self.rows - start)
                try:
                    got = keys.read(n), vectors.read(n * self.dim).reshape(n, self.dim)
                except (InvalidArgumentError, zipfile.BadZipFile, OSError, EOFError) as exc:
                    raise _refuse(self.path, f"cannot read rows {start}-{start + n}: {exc}") from None
                yield _as_batch(*got)


@dataclass
class HugeCTRSource:
    """A HugeCTR sparse model directory: ``key`` and ``emb_vector``, mapped and read a batch at a time."""

    path: Path
    rows: int = 0
    dim: int = 0

    def __post_init__(self) -> None:
        key_file, vec_file = (self.path / name for name in HUGECTR_FILES)
        for f in (key_file, vec_file):
            if not f.is_file():
                raise _refuse(self.path, f"is not a HugeCTR sparse model: missing file {f.name}")
        key_bytes, vec_bytes = key_file.stat().st_size, vec_file.stat().st_size
        if key_bytes % 8:
            raise _refuse(key_file, f"has {key_bytes} bytes, not a multiple of 8 (int64 keys)")
        n = key_bytes // 8
        _check_counts(self.path, n, n)
        if vec_bytes == 0 or vec_bytes % (n * 4):
            raise _refuse(vec_file, f"has {vec_bytes} bytes, not a multiple of {n} keys x 4 bytes (float32 rows)")
        self.rows, self.dim = n, vec_bytes // (n * 4)

    def batches(self, size: int) -> Iterator[Batch]:
        keys = np.memmap(self.path / "key", dtype="<i8", mode="r")
        vectors = np.memmap(self.path / "emb_vector", dtype="<f4", mode="r").reshape(self.rows, self.dim)
        for start in range(0, self.rows, size):
            yield _as_batch(keys[start : start + size], vectors[start : start + size])


@dataclass
class ParquetSource:
    """A Parquet file with ``key`` and ``vector`` columns, read a record batch at a time with pyarrow."""

    path: Path
    rows: int = 0
    dim: int = 0

    def __post_init__(self) -> None:
        pq = _pyarrow_parquet()
        import pyarrow as pa

        try:
            self._file = pq.ParquetFile(self.path)
        except (OSError, pa.ArrowException) as exc:
            raise _refuse(self.path, f"is not a readable Parquet file (cut short?): {exc}") from None
        schema = self._file.schema_arrow
        missing = [c for c in ("key", "vector") if c not in schema.names]
        if missing:
            raise _refuse(self.path, f"lacks the column(s) {', '.join(missing)} (needs key and vector)")
        key_type, vector_type = schema.field("key").type, schema.field("vector").type
        if not pa.types.is_integer(key_type):
            raise _refuse(self.path, f"column key must hold integers, got {key_type}")
        if not (pa.types.is_list(vector_type) or pa.types.is_large_list(vector_type)
                or pa.types.is_fixed_size_list(vector_type)) or not (
                pa.types.is_floating(vector_type.value_type) or pa.types.is_integer(vector_type.value_type)):
            raise _refuse(self.path, f"column vector must hold a list of numbers per row, got {vector_type}")
        self.rows = int(self._file.metadata.num_rows)
        _check_counts(self.path, self.rows, self.rows)
        if pa.types.is_fixed_size_list(vector_type):
            self.dim = int(vector_type.list_size)
        else:
            first = next(self._file.iter_batches(batch_size=1, columns=["vector"])).column(0)
            self.dim = len(first[0]) if first[0].is_valid else 0
        if self.dim < 1:
            raise _refuse(self.path, "the first row's vector is empty or null")

    def batches(self, size: int) -> Iterator[Batch]:
        import pyarrow as pa
        import pyarrow.compute as pc

        done = 0
        try:
            for batch in self._file.iter_batches(batch_size=size, columns=["key", "vector"]):
                keys, vectors = batch.column(0), batch.column(1)
                if keys.null_count or vectors.null_count:
                    raise _refuse(self.path, f"a key or vector of rows {done}-{done + len(batch)} is null")
                lengths = pc.list_value_length(vectors).to_numpy(zero_copy_only=False)
                if (lengths != self.dim).any():
                    bad = done + int(np.flatnonzero(lengths != self.dim)[0])
                    raise _refuse(self.path, f"row {bad} has {lengths[bad - done]} values, not {self.dim}")
                flat = vectors.flatten().to_numpy(zero_copy_only=False)
                yield _as_batch(keys.to_numpy(zero_copy_only=False), flat.reshape(len(batch), self.dim))
                done += len(batch)
        except (OSError, pa.ArrowException) as exc:
            raise _refuse(self.path, f"cannot read rows after row {done}: {exc}") from None


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InvalidArgumentError("reading .parquet needs pyarrow: pip install 'hps-service[repository]'") from None
    return pq


def open_rows(path: Path, table: str | None = None) -> RowSource:
    """The rows at ``path`` (see the module docstring for the formats; ``table``: the name its weights go by in a
    file of torch weights); InvalidArgumentError naming the problem."""
    path = Path(path)
    if not path.exists():
        raise InvalidArgumentError(f"model source {path} does not exist")
    if path.is_dir():
        return HugeCTRSource(path)
    if path.suffix == ".npz":
        return NpzSource(path)
    if path.suffix == ".parquet":
        return ParquetSource(path)
    if is_torch_weights(path):
        return WeightsSource(path, table)
    raise InvalidArgumentError(f"{path} is none of a .npz, .parquet, .safetensors, .pt or .pth file or a HugeCTR "
                               "model directory")

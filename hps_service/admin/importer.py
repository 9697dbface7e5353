"""Model import: read a HugeCTR sparse-model directory, an ``.npz`` or a table of torch weights and bulk-load it into
the RocksDB tier.

Everything is validated before the first byte is written, so a bad file never leaves a half-imported table.
Also writes HugeCTR directories and synthesizes deterministic demo models (used by ``make run`` and tests).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from hps_service.engine.registry import record_storage
from hps_service.errors import InvalidArgumentError
from hps_service.rows import row_format
from hps_service.rows.torch_weights import WeightsSource, is_torch_weights
from hps_service.tiers.rocksdb.tier import RocksDBTier

#: Rows checked per pass when scanning vectors for NaN/inf (bounds the temporary memory on huge files).
_FINITE_CHECK_ROWS = 1 << 20


def _map_file(path: Path, dtype: str) -> np.ndarray:
    """Memory-map a raw little-endian file (an empty file gives an empty array; mmap cannot map 0 bytes)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _read_hugectr_dir(path: Path) -> tuple[np.ndarray, np.ndarray]:
    key_file, vec_file = path / "key", path / "emb_vector"
    for f in (key_file, vec_file):
        if not f.is_file():
            raise InvalidArgumentError(f"{path} is not a HugeCTR sparse model: missing file {f.name}")
    key_bytes, vec_bytes = key_file.stat().st_size, vec_file.stat().st_size
    if key_bytes % 8:
        raise InvalidArgumentError(f"{key_file} has {key_bytes} bytes, not a multiple of 8 (int64 keys)")
    n = key_bytes // 8
    if n == 0:
        raise InvalidArgumentError(f"empty model: {key_file} holds no keys")
    if vec_bytes == 0 or vec_bytes % (n * 4):
        raise InvalidArgumentError(
            f"{vec_file} has {vec_bytes} bytes, not a multiple of {n} keys x 4 bytes (float32 rows)"
        )
    dim = vec_bytes // (n * 4)
    keys = _map_file(key_file, "<i8")
    vectors = _map_file(vec_file, "<f4").reshape(n, dim)
    return keys, vectors


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"{path} is not a readable .npz file: {exc}") from exc
    with archive:
        missing = [name for name in ("keys", "vectors") if name not in archive.files]
        if missing:
            raise InvalidArgumentError(f"{path} lacks array(s) {', '.join(missing)} (needs keys and vectors)")
        keys, vectors = archive["keys"], archive["vectors"]
    if keys.ndim != 1:
        raise InvalidArgumentError(f"{path}: keys must be 1-D, got shape {keys.shape}")
    if keys.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{path}: keys must be integers, got {keys.dtype}")
    if vectors.ndim != 2:
        raise InvalidArgumentError(f"{path}: vectors must be 2-D (rows, dim), got shape {vectors.shape}")
    if vectors.dtype.kind not in "fiu":
        raise InvalidArgumentError(f"{path}: vectors must be numeric, got {vectors.dtype}")
    if keys.size == 0:
        raise InvalidArgumentError(f"empty model: {path} holds no keys")
    if keys.shape[0] != vectors.shape[0]:
        raise InvalidArgumentError(f"{path}: {keys.shape[0]} keys but {vectors.shape[0]} vectors")
    return keys.astype(np.int64, copy=False), vectors.astype(np.float32, copy=False)


def check_finite(vectors: np.ndarray) -> None:
    """Raise if any row holds NaN or inf (checked in bounded chunks)."""
    for start in range(0, vectors.shape[0], _FINITE_CHECK_ROWS):
        bad = np.flatnonzero(~np.isfinite(vectors[start : start + _FINITE_CHECK_ROWS]).all(axis=1))
        if bad.size:
            raise InvalidArgumentError(f"row {start + int(bad[0])} of the model has NaN or inf values")


def read_model_source(path: Path, table: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Read validated ``(keys int64 (n,), vectors float32 (n, dim))`` from a HugeCTR dir, a ``.npz``, or ``table``'s
    weights in a torch state_dict or safetensors file (:mod:`hps_service.rows.torch_weights`)."""
    path = Path(path)
    if not path.exists():
        raise InvalidArgumentError(f"model source {path} does not exist")
    if path.is_dir():
        keys, vectors = _read_hugectr_dir(path)
    elif path.suffix == ".npz":
        keys, vectors = _read_npz(path)
    elif is_torch_weights(path):
        source = WeightsSource(path, table)
        keys, vectors = next(source.batches(source.rows))
    else:
        raise InvalidArgumentError(f"{path} is neither a HugeCTR model directory, a .npz file, a torch state_dict "
                                   f"(.pt, .pth) nor a .safetensors file")
    check_finite(vectors)
    return keys, vectors


def check_import_shape(table: str, dim: int, keys: np.ndarray, vectors: np.ndarray) -> None:
    """InvalidArgumentError unless ``vectors`` are (len(keys), dim) rows for ``table``."""
    if vectors.ndim != 2:
        raise InvalidArgumentError(f"vectors must be 2-D (rows, dim), got shape {vectors.shape}")
    if vectors.shape[1] != dim:
        raise InvalidArgumentError(f"table {table} has dim {dim} but the file has dim {vectors.shape[1]}")
    if keys.shape != (vectors.shape[0],):
        raise InvalidArgumentError(f"{keys.size} keys but {vectors.shape[0]} vectors")


def import_table(
    tier: RocksDBTier,
    table: str,
    dim: int,
    keys: np.ndarray,
    vectors: np.ndarray,
    version: int = 0,
    progress: Callable[[int], None] | None = None,
    storage: str = "fp32",
    written_s: int | None = None,
) -> int:
    """Check the file's dim against the configured one, create the table, bulk-load its rows encoded as
    ``storage`` (``written_s``: stamped with that write time, for a table with ``ttl_s``); return rows written."""
    check_import_shape(table, dim, keys, vectors)
    check_finite(vectors)
    fmt = row_format(storage, dim, stamped=written_s is not None)
    tier.create_table(table, fmt.words)
    record_storage(tier, table, storage)
    stored = fmt.encode(np.ascontiguousarray(vectors, dtype=np.float32), written_s)
    return tier.bulk_import(table, keys, stored, version=version, progress=progress)


def write_hugectr_dir(path: Path, keys: np.ndarray, vectors: np.ndarray) -> None:
    """Write a HugeCTR sparse-model directory: ``key`` (int64 LE) and ``emb_vector`` (float32 LE)."""
    keys, vectors = np.asarray(keys), np.asarray(vectors)
    if vectors.ndim != 2 or keys.shape != (vectors.shape[0],):
        raise InvalidArgumentError(
            f"need keys (n,) and vectors (n, dim), got {keys.shape} and {vectors.shape}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    np.ascontiguousarray(keys, dtype="<i8").tofile(path / "key")
    np.ascontiguousarray(vectors, dtype="<f4").tofile(path / "emb_vector")


def synthesize_model(rows: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic demo table: unique, non-contiguous, shuffled int64 keys and N(0, 0.1) float32 rows."""
    if rows < 1 or dim < 1:
        raise InvalidArgumentError(f"rows and dim must be >= 1, got rows={rows} dim={dim}")
    rng = np.random.default_rng(seed)
    stride = 1_000_003
    keys = np.arange(rows, dtype=np.int64) * stride + rng.integers(0, stride, size=rows, dtype=np.int64)
    keys = rng.permutation(keys)
    vectors = rng.standard_normal((rows, dim), dtype=np.float32)
    vectors *= np.float32(0.1)
    return keys, vectors

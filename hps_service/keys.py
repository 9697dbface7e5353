"""Key batches: validation and deduplication, shared by the engine and every tier."""

from __future__ import annotations

from collections.abc import Iterable

import numba
import numpy as np

from hps_service.errors import InvalidArgumentError, ResourceExhaustedError


def as_keys(keys: np.ndarray | Iterable[int], max_keys: int | None = None) -> np.ndarray:
    """Keys as a contiguous 1-D int64 array; InvalidArgumentError for other shapes or types, ResourceExhaustedError
    beyond ``max_keys``."""
    arr = np.asarray(keys)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"keys must be a 1-D array, got shape {arr.shape}")
    if arr.dtype != np.int64:
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise InvalidArgumentError(f"keys must be integers, got dtype {arr.dtype}")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise InvalidArgumentError("keys must fit in int64; got uint64 keys above 2**63-1")
        arr = arr.astype(np.int64)
    if max_keys is not None and arr.shape[0] > max_keys:
        raise ResourceExhaustedError(f"{arr.shape[0]} keys in one request exceeds server.max_batch_keys={max_keys}")
    return np.ascontiguousarray(arr)


@numba.njit(cache=True, nogil=True)
def _unique_inverse(keys: np.ndarray, uniq: np.ndarray, inverse: np.ndarray) -> int:
    # Fills the caller's arrays and returns a count: returning arrays would box them through numba's
    # object unpickling on every call, which costs more than the work on a few hundred keys.
    order = np.argsort(keys)
    m = -1
    for j in range(keys.shape[0]):
        i = order[j]
        if m < 0 or keys[i] != uniq[m]:
            m += 1
            uniq[m] = keys[i]
        inverse[i] = m
    return m + 1


def unique_with_inverse(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` for int64 keys: sorted unique keys and, per key, its index in them.

    One compiled pass after a sort; NumPy's version costs about 30 us of overhead on a batch's few hundred misses.
    """
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    uniq = np.empty(keys.shape[0], dtype=np.int64)
    inverse = np.empty(keys.shape[0], dtype=np.int64)
    m = _unique_inverse(keys, uniq, inverse)
    return uniq[:m], inverse


def warm_up_kernels() -> None:
    """Compile (or load) the dedup kernel for the key arrays lookups pass: writable and read-only (see warmup)."""
    from hps_service.jit.warmup import read_only

    keys = np.array([3, 1, 3], dtype=np.int64)
    unique_with_inverse(keys)
    unique_with_inverse(read_only(keys))

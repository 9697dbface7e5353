"""Validation of key batches, shared by the engine and every tier."""

from __future__ import annotations

from collections.abc import Iterable

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

"""Default vectors for keys that no tier holds: zeros, a constant, or a deterministic per-key random row."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hps_service.config import ConstantDefault, DefaultSpec
from hps_service.jit.hashing import mix64_array

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def hashed_random_rows(keys: np.ndarray, dim: int) -> np.ndarray:
    """Uniform rows in [-1/sqrt(dim), 1/sqrt(dim)) that depend only on (key, column): the same on every pod."""
    k = keys.astype(np.int64, copy=False).view(np.uint64)[:, None]
    cells = k * np.uint64(dim) + np.arange(dim, dtype=np.uint64)[None, :]
    bits = mix64_array(cells + _GOLDEN) >> np.uint64(40)  # one splitmix64 step: 24 random bits
    unit = bits.astype(np.float32) * np.float32(1.0 / (1 << 24))
    scale = np.float32(1.0 / np.sqrt(dim))
    return (unit * np.float32(2.0) - np.float32(1.0)) * scale


def default_spec(value: Any) -> DefaultSpec:
    """A table's default as the engine takes it, from what the node store's manifest writes (a constant is a mapping
    there: a colocated reader's table has it so)."""
    return ConstantDefault.model_validate(value) if isinstance(value, Mapping) else value


def default_rows(spec: DefaultSpec, keys: np.ndarray, dim: int) -> np.ndarray:
    """The default rows of ``keys`` for a table whose default is ``spec``, as (n, dim) float32."""
    n = keys.shape[0]
    if isinstance(spec, ConstantDefault):
        return np.full((n, dim), spec.constant, dtype=np.float32)
    if spec == "hashed_random":
        return hashed_random_rows(keys, dim)
    return np.zeros((n, dim), dtype=np.float32)

"""Default vectors for keys that no tier holds: zeros, a constant, or a deterministic per-key random row."""

from __future__ import annotations

import numpy as np

from hps_service.config import ConstantDefault, DefaultSpec

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, element-wise on uint64 (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def hashed_random_rows(keys: np.ndarray, dim: int) -> np.ndarray:
    """Uniform rows in [-1/sqrt(dim), 1/sqrt(dim)) that depend only on (key, column): the same on every pod."""
    k = keys.astype(np.int64, copy=False).view(np.uint64)[:, None]
    cells = k * np.uint64(dim) + np.arange(dim, dtype=np.uint64)[None, :]
    bits = _splitmix64(cells) >> np.uint64(40)  # 24 random bits
    unit = bits.astype(np.float32) * np.float32(1.0 / (1 << 24))
    scale = np.float32(1.0 / np.sqrt(dim))
    return (unit * np.float32(2.0) - np.float32(1.0)) * scale


def default_rows(spec: DefaultSpec, keys: np.ndarray, dim: int) -> np.ndarray:
    """The default rows of ``keys`` for a table whose default is ``spec``, as (n, dim) float32."""
    n = keys.shape[0]
    if isinstance(spec, ConstantDefault):
        return np.full((n, dim), spec.constant, dtype=np.float32)
    if spec == "hashed_random":
        return hashed_random_rows(keys, dim)
    return np.zeros((n, dim), dtype=np.float32)

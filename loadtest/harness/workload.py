"""What the load generator asks for: a key set, a zipf(alpha) or uniform sampler over it, and pools of batches.

Batches are drawn ahead of the run (a pool per worker, cycled), so sampling costs nothing on the timed path.
Zipf ranks map to keys through the order of the key set; ``hps synth`` writes its keys shuffled, so the hot
keys are spread over the key space rather than clustered at its start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from hps_service.errors import InvalidArgumentError

Distribution = Literal["zipf", "uniform"]

#: Bytes of keys held in one worker's pool of pre-drawn batches (bounds memory for large batches).
POOL_KEY_BYTES = 32 << 20
#: Most batches in one pool; enough that a worker rarely repeats a batch within a second.
POOL_MAX_BATCHES = 512


def load_keys(source: str | Path | None = None, key_range: int | None = None) -> np.ndarray:
    """The key set to draw from: ``keys`` of an ``.npz`` (as ``hps synth`` writes), an ``.npy`` of int64 keys,
    or ``0 .. key_range-1``."""
    if (source is None) == (key_range is None):
        raise InvalidArgumentError("give exactly one key source: a keys file (.npz/.npy) or a key range")
    if key_range is not None:
        if key_range < 1:
            raise InvalidArgumentError(f"key range must be >= 1, got {key_range}")
        return np.arange(key_range, dtype=np.int64)
    path = Path(source)  # type: ignore[arg-type]
    if not path.is_file():
        raise InvalidArgumentError(f"keys file {path} does not exist")
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                if "keys" not in archive.files:
                    raise InvalidArgumentError(f"{path} has no 'keys' array")
                keys = archive["keys"]
        else:
            keys = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot read keys from {path}: {exc}") from exc
    if keys.ndim != 1 or keys.size == 0 or not np.issubdtype(keys.dtype, np.integer):
        raise InvalidArgumentError(f"{path}: keys must be a non-empty 1-D integer array, got {keys.dtype} {keys.shape}")
    return np.ascontiguousarray(keys, dtype=np.int64)


@dataclass(frozen=True)
class KeySampler:
    """Draws batches of keys from ``keys``: rank ``r`` (0-based) with probability proportional to
    ``1 / (r + 1) ** alpha`` for zipf, or uniformly."""

    keys: np.ndarray
    distribution: Distribution = "zipf"
    alpha: float = 1.05

    def __post_init__(self) -> None:
        if self.distribution not in ("zipf", "uniform"):
            raise InvalidArgumentError(f"distribution must be 'zipf' or 'uniform', got {self.distribution!r}")
        if self.distribution == "zipf" and not self.alpha > 0:
            raise InvalidArgumentError(f"zipf alpha must be > 0, got {self.alpha}")
        if self.keys.ndim != 1 or self.keys.size == 0:
            raise InvalidArgumentError("the key set must be a non-empty 1-D array")

    def _cdf(self) -> np.ndarray:
        weights = np.arange(1, self.keys.shape[0] + 1, dtype=np.float64) ** -self.alpha
        cdf = np.cumsum(weights)
        cdf /= cdf[-1]
        return cdf

    def ranks(self, n: int, rng: np.random.Generator, cdf: np.ndarray | None = None) -> np.ndarray:
        """``n`` ranks into the key set."""
        if self.distribution == "uniform":
            return rng.integers(0, self.keys.shape[0], size=n)
        cdf = self._cdf() if cdf is None else cdf
        return np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), self.keys.shape[0] - 1)

    def pool(self, batches: int, batch: int, seed: int) -> np.ndarray:
        """``(batches, batch)`` int64 keys, drawn in one vectorised pass."""
        if batches < 1 or batch < 1:
            raise InvalidArgumentError(f"batches and batch must be >= 1, got {batches} and {batch}")
        rng = np.random.default_rng(seed)
        cdf = self._cdf() if self.distribution == "zipf" else None
        return self.keys[self.ranks(batches * batch, rng, cdf)].reshape(batches, batch)

    def hot_fraction(self, fraction: float) -> float:
        """Probability mass of the hottest ``fraction`` of keys (what a perfect cache of that size would hit)."""
        if not 0.0 < fraction <= 1.0:
            raise InvalidArgumentError(f"fraction must be in (0, 1], got {fraction}")
        if self.distribution == "uniform":
            return fraction
        cdf = self._cdf()
        return float(cdf[max(0, round(fraction * cdf.shape[0]) - 1)])


def pool_size(batch: int, tables: int) -> int:
    """Batches per worker pool for ``batch`` keys in each of ``tables`` tables."""
    return int(max(8, min(POOL_MAX_BATCHES, POOL_KEY_BYTES // max(1, batch * tables * 8))))

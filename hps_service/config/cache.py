"""The ``cache`` section: the L1 embedding cache of each table (where it lives, how large, how rows enter it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from hps_service.config.base import Section as _Section


class CacheConfig(_Section):
    """L1 embedding cache (device memory on a GPU, host memory on NumPy)."""

    enabled: bool | Literal["auto"] = Field(
        "auto", description="keep an L1 cache per table (false: lookups start at L2); auto: on where it sits on a "
        "GPU or in front of a remote volatile tier (redis_cluster) or none, off where it would be a second host "
        "copy of this node's hash map (cache.backend resolving to host memory with volatile.type hashmap)")
    backend: Literal["auto", "numpy", "cupy"] = Field(
        "auto", description="auto: the GPU when a CUDA device is usable, else host memory (logged); numpy: host "
        "memory; cupy: the GPU, or fail at start")
    capacity: int | float = Field(0.2, description="float in (0, 1]: fraction of each table's rows; int: rows")
    min_rows: int = Field(8192, ge=0, description="a fractional capacity never gives fewer rows than this (so that a "
                          "table fed only by updates gets a cache)")
    ways: int = Field(32, ge=1, le=1024, description="slots per set of the set-associative cache")
    policy: Literal["lru", "lfu"] = Field("lru", description="which slot of a full set is evicted")
    hit_rate_threshold: float = Field(
        0.9, ge=0.0, le=1.0, description="a batch with at least this hit rate inserts its misses off the request path")
    # 3, not 2: on zipf(0.9 / 1.05 / 1.2) over a table 5x L1 the hit rate is as high or higher (in process 0.59 /
    # 0.79 / 0.91 against 0.57 / 0.78 / 0.91; served, part 2 of make bench, 0.917 against 0.898) with 1.4-8x fewer
    # inserts, and every insert makes the lock-free L1 reads it overlaps run again (14% of a worker's reads on part
    # 2's mix at 2, 1.5% at 3).
    admit_after_misses: int = Field(
        3, ge=1, le=15,
        description="once the cache is full, a key enters it after missing this many times lately (a count-min "
        "sketch of misses, halved every `capacity` misses; 1: every miss)")
    refresh_interval_s: float = Field(0.0, ge=0.0, description="re-read cached rows from below this often (0: off)")
    refresh_fraction: float = Field(0.1, gt=0.0, le=1.0, description="share of the cache re-read per refresh")
    warm_start: bool = Field(True, description="fill L1 at start from the hot-key snapshot, else RocksDB's first rows")

    @field_validator("enabled", mode="before")
    @classmethod
    def _enabled_choice(cls, v: Any) -> bool | str:
        if isinstance(v, str) and v.strip().lower() in ("auto", "true", "false", "yes", "no", "on", "off", "1", "0"):
            word = v.strip().lower()
            return "auto" if word == "auto" else word in ("true", "yes", "on", "1")
        if isinstance(v, bool):
            return v
        raise ValueError(f"must be true, false or auto, got {v!r}")

    @field_validator("capacity")
    @classmethod
    def _capacity_range(cls, v: float) -> int | float:
        if isinstance(v, bool):
            raise ValueError("must be a fraction in (0, 1] or a row count")
        if isinstance(v, float) and not (0.0 < v <= 1.0):
            raise ValueError("a fractional capacity must be in (0, 1]; give an integer for a row count")
        if isinstance(v, int) and v < 0:
            raise ValueError("a row count must be >= 0")
        return v

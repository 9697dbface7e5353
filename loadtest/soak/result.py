"""What a soak saw, sample by sample, and the limits its verdict allows."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One sampling interval: seconds since start; server PSS (workers included) and the RocksDB memory inside it that is bounded by
    configuration (memtables, block cache); lookups answered and their p99; rows published and applied so far;
    the oldest unapplied publish's age (max in the interval); server and broker CPU (cores) and broker RSS."""

    t_s: float
    mem_mib: float
    memtable_mib: float
    block_cache_mib: float
    lookups: int
    p99_ms: float
    rows_published: int
    rows_applied: int
    staleness_s: float
    server_cpu: float
    broker_cpu: float
    broker_rss_mib: float
    server_stalled: bool

    @property
    def net_mib(self) -> float:
        """PSS net of memtables and block-cache usage: what must not trend upwards."""
        return self.mem_mib - self.memtable_mib - self.block_cache_mib


@dataclass(frozen=True)
class Limits:
    """What the verdict allows."""

    max_no_apply_s: float = 30.0
    min_lookup_ratio: float = 0.8
    max_p99_ratio: float = 1.5
    max_mem_growth: float = 0.05
    warmup_fraction: float = 0.1


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class SoakResult:
    """What the soak saw, and its verdict."""

    duration_s: float
    samples: list[Sample] = field(default_factory=list)
    lookups: int = 0
    lookup_errors: list[str] = field(default_factory=list)
    wrong_rows: int = 0
    publish_errors: list[str] = field(default_factory=list)
    rows_published: int = 0
    rows_applied: int = 0
    stale_keys_at_end: int = -1
    server_exit: int | None = None
    no_apply_failure: str | None = None  # set the moment rows waited with nothing applied for max_no_apply_s
    ran_s: float = 0.0
    publish_every_s: float = 0.0
    rows_per_publish: int = 0
    partitions: int = 0
    record_batches: int = 0
    lookup_ratio: float = float("nan")  # lookups per interval, late / early
    p99_ratio: float = float("nan")  # p99, late / early
    mem_growth: float = float("nan")  # fitted growth of net memory over the last half, fraction of its median
    checks: list[Check] = field(default_factory=list)
    plot: str | None = None

    @property
    def correct(self) -> bool:
        """Zero errors, no wrong row, every key at its latest version, clean exit."""
        return (not self.lookup_errors and not self.publish_errors and self.wrong_rows == 0
                and self.stale_keys_at_end == 0 and self.server_exit == 0)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

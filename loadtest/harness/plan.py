"""The sizes and durations of one ``make bench`` run (full or ``--quick``), and the table its first parts serve."""

from __future__ import annotations

from dataclasses import dataclass, replace

MODEL, TABLE, DIM = "demo", "item", 64


@dataclass(frozen=True)
class Plan:
    """Sizes and durations of one suite run."""

    rows: int
    table_sizes: tuple[int, ...]
    batches: tuple[int, ...]
    cache_fractions: tuple[float, ...]
    measure_s: float
    warmup_s: float
    rounds: int
    curve_s: float
    l1_repeats: int
    l1_budget_s: float
    l3_batches: int
    workers: int
    concurrency: int
    freshness_samples: int


def plan(quick: bool, table_sizes: str | None) -> Plan:
    if quick:
        p = Plan(rows=200_000, table_sizes=(200_000, 500_000), batches=(256, 1024, 4096, 16384),
                 cache_fractions=(0.01, 1.0), measure_s=3.0, warmup_s=3.0, rounds=1, curve_s=2.0,
                 l1_repeats=3, l1_budget_s=0.5, l3_batches=100, workers=2, concurrency=8, freshness_samples=30)
    else:
        p = Plan(rows=1_000_000, table_sizes=(1_000_000, 5_000_000), batches=(256, 1024, 4096, 16384),
                 cache_fractions=(0.01, 0.1, 0.5, 1.0), measure_s=6.0, warmup_s=5.0, rounds=2, curve_s=4.0,
                 l1_repeats=5, l1_budget_s=1.0, l3_batches=300, workers=2, concurrency=8, freshness_samples=100)
    if table_sizes:
        p = replace(p, table_sizes=tuple(int(s) for s in table_sizes.split(",") if s.strip()))
    return p

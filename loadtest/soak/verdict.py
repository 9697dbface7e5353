"""The soak's verdict, from what its samples (the plot) show: early and late windows, robust memory growth."""

from __future__ import annotations

import math

import numpy as np

from loadtest.soak.result import Check, Limits, Sample, SoakResult


def windows(samples: list[Sample], warmup_fraction: float) -> tuple[list[Sample], list[Sample]]:
    """(early, late): the first and last third of the samples after the warm-up."""
    measured = samples[max(1, math.ceil(len(samples) * warmup_fraction)):] if len(samples) > 3 else samples
    third = max(1, len(measured) // 3)
    return measured[:third], measured[-third:]


def late_over_early(early: list[float], late: list[float]) -> float:
    """Median of ``late`` over median of ``early`` (NaN values left out)."""
    e = [v for v in early if not math.isnan(v)]
    la = [v for v in late if not math.isnan(v)]
    if not e or not la:
        return float("nan")
    return float(np.median(la) / max(float(np.median(e)), 1e-9))


def fitted_growth(t: np.ndarray, y: np.ndarray) -> float:
    """Theil-Sen slope of ``y`` over ``t`` times the span, as a fraction of the median of ``y``: a trend that a
    few spikes (compactions, a large response) cannot fake."""
    if t.shape[0] < 3:
        return 0.0
    i, j = np.triu_indices(t.shape[0], k=1)
    dt = t[j] - t[i]
    keep = dt > 0
    slope = float(np.median((y[j] - y[i])[keep] / dt[keep]))
    return slope * float(t[-1] - t[0]) / max(float(np.median(y)), 1e-9)


def last_half(samples: list[Sample]) -> list[Sample]:
    return samples[len(samples) // 2:]


def judge(result: SoakResult, limits: Limits) -> list[Check]:
    """The checks of the verdict, from what the samples (the plot) show; see the module docstring."""
    early, late = windows(result.samples, limits.warmup_fraction)
    result.lookup_ratio = late_over_early([s.lookups for s in early], [s.lookups for s in late])
    result.p99_ratio = late_over_early([s.p99_ms for s in early], [s.p99_ms for s in late])
    half = [s for s in last_half(result.samples) if not math.isnan(s.net_mib)]
    result.mem_growth = fitted_growth(np.array([s.t_s for s in half]), np.array([s.net_mib for s in half]))
    errors = len(result.lookup_errors) + len(result.publish_errors)
    return [
        Check("correct", result.correct,
              f"{len(result.lookup_errors)} lookup errors, {len(result.publish_errors)} publish errors, "
              f"{result.wrong_rows} wrong rows, {result.stale_keys_at_end} stale keys at the end, "
              f"server exit {result.server_exit}" + (f"; first error: {(result.lookup_errors + result.publish_errors)[0]}"
                                                    if errors else "")),
        Check("fresh", result.no_apply_failure is None,
              result.no_apply_failure or f"updates applied throughout (never {limits.max_no_apply_s:.0f} s without "
              f"one while rows waited); oldest unapplied publish at most "
              f"{max((s.staleness_s for s in result.samples), default=0.0):.1f} s old"),
        Check("lookups late/early", not result.lookup_ratio < limits.min_lookup_ratio,
              f"{result.lookup_ratio:.2f} (>= {limits.min_lookup_ratio})"),
        Check("p99 late/early", not result.p99_ratio > limits.max_p99_ratio,
              f"{result.p99_ratio:.2f} (<= {limits.max_p99_ratio})"),
        Check("memory trend, last half", not result.mem_growth > limits.max_mem_growth,
              f"PSS net of memtables and block cache {result.mem_growth:+.1%} (<= {limits.max_mem_growth:+.0%}); "
              + (f"{min(s.net_mib for s in half):.0f}-{max(s.net_mib for s in half):.0f} MiB" if half else "no samples")),
    ]

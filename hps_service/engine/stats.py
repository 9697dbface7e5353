"""Per-table statistics in the ``/v1/stats`` shape: hits, misses, hit rate, rows, capacity, evictions per level."""

from __future__ import annotations

from hps_service.engine.levels import LEVELS
from hps_service.engine.table import ServedTable
from hps_service.tiers.base import Tier

#: One level's figures: counts and rates, and what the cache or tier adds (its policy, whether it is enabled).
LevelStats = dict[str, float | int | str | None]
#: Per level (and "default"): its figures.
TableStats = dict[str, LevelStats]


def table_stats(t: ServedTable, volatile: Tier | None, persistent: Tier | None) -> TableStats:
    """Per level: hits, misses, hit_rate, rows, capacity, evictions (+ errors for lower tiers); defaults answered;
    with an ingest filter, ``admission``: its threshold and the writes it dropped."""
    hits, misses, defaults = t.counters.totals()
    out: TableStats = {}
    for level in LEVELS:
        h, m = hits[level], misses[level]
        entry: LevelStats = {
            "hits": h,
            "misses": m,
            "hit_rate": (h / (h + m)) if (h + m) else 0.0,
            "rows": 0,
            "capacity": 0,
            "evictions": 0,
        }
        if level == "cache":
            entry["enabled"] = t.cache is not None
            if t.cache is not None:
                cs = t.cache.stats()
                entry.update({k: v for k, v in cs.items() if k not in ("hits", "misses", "hit_rate")})
        else:
            tier = volatile if level == "volatile" else persistent
            entry["enabled"] = tier is not None
            if tier is not None:
                ts = tier.stats(t.id)
                entry.update(rows=ts.rows, capacity=ts.capacity, evictions=ts.evictions, errors=ts.errors)
                entry.update(ts.extra)
        out[level] = entry
    out["default"] = {"hits": defaults}
    if t.ingest is not None:
        out["admission"] = dict(t.ingest.stats())
    return out

"""The soak's plot: memory, p99, lookups, update freshness and the broker against time, verdict windows shaded."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from loadtest.soak.result import Limits, SoakResult
from loadtest.soak.verdict import last_half, windows


def plot(result: SoakResult, path: Path, limits: Limits) -> None:
    """Memory, p99, lookups per interval, update freshness and the broker against time, one panel each, with the
    windows the verdict compares shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result.samples
    t = np.array([x.t_s for x in s])
    fig, axes = plt.subplots(5, 1, figsize=(9, 13), sharex=True)
    early, late = windows(s, limits.warmup_fraction)
    for ax in axes:
        for win, color in ((early, "tab:green"), (late, "tab:orange")):
            if win:
                ax.axvspan(win[0].t_s, win[-1].t_s, color=color, alpha=0.08)
    verdict = "PASS" if result.passed else "FAIL: " + ", ".join(c.name for c in result.checks if not c.passed)
    axes[0].set_title(f"soak {result.ran_s:.0f} s: {result.lookups} lookups, {result.rows_published} rows published "
                      f"- {verdict}", fontsize=10)
    axes[0].plot(t, [x.mem_mib for x in s], marker=".", label="PSS (server and workers)")
    axes[0].plot(t, [x.net_mib for x in s], marker=".", label="PSS - memtables - block cache")
    half = [x for x in last_half(s) if not math.isnan(x.net_mib)]
    if len(half) >= 2:
        th = np.array([x.t_s for x in half])
        med = float(np.median([x.net_mib for x in half]))
        growth = result.mem_growth * med
        axes[0].plot(th, med + growth * ((th - th.mean()) / max(th[-1] - th[0], 1e-9)), color="k", lw=1,
                     label=f"last half trend {result.mem_growth:+.1%}")
    axes[0].legend(loc="lower right", fontsize=8)
    axes[0].set_ylabel("server memory (MiB)")
    axes[1].plot(t, [x.p99_ms for x in s], marker=".", color="tab:red")
    axes[1].set_ylabel(f"lookup p99 (ms)\nlate/early {result.p99_ratio:.2f}")
    axes[2].plot(t, [x.lookups for x in s], marker=".", color="tab:green")
    axes[2].set_ylabel(f"lookups / interval\nlate/early {result.lookup_ratio:.2f}")
    dt = np.diff(t, prepend=0.0)
    dt[dt <= 0] = np.nan
    axes[3].plot(t, np.diff([0] + [x.rows_published for x in s]) / dt, label="published rows/s")
    axes[3].plot(t, np.diff([0] + [x.rows_applied for x in s]) / dt, label="applied rows/s")
    axes[3].set_ylabel("updates")
    axes[3].legend(loc="lower left", fontsize=8)
    stale_ax = axes[3].twinx()
    stale_ax.plot(t, [x.staleness_s for x in s], color="tab:purple", marker=".", lw=0.8)
    stale_ax.set_ylabel("oldest unapplied\npublish (s)", color="tab:purple")
    axes[4].plot(t, [x.broker_cpu for x in s], marker=".", color="tab:brown", label="broker CPU")
    axes[4].plot(t, [x.server_cpu for x in s], marker=".", color="tab:gray", label="server CPU")
    axes[4].set_ylabel("cores")
    axes[4].legend(loc="upper left", fontsize=8)
    rss_ax = axes[4].twinx()
    rss_ax.plot(t, [x.broker_rss_mib for x in s], color="tab:cyan", marker=".", lw=0.8)
    rss_ax.set_ylabel("broker RSS (MiB)", color="tab:cyan")
    axes[4].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)

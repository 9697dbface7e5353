"""Turn the workers' per-call samples into the load report: QPS, keys/s, latency percentiles, errors by status,
client and server hit rates, a timeline; print it as a rich table and plot it (matplotlib Agg)."""

from __future__ import annotations

import os
import platform
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from loadtest.harness.drivers import STATUS_NAMES

PERCENTILES = {"p50": 50.0, "p95": 95.0, "p99": 99.0, "p99.9": 99.9}


def merge(worker_samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One set of arrays from every worker's samples."""
    keys = ("start", "latency", "status", "keys", "hits")
    merged = {k: np.concatenate([s[k] for s in worker_samples]) for k in keys}
    merged["dropped"] = int(sum(s["dropped"] for s in worker_samples))
    merged["client_cpu_s"] = float(sum(s["cpu_s"] for s in worker_samples))
    return merged


def latency_ms(latency_s: np.ndarray) -> dict[str, float | None]:
    """Percentiles, mean and max of latencies (seconds in, milliseconds out); None when there are none."""
    if latency_s.size == 0:
        return {**dict.fromkeys(PERCENTILES), "mean": None, "max": None}
    ms = latency_s * 1e3
    out: dict[str, float | None] = {
        name: float(v) for name, v in zip(PERCENTILES, np.percentile(ms, list(PERCENTILES.values())))
    }
    out.update(mean=float(ms.mean()), max=float(ms.max()))
    return out


def summarize(samples: dict[str, Any], warmup_s: float, duration_s: float, buckets_s: float = 1.0) -> dict[str, Any]:
    """The report of calls whose (intended) start lies in ``[warmup_s, warmup_s + duration_s)``."""
    start = samples["start"]
    window = (start >= warmup_s) & (start < warmup_s + duration_s)
    status = samples["status"][window]
    ok = status == 0
    latency = samples["latency"][window]
    keys = samples["keys"][window]
    hits = samples["hits"][window]
    codes, counts = np.unique(status[~ok], return_counts=True)
    known = hits >= 0
    answered_keys = int(keys[ok].sum())
    timeline = []
    edges = np.arange(warmup_s, warmup_s + duration_s + 1e-9, buckets_s)
    for lo, hi in pairwise(edges):
        b = (start >= lo) & (start < hi) & (samples["status"] == 0)
        n_keys = samples["keys"][b]
        b_hits = samples["hits"][b]
        b_known = b_hits >= 0
        timeline.append({
            "t": round(float(hi - warmup_s), 3),
            "qps": float(b.sum() / (hi - lo)),
            "p99_ms": latency_ms(samples["latency"][b])["p99"],
            "client_cache_hit_rate": (float(b_hits[b_known].sum() / n_keys[b_known].sum())
                                      if b_known.any() and n_keys[b_known].sum() else None),
        })
    calls_total = int(start.shape[0])
    return {
        "duration_s": duration_s,
        "calls_total": calls_total,  # every call of the run, warm-up included (CPU per call divides by this)
        "client_cpu_ms_per_call": samples["client_cpu_s"] * 1e3 / calls_total if calls_total else None,
        "requests": int(window.sum()),
        "responses": int(ok.sum()),
        "errors": {STATUS_NAMES.get(int(c), str(int(c))): int(n) for c, n in zip(codes, counts)},
        "dropped": samples["dropped"],
        "qps": float(ok.sum() / duration_s),
        "keys_per_s": float(answered_keys / duration_s),
        "latency_ms": latency_ms(latency[ok]),
        "client_cache_hit_rate": (float(hits[known & ok].sum() / keys[known & ok].sum())
                                  if (known & ok).any() and keys[known & ok].sum() else None),
        "timeline": timeline,
    }


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_summary(report: dict[str, Any], console: Console | None = None, title: str = "load") -> None:
    """One rich table of a run's report."""
    console = console or Console()
    table = Table(title=title, show_header=True, header_style="bold")
    for column in ("QPS", "keys/s", "p50 ms", "p95 ms", "p99 ms", "p99.9 ms", "requests", "errors", "dropped",
                   "client L1 hit", "server hit rate"):
        table.add_column(column, justify="right")
    lat = report["latency_ms"]
    server = report.get("server_hit_rate")
    server_text = "not reachable" if server is None else ", ".join(
        f"{tier} {_fmt(rate, 3)}" for tier, rate in server.items())
    errors = ", ".join(f"{k} {v}" for k, v in report["errors"].items()) or "0"
    table.add_row(
        _fmt(report["qps"], 0), _fmt(report["keys_per_s"], 0), _fmt(lat["p50"]), _fmt(lat["p95"]), _fmt(lat["p99"]),
        _fmt(lat["p99.9"]), str(report["requests"]), errors, str(report["dropped"]),
        _fmt(report["client_cache_hit_rate"], 3), server_text,
    )
    console.print(table)


def print_sweep(reports: list[dict[str, Any]], console: Console | None = None) -> None:
    """Latency percentiles per offered load step."""
    console = console or Console()
    table = Table(title="open-loop sweep", header_style="bold")
    for column in ("offered QPS", "achieved QPS", "keys/s", "p50 ms", "p95 ms", "p99 ms", "p99.9 ms", "errors",
                   "dropped"):
        table.add_column(column, justify="right")
    for r in reports:
        lat = r["latency_ms"]
        table.add_row(_fmt(r["config"]["qps"], 0), _fmt(r["qps"], 0), _fmt(r["keys_per_s"], 0), _fmt(lat["p50"]),
                      _fmt(lat["p95"]), _fmt(lat["p99"]), _fmt(lat["p99.9"]), str(sum(r["errors"].values())),
                      str(r["dropped"]))
    console.print(table)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_vs_load(reports: list[dict[str, Any]], path: Path) -> Path:
    """Latency percentiles (log scale) against offered QPS, achieved QPS on a second axis."""
    plt = _pyplot()
    offered = [r["config"]["qps"] for r in reports]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in PERCENTILES:
        ax.plot(offered, [r["latency_ms"][name] or np.nan for r in reports], marker="o", label=name)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("latency from intended send (ms)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    twin = ax.twinx()
    twin.plot(offered, [r["qps"] for r in reports], color="gray", linestyle="--", marker="x", label="achieved QPS")
    twin.set_ylabel("achieved requests/s")
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    ax.set_title("latency vs offered load")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_hit_rate(report: dict[str, Any], path: Path) -> Path:
    """Server hit rate per tier (from /v1/stats) and the client-seen L1 hit rate over the run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    server = report.get("server_timeline") or []
    for tier in ("cache", "volatile", "persistent"):
        points = [(p["t"], p["hit_rate"].get(tier)) for p in server if p["hit_rate"].get(tier) is not None]
        if points:
            ax.plot(*zip(*points), marker=".", label=f"server {tier}")
    client = [(p["t"] + report["config"]["warmup_s"], p["client_cache_hit_rate"]) for p in report["timeline"]
              if p["client_cache_hit_rate"] is not None]
    if client:
        ax.plot(*zip(*client), linestyle="--", label="client-seen L1")
    ax.axvline(report["config"]["warmup_s"], color="gray", linewidth=0.8, linestyle=":")
    ax.set_xlabel("time since start (s); warm-up left of the dotted line")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("hit rate over time")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1), "python": platform.python_version(),
            "platform": platform.platform(), "load_average_at_start": os.getloadavg()}

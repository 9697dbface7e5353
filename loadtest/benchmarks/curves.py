"""Part 5 of ``make bench``: the cost curves over gRPC (keys/s and p99 against batch size, table rows and the L1
fraction of the table), closed loop, and their plot."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from loadtest.harness.embedded import EmbeddedServer
from loadtest.harness.loadgen import LoadSpec, run_load
from loadtest.harness.plan import DIM, MODEL, TABLE, Plan


def curve_point(server: EmbeddedServer, p: Plan, batch: int = 1024) -> dict[str, Any]:
    spec = LoadSpec(target=server.target, model=MODEL, tables=(TABLE,), batch=batch, workers=p.workers,
                    concurrency=p.concurrency, duration_s=p.curve_s, warmup_s=1.0, keys_file=str(server.keys_file),
                    http_target=server.http_target)
    r = run_load(spec)
    return {"keys_per_s": r["keys_per_s"], "qps": r["qps"], "p99_ms": r["latency_ms"]["p99"],
            "p50_ms": r["latency_ms"]["p50"], "errors": sum(r["errors"].values()),
            "server_hit_rate": r["server_hit_rate"]}


def curve_batches(server: EmbeddedServer, p: Plan) -> list[dict[str, Any]]:
    return [{"batch": b, **curve_point(server, p, b)} for b in p.batches]


def curve_table_sizes(p: Plan, workdir: Path, base_point: dict[str, Any], console: Console) -> list[dict[str, Any]]:
    points = []
    for rows in p.table_sizes:
        if rows == p.rows:
            points.append({"rows": rows, **base_point})
            continue
        console.print(f"  table of {rows:,} rows: hps synth + hps import + serve")
        t0 = time.perf_counter()
        srv = EmbeddedServer(workdir / f"rows-{rows}", rows=rows, table_dim=DIM).prepare()
        prepared = time.perf_counter() - t0
        srv.start()
        try:
            run_load(LoadSpec(target=srv.target, model=MODEL, tables=(TABLE,), workers=p.workers,
                              concurrency=p.concurrency, duration_s=p.warmup_s, warmup_s=0.0,
                              keys_file=str(srv.keys_file)))
            points.append({"rows": rows, "prepare_s": prepared, **curve_point(srv, p)})
        finally:
            srv.stop()
            shutil.rmtree(srv.workdir, ignore_errors=True)
    return points


def curve_cache_fractions(p: Plan, workdir: Path) -> list[dict[str, Any]]:
    points = []
    for fraction in p.cache_fractions:
        srv = EmbeddedServer(workdir / "base", rows=p.rows, table_dim=DIM,
                             overrides={"cache": {"capacity": fraction}}).prepare().start()
        try:
            run_load(LoadSpec(target=srv.target, model=MODEL, tables=(TABLE,), workers=p.workers,
                              concurrency=p.concurrency, duration_s=p.warmup_s, warmup_s=0.0,
                              keys_file=str(srv.keys_file)))
            points.append({"cache_fraction": fraction, **curve_point(srv, p)})
        finally:
            srv.stop()
    return points


def plot_curves(curves: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("batch", "batch size (keys)", True), ("rows", "table rows", True),
              ("cache_fraction", "L1 cache fraction of the table", True)]
    names = {"batch": "batches", "rows": "table_sizes", "cache_fraction": "cache_fractions"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (x, label, logx) in zip(axes, panels):
        pts = curves.get(names[x]) or []
        if not pts:
            ax.set_visible(False)
            continue
        xs = [q[x] for q in pts]
        ax.plot(xs, [q["keys_per_s"] / 1e6 for q in pts], marker="o", color="tab:blue")
        ax.set_xlabel(label)
        ax.set_ylabel("M keys/s", color="tab:blue")
        if logx:
            ax.set_xscale("log")
        twin = ax.twinx()
        twin.plot(xs, [q["p99_ms"] or np.nan for q in pts], marker="s", color="tab:red")
        twin.set_ylabel("p99 ms", color="tab:red")
        ax.grid(True, alpha=0.3)
    fig.suptitle("cost curves over gRPC (closed loop, zipf 1.05)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

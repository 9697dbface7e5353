"""Part 2 of ``make bench``: lookups served over gRPC (batch 1024, dim 64, zipf(1.05), hot set cached after a warm-up)
from other processes, against the transport floor (aio and thread pool, as many processes) and a plain Redis Cluster
client, round by round; with ``--profile`` also who holds the server's GIL meanwhile."""

from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from hps_service.runtime.cpus import usable_cpus
from hps_service.runtime.processes import process_tree
from loadtest.harness import cli
from loadtest.harness.embedded import EmbeddedServer
from loadtest.harness.floor_server import FloorServer
from loadtest.harness.loadgen import LoadSpec, run_load
from loadtest.harness.plan import DIM, MODEL, TABLE, Plan
from loadtest.harness.redis_baseline import loaded_cluster
from loadtest.harness.workload import KeySampler, load_keys


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    return {k: report[k] for k in ("qps", "keys_per_s", "latency_ms", "requests", "responses", "errors", "dropped",
                                   "client_cache_hit_rate", "server_hit_rate", "server_cpu_ms_per_call",
                                   "client_cpu_ms_per_call")}


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.mean(present) if present else None


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one contender: mean keys/s and QPS, median p50/p99, every round kept."""
    return {
        "keys_per_s": statistics.mean(r["keys_per_s"] for r in runs),
        "qps": statistics.mean(r["qps"] for r in runs),
        "p50_ms": statistics.median(r["latency_ms"]["p50"] or float("nan") for r in runs),
        "p99_ms": statistics.median(r["latency_ms"]["p99"] or float("nan") for r in runs),
        "errors": sum(sum(r["errors"].values()) for r in runs),
        "server_cpu_ms_per_call": _mean([r["server_cpu_ms_per_call"] for r in runs]),
        "client_cpu_ms_per_call": _mean([r["client_cpu_ms_per_call"] for r in runs]),
        "rounds": [_summary(r) for r in runs],
    }


def part(p: Plan, server: EmbeddedServer, workdir: Path, console: Console, profile: bool,
               cache_fraction: float) -> dict[str, Any]:
    """Ours vs the floors (aio and thread-pool) vs Redis Cluster, interleaved round by round."""
    base = LoadSpec(target=server.target, model=MODEL, tables=(TABLE,), batch=1024, workers=p.workers,
                    concurrency=p.concurrency, duration_s=p.measure_s, warmup_s=1.0, keys_file=str(server.keys_file),
                    http_target=server.http_target, dim=DIM, channels=4)
    assert server.proc is not None
    processes = usable_cpus()  # the server's worker processes (its default), and the floors' processes
    ours_pid = process_tree(server.proc.pid)
    console.print(f"  warming the L1 with {p.warmup_s:.0f} s of zipf(1.05) load")
    run_load(replace(base, duration_s=p.warmup_s, warmup_s=0.0))
    sampler = KeySampler(load_keys(server.keys_file), "zipf", 1.05)
    out: dict[str, Any] = {"expected_hit_rate_perfect_cache": sampler.hot_fraction(cache_fraction),
                           "cache_fraction": cache_fraction, "rows": p.rows, "in_flight": p.concurrency,
                           "client_processes": p.workers}
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "floor_aio": [], "floor_sync": [], "redis": []}
    redis_ctx = loaded_cluster(server.keys_file, workdir, console)
    try:
        redis_seed = redis_ctx.__enter__()
        redis_pids = redis_ctx.pids() if redis_seed is not None else []
        for r in range(p.rounds):
            console.print(f"  round {r + 1}/{p.rounds}: ours, floor (aio), floor (thread pool), redis")
            runs["ours"].append(run_load(base, ours_pid))
            for mode in ("aio", "sync"):
                with FloorServer(mode, 1024, workdir, processes=processes,
                                 threads=2 if mode == "sync" else None) as floor:
                    runs[f"floor_{mode}"].append(
                        run_load(replace(base, target=floor.target, http_target=None), process_tree(floor.proc.pid)))
            if redis_seed is not None:
                runs["redis"].append(run_load(replace(base, backend="redis", target=redis_seed, http_target=None,
                                                      channels=1), redis_pids))
        if profile:
            out["profile"] = _profile_server(server, base, workdir, console)
    finally:
        redis_ctx.__exit__(None, None, None)
    for name, rs in runs.items():
        out[name] = _combine(rs) if rs else None
    floors = [out[k]["keys_per_s"] for k in ("floor_aio", "floor_sync") if out[k]]
    out["floor_best_keys_per_s"] = max(floors)
    out["ratio_vs_floor"] = out["ours"]["keys_per_s"] / out["floor_best_keys_per_s"]
    out["ratio_vs_floor_same_kind"] = (out["ours"]["keys_per_s"] / out["floor_sync"]["keys_per_s"]
                                       if out["floor_sync"] else None)
    out["ratio_vs_redis"] = out["ours"]["keys_per_s"] / out["redis"]["keys_per_s"] if out["redis"] else None
    return out


def _profile_server(server: EmbeddedServer, base: LoadSpec, workdir: Path, console: Console) -> dict[str, Any]:
    """py-spy samples of the server while the load generator runs; on-CPU share per category."""
    import threading

    from loadtest.probes import profiling

    assert server.proc is not None
    seconds = max(3.0, base.duration_s)
    out_file = workdir / "server-profile.txt"
    result: dict[str, Any] = {}

    def sample() -> None:
        time.sleep(1.0)
        result["file"] = profiling.record(server.proc.pid, seconds, out_file)

    thread = threading.Thread(target=sample)
    thread.start()
    run_load(replace(base, duration_s=seconds + 2.0))
    thread.join()
    if result.get("file") is None:
        console.print("  [yellow]py-spy could not sample the server (missing or ptrace not allowed)[/]")
        return {"error": "py-spy could not sample the server"}
    kept = cli.RESULTS / "bench-server-profile.txt"
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out_file, kept)
    return {"gil_busy": profiling.gil_busy(out_file, seconds), "by_category": profiling.breakdown(out_file),
            "top_frames": profiling.top_frames(out_file), "collapsed_stacks": str(kept)}

"""Part 2 of ``make bench``: lookups served over gRPC (batch 1024, dim 64) by a node on the default configuration (on a
CPU: no L1, the hash map's compiled pass over a complete table), from other processes, round by round against:

* the same node asked only the hottest keys (the ``cache_fraction`` of ranks an L1 would hold): the mix's target is
  <= 1.15x that server CPU per call;
* the same node with ``server.front: native`` (pygrpc-native), on the mix;
* the transport floors: grpcio's thread-pool server answering a canned response of the same bytes (as many
  processes as the node's workers, 2 threads each), and pygrpc-native's front answering it (a second floor);
* a plain Redis Cluster client, with as many masters as the node has workers.

Server CPU per call is every process of a server (from /proc); keys/s are the clients'. With ``--profile`` also who
holds a worker's GIL meanwhile."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from hps_service.runtime.cpus import usable_cpus
from hps_service.runtime.processes import process_tree
from loadtest.harness import cli
from loadtest.harness.embedded import EmbeddedServer, table_stats
from loadtest.harness.floor_server import FloorServer
from loadtest.harness.loadgen import LoadSpec, run_load
from loadtest.harness.plan import DIM, MODEL, TABLE, Plan
from loadtest.harness.redis_baseline import loaded_cluster
from loadtest.harness.workload import KeySampler, load_keys

#: The issue-52 targets, each printed with its row.
MIX_VS_HOT = cli.at_most(1.15)
GRPCIO_CPU, GRPCIO_KEYS = cli.at_most(1.5), cli.at_least(0.8)
NATIVE_CPU, NATIVE_KEYS = cli.at_most(0.75), cli.at_least(1.2)
VS_REDIS = cli.at_least(1.5)
CONTENDERS = ("ours", "ours_hot", "native", "floor_sync", "floor_native", "redis")


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


def wait_complete(server: EmbeddedServer, timeout_s: float = 900.0) -> None:
    """Until the served table is complete in the hash map (its preload ended)."""
    deadline = time.monotonic() + timeout_s
    while not table_stats(server)["volatile"].get("complete"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the table was not complete after {timeout_s:.0f} s: {table_stats(server)['volatile']}")
        time.sleep(0.5)


def native_twin(base: EmbeddedServer, workdir: Path) -> EmbeddedServer | None:
    """``base``'s table served by a node with ``server.front: native`` (a copy of its RocksDB), or None when
    pygrpc-native is not installed."""
    try:
        import pygrpc_native  # noqa: F401
    except ImportError:
        return None
    twin = EmbeddedServer(workdir / "native", rows=base.rows, table_dim=base.dim, overrides={
        **base.overrides, "server": {"front": "native", "max_connection_age_s": 0}})
    twin.workdir.mkdir(parents=True, exist_ok=True)
    if not (twin.workdir / "rocksdb").exists():
        shutil.copytree(base.workdir / "rocksdb", twin.workdir / "rocksdb")
    if not twin.keys_file.exists():
        os.link(base.keys_file, twin.keys_file)
    return twin.prepare()


def hot_keys_file(keys_file: Path, fraction: float, out: Path) -> Path:
    """The hottest ``fraction`` of the key set's zipf ranks, as a key set of its own (zipf over it: the mix's
    distribution restricted to those keys)."""
    keys = load_keys(keys_file)
    np.save(out, keys[: max(1, int(fraction * keys.shape[0]))])
    return out


def part(p: Plan, server: EmbeddedServer, workdir: Path, console: Console, profile: bool,
         cache_fraction: float) -> dict[str, Any]:
    """The contenders of the module docstring, interleaved round by round."""
    base = LoadSpec(target=server.target, model=MODEL, tables=(TABLE,), batch=1024, workers=p.workers,
                    concurrency=p.concurrency, duration_s=p.measure_s, warmup_s=1.0, keys_file=str(server.keys_file),
                    http_target=server.http_target, dim=DIM, channels=4)
    assert server.proc is not None
    processes = usable_cpus()  # the server's worker processes (its default), and the floors' processes
    ours_pid = process_tree(server.proc.pid)
    console.print("  waiting for the table to be complete in the hash map (its preload)")
    wait_complete(server)
    stats = table_stats(server)
    hot = replace(base, keys_file=str(hot_keys_file(server.keys_file, cache_fraction, workdir / "hot-keys.npy")))
    twin = native_twin(server, workdir)
    sampler = KeySampler(load_keys(server.keys_file), "zipf", 1.05)
    out: dict[str, Any] = {"hot_share_of_the_mix": sampler.hot_fraction(cache_fraction), "hot_fraction": cache_fraction,
                           "rows": p.rows, "in_flight": p.concurrency, "client_processes": p.workers,
                           "worker_processes": processes, "l1": stats["cache"]["enabled"], "load_average": []}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
    redis_ctx = loaded_cluster(server.keys_file, workdir, console, masters=processes)
    try:
        redis_seed = redis_ctx.__enter__()
        redis_pids = redis_ctx.pids() if redis_seed is not None else []
        native_pid: list[int] = []
        if twin is not None:
            twin.start(timeout=600)
            assert twin.proc is not None
            native_pid = process_tree(twin.proc.pid)
            wait_complete(twin)
        for r in range(p.rounds):
            console.print(f"  round {r + 1}/{p.rounds}: ours (mix, hot keys), native front, floors (grpcio, "
                          f"native), redis")
            out["load_average"].append(os.getloadavg()[0])
            runs["ours"].append(run_load(base, ours_pid))
            runs["ours_hot"].append(run_load(hot, ours_pid))
            if twin is not None:
                runs["native"].append(run_load(replace(base, target=twin.target, http_target=twin.http_target),
                                               native_pid))
            for mode in ("sync", "native") if twin is not None else ("sync",):
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
        if twin is not None:
            twin.stop()
    for name, rs in runs.items():
        out[name] = _combine(rs) if rs else None
    out["ratios"] = ratios(out)
    return out


def _cpu(out: dict[str, Any], a: str, b: str) -> float | None:
    x, y = out.get(a), out.get(b)
    if not x or not y or x["server_cpu_ms_per_call"] is None or not y["server_cpu_ms_per_call"]:
        return None
    return float(x["server_cpu_ms_per_call"] / y["server_cpu_ms_per_call"])


def _keys(out: dict[str, Any], a: str, b: str) -> float | None:
    x, y = out.get(a), out.get(b)
    return float(x["keys_per_s"] / y["keys_per_s"]) if x and y else None


def ratios(out: dict[str, Any]) -> dict[str, float | None]:
    """Every ratio the targets judge (None where a contender did not run)."""
    return {"mix_vs_hot_cpu": _cpu(out, "ours", "ours_hot"),
            "grpcio_vs_floor_cpu": _cpu(out, "ours", "floor_sync"), "grpcio_vs_floor_keys": _keys(out, "ours",
                                                                                                  "floor_sync"),
            "native_vs_floor_cpu": _cpu(out, "native", "floor_sync"), "native_vs_floor_keys": _keys(out, "native",
                                                                                                   "floor_sync"),
            "native_floor_vs_floor_cpu": _cpu(out, "floor_native", "floor_sync"),
            "native_floor_vs_floor_keys": _keys(out, "floor_native", "floor_sync"),
            "grpcio_vs_redis_keys": _keys(out, "ours", "redis"), "native_vs_redis_keys": _keys(out, "native", "redis")}


def rows(g: dict[str, Any], row: Any) -> None:
    """Part 2's rows of the summary table, each with its target."""
    r = g.get("ratios") or ratios(g)

    def ms(name: str) -> str:
        c = g.get(name)
        return f"{c['server_cpu_ms_per_call']:.3f} ms/call" if c and c["server_cpu_ms_per_call"] else "not run"

    def rate(name: str) -> str:
        c = g.get(name)
        return f"{c['keys_per_s'] / 1e6:.2f} M keys/s p99 {c['p99_ms']:.1f} ms" if c else "not run"

    where = f"{g.get('rows', 0):,} x 64, L1 {'on' if g.get('l1') else 'off'}, load avg " + \
        "/".join(f"{a:.1f}" for a in g.get("load_average", []))
    row(f"2. server CPU per call, zipf mix vs hottest {g.get('hot_fraction', 0.2):.0%} only ({where})", ms("ours"),
        ms("ours_hot"), r["mix_vs_hot_cpu"], MIX_VS_HOT)
    row("2. grpcio front: server CPU per call vs grpcio floor", ms("ours"), ms("floor_sync"),
        r["grpcio_vs_floor_cpu"], GRPCIO_CPU)
    row("2. grpcio front: keys/s vs grpcio floor", rate("ours"), rate("floor_sync"), r["grpcio_vs_floor_keys"],
        GRPCIO_KEYS)
    row("2. native front: server CPU per call vs grpcio floor", ms("native"), ms("floor_sync"),
        r["native_vs_floor_cpu"], NATIVE_CPU)
    row("2. native front: keys/s vs grpcio floor", rate("native"), rate("floor_sync"), r["native_vs_floor_keys"],
        NATIVE_KEYS)
    row("2. second floor: native canned answer vs grpcio floor, CPU per call", ms("floor_native"), ms("floor_sync"),
        r["native_floor_vs_floor_cpu"], "-")
    row("   keys/s", rate("floor_native"), "", r["native_floor_vs_floor_keys"], "-")
    row("2. keys/s, grpcio front vs Redis Cluster (as many masters as workers)", "", rate("redis"),
        r["grpcio_vs_redis_keys"], VS_REDIS)
    row("2. keys/s, native front vs Redis Cluster", "", "", r["native_vs_redis_keys"], VS_REDIS)


def _profile_server(server: EmbeddedServer, base: LoadSpec, workdir: Path, console: Console) -> dict[str, Any]:
    """py-spy samples of a worker of the server while the load generator runs; on-CPU share per category."""
    import threading

    from loadtest.probes import profiling

    assert server.proc is not None
    seconds = max(3.0, base.duration_s)
    out_file = workdir / "server-profile.txt"
    result: dict[str, Any] = {}
    pid = max(process_tree(server.proc.pid))  # the youngest process: a worker

    def sample() -> None:
        time.sleep(1.0)
        result["file"] = profiling.record(pid, seconds, out_file)

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


def main(argv: list[str] | None = None) -> int:
    """Part 2 alone: the embedded default with ``--rows`` rows, its contenders, the rows with their targets."""
    import tempfile

    from loadtest.harness.plan import plan

    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--quick", action="store_true", help="shorter rounds")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default: the plan's)")
    ap.add_argument("--seconds", type=float, help="seconds per contender and round (default: the plan's)")
    ap.add_argument("--profile", action="store_true", help="py-spy a worker under the load")
    ap.add_argument("--hot-fraction", type=float, default=0.2, help="the hottest ranks of the hot-keys contender")
    cli.add_out(ap)
    args = ap.parse_args(argv)
    p = replace(plan(args.quick, None), rows=args.rows)
    p = replace(p, rounds=args.rounds or p.rounds, measure_s=args.seconds or p.measure_s)
    console = cli.console()
    workdir = Path(tempfile.mkdtemp(prefix="hps-bench-served-"))
    server = EmbeddedServer(workdir / "base", rows=p.rows, table_dim=DIM)
    try:
        console.print(f"  hps synth + hps import of {p.rows:,} x {DIM} rows")
        server.prepare().start(timeout=600)
        res = {"plan": p.__dict__, **part(p, server, workdir, console, args.profile, args.hot_fraction)}
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    path = cli.write_result(res, args.out, "bench-served")
    table = cli.RatioTable("2. served over gRPC (ratios measured side by side, interleaved)")
    rows(res, table.row)
    console.print(table)
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    cli.run(main)

"""A node's gRPC worker processes (issue 17) and colocated reads (issue 18), measured side by side in one run.

10. ``hps serve`` on the default configuration with every row of a table held (on a CPU no L1: the hash map's
    compiled pass over the complete table; so every batch of 1024 keys, dim 64, is all hits), loaded by the same
    multi-process gRPC client (``--clients`` processes, 4 connections each, so SO_REUSEPORT spreads them over the
    workers), beside the same node with ``server.front: native`` (pygrpc-native) when it is installed:
    a. server CPU per call (every process of the server: owner, fork server, workers) and keys/s, against the
       thread-pool floor (``loadtest.harness.floor_server``: the same proto and payload, no work) run with as many
       processes as the server has workers; targets (issue 52) <= 1.5x the CPU and >= 0.8x the keys/s with the
       grpcio front, <= 0.75x and >= 1.2x with the native one; pygrpc-native's canned answer is a second floor;
    b. keys/s with each worker count of ``--workers`` under that load, and against a Redis Cluster with as many
       masters as workers (hash-tagged MGET per master); target >= 1.5x;
    c. the server's PSS (/proc/PID/smaps_rollup, all its processes) for each worker count;
    d. unary p99 of that load with 2x``workers`` idle streams open vs none (``loadtest.benchmarks.streams``); target
       <= 1.2x.
11. One caller, batches of 1024 keys all held (L1 or the hash map): ``LocalClient`` (the store mapped read-only) vs ``HPSClient`` over gRPC vs
    a plain Redis Cluster client vs the raw NumPy gather of the same rows from a preallocated array; targets
    >= 10x gRPC, >= 0.3x the gather; 11e. ``LocalClient(out=)`` vs the gather at batches 256..16384, beside its
    bare compiled read (the L1 query, or the hash map's pass without L1: ``loadtest.benchmarks.local_sizes``); target >= 0.5x at each; 11f. LocalClient and the
    in-process lookup with L1 off vs L1 on (``loadtest.benchmarks.l1_off``); target >= 1x.

    python -m loadtest.benchmarks.node --quick                    # ~5 minutes on 2 cores
    python -m loadtest.benchmarks.node --workers 1,2,4,8,16 --clients 16 --rows 5000000    # a 16-core machine

On a 16-core (GPU) machine the second line measures every worker count in one run, with 16 load processes (64
connections) so that the clients are not the limit; L1 stays in host memory there too (workers share it through
the store; a device L1 is not shared with worker processes). Needs ``make install-dev`` and ``redis-server``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from hps_service.runtime.cpus import usable_cpus
from hps_service.runtime.processes import process_tree, pss_bytes
from loadtest.benchmarks import l1_off, local_sizes, streams
from loadtest.harness import cli
from loadtest.harness.embedded import EmbeddedServer, start_node
from loadtest.harness.floor_server import FloorServer
from loadtest.harness.loadgen import LoadSpec, run_load
from loadtest.harness.redis_baseline import loaded_cluster

MODEL, TABLE, DIM, BATCH = "demo", "item", 64, 1024


@dataclass(frozen=True)
class NodePlan:
    rows: int = 1_000_000
    workers: tuple[int, ...] = (1, 2)
    clients: int = 2
    concurrency: int = 8
    channels: int = 4
    measure_s: float = 6.0
    rounds: int = 2
    local_s: float = 1.5


def plan(quick: bool, rows: int | None, workers: str | None, clients: int | None) -> NodePlan:
    p = NodePlan(rows=200_000, measure_s=3.0, rounds=1, local_s=0.8) if quick else NodePlan()
    cpus = usable_cpus()
    p = replace(p, workers=tuple(sorted({1, cpus}))) if workers is None else p
    if rows is not None:
        p = replace(p, rows=rows)
    if workers is not None:
        p = replace(p, workers=tuple(int(w) for w in workers.split(",") if w.strip()))
    if clients is not None:
        p = replace(p, clients=clients, concurrency=max(p.concurrency, 4 * clients))
    return p


def _load(p: NodePlan, target: str, keys_file: Path, **kw: Any) -> LoadSpec:
    return LoadSpec(target=target, model=MODEL, tables=(TABLE,), batch=BATCH, workers=p.clients,
                    concurrency=p.concurrency, duration_s=p.measure_s, warmup_s=1.0, keys_file=str(keys_file),
                    distribution="uniform", channels=p.channels, **kw)


def _point(report: dict[str, Any]) -> dict[str, Any]:
    return {"keys_per_s": report["keys_per_s"], "p99_ms": report["latency_ms"]["p99"],
            "server_cpu_ms_per_call": report["server_cpu_ms_per_call"],
            "errors": sum(report["errors"].values()), "client_hit_rate": report.get("client_cache_hit_rate")}


def _mean(points: list[dict[str, Any]]) -> dict[str, Any]:
    out = {k: statistics.mean(pt[k] for pt in points if pt[k] is not None) for k in ("keys_per_s",
                                                                                      "server_cpu_ms_per_call")}
    out["p99_ms"] = statistics.median(pt["p99_ms"] or float("nan") for pt in points)
    out["errors"] = sum(pt["errors"] for pt in points)
    rates = [pt["client_hit_rate"] for pt in points if pt.get("client_hit_rate") is not None]
    out["l1_hit_rate"] = min(rates) if rates else None
    out["rounds"] = points
    return out


# ---------------------------------------------------------------------------------------------- 11. colocated reads
def bench_local(server: EmbeddedServer, store: Path, redis_seed: str | None, p: NodePlan) -> dict[str, Any]:
    """One caller, batches of 1024 keys all held in L1, interleaved in rounds of ``p.local_s`` per contender."""
    from hps_service.client import HPSClient
    from hps_service.local import LocalClient

    with np.load(server.keys_file) as archive:
        keys, vectors = archive["keys"], np.ascontiguousarray(archive["vectors"], dtype=np.float32)
    rng = np.random.default_rng(7)
    idx = [rng.integers(0, keys.shape[0], BATCH) for _ in range(64)]
    batches = [keys[i] for i in idx]
    out = np.empty((BATCH, DIM), np.float32)
    local = LocalClient(store)
    remote = HPSClient(server.target)
    assert local.mapped, "the store is not mapped"
    for b, i in zip(batches[:4], idx[:4]):  # the same rows, and all held (L1, or the hash map without it)
        got = local.lookup_with_sources(MODEL, TABLE, b)
        np.testing.assert_array_equal(got.vectors, vectors[i])
        assert np.isin(got.sources, (1, 2)).all(), np.bincount(got.sources)
        np.testing.assert_array_equal(remote.lookup(MODEL, TABLE, b), vectors[i])
    redis_driver = None
    if redis_seed is not None:
        from loadtest.harness.redis_baseline import RedisMgetDriver, cluster_layout

        redis_driver = RedisMgetDriver(cluster_layout(redis_seed), np.stack(batches), DIM)

    def local_call(j: int) -> None:
        local.lookup(MODEL, TABLE, batches[j % 64])

    def grpc_call(j: int) -> None:
        remote.lookup(MODEL, TABLE, batches[j % 64])

    def gather_call(j: int) -> None:
        np.take(vectors, idx[j % 64], axis=0, out=out, mode="clip")

    contenders: dict[str, Any] = {"local": local_call, "grpc": grpc_call, "gather": gather_call}
    loop = asyncio.new_event_loop()
    if redis_driver is not None:
        loop.run_until_complete(redis_driver.open())

        def redis_call(j: int) -> None:
            loop.run_until_complete(redis_driver.rows(j))

        contenders["redis"] = redis_call
    us = local_sizes.interleaved_us(contenders, 3 * p.local_s)
    if redis_driver is not None:
        loop.run_until_complete(redis_driver.close())
    loop.close()
    local.close()
    remote.close()
    rate = {name: BATCH / (1e-6 * us[name]) for name in contenders}
    return {"keys_per_s": rate, "us_per_call": us,
            "local_vs_grpc": rate["local"] / rate["grpc"], "local_vs_gather": rate["local"] / rate["gather"],
            "local_vs_redis": rate["local"] / rate["redis"] if "redis" in rate else None,
            "targets": {"local_vs_grpc": 10.0, "local_vs_gather": 0.3}}


# ---------------------------------------------------------------------------------------------- 10. workers
def _native_twin(server: EmbeddedServer) -> EmbeddedServer | None:
    """The node's table on a copy of its RocksDB, for a node with ``server.front: native`` (None without
    pygrpc-native)."""
    try:
        import pygrpc_native  # noqa: F401
    except ImportError:
        return None
    twin = EmbeddedServer(server.workdir.parent / "node-native", rows=server.rows, table_dim=DIM,
                          overrides={k: dict(v) for k, v in server.overrides.items()})
    twin.workdir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(server.workdir / "rocksdb", twin.workdir / "rocksdb", dirs_exist_ok=True)
    if not twin.keys_file.exists():
        shutil.copyfile(server.keys_file, twin.keys_file)
    return twin.prepare()


def bench_nodes(p: NodePlan, workdir: Path, console: Console) -> dict[str, Any]:
    # the default configuration (no L1 on a CPU), the hash map holding every row
    server = EmbeddedServer(workdir / "node", rows=p.rows, table_dim=DIM,
                            overrides={"volatile": {"capacity_rows": p.rows}})
    console.print(f"  hps synth + hps import of {p.rows:,} x {DIM} rows")
    server.prepare()
    twin = _native_twin(server)
    store = Path(tempfile.mkdtemp(prefix="hps-bench-store-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    out: dict[str, Any] = {"rows": p.rows, "client_processes": p.clients, "in_flight": p.concurrency,
                           "connections": p.clients * p.channels, "by_workers": {}}
    widest = max(p.workers)
    try:
        for w in p.workers:
            console.print(f"  workers {w}: start (the table preloaded into the hash map: complete)")
            start_node(server, w, store if w == widest else None)
            if twin is not None:
                start_node(twin, w, None, front="native", max_connection_age_s=0)
            try:
                assert server.proc is not None
                pids = process_tree(server.proc.pid)
                native_pids = process_tree(twin.proc.pid) if twin is not None and twin.proc is not None else []
                entry: dict[str, Any] = {"pss_bytes": pss_bytes(pids), "processes": len(pids),
                                         "load_average": []}
                spec = _load(p, server.target, server.keys_file, http_target=server.http_target)
                runs: dict[str, list[dict[str, Any]]] = {
                    "ours": [], "native": [], "floor_sync": [], "floor_native": [], "floor_aio": [], "redis": []}
                redis = loaded_cluster(server.keys_file, workdir, console, masters=w)
                redis_seed = redis.__enter__()
                try:
                    redis_pids = redis.pids() if redis_seed is not None else []
                    for r in range(p.rounds):
                        console.print(f"  workers {w}, round {r + 1}/{p.rounds}: ours, floors ({w} processes), "
                                      f"Redis Cluster ({w} masters)")
                        entry["load_average"].append(os.getloadavg()[0])
                        runs["ours"].append(_point(run_load(spec, process_tree(server.proc.pid))))
                        if twin is not None:
                            runs["native"].append(_point(run_load(
                                replace(spec, target=twin.target, http_target=twin.http_target), native_pids)))
                        for mode in ("sync", "aio", *(("native",) if twin is not None else ())):
                            threads = 2 if mode == "sync" else None  # as each worker: 2 handler threads
                            with FloorServer(mode, BATCH, workdir, processes=w, threads=threads) as floor:
                                runs[f"floor_{mode}"].append(_point(run_load(
                                    replace(spec, target=floor.target, http_target=None),
                                    process_tree(floor.proc.pid))))
                        if redis_seed is not None:
                            runs["redis"].append(_point(run_load(
                                replace(spec, backend="redis", target=redis_seed, http_target=None, channels=1),
                                redis_pids)))
                    console.print(f"  workers {w}: unary p99 without and with {2 * w} idle streams open")
                    entry["idle_streams"] = streams.measure(spec, 2 * w, p.rounds)
                    if w == widest:
                        console.print("  11. colocated reads: LocalClient, gRPC, Redis, raw gather")
                        out["local"] = bench_local(server, store, redis_seed, p)
                        console.print("  11e. LocalClient vs the raw gather at batches 256..16384")
                        out["local_sizes"] = local_sizes.measure(store, server.keys_file, MODEL, TABLE,
                                                                       4 * p.local_s)
                finally:
                    redis.__exit__(None, None, None)
                entry.update({name: _mean(rs) for name, rs in runs.items() if rs})
                ours = entry["ours"]
                floor = entry["floor_sync"]
                entry["cpu_vs_floor"] = ours["server_cpu_ms_per_call"] / floor["server_cpu_ms_per_call"]
                entry["keys_vs_floor"] = ours["keys_per_s"] / floor["keys_per_s"]
                entry["keys_vs_floor_aio"] = ours["keys_per_s"] / entry["floor_aio"]["keys_per_s"]
                entry["keys_vs_redis"] = ours["keys_per_s"] / entry["redis"]["keys_per_s"] if "redis" in entry else None
                if "native" in entry:
                    nat = entry["native"]
                    entry["native_cpu_vs_floor"] = nat["server_cpu_ms_per_call"] / floor["server_cpu_ms_per_call"]
                    entry["native_keys_vs_floor"] = nat["keys_per_s"] / floor["keys_per_s"]
                    entry["native_floor_cpu_vs_floor"] = (entry["floor_native"]["server_cpu_ms_per_call"]
                                                          / floor["server_cpu_ms_per_call"])
                    entry["native_keys_vs_redis"] = (nat["keys_per_s"] / entry["redis"]["keys_per_s"]
                                                     if "redis" in entry else None)
                out["by_workers"][w] = entry
            finally:
                server.stop()
                if twin is not None:
                    twin.stop()
        console.print("  11f. LocalClient and in-process lookups, L1 off vs L1 on")
        out["l1_off"] = l1_off.measure(server, workdir, console, seconds=3 * p.local_s)
        first = out["by_workers"][p.workers[0]]
        for entry in out["by_workers"].values():
            entry["keys_vs_first"] = entry["ours"]["keys_per_s"] / first["ours"]["keys_per_s"]
            entry["pss_vs_first"] = entry["pss_bytes"] / first["pss_bytes"]
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------- report
def table(res: dict[str, Any]) -> cli.RatioTable:
    t = cli.RatioTable("10-11. a node's worker processes and colocated reads (ratios measured side by side)")
    row = t.row
    for w, e in res.get("by_workers", {}).items():
        o, f = e["ours"], e["floor_sync"]
        load = "/".join(f"{a:.1f}" for a in e.get("load_average", []))
        row(f"10a. server CPU per all-hit call, workers {w}, grpcio front vs grpcio floor ({w} proc., load avg "
            f"{load})", f"{o['server_cpu_ms_per_call']:.3f} ms", f"{f['server_cpu_ms_per_call']:.3f} ms",
            e["cpu_vs_floor"], cli.at_most(1.5))
        row(f"10a. keys/s b1024 all-hit, workers {w}, grpcio front vs grpcio floor", f"{o['keys_per_s'] / 1e6:.2f} M "
            f"p99 {o['p99_ms']:.1f} ms", f"{f['keys_per_s'] / 1e6:.2f} M", e["keys_vs_floor"], cli.at_least(0.8))
        row("    vs aio floor", "", f"{e['floor_aio']['keys_per_s'] / 1e6:.2f} M", e["keys_vs_floor_aio"])
        if e.get("native"):
            n = e["native"]
            row(f"10a. server CPU per call, workers {w}, native front vs grpcio floor",
                f"{n['server_cpu_ms_per_call']:.3f} ms", f"{f['server_cpu_ms_per_call']:.3f} ms",
                e["native_cpu_vs_floor"], cli.at_most(0.75))
            row(f"10a. keys/s, workers {w}, native front vs grpcio floor", f"{n['keys_per_s'] / 1e6:.2f} M p99 "
                f"{n['p99_ms']:.1f} ms", f"{f['keys_per_s'] / 1e6:.2f} M", e["native_keys_vs_floor"],
                cli.at_least(1.2))
            row(f"10a. second floor: native canned answer vs grpcio floor, CPU per call, workers {w}",
                f"{e['floor_native']['server_cpu_ms_per_call']:.3f} ms", "", e["native_floor_cpu_vs_floor"], "-")
        if e.get("redis"):
            row(f"10b. keys/s workers {w}, grpcio front vs Redis Cluster, {w} masters", "",
                f"{e['redis']['keys_per_s'] / 1e6:.2f} M p99 {e['redis']['p99_ms']:.1f} ms", e["keys_vs_redis"],
                cli.at_least(1.5))
            if e.get("native_keys_vs_redis"):
                row(f"10b. keys/s workers {w}, native front vs Redis Cluster", "", "", e["native_keys_vs_redis"],
                    cli.at_least(1.5))
        row(f"10b. keys/s workers {w} vs workers {next(iter(res['by_workers']))}", f"{o['keys_per_s'] / 1e6:.2f} M", "",
            e["keys_vs_first"], "grows")
        row(f"10c. server PSS, workers {w} ({e['processes']} processes)", f"{e['pss_bytes'] / 2**20:.0f} MiB", "",
            e["pss_vs_first"], "<= 1.15 (2 vs 1)", None if w == 1 else e["pss_vs_first"] <= 1.15)
        if e.get("idle_streams"):
            row(*streams.report_row(w, e["idle_streams"]))
    loc = res.get("local")
    if loc:
        r, us = loc["keys_per_s"], loc["us_per_call"]
        row("11. LocalClient vs HPSClient over gRPC, 1024 keys all held", f"{r['local'] / 1e6:.2f} M keys/s "
            f"({us['local']:.0f} us)", f"{r['grpc'] / 1e6:.2f} M ({us['grpc']:.0f} us)", loc["local_vs_grpc"],
            cli.at_least(10))
        row("11. LocalClient vs raw NumPy gather", "", f"{r['gather'] / 1e6:.2f} M ({us['gather']:.0f} us)",
            loc["local_vs_gather"], cli.at_least(0.3))
        if loc.get("local_vs_redis"):
            row("11. LocalClient vs Redis Cluster client", "", f"{r['redis'] / 1e6:.2f} M ({us['redis']:.0f} us)",
                loc["local_vs_redis"])
    if res.get("l1_off"):
        l1_off.rows(res["l1_off"], row)
    for size in res.get("local_sizes") or []:
        row(f"11e. LocalClient(out=) vs raw gather, batch {size['batch']} ({size['all_hit_batches']:.0%} of the "
            f"batches all from the first level)", f"{size['us']['local']:.1f} us",
            f"{size['us']['gather']:.1f} us", size["local_vs_gather"], cli.at_least(size["target"]))
        row("     its bare compiled read vs the gather (the client's limit)", f"{size['us']['query']:.1f} us", "",
            size["query_vs_gather"])
    return t


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--quick", action="store_true", help="200k rows, shorter runs")
    ap.add_argument("--rows", type=int, help="rows of the table (all of them in L1)")
    ap.add_argument("--workers", help="worker counts to measure, e.g. 1,2,4,8,16 (default: 1 and the CPUs)")
    ap.add_argument("--clients", type=int, help="load-generator processes (default 2)")
    cli.add_out(ap)
    args = ap.parse_args(argv)
    p = plan(args.quick, args.rows, args.workers, args.clients)
    console = cli.console()
    workdir = Path(tempfile.mkdtemp(prefix="hps-bench-node-"))
    try:
        res = {"plan": p.__dict__, **bench_nodes(p, workdir, console)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    path = cli.write_result(res, args.out, "bench-node")
    console.print(table(res))
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    cli.run(main)

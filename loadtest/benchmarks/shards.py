"""Sharding benchmarks, measured side by side in one run on this machine (part 8 of ``make bench``).

1. Fan-out through the client: keys/s and p99 of batch 1024 and 4096 lookups with ``AsyncHPSClient`` against an
   unsharded server, the same server through the client's routing path (hash, split, reassemble: one shard), and
   the table split over 2 and 4 shards (`hps serve` each, every row cached in L1 so the servers cost little and the
   fan-out shows), interleaved round by round; ratio = keys/s / the unsharded server's.
2. Import of a 1M-row table: `hps import` unsharded vs into each of 2 shards (each reads the whole file and keeps its
   half), one after the other and both at once (as two pods would).

    python -m loadtest.benchmarks.shards            # ~3 min on 2 cores
    python -m loadtest.benchmarks.shards --quick
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from loadtest.harness import cli
from loadtest.harness.embedded import EmbeddedServer, synth_model
from loadtest.harness.loadgen import process_cpu_s

MODEL, TABLE, DIM = "demo", "item", 64
HPS = [sys.executable, "-m", "hps_service.cli.main"]


@dataclass(frozen=True)
class Plan:
    rows: int
    import_rows: int
    batches: tuple[int, ...]
    shard_counts: tuple[int, ...]
    measure_s: float
    rounds: int
    workers: int
    in_flight: int


def plan(quick: bool) -> Plan:
    if quick:
        return Plan(rows=100_000, import_rows=200_000, batches=(1024, 4096), shard_counts=(2, 4), measure_s=2.0,
                    rounds=1, workers=2, in_flight=4)
    return Plan(rows=200_000, import_rows=1_000_000, batches=(1024, 4096), shard_counts=(2, 4), measure_s=4.0,
                rounds=2, workers=2, in_flight=4)


# ---------------------------------------------------------------------------------------------- load
def _worker(targets: list[str], keys_file: str, batch: int, in_flight: int, duration_s: float, seed: int,
            ready: Any, go: Any, start_at: Any, out: Any) -> None:
    """One client process: ``in_flight`` closed-loop lookups through AsyncHPSClient from the common start on;
    puts (latencies, keys, cpu)."""
    from hps_client import AsyncHPSClient

    with np.load(keys_file) as archive:
        keys = archive["keys"]
    rng = np.random.default_rng(seed)
    pool = [keys[rng.integers(0, keys.shape[0], batch)] for _ in range(64)]

    async def run() -> tuple[list[float], int, float]:
        latencies: list[float] = []
        async with AsyncHPSClient(targets, timeout=30) as client:
            await client.lookup(MODEL, TABLE, pool[0])  # learn the shard map and connect before the clock starts
            ready.put(True)
            await asyncio.to_thread(go.wait)
            while time.monotonic() < start_at.value:  # CLOCK_MONOTONIC: one clock for every process
                await asyncio.sleep(0.001)
            cpu0 = time.process_time()
            end = start_at.value + duration_s

            async def loop(i: int) -> None:
                n = i
                while time.monotonic() < end:
                    t = time.perf_counter()
                    await client.lookup(MODEL, TABLE, pool[n % len(pool)])
                    latencies.append(time.perf_counter() - t)
                    n += in_flight

            await asyncio.gather(*(loop(i) for i in range(in_flight)))
            return latencies, len(latencies) * batch, time.process_time() - cpu0

    out.put(asyncio.run(run()))


def measure(targets: list[str], server_pids: list[int], keys_file: Path, batch: int, p: Plan,
            seed: int) -> dict[str, float]:
    """keys/s, p50/p99 (ms), and client and server CPU per call, of ``p.workers`` processes x ``p.in_flight``
    calls in flight (CPU time is what contention on a shared machine disturbs least)."""
    ctx = mp.get_context("spawn")
    out, ready, go, start_at = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    procs = [ctx.Process(target=_worker, args=(targets, str(keys_file), batch, p.in_flight, p.measure_s,
                                               seed + w, ready, go, start_at, out)) for w in range(p.workers)]
    for proc in procs:
        proc.start()
    for _ in procs:  # spawned workers import numpy and grpc, load keys, connect and learn the shard map
        ready.get(timeout=300)
    start_at.value = time.monotonic() + 0.1
    server_cpu0 = process_cpu_s(server_pids)
    go.set()
    results = [out.get(timeout=120 + p.measure_s) for _ in procs]
    server_cpu = process_cpu_s(server_pids) - server_cpu0
    for proc in procs:
        proc.join(30)
    latencies = np.concatenate([np.asarray(r[0]) for r in results])
    calls = latencies.shape[0]
    return {"keys_per_s": sum(r[1] for r in results) / p.measure_s, "calls": int(calls),
            "p50_ms": float(np.percentile(latencies, 50) * 1e3), "p99_ms": float(np.percentile(latencies, 99) * 1e3),
            "client_cpu_ms_per_call": sum(r[2] for r in results) / max(calls, 1) * 1e3,
            "server_cpu_ms_per_call": server_cpu / max(calls, 1) * 1e3}


# ---------------------------------------------------------------------------------------------- 1. fan-out
def start_fleet(workdir: Path, keys_file: Path, rows: int, shards: int, console: Console) -> list[EmbeddedServer]:
    """``shards`` servers of the table (each imports the file and keeps its shard), every row cached in L1."""
    servers = []
    for shard in range(shards):
        cluster = {"shards": shards, "shard": shard, "partitions": 24}
        srv = EmbeddedServer(workdir / f"s{shards}-{shard}", rows=rows, table_dim=DIM,
                             overrides={"cluster": cluster, "cache": {"capacity": 1.0, "backend": "numpy"},
                                        "server": {"grpc_workers": 2}})
        srv.workdir.mkdir(parents=True, exist_ok=True)
        if not srv.keys_file.exists():
            os.link(keys_file, srv.keys_file)  # the same table file: prepare() skips hps synth
        servers.append(srv.prepare())
    for srv in servers:
        srv.start()
    console.print(f"  {shards} shard(s) serving on {', '.join(s.target for s in servers)}")
    return servers


def warm(targets: list[str], keys: np.ndarray) -> None:
    """Look every key up twice so every server holds its rows in L1."""
    from hps_client import HPSClient

    with HPSClient(targets, timeout=60) as client:
        for _ in range(2):
            for lo in range(0, keys.shape[0], 16384):
                client.lookup(MODEL, TABLE, keys[lo : lo + 16384])


def bench_fanout(p: Plan, workdir: Path, console: Console) -> dict[str, Any]:
    keys_file = synth_model(workdir / f"{MODEL}-{TABLE}-{p.rows}x{DIM}.npz", p.rows, DIM)
    with np.load(keys_file) as archive:
        keys = archive["keys"]
    fleets: dict[str, list[EmbeddedServer]] = {}
    try:
        fleets["unsharded"] = start_fleet(workdir, keys_file, p.rows, 1, console)
        for s in p.shard_counts:
            fleets[f"{s} shards"] = start_fleet(workdir, keys_file, p.rows, s, console)
        one = fleets["unsharded"][0]
        pids = {name: [srv.proc.pid for srv in fleet if srv.proc is not None] for name, fleet in fleets.items()}
        pids["1 shard (routed)"] = pids["unsharded"]
        contenders = {
            "unsharded": [one.target],
            # the same server through the routing path (hash, split, reassemble): named twice, so the client cannot
            # make it its one unsharded channel and learns the shard map (1 shard) instead
            "1 shard (routed)": [f"ipv4:{one.target}"] * 2,
            **{f"{s} shards": [srv.target for srv in fleets[f"{s} shards"]] for s in p.shard_counts},
        }
        for targets in contenders.values():
            warm(targets, keys)
        runs: dict[int, dict[str, list[dict[str, float]]]] = {b: {c: [] for c in contenders} for b in p.batches}
        for r in range(p.rounds):
            for batch in p.batches:
                order = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
                console.print(f"  round {r + 1}/{p.rounds}, batch {batch}: {', '.join(order)}")
                for name in order:
                    runs[batch][name].append(measure(contenders[name], pids[name], keys_file, batch, p,
                                                     seed=100 * r + batch))
    finally:
        for fleet in fleets.values():
            for srv in fleet:
                srv.stop()
    out: dict[str, Any] = {"rows": p.rows, "dim": DIM, "client_processes": p.workers,
                           "in_flight": p.workers * p.in_flight, "per_batch": {}}
    for batch, by_name in runs.items():
        base = statistics.mean(x["keys_per_s"] for x in by_name["unsharded"])
        rows = {}
        for name, rs in by_name.items():
            kps = statistics.mean(x["keys_per_s"] for x in rs)
            rows[name] = {"keys_per_s": kps, "p50_ms": statistics.median(x["p50_ms"] for x in rs),
                          "p99_ms": statistics.median(x["p99_ms"] for x in rs),
                          "client_cpu_ms_per_call": statistics.mean(x["client_cpu_ms_per_call"] for x in rs),
                          "server_cpu_ms_per_call": statistics.mean(x["server_cpu_ms_per_call"] for x in rs),
                          "ratio": kps / base, "rounds": rs}
        base_cpu = rows["unsharded"]["client_cpu_ms_per_call"] + rows["unsharded"]["server_cpu_ms_per_call"]
        for r in rows.values():
            r["cpu_ratio"] = (r["client_cpu_ms_per_call"] + r["server_cpu_ms_per_call"]) / base_cpu
        out["per_batch"][str(batch)] = rows
    return out


# ---------------------------------------------------------------------------------------------- 2. import
def _import_config(path: Path, db: Path, shards: int, shard: int) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({
        "persistent": {"type": "rocksdb", "path": str(db)},
        "cluster": {"shards": shards, "shard": shard, "partitions": 24},
        "models": [{"name": MODEL, "tables": [{"name": TABLE, "dim": DIM}]}],
    }))
    return path


def _import(config: Path, source: Path) -> subprocess.Popen:
    return subprocess.Popen([*HPS, "import", "--config", str(config), "--model", MODEL, "--table", TABLE,
                             str(source)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cli.REPO)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(procs: list[subprocess.Popen], t0: float, cpu0: float) -> tuple[float, float, list[str]]:
    """Wall seconds since ``t0`` until every process ended, their CPU seconds (since ``cpu0``), their outputs."""
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"hps import failed: {err.strip()[-1000:]}")
        outs.append(" ".join(out.split()))
    return time.perf_counter() - t0, _children_cpu_s() - cpu0, outs


def _run_imports(*configs: Path, source: Path) -> tuple[float, float, list[str]]:
    """``hps import`` of ``source`` with each config, all at once; wall and CPU seconds, outputs."""
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    return _timed([_import(c, source) for c in configs], t0, cpu0)


def bench_import(p: Plan, workdir: Path, console: Console) -> dict[str, Any]:
    source = synth_model(workdir / f"import-{p.import_rows}x{DIM}.npz", p.import_rows, DIM, seed=3)
    cfg = lambda name, shards, shard: _import_config(workdir / f"{name}.yaml", workdir / name / "rocksdb",  # noqa: E731
                                                     shards, shard)
    console.print(f"  hps import of {p.import_rows:,} x {DIM}: unsharded, 2 shards one after the other, both at once")
    # each a whole `hps import` process (interpreter start included, as a pod's init container would run it)
    t_one, cpu_one, _ = _run_imports(cfg("one", 1, 0), source=source)
    t_s0, cpu_s0, out0 = _run_imports(cfg("seq0", 2, 0), source=source)
    t_s1, cpu_s1, out1 = _run_imports(cfg("seq1", 2, 1), source=source)
    t_both, cpu_both, _ = _run_imports(cfg("par0", 2, 0), cfg("par1", 2, 1), source=source)
    return {"rows": p.import_rows, "unsharded_s": t_one, "shard0_s": t_s0, "shard1_s": t_s1,
            "two_shards_sequential_s": t_s0 + t_s1, "two_shards_parallel_s": t_both,
            "unsharded_cpu_s": cpu_one, "shard0_cpu_s": cpu_s0, "shard1_cpu_s": cpu_s1,
            "two_shards_parallel_cpu_s": cpu_both,
            "ratio_per_shard": max(t_s0, t_s1) / t_one, "ratio_parallel": t_both / t_one,
            "ratio_sequential": (t_s0 + t_s1) / t_one,
            "cpu_ratio_per_shard": max(cpu_s0, cpu_s1) / cpu_one, "cpu_ratio_both": (cpu_s0 + cpu_s1) / cpu_one,
            "shard_output": [out0[0], out1[0]]}


# ---------------------------------------------------------------------------------------------- report
def table(res: dict[str, Any]) -> Table:
    t = Table(title="sharding: fan-out through the client and import, side by side in one run", header_style="bold")
    for col in ("benchmark", "contender", "M keys/s", "p50 ms", "p99 ms", "CPU ms/call client + servers",
                "ratio keys/s", "ratio CPU"):
        t.add_column(col, justify="left" if col in ("benchmark", "contender") else "right")
    for batch, rows in (res.get("fanout") or {}).get("per_batch", {}).items():
        for name, r in rows.items():
            t.add_row(f"8. fan-out, batch {batch}", name, f"{r['keys_per_s'] / 1e6:.2f}", f"{r['p50_ms']:.1f}",
                      f"{r['p99_ms']:.1f}", f"{r['client_cpu_ms_per_call']:.2f} + {r['server_cpu_ms_per_call']:.2f}",
                      f"{r['ratio']:.2f}x", f"{r['cpu_ratio']:.2f}x")
    imp = res.get("import")
    if imp:
        t.add_row(f"8. import {imp['rows']:,} rows", "unsharded", "", "", "", f"CPU {imp['unsharded_cpu_s']:.1f} s",
                  f"{imp['unsharded_s']:.1f} s", "")
        t.add_row("", "2 shards: each (the slower)", "", "", "",
                  f"CPU {max(imp['shard0_cpu_s'], imp['shard1_cpu_s']):.1f} s",
                  f"{max(imp['shard0_s'], imp['shard1_s']):.1f} s = {imp['ratio_per_shard']:.2f}x",
                  f"{imp['cpu_ratio_per_shard']:.2f}x")
        t.add_row("", "2 shards: both at once", "", "", "", f"CPU {imp['two_shards_parallel_cpu_s']:.1f} s",
                  f"{imp['two_shards_parallel_s']:.1f} s = {imp['ratio_parallel']:.2f}x",
                  f"{imp['cpu_ratio_both']:.2f}x")
        t.add_row("", "2 shards: one after the other", "", "", "", "",
                  f"{imp['two_shards_sequential_s']:.1f} s = {imp['ratio_sequential']:.2f}x", "")
    return t


def run(quick: bool, console: Console, skip: set[str] | None = None) -> dict[str, Any]:
    """Both parts; the result is JSON-ready."""
    p = plan(quick)
    skip = skip or set()
    res: dict[str, Any] = {"plan": asdict(p)}
    workdir = Path(tempfile.mkdtemp(prefix="hps-bench-shards-"))
    try:
        if "fanout" not in skip:
            console.rule("8. sharding: fan-out through the client (1, 2, 4 shards beside an unsharded server)")
            res["fanout"] = bench_fanout(p, workdir, console)
        if "import" not in skip:
            console.rule(f"8. sharding: import of {p.import_rows:,} rows into 2 shards vs 1")
            res["import"] = bench_import(p, workdir, console)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", default="", help="fanout,import")
    args = ap.parse_args(argv)
    console = cli.console(140)
    res = run(args.quick, console, {s.strip() for s in args.skip.split(",") if s.strip()})
    console.print(table(res))
    return 0


if __name__ == "__main__":
    cli.run(main)

"""Load generator for hps-service: asyncio gRPC (grpc.aio) over several worker processes.

    python -m loadtest.harness.loadgen --target 127.0.0.1:8500 --http 127.0.0.1:8000 --model demo --table item \\
        --keys var/demo/demo.npz --batch 1024 --concurrency 8 --duration 10
    python -m loadtest.harness.loadgen --embedded --sweep 200,400,800      # starts the embedded default itself

Closed loop keeps N calls in flight; open loop sends at a target rate and times each call from its intended
send time (no coordinated omission). Keys are zipf(alpha) or uniform over the table's key set. Reports QPS,
keys/s, p50/p95/p99/p99.9, errors by status code, the client-seen L1 hit rate and the server's hit rate per
tier (from /v1/stats), as a rich table, JSON under loadtest/results/ and PNG plots.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hps_service.errors import HPSError, InvalidArgumentError, UnavailableError
from loadtest.harness import cli
from loadtest.harness.report import (
    merge,
    plot_hit_rate,
    plot_latency_vs_load,
    print_summary,
    print_sweep,
    summarize,
)
from loadtest.harness.runner import Backend, Mode, WorkerSpec, worker_main
from loadtest.harness.server_stats import StatsPoller
from loadtest.harness.workload import Distribution

#: Seconds a worker may take to load keys, draw its pool and connect.
READY_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class LoadSpec:
    """One run of the load generator."""

    target: str
    model: str
    tables: tuple[str, ...]
    batch: int = 1024
    mode: Mode = "closed"
    workers: int = 2
    concurrency: int = 8  # closed loop: calls in flight over all workers
    qps: float = 0.0  # open loop: target rate over all workers
    duration_s: float = 10.0
    warmup_s: float = 2.0
    keys_file: str | None = None
    key_range: int | None = None
    distribution: Distribution = "zipf"
    alpha: float = 1.05
    http_target: str | None = None  # host:port of the REST API, for /v1/stats
    backend: Backend = "grpc"
    dim: int = 64
    timeout_s: float = 10.0
    seed: int = 1
    channels: int = 1  # grpc connections per load process (spread over a node's worker processes)

    def validate(self) -> None:
        if self.workers < 1:
            raise InvalidArgumentError(f"workers must be >= 1, got {self.workers}")
        if not self.tables:
            raise InvalidArgumentError("name at least one table")
        if self.mode == "closed" and self.concurrency < self.workers:
            raise InvalidArgumentError(f"concurrency {self.concurrency} is below the {self.workers} workers")
        if self.warmup_s < 0 or self.duration_s <= 0:
            raise InvalidArgumentError("warm-up must be >= 0 and duration > 0 seconds")

    def worker_specs(self) -> list[WorkerSpec]:
        """Each worker's share: calls in flight (closed) or rate (open), and its own seed."""
        specs = []
        for w in range(self.workers):
            specs.append(WorkerSpec(
                backend=self.backend, target=self.target, model=self.model, tables=tuple(self.tables),
                batch=self.batch, mode=self.mode,
                concurrency=self.concurrency // self.workers + (1 if w < self.concurrency % self.workers else 0),
                qps=self.qps / self.workers, duration_s=self.warmup_s + self.duration_s,
                seed=self.seed * 1000 + w, keys_file=self.keys_file, key_range=self.key_range,
                distribution=self.distribution, alpha=self.alpha, dim=self.dim, timeout_s=self.timeout_s,
                channels=self.channels,
            ))
        return specs


def _stop_all(processes: list[mp.process.BaseProcess]) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(10)


def process_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds used so far by the processes ``pids`` (Linux /proc); a process that is gone counts
    nothing (take the pids just before the run)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
    return total / ticks


def run_load(spec: LoadSpec, server_pids: list[int] | None = None) -> dict[str, Any]:
    """Run ``spec`` over ``spec.workers`` processes and return its report (see :func:`report.summarize`).

    With ``server_pids`` the report also gives the CPU those processes used per call over the whole run."""
    spec.validate()
    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    start = {"event": ctx.Event(), "t0": ctx.Value("d", 0.0)}
    processes = [
        ctx.Process(target=worker_main, args=(ws, ready, start, results, i), name=f"loadgen-{i}", daemon=True)
        for i, ws in enumerate(spec.worker_specs())
    ]
    for p in processes:
        p.start()
    poller: StatsPoller | None = None
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for _ in processes:
            try:
                worker_id, error = ready.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise UnavailableError(f"load workers not ready within {READY_TIMEOUT_S:.0f} s") from None
            if error:
                raise UnavailableError(f"load worker {worker_id} failed to start:\n{error}")
        if spec.http_target:
            poller = StatsPoller(spec.http_target, spec.model, tuple(spec.tables)).start()
        server_cpu0 = process_cpu_s(server_pids) if server_pids else 0.0
        t0 = time.monotonic() + 0.2
        start["t0"].value = t0
        start["event"].set()
        collected = []
        wait_s = spec.warmup_s + spec.duration_s + spec.timeout_s + 60
        for _ in processes:
            try:
                worker_id, samples, error = results.get(timeout=wait_s)
            except queue.Empty:
                raise UnavailableError(f"load workers did not finish within {wait_s:.0f} s") from None
            if error:
                raise UnavailableError(f"load worker {worker_id} failed:\n{error}")
            collected.append(samples)
        server_cpu = process_cpu_s(server_pids) - server_cpu0 if server_pids else None
        for p in processes:
            p.join(10)
    finally:
        if poller is not None:
            poller.stop()
        _stop_all(processes)
    report = summarize(merge(collected), spec.warmup_s, spec.duration_s)
    report["config"] = asdict(spec)
    report["server_cpu_ms_per_call"] = (server_cpu * 1e3 / report["calls_total"]
                                        if server_cpu is not None and report["calls_total"] else None)
    report["server_hit_rate"] = None
    report["server_timeline"] = []
    if poller is not None and poller.reachable:
        report["server_hit_rate"] = poller.window(t0 + spec.warmup_s, t0 + spec.warmup_s + spec.duration_s)
        report["server_timeline"] = poller.timeline(t0)
    return report


def run_sweep(spec: LoadSpec, steps: list[float]) -> list[dict[str, Any]]:
    """Open-loop runs at each offered rate in ``steps``."""
    if not steps or any(q <= 0 for q in steps):
        raise InvalidArgumentError(f"sweep steps must be positive rates, got {steps}")
    return [run_load(replace(spec, mode="open", qps=q)) for q in steps]


def save(report: dict[str, Any], sweep: list[dict[str, Any]], out_dir: Path, name: str,
         plots: bool = True) -> list[Path]:
    """Write ``<name>.json`` (the run and the sweep) and its PNG plots into ``out_dir``."""
    written = [cli.write_json({"run": report, "sweep": sweep}, out_dir / f"{name}.json")]
    if plots:
        written.append(plot_hit_rate(report, out_dir / f"{name}-hit-rate.png"))
        if sweep:
            written.append(plot_latency_vs_load(sweep, out_dir / f"{name}-latency-vs-load.png"))
    return written


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(__spec__, __doc__)
    where = p.add_argument_group("server")
    where.add_argument("--target", help="gRPC host:port")
    where.add_argument("--http", dest="http_target", help="REST host:port, for the hit rates of /v1/stats")
    where.add_argument("--model", default="demo")
    where.add_argument("--table", dest="tables", action="append", help="table to look up (repeat: tables per request)")
    where.add_argument("--embedded", action="store_true",
                       help="start the embedded default server on free ports with a generated table and load it")
    where.add_argument("--rows", type=int, default=200_000, help="--embedded: rows of the generated table")
    where.add_argument("--dim", type=int, default=64, help="--embedded: dim of the generated table")
    keys = p.add_argument_group("keys")
    keys.add_argument("--keys", dest="keys_file", help=".npz with a keys array (as hps synth writes) or .npy")
    keys.add_argument("--key-range", type=int, help="draw from keys 0..N-1 instead of a keys file")
    keys.add_argument("--dist", dest="distribution", choices=("zipf", "uniform"), default="zipf")
    keys.add_argument("--alpha", type=float, default=1.05, help="zipf exponent")
    load = p.add_argument_group("load")
    load.add_argument("--batch", type=int, default=1024, help="keys per table per request")
    load.add_argument("--mode", choices=("closed", "open"), default="closed")
    load.add_argument("--concurrency", type=int, default=8, help="closed loop: calls in flight, all workers")
    load.add_argument("--qps", type=float, default=0.0, help="open loop: target requests/s, all workers")
    load.add_argument("--sweep", default="", help="comma-separated open-loop rates run after the main run")
    load.add_argument("--workers", type=int, default=2, help="client processes")
    load.add_argument("--duration", dest="duration_s", type=float, default=10.0, help="measured seconds per run")
    load.add_argument("--warmup", dest="warmup_s", type=float, default=2.0, help="unmeasured seconds first")
    load.add_argument("--timeout", dest="timeout_s", type=float, default=10.0, help="per-call deadline (s)")
    load.add_argument("--seed", type=int, default=1)
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=cli.RESULTS, help="directory for JSON and PNG results")
    out.add_argument("--name", default=None, help="file name stem (default: loadgen-<timestamp>)")
    out.add_argument("--no-plots", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    console = cli.console()
    tables = tuple(args.tables or ["item"])
    steps = [float(s) for s in args.sweep.split(",") if s.strip()]
    name = args.name or time.strftime("loadgen-%Y%m%d-%H%M%S")
    server = None
    scratch = None
    try:
        if args.embedded:
            from loadtest.harness.embedded import EmbeddedServer

            scratch = tempfile.TemporaryDirectory(prefix="hps-loadtest-")
            console.print(f"starting the embedded default server with a generated {args.rows} x {args.dim} table")
            server = EmbeddedServer(Path(scratch.name), rows=args.rows, table_dim=args.dim,
                                    model=args.model, table=tables[0]).prepare().start()
            args.target, args.http_target, args.keys_file = server.target, server.http_target, str(server.keys_file)
        if not args.target:
            raise InvalidArgumentError("give --target HOST:PORT (or --embedded)")
        if args.keys_file is None and args.key_range is None:
            raise InvalidArgumentError("give --keys FILE (.npz/.npy) or --key-range N: the key set to draw from")
        spec = LoadSpec(
            target=args.target, model=args.model, tables=tables, batch=args.batch, mode=args.mode,
            workers=args.workers, concurrency=args.concurrency, qps=args.qps, duration_s=args.duration_s,
            warmup_s=args.warmup_s, keys_file=args.keys_file, key_range=args.key_range,
            distribution=args.distribution, alpha=args.alpha, http_target=args.http_target, timeout_s=args.timeout_s,
            seed=args.seed,
        )
        report = run_load(spec)
        print_summary(report, console, title=f"{spec.mode} loop, batch {spec.batch} x {len(tables)} table(s), "
                                             f"{spec.distribution}, {spec.workers} workers")
        sweep = run_sweep(replace(spec, warmup_s=min(spec.warmup_s, 1.0)), steps) if steps else []
        if sweep:
            print_sweep(sweep, console)
        for path in save(report, sweep, args.out, name, plots=not args.no_plots):
            console.print(f"wrote {path}")
        return 1 if report["errors"] else 0
    except HPSError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return 2
    finally:
        if server is not None:
            server.stop()
        if scratch is not None:
            scratch.cleanup()


if __name__ == "__main__":
    cli.run(main)

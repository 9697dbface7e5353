"""12. What tracing costs (issue 32): server CPU per gRPC call of 1024 all-hit keys (dim 64) and keys/s, measured side
by side in one run, rounds interleaved, on four servers of the same table with the node's default worker processes:

- ``base``: the code of the base commit (``--base``, 1a18ab6 by default: before tracing existed), from ``git archive``;
- ``off``: this checkout, ``server.tracing`` off (the default): target the base's CPU (no cost when off);
- ``unsampled``: tracing on, ``sample_ratio: 0`` (the interceptors run, no span is recorded);
- ``on``: tracing on, every call sampled: a SERVER span and an ``hps.lookup`` span per call, exported over
  OTLP/gRPC to a collector this process runs (tests.fixtures.otlp_collector).

CPU is that of every process of each server (owner, fork server, workers), from /proc, over the measured seconds;
each figure is the median over the rounds (a loaded machine makes single rounds vary by 2x).

    python -m loadtest.benchmarks.tracing --quick     # ~3 min on 2 cores
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hps_service.runtime.processes import process_tree
from loadtest.benchmarks.node import NodePlan, _load, _point
from loadtest.harness import cli
from loadtest.harness.embedded import EmbeddedServer, table_stats
from loadtest.harness.loadgen import run_load
from tests.fixtures.otlp_collector import OtlpCollector

DIM = 64
BASE = "1a18ab6"
#: The contenders, in the order of the first round (later rounds rotate it).
NAMES = ("base", "off", "unsampled", "on")


@dataclass(frozen=True)
class TracingPlan:
    rows: int = 100_000
    measure_s: float = 3.0
    rounds: int = 6


def plan(quick: bool) -> TracingPlan:
    return TracingPlan(rows=50_000, measure_s=2.0, rounds=4) if quick else TracingPlan(measure_s=3.0, rounds=6)


def base_tree(commit: str) -> Path:
    """The code of ``commit`` under build/ (kept: its compiled kernels are cached beside it for the next run)."""
    sha = subprocess.run(["git", "rev-parse", "--short=12", commit], cwd=cli.REPO, check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = cli.REPO / "build" / f"bench-base-{sha}"
    if not (tree / "hps_service").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=cli.REPO, check=True, capture_output=True)
        with tempfile.TemporaryFile() as f:
            f.write(archive.stdout)
            f.seek(0)
            with tarfile.open(fileobj=f) as tar:
                tar.extractall(tree, filter="data")
    return tree


def _server(workdir: Path, name: str, rows: int, source: Path, tracing: dict[str, Any] | None) -> EmbeddedServer:
    """Every row in L1 and the hash map (so each call is all hits), the node's default worker processes."""
    overrides: dict[str, dict[str, Any]] = {
        "cache": {"backend": "numpy", "capacity": 2 * rows, "admit_after_misses": 1},
        "volatile": {"capacity_rows": rows}}
    if tracing is not None:
        overrides["server"] = {"tracing": tracing}
    return EmbeddedServer(workdir / name, rows=rows, table_dim=DIM, overrides=overrides, source=source)


def _wait_warm(server: EmbeddedServer) -> None:
    deadline = time.monotonic() + 600
    while (stats := table_stats(server))["cache"]["rows"] < 0.999 * server.rows:
        if time.monotonic() > deadline:
            raise TimeoutError(f"L1 not warm after 600 s: {stats['cache']}")
        time.sleep(0.5)


def run(quick: bool, console: Console, base: str = BASE) -> dict[str, Any]:
    p = plan(quick)
    load = NodePlan(measure_s=p.measure_s)
    workdir = Path(tempfile.mkdtemp(prefix="hps-bench-tracing-"))
    out: dict[str, Any] = {"rows": p.rows, "rounds": p.rounds, "base_commit": base, "batch": 1024, "dim": DIM}
    servers: dict[str, EmbeddedServer] = {}
    try:
        with OtlpCollector(keep=False) as collector:
            tracing = {"enabled": True, "endpoint": collector.endpoint}
            servers = {
                "base": _server(workdir, "base", p.rows, base_tree(base), None),
                "off": _server(workdir, "off", p.rows, cli.REPO, None),
                "unsampled": _server(workdir, "unsampled", p.rows, cli.REPO, {**tracing, "sample_ratio": 0.0}),
                "on": _server(workdir, "on", p.rows, cli.REPO, {**tracing, "sample_ratio": 1.0}),
            }
            console.print(f"  hps import of {p.rows:,} x {DIM} rows into each of {', '.join(servers)}; serve; warm L1")
            for server in servers.values():
                server.prepare().start(timeout=600)
            for server in servers.values():
                _wait_warm(server)
            points: dict[str, list[dict[str, Any]]] = {name: [] for name in NAMES}
            for r in range(p.rounds):
                order = NAMES[r % len(NAMES):] + NAMES[:r % len(NAMES)]
                console.print(f"  round {r + 1}/{p.rounds}: {', '.join(order)}")
                for name in order:
                    s = servers[name]
                    assert s.proc is not None
                    spec = _load(load, s.target, s.keys_file, http_target=s.http_target)
                    points[name].append(_point(run_load(spec, process_tree(s.proc.pid))))
            out["spans_received"] = collector.spans.received
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    for name, pts in points.items():
        out[name] = {**{k: statistics.median(pt[k] for pt in pts) for k in ("server_cpu_ms_per_call", "keys_per_s",
                                                                            "p99_ms")},
                     "errors": sum(pt["errors"] for pt in pts),
                     "client_hit_rate": min(pt["client_hit_rate"] or 0.0 for pt in pts), "rounds": pts}
    cpu = {name: out[name]["server_cpu_ms_per_call"] for name in NAMES}
    keys = {name: out[name]["keys_per_s"] for name in NAMES}
    out["cpu_off_vs_base"] = cpu["off"] / cpu["base"]
    out["cpu_unsampled_vs_off"] = cpu["unsampled"] / cpu["off"]
    out["cpu_on_vs_off"] = cpu["on"] / cpu["off"]
    out["keys_off_vs_base"] = keys["off"] / keys["base"]
    out["keys_on_vs_off"] = keys["on"] / keys["off"]
    return out


def table(res: dict[str, Any]) -> Table:
    t = Table(title=f"12. tracing: server CPU per all-hit call of {res['batch']} keys (ratios measured side by side, "
                    f"{res['rounds']} interleaved rounds)", header_style="bold")
    for col in ("server", "CPU ms/call", "keys/s", "p99 ms", "L1 hits", "errors", "CPU vs", "ratio", "target"):
        t.add_column(col, justify="left" if col in ("server", "CPU vs") else "right")
    vs = {"base": ("", None, ""), "off": ("base", res["cpu_off_vs_base"], "<= 1.05 (no cost when off)"),
          "unsampled": ("off", res["cpu_unsampled_vs_off"], ""), "on": ("off", res["cpu_on_vs_off"], "")}
    for name in NAMES:
        r = res[name]
        other, ratio, target = vs[name]
        t.add_row(f"{name}" + (f" ({res['base_commit']})" if name == "base" else ""), f"{r['server_cpu_ms_per_call']:.3f}",
                  f"{r['keys_per_s']:,.0f}", f"{r['p99_ms']:.2f}", f"{r['client_hit_rate']:.4f}", str(r["errors"]), other, f"{ratio:.3f}" if ratio else "", target)
    return t


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--base", default=BASE, help="the commit the 'base' server runs (before tracing)")
    cli.add_out(ap)
    args = ap.parse_args(argv)
    console = cli.console()
    res = run(args.quick, console, args.base)
    path = cli.write_result(res, args.out, "bench-tracing")
    console.print(table(res))
    console.print(f"spans received by the collector: {res['spans_received']:,}; wrote {path}")
    return 0


if __name__ == "__main__":
    cli.run(main)

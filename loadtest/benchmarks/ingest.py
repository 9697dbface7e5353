"""Lookups under sustained ingest: keys/s served over gRPC with and without a concurrent ingest of 10,000 rows/s of
Kafka updates, in one run (rounds interleaved), and where the ingest's cost goes.

    python -m loadtest.benchmarks.ingest                       # ~2 min (part of make bench)
    python -m loadtest.benchmarks.ingest --rows 1000000 --rounds 3 --profile
    python -m loadtest.benchmarks.ingest --persistent '{"compaction_threads": 1}'     # a RocksDB setting to compare

``hps serve`` runs the embedded default (L1 = 20% of the table, the hash map holds every row, RocksDB) with Kafka
updates from a local tansu broker; the load generator's worker processes keep 8 calls of 1024 zipf(1.05) keys in
flight over 8 connections (with one per load process, the kernel put both on one of a node's two workers half the
time, and the phases differed by which it did: idle phases of one build ranged 0.60-1.10 M keys/s). In the ingest
phases a publisher thread sends ``--rate`` rows/s of existing keys (each a versioned update: RocksDB multi-get of
the stored versions, a synced write batch, the hash map, the rows present in L1). Target:
keys/s with ingest >= 0.8x keys/s without. Per phase it reports the server's CPU by thread (RocksDB's background
compaction and flush threads, librdkafka, the Python threads), the rows applied per second, and with
``--profile`` a py-spy profile of who holds the server's GIL during ingest (the lookups need it): the consumer
thread's share split into the stored-version read, the write batch, the hash map and L1, decoding and polling.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console

from hps_service.runtime.processes import process_tree
from hps_service.updates import Publisher
from loadtest.harness import cli
from loadtest.harness.embedded import EmbeddedServer
from loadtest.harness.loadgen import LoadSpec, process_cpu_s, run_load
from loadtest.harness.plan import Plan
from loadtest.harness.workload import load_keys

MODEL, TABLE, DIM = "demo", "item", 64
PREFIX = "bench"


class Ingest:
    """Publishes ``rate`` rows/s of ``keys`` (random, new rows, rising versions) in chunks every ``every_s``."""

    def __init__(self, publisher: Publisher, keys: np.ndarray, dim: int, rate: int, every_s: float = 0.1) -> None:
        self.publisher, self.keys, self.dim, self.rate, self.every_s = publisher, keys, dim, rate, every_s
        self.version = 0
        self.rows_sent = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ingest", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        self.publisher.flush(30)

    def _run(self) -> None:
        rng = np.random.default_rng(self.version)
        chunk = max(1, round(self.rate * self.every_s))
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.version += 1
            keys = self.keys[rng.integers(0, self.keys.shape[0], chunk)]
            rows = rng.standard_normal((chunk, self.dim), dtype=np.float32)
            self.publisher.publish(TABLE, keys, rows, self.version)
            self.rows_sent += chunk
            next_at += self.every_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread group of ``pid``: RocksDB's background threads, librdkafka's, the Python threads
    (gRPC handlers, the update consumer, ...: Python does not name its OS threads) and other native ones."""
    import os

    groups: Counter[str] = Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick
        if comm.startswith("rocksdb:"):
            group = "rocksdb background (compaction, flush)"
        elif comm.startswith("rdk:"):
            group = "librdkafka"
        elif comm.startswith(("python", "hps")):
            group = "python threads (gRPC handlers, consumer, ...)"
        else:
            group = "other native (gRPC core, numba, ...)"
        groups[group] += seconds
    return dict(groups)


def _drained(http_target: str, rows_sent: int, timeout_s: float = 60.0) -> None:
    """Wait until the server applied every row published so far (so no backlog spills into the next phase)."""
    deadline = time.monotonic() + timeout_s
    while _applied_rows(http_target) < rows_sent and time.monotonic() < deadline:
        time.sleep(0.1)


def _applied_rows(http_target: str) -> int:
    return int(httpx.get(f"http://{http_target}/v1/stats", timeout=10).json()["updates"]["rows_received"])


def _applied_batches(http_target: str) -> int:
    return int(httpx.get(f"http://{http_target}/v1/stats", timeout=10).json()["updates"]["batches_applied"])


#: The RocksDB tier's modules whose lines name the update path's steps.
_ROCKSDB_FILES = ("rocksdb/tier.py", "rocksdb/staging.py")


def _rocksdb_lines() -> dict[tuple[str, int], str]:
    """(module, line) of RocksDBTier.put's steps, to name the innermost frames py-spy reports inside it."""
    names = {}
    for module in _ROCKSDB_FILES:
        source = (cli.REPO / "hps_service" / "tiers" / module).read_text().splitlines()
        for i, line in enumerate(source, start=1):
            if "stored_states(cf, encoded" in line or "return decode_states(" in line:
                names[(module, i)] = "RocksDB: read the stored versions (multi-get)"
            elif "self._db.write(batch" in line:
                names[(module, i)] = "RocksDB: synced write batch"
            elif "drain(map(batch.put" in line or "encode_rows(" in line or "encode_keys(" in line:
                names[(module, i)] = "RocksDB: encode and fill the batch"
    return names


def consumer_breakdown(collapsed: Path) -> dict[str, Any]:
    """Samples of a ``py-spy record --threads`` file: share per thread, and the update consumer's split by step."""
    lines = _rocksdb_lines()
    by_thread: Counter[str] = Counter()
    steps: Counter[str] = Counter()
    total = 0
    for raw in collapsed.read_text().splitlines():
        stack, _, n = raw.rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = stack.split(";")
        thread = frames[0].partition(": ")[2] or frames[0]
        name = ("update consumer" if thread.startswith("hps-updates") else
                "gRPC handlers" if thread.startswith("grpc") else
                "stall detector" if thread.startswith("hps-stall") else thread)
        by_thread[name] += count
        if name != "update consumer":
            continue
        step = "other"
        for frame in reversed(frames):
            module = next((m for m in _ROCKSDB_FILES if f"tiers/{m}:" in frame), None)
            if module is not None:
                line = int(frame.rpartition(":")[2].rstrip(")"))
                step = lines.get((module, line), "RocksDB: other")
                break
            if "tiers/hashmap/" in frame:
                step = "hash map tier"
                break
            if "hps_service/cache/" in frame:
                step = "L1 refresh"
                break
            if "updates/message.py" in frame or "decode_update" in frame:
                step = "decode messages"
                break
            if "_next_batch" in frame or "_refresh_consumer_lag" in frame or "_commit" in frame:
                step = "poll, commit, lag"
                break
            if "resolve_latest" in frame:
                step = "latest version per key"
                break
        steps[step] += count
    consumer = by_thread.get("update consumer", 0)
    return {
        "samples": total,
        "threads": {k: v / total for k, v in by_thread.most_common()} if total else {},
        "consumer_steps": {k: v / consumer for k, v in steps.most_common()} if consumer else {},
    }


def run(rows: int, rate: int, rounds: int, measure_s: float, workers: int, concurrency: int, profile: bool,
        persistent: dict[str, Any], workdir: Path, quiet: bool = False, publish_every_s: float = 0.1) -> dict[str, Any]:
    """Start broker and server, alternate phases without and with ingest; return the measurements."""
    from hps_service.updates.local_broker import running_tansu

    def say(text: str) -> None:
        if not quiet:
            print(text, flush=True)

    out: dict[str, Any] = {"rows": rows, "rate_rows_per_s": rate, "publish_every_s": publish_every_s,
                           "persistent": persistent, "phases": []}
    with running_tansu() as broker:
        publisher = Publisher(broker.bootstrap, MODEL, topic_prefix=PREFIX, partitions=4, **{"linger.ms": 5})
        server = EmbeddedServer(workdir, rows=rows, table_dim=DIM, overrides={
            "updates": {"type": "kafka", "brokers": broker.bootstrap, "topic_prefix": PREFIX, "group": "bench"},
            "persistent": persistent,
        })
        say(f"setup: hps synth + hps import of {rows:,} x {DIM} rows, hps serve with Kafka updates")
        server.prepare().start()
        try:
            assert server.proc is not None
            pid = server.proc.pid
            deadline = time.monotonic() + 120
            while httpx.get(f"http://{server.http_target}/readyz", timeout=5).status_code != 200:
                if time.monotonic() > deadline:
                    raise TimeoutError("the server did not become ready")
                time.sleep(0.2)
            spec = LoadSpec(target=server.target, model=MODEL, tables=(TABLE,), batch=1024, workers=workers,
                            concurrency=concurrency, duration_s=measure_s, warmup_s=1.0,
                            keys_file=str(server.keys_file), http_target=server.http_target, dim=DIM,
                            channels=4)  # 8 connections, so the kernel spreads them over a node's workers
            keys = load_keys(server.keys_file)
            ingest = Ingest(publisher, keys, DIM, rate, publish_every_s)
            say("warm-up: 5 s of lookups with ingest (kernels compiled, L1 filled, RocksDB flushing)")
            ingest.start()
            run_load(replace(spec, duration_s=5.0, warmup_s=0.0))
            ingest.stop()
            _drained(server.http_target, ingest.rows_sent)
            for r in range(rounds):
                for phase in (("idle", "ingest") if r % 2 == 0 else ("ingest", "idle")):
                    if phase == "ingest":
                        ingest.start()
                        time.sleep(2.0)  # the consumer at its steady pace before the window opens
                    batches0 = _applied_batches(server.http_target)
                    broker0, own0 = process_cpu_s([broker.process.pid]), time.process_time()
                    workers = process_tree(pid)[1:]  # a node's fork server and gRPC worker processes
                    applied0, cpu0, t0 = _applied_rows(server.http_target), thread_cpu(pid), time.monotonic()
                    workers0 = process_cpu_s(workers)
                    report = run_load(spec, [pid])
                    elapsed = time.monotonic() - t0
                    applied1, cpu1 = _applied_rows(server.http_target), thread_cpu(pid)
                    workers_s = process_cpu_s(workers) - workers0
                    broker_s, own_s = process_cpu_s([broker.process.pid]) - broker0, time.process_time() - own0
                    batches = _applied_batches(server.http_target) - batches0
                    if phase == "ingest":
                        ingest.stop()
                        _drained(server.http_target, ingest.rows_sent)
                    entry = {
                        "phase": phase, "round": r + 1, "keys_per_s": report["keys_per_s"],
                        "p50_ms": report["latency_ms"]["p50"], "p99_ms": report["latency_ms"]["p99"],
                        "errors": sum(report["errors"].values()),
                        "server_cpu_ms_per_call": report["server_cpu_ms_per_call"],
                        "applied_rows_per_s": (applied1 - applied0) / elapsed,
                        "applied_batches_per_s": batches / elapsed,
                        "server_cores": {k: (cpu1.get(k, 0.0) - cpu0.get(k, 0.0)) / elapsed for k in cpu1},
                        "worker_processes_cores": workers_s / elapsed,
                        "broker_cores": broker_s / elapsed,
                        "publisher_process_cores": own_s / elapsed,
                    }
                    out["phases"].append(entry)
                    say(f"  round {r + 1} {phase:6s}: {entry['keys_per_s'] / 1e6:.3f} M keys/s, p99 "
                        f"{entry['p99_ms']:.1f} ms, applied {entry['applied_rows_per_s']:,.0f} rows/s in "
                        f"{entry['applied_batches_per_s']:.0f} batches/s, server cores "
                        + ", ".join(f"{k.split(' (')[0]} {v:.2f}" for k, v in entry["server_cores"].items())
                        + f"; worker processes {entry['worker_processes_cores']:.2f}"
                        + f"; broker {entry['broker_cores']:.2f}, publisher process {entry['publisher_process_cores']:.2f}")
            if profile:
                out["profile"] = _profile(spec, ingest, pid, workdir, say)
        finally:
            server.stop()
            publisher.close(10)
    idle = [p["keys_per_s"] for p in out["phases"] if p["phase"] == "idle"]
    busy = [p["keys_per_s"] for p in out["phases"] if p["phase"] == "ingest"]
    out["keys_per_s_idle"] = statistics.mean(idle)
    out["keys_per_s_ingest"] = statistics.mean(busy)
    out["ratio"] = out["keys_per_s_ingest"] / out["keys_per_s_idle"]
    out["applied_rows_per_s"] = statistics.mean(p["applied_rows_per_s"] for p in out["phases"] if p["phase"] == "ingest")
    out["target"] = 0.8
    return out


def _profile(spec: LoadSpec, ingest: Ingest, pid: int, workdir: Path, say) -> dict[str, Any]:  # noqa: ANN001
    """py-spy of every busy server thread while lookups and the ingest run."""
    from loadtest.probes import profiling

    exe = profiling.py_spy()
    if exe is None:
        return {"error": "py-spy not found"}
    import subprocess

    seconds = max(4.0, spec.duration_s)
    out_file = workdir / "ingest-profile.txt"
    ingest.start()
    time.sleep(2.0)
    spy = subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "100",
                            "--format", "raw", "--threads", "--gil", "--nonblocking", "--output", str(out_file)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_load(replace(spec, duration_s=seconds + 1.0))
    spy.wait(seconds + 60)
    ingest.stop()
    if not out_file.is_file():
        return {"error": "py-spy could not sample the server"}
    result = consumer_breakdown(out_file)
    result["gil_busy"] = profiling.gil_busy(out_file, seconds, rate=100)
    kept = cli.RESULTS / "bench-ingest-profile.txt"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_bytes(out_file.read_bytes())
    result["collapsed_stacks"] = str(kept)
    say(f"  GIL held {result['gil_busy']:.0%} of the time during lookups + ingest (py-spy --gil); by thread: "
        + ", ".join(f"{k} {v:.0%}" for k, v in result["threads"].items() if v >= 0.01))
    say("  update consumer's GIL time: " + ", ".join(f"{k} {v:.0%}" for k, v in result["consumer_steps"].items()))
    return result


def part(p: Plan, workdir: Path, console: Console, profile: bool) -> dict[str, Any]:
    """Part 7 of ``make bench``: :func:`run` on a table of the plan's rows, lookups with and without 10k rows/s of
    updates."""
    result = run(rows=p.rows, rate=10_000, rounds=p.rounds + 1, measure_s=p.measure_s, workers=p.workers,
                 concurrency=p.concurrency, profile=profile, persistent={}, workdir=workdir / "ingest", quiet=False)
    console.print(f"  lookups with 10,000 rows/s of ingest: {result['ratio']:.2f}x of those without")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--rows", type=int, default=200_000, help="rows of the served table")
    ap.add_argument("--rate", type=int, default=10_000, help="ingested rows per second in the ingest phases")
    ap.add_argument("--publish-every", type=float, default=0.1, help="seconds between publishes of rate x this")
    ap.add_argument("--rounds", type=int, default=3, help="pairs of phases (without, with ingest), interleaved")
    ap.add_argument("--measure", type=float, default=6.0, help="seconds of lookups per phase")
    ap.add_argument("--workers", type=int, default=2, help="load generator processes")
    ap.add_argument("--concurrency", type=int, default=8, help="calls in flight")
    ap.add_argument("--profile", action="store_true", help="py-spy the server's threads during ingest")
    ap.add_argument("--persistent", default="{}", help="JSON of persistent.* settings for the server")
    cli.add_json(ap)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hps-bench-ingest-") as tmp:
        res = run(args.rows, args.rate, args.rounds, args.measure, args.workers, args.concurrency, args.profile,
                  json.loads(args.persistent), Path(tmp), publish_every_s=args.publish_every)
    print(f"lookups with {args.rate:,} rows/s of ingest ({res['applied_rows_per_s']:,.0f} applied/s): "
          f"{res['keys_per_s_ingest'] / 1e6:.3f} M keys/s vs {res['keys_per_s_idle'] / 1e6:.3f} M keys/s without: "
          f"ratio {cli.judged(res['ratio'], cli.at_least(res['target']))}")
    if args.json:
        cli.write_json(res, args.json)
    return 0


if __name__ == "__main__":
    cli.run(main)

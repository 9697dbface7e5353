"""Unary p99 with idle StreamLookup calls open (issue 29): 2x``workers`` streams, each answered once and then waiting
for its next request, must leave the unary calls their threads; target: p99 within 1.2x of the p99 without them.

    python -m loadtest.benchmarks.streams --quick          # ~1 minute on 2 cores: workers 1 and 2
    python -m loadtest.benchmarks.streams --workers 1,2,4,8,16 --rows 1000000

Part 10 of ``loadtest.benchmarks.node`` measures it too, on the server and load it has running (rows ``10d``).
"""

from __future__ import annotations

import queue
import shutil
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from loadtest.harness import cli
from loadtest.harness.embedded import EmbeddedServer, start_node
from loadtest.harness.loadgen import LoadSpec, run_load

#: The ratio of unary p99 with the idle streams open to the p99 without them that the issue asks for, at most.
TARGET = 1.2


class IdleStreams:
    """``n`` StreamLookup calls to ``target``, each on a connection of its own (a node's kernel hands each to one
    worker), each answered once and then idle until :meth:`close`."""

    def __init__(self, target: str, n: int, model: str, table: str, keys: np.ndarray) -> None:
        from hps_service.client import build_request
        from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc

        self._stack = ExitStack()
        self._feeds: list[queue.Queue] = []
        request = build_request(model, {table: keys})
        try:
            for _ in range(n):
                channel = self._stack.enter_context(grpc.insecure_channel(
                    target, options=[("grpc.use_local_subchannel_pool", 1)]))
                feed: queue.Queue = queue.Queue()
                self._feeds.append(feed)
                answers = pb_grpc.EmbeddingServiceStub(channel).StreamLookup(_drain(feed), timeout=3600)
                self._stack.callback(answers.cancel)
                feed.put(request)
                next(answers)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for feed in self._feeds:
            feed.put(None)
        self._stack.close()

    def __enter__(self) -> IdleStreams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drain(feed: queue.Queue) -> Iterator[Any]:
    while (request := feed.get()) is not None:
        yield request


def measure(spec: LoadSpec, streams: int, rounds: int) -> dict[str, Any]:
    """Unary p99 of ``spec``'s load without and with ``streams`` idle streams open, interleaved over ``rounds``;
    the ratio of the medians and the calls that failed with the streams open."""
    assert spec.keys_file is not None
    with np.load(spec.keys_file) as archive:
        keys = np.asarray(archive["keys"][:8], dtype=np.int64)
    without, with_streams, errors = [], [], 0
    for _ in range(rounds):
        without.append(_p99(run_load(spec)))
        with IdleStreams(spec.target, streams, spec.model, spec.tables[0], keys):
            report = run_load(spec)
        with_streams.append(_p99(report))
        errors += sum(report["errors"].values())
    base, loaded = statistics.median(without), statistics.median(with_streams)
    return {"streams": streams, "p99_ms_without": base, "p99_ms_with": loaded, "ratio": loaded / base,
            "errors_with_streams": errors, "target": TARGET, "rounds": {"without": without, "with": with_streams}}


def _p99(report: dict[str, Any]) -> float:
    """The run's p99 in ms; infinite when no call was answered (every one failed)."""
    p99 = report["latency_ms"]["p99"]
    return float("inf") if p99 is None else p99


def report_row(workers: int, res: dict[str, Any]) -> tuple[str, str, str, float, cli.Target, bool]:
    """The benchmark row (name, ours, baseline, ratio, target, met) of :func:`measure`'s result."""
    errors = res["errors_with_streams"]
    return (f"10d. unary p99, workers {workers}, {res['streams']} idle streams open vs none",
            f"{res['p99_ms_with']:.1f} ms" + (f", {errors} errors" if errors else ""),
            f"{res['p99_ms_without']:.1f} ms", res["ratio"], cli.at_most(TARGET),
            res["ratio"] <= TARGET and not errors)


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--quick", action="store_true", help="50k rows, 3 s runs, 2 rounds")
    ap.add_argument("--rows", type=int, help="rows of the table (all of them in L1)")
    ap.add_argument("--workers", default="1,2", help="worker counts to measure (default 1,2)")
    ap.add_argument("--clients", type=int, default=2, help="load-generator processes")
    args = ap.parse_args(argv)
    rows = args.rows or (50_000 if args.quick else 200_000)
    measure_s, rounds = (3.0, 2) if args.quick else (6.0, 3)
    console = cli.console()
    t = cli.RatioTable("unary p99 with idle streams open")
    workdir = Path(tempfile.mkdtemp(prefix="hps-bench-streams-"))
    try:
        server = EmbeddedServer(workdir / "node", rows=rows, table_dim=64, overrides={
            "cache": {"backend": "numpy", "capacity": 2 * rows, "admit_after_misses": 1},
            "volatile": {"capacity_rows": rows}})
        server.prepare()
        for w in (int(x) for x in args.workers.split(",") if x.strip()):
            start_node(server, w, None)  # every row in L1: the calls are all hits
            try:
                spec = LoadSpec(target=server.target, model=server.model, tables=(server.table,), batch=1024,
                                workers=args.clients, concurrency=4 * args.clients, duration_s=measure_s,
                                warmup_s=1.0, keys_file=str(server.keys_file), distribution="uniform", channels=4)
                console.print(f"  workers {w}: {rounds} rounds without and with {2 * w} idle streams")
                res = measure(spec, 2 * w, rounds)
            finally:
                server.stop()
            t.row(*report_row(w, res))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    console.print(t)
    return 0


if __name__ == "__main__":
    cli.run(main)

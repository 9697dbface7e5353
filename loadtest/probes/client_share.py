"""The client's share of a Lookup: ``HPSClient`` against bare stub calls with the same request, all against the
transport floor (``loadtest.harness.floor_server``, one fixed answer), so that the server's cost is the same for every
contender and the difference is the client's. Interleaved rounds; the median of each contender's process CPU per
call (this process: Python and gRPC's own threads) and its wall time.

    python -m loadtest.probes.client_share --batch 1024 --dim 64 --rounds 15 --calls 300
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from rich.console import Console
from rich.table import Table

from hps_client import HPSClient
from hps_client.channel import channel_options
from hps_client.stub import LOOKUP
from hps_client.wire import build_request
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from loadtest.harness import cli
from loadtest.harness.floor_server import FloorServer

MODEL, TABLE = "demo", "item"
#: The contender the others are measured against: the generated stub, protobuf both ways.
BASELINE = "generated stub (protobuf both ways)"


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(batch: int, dim: int, rounds: int, calls: int, workdir: Path) -> dict[str, dict[str, float]]:
    """``{contender: {"cpu_us": ..., "wall_us": ...}}``, medians over ``rounds`` interleaved rounds of ``calls``."""
    rng = np.random.default_rng(0)
    keys = [rng.integers(0, 1 << 40, batch) for _ in range(64)]
    requests = [build_request(MODEL, {TABLE: k}) for k in keys]
    raw_requests = [r.SerializeToString() for r in requests]
    with FloorServer("sync", batch, workdir, dim=dim) as floor:
        client = HPSClient(floor.target)
        plain = grpc.insecure_channel(floor.target, options=[("grpc.max_receive_message_length", -1)])
        tuned = grpc.insecure_channel(floor.target, options=channel_options())
        generated = pb_grpc.EmbeddingServiceStub(plain)
        raw = plain.unary_unary(LOOKUP, request_serializer=None, response_deserializer=None)
        raw_tuned = tuned.unary_unary(LOOKUP, request_serializer=None, response_deserializer=None)
        out = np.empty((batch, dim), np.float32)
        contenders: dict[str, Callable[[int], Any]] = {
            "HPSClient.lookup": lambda j: client.lookup(MODEL, TABLE, keys[j]),
            "HPSClient.lookup(out=)": lambda j: client.lookup(MODEL, TABLE, keys[j], out=out),
            BASELINE: lambda j: np.frombuffer(generated.Lookup(requests[j], timeout=5).tables[0].vectors, "<f4"),
            "HPSClient's stub, request built": lambda j: client.transport._stub.Lookup(requests[j], timeout=5),
            "raw bytes both ways": lambda j: raw(raw_requests[j], timeout=5),
            "raw bytes, HPSClient's channel options": lambda j: raw_tuned(raw_requests[j], timeout=5),
        }
        try:
            want = np.frombuffer(generated.Lookup(requests[0], timeout=5).tables[0].vectors, "<f4").reshape(batch, dim)
            np.testing.assert_array_equal(client.lookup(MODEL, TABLE, keys[0]), want)
            for fn in contenders.values():
                for j in range(min(calls, 64)):
                    fn(j % 64)
            cpu: dict[str, list[float]] = {name: [] for name in contenders}
            wall: dict[str, list[float]] = {name: [] for name in contenders}
            for _ in range(rounds):
                for name, fn in contenders.items():
                    t0, c0 = time.perf_counter(), _process_cpu()
                    for j in range(calls):
                        fn(j % 64)
                    cpu[name].append((_process_cpu() - c0) / calls * 1e6)
                    wall[name].append((time.perf_counter() - t0) / calls * 1e6)
        finally:
            client.close()
            plain.close()
            tuned.close()
    return {name: {"cpu_us": statistics.median(cpu[name]), "wall_us": statistics.median(wall[name])}
            for name in contenders}


def report(results: dict[str, dict[str, float]], batch: int, console: Console) -> None:
    base = results[BASELINE]["cpu_us"]
    table = Table(title=f"client CPU per Lookup of {batch} keys against the floor (medians of interleaved rounds)")
    for col in ("contender", "process CPU us/call", f"vs {BASELINE}", "wall us/call"):
        table.add_column(col, justify="left" if col == "contender" else "right")
    for name, r in results.items():
        table.add_row(name, f"{r['cpu_us']:.1f}", f"{r['cpu_us'] / base:.2f}x", f"{r['wall_us']:.1f}")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__spec__, __doc__)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(args.batch, args.dim, args.rounds, args.calls, Path(tmp))
    report(results, args.batch, Console())
    return 0


if __name__ == "__main__":
    cli.run(main)

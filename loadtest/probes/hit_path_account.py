"""Where the CPU of one all-hit Lookup goes inside our server, layer by layer, in one process with no transport:
the protobuf parse the floor pays too, the servicer's checks and metrics, the engine facade, the L1 probe and
gather, the response encode; each measured alone on the same request, beside the raw NumPy gather of the same
rows. Issue 29's account of the difference to the bare gRPC floor starts here (the floor's own cost per call is
``make bench`` part 10).

    python -m loadtest.probes.hit_path_account --batch 1024 --dim 64
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from hps_service.config import load_config
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.serve.process import HPSServer
from hps_service.server.grpc_service import EmbeddingServicer
from hps_service.server.wire import ResponseBuffer
from loadtest.harness import cli
from tests.helpers import free_port

MODEL, TABLE = "demo", "item"


class _NoDeadline:
    """What the servicer asks of a gRPC context on the hit path: the time left (none here)."""

    def time_remaining(self) -> float | None:
        return None


def cpu_us(fn: Callable[[], Any], calls: int) -> float:
    """Thread CPU per call in microseconds (the best of 3 runs of ``calls``)."""
    for _ in range(min(calls, 200)):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls * 1e6)
    return best


def measure(batch: int, dim: int, rows: int, calls: int) -> list[tuple[str, float]]:
    """(layer, µs per call), outermost first."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            None,
            server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "workers": 0,
                    "max_batch_keys": max(batch, 4096)},
            cache={"enabled": True, "backend": "numpy", "capacity": rows, "warm_start": False},
            volatile={"type": "hashmap", "capacity_rows": rows},
            persistent={"type": "rocksdb", "path": str(Path(tmp) / "rocksdb"), "block_cache_mb": 8},
            models=[{"name": MODEL, "tables": [{"name": TABLE, "dim": dim}]}],
        )
        srv = HPSServer(cfg)
        srv.start()
        try:
            engine = srv.engine
            assert engine is not None
            all_keys = np.arange(rows, dtype=np.int64)
            table_rows = np.random.default_rng(0).standard_normal((rows, dim), dtype=np.float32)
            engine.apply_updates(MODEL, TABLE, all_keys, table_rows, 1)
            keys = np.random.default_rng(1).choice(rows, batch, replace=False).astype(np.int64)
            for _ in range(4):  # the request's keys read again until all of them are admitted to L1
                engine.lookup(MODEL, TABLE, keys)
            request_bytes = pb.LookupRequest(
                model=MODEL, tables=[pb.TableKeys(table=TABLE, keys=keys.astype("<i8").tobytes())]).SerializeToString()
            request = pb.LookupRequest.FromString(request_bytes)
            servicer = EmbeddingServicer(engine, cfg.server, srv.gate, srv.metrics)
            context: Any = _NoDeadline()
            t = engine.table(MODEL, TABLE)
            assert t.cache is not None
            out = np.empty((batch, dim), dtype=np.float32)
            sources = np.empty(batch, dtype=np.uint8)
            buf = ResponseBuffer()
            index = keys.copy()
            gathered = np.empty((batch, dim), dtype=np.float32)
            hit = t.cache.lookup(keys, out)
            assert hit.all(), f"{int((~hit).sum())} of {batch} keys missed L1"
            return [
                ("servicer._serve_one (what a Lookup handler runs)",
                 cpu_us(lambda: servicer._serve_one("Lookup", request, context), calls)),
                ("servicer.lookup (no metrics, no auth)", cpu_us(lambda: servicer.lookup(request, context), calls)),
                ("engine.lookup into reused buffers", cpu_us(lambda: engine.lookup(MODEL, TABLE, keys, out, sources),
                                                             calls)),
                ("TableCache.lookup (L1 probe + gather)", cpu_us(lambda: t.cache.lookup(keys, out), calls)),
                ("ResponseBuffer layout + finish (encode)", cpu_us(
                    lambda: (buf.layout(MODEL, TABLE, batch, dim, 0), buf.finish()), calls)),
                ("protobuf parse of the request (the floor pays it)",
                 cpu_us(lambda: pb.LookupRequest.FromString(request_bytes), calls)),
                ("raw NumPy gather (np.take into a buffer)",
                 cpu_us(lambda: np.take(table_rows, index, axis=0, out=gathered), calls)),
            ]
        finally:
            srv.stop(grace=1)


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    layers = measure(args.batch, args.dim, args.rows, args.calls)
    total = layers[0][1]
    out = Table(title=f"one all-hit Lookup of {args.batch} keys x {args.dim}, thread CPU per call (no transport)")
    for col in ("layer", "µs/call", "share of _serve_one"):
        out.add_column(col, justify="right" if col != "layer" else "left")
    for name, us in layers:
        out.add_row(name, f"{us:.1f}", f"{us / total:.2f}")
    Console().print(out)
    return 0


if __name__ == "__main__":
    cli.run(main)

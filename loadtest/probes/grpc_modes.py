"""Sync gRPC server (thread pool) vs grpc.aio for Lookup, batch 1024, dim 64, measured from another process.

Run: ``python -m loadtest.probes.grpc_modes --seconds 8 --concurrency 1 8 --rows 1000000 --cache-fraction 0.2``.
Each server mode runs in its own subprocess over a copy of the same RocksDB store and the same L1 config; this
process is the client (grpc.aio, the same client for every mode, ``concurrency`` requests in flight). Modes are
driven in interleaved slices (``--rounds``), so load that drifts on a shared machine falls on every mode alike. Keys
are zipf(1.05) over the table; L1 holds ``--cache-fraction`` of it and the hash-map tier all of it.

Modes: ``sync`` is the production server (HPSServer, ``server.grpc_workers`` threads: the cores); ``aio`` is a
grpc.aio server whose lookups run in a thread pool (never on the event loop); ``aio-inline`` runs lookups on the
event loop (for reference only: it would stall every other call during a slow L3 read). Prints keys/s and p50/p99
per mode and the ratios to sync. A hybrid (aio, lookups inline while L1 and the hash map answer them, only RocksDB
and Redis reads on threads) was built and measured on 2 cores: no faster than ``sync`` at 8 in flight and slower at
1 (p50 3.1 vs 2.4 ms), so the production server stays a thread pool.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import yaml

from hps_service.admin.importer import import_table, synthesize_model
from hps_service.config import HPSConfig, load_config
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.tiers.rocksdb.tier import RocksDBTier
from loadtest.harness import cli

MODES = ("sync", "aio", "aio-inline")
BATCH, DIM = 1024, 64


def _config(workdir: Path, port: int, rows: int, cache_fraction: float) -> dict:
    return {
        "server": {"host": "127.0.0.1", "grpc_port": port, "http_port": 0},  # grpc_workers: the default (cores)
        "cache": {"capacity": cache_fraction},
        "volatile": {"type": "hashmap", "capacity_rows": rows},
        "persistent": {"type": "rocksdb", "path": str(workdir / "rocksdb")},
        "models": [{"name": "bench", "tables": [{"name": "item", "dim": DIM}]}],
    }


# ---- server side (a subprocess) ----------------------------------------------------------------------------
async def _serve_aio(config: HPSConfig, inline: bool) -> None:
    """A grpc.aio server over the same engine and request handling as the sync servicer."""
    from hps_service.errors import HPSError
    from hps_service.serve.process import build_engine, message_limits
    from hps_service.server.grpc_service import EmbeddingServicer, ServingGate, status_for

    engine = build_engine(config)
    gate = ServingGate()
    gate.open()
    core = EmbeddingServicer(engine, config.server, gate)
    pool = ThreadPoolExecutor(max_workers=config.server.grpc_threads())

    class AioServicer(pb_grpc.EmbeddingServiceServicer):
        async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> bytes:
            try:
                if inline:
                    return core.lookup(request)
                return await asyncio.get_running_loop().run_in_executor(pool, core.lookup, request)
            except HPSError as err:
                await context.abort(status_for(err), str(err))
                raise

    receive, send = message_limits(config)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", receive),
                                      ("grpc.max_send_message_length", send), ("grpc.so_reuseport", 0)])
    handler = grpc.unary_unary_rpc_method_handler(
        AioServicer().Lookup, request_deserializer=pb.LookupRequest.FromString, response_serializer=None)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("hps.v1.EmbeddingService", {"Lookup": handler}),))
    server.add_insecure_port(f"{config.server.host}:{config.server.grpc_port}")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await server.stop(1)
    engine.close()


def serve(mode: str, config_path: Path) -> None:
    config = load_config(config_path)
    if mode == "sync":
        from hps_service.serve.process import HPSServer

        server = HPSServer(config)
        server.start()
        print("ready", flush=True)
        server.run_until_signal()
    else:
        asyncio.run(_serve_aio(config, inline=mode == "aio-inline"))


# ---- client side (this process) ----------------------------------------------------------------------------
async def _drive(target: str, requests: list[bytes], seconds: float, concurrency: int) -> np.ndarray:
    """Send pre-serialized requests from ``concurrency`` tasks for ``seconds``; returns per-call latencies."""
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)]) as channel:
        call = channel.unary_unary("/hps.v1.EmbeddingService/Lookup", request_serializer=None,
                                   response_deserializer=None)
        for r in requests[:64]:  # warm-up: fills L1, JIT, connections
            await call(r, timeout=30)
        end = time.perf_counter() + seconds

        async def worker(offset: int) -> None:
            i = offset
            while time.perf_counter() < end:
                start = time.perf_counter()
                await call(requests[i % len(requests)], timeout=30)
                latencies.append(time.perf_counter() - start)
                i += concurrency

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return np.array(latencies)


def _wait_ready(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline() if proc.stdout else ""
    if "ready" not in line:
        raise RuntimeError(f"server did not start: {line} {proc.stderr.read() if proc.stderr else ''}")


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--cache-fraction", type=float, default=1.0, help="L1 capacity as a fraction of the rows")
    ap.add_argument("--seconds", type=float, default=8.0, help="per mode and concurrency, over all rounds")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.config)
        return 0

    from tests.helpers import free_port

    with tempfile.TemporaryDirectory(prefix="bench-grpc-") as tmp:
        workdir = Path(tmp)
        keys, vectors = synthesize_model(args.rows, DIM, seed=1)
        tier = RocksDBTier(workdir / "rocksdb")
        import_table(tier, "bench.item", DIM, keys, vectors)
        tier.close()
        rng = np.random.default_rng(2)
        ranks = np.minimum(rng.zipf(1.05, size=256 * BATCH), args.rows) - 1
        requests = [
            pb.LookupRequest(model="bench", tables=[pb.TableKeys(table="item", keys=keys[ranks[i:i + BATCH]]
                                                                 .astype("<i8").tobytes())]).SerializeToString()
            for i in range(0, ranks.shape[0], BATCH)
        ]
        procs: dict[str, tuple[subprocess.Popen, int]] = {}
        latencies: dict[tuple[str, int], list[np.ndarray]] = {(m, c): [] for m in args.modes for c in args.concurrency}
        try:
            for mode in args.modes:  # every mode's server is up at once; only the one being driven is busy
                port = free_port()
                config_path = workdir / f"{mode}.yaml"
                config_path.write_text(yaml.safe_dump(_config(workdir / mode, port, args.rows, args.cache_fraction)))
                shutil.copytree(workdir / "rocksdb", workdir / mode / "rocksdb")
                proc = subprocess.Popen([sys.executable, "-m", "loadtest.probes.grpc_modes", "--serve", mode,
                                         "--config", str(config_path)], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
                procs[mode] = (proc, port)
                _wait_ready(proc)
            slice_s = args.seconds / args.rounds
            for _ in range(args.rounds):  # interleaved slices, so drifting load on a shared machine hits all modes
                for c in args.concurrency:
                    for mode in args.modes:
                        lat = asyncio.run(_drive(f"127.0.0.1:{procs[mode][1]}", requests, slice_s, c))
                        latencies[(mode, c)].append(lat)
        finally:
            for proc, _ in procs.values():
                proc.send_signal(signal.SIGTERM)
            for proc, _ in procs.values():
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        results: dict[tuple[str, int], dict] = {}
        for (mode, c), parts in latencies.items():
            lat = np.concatenate(parts)
            results[(mode, c)] = {
                "keys_per_s": lat.shape[0] * BATCH / args.seconds,
                "p50_ms": float(np.percentile(lat, 50) * 1e3),
                "p99_ms": float(np.percentile(lat, 99) * 1e3),
                "calls": int(lat.shape[0]),
            }
    print(f"Lookup, batch {BATCH}, dim {DIM}, zipf(1.05) over {args.rows} rows, L1 = {args.cache_fraction:g} of "
          f"them; {args.seconds:g}s per run")
    print(f"{'mode':<12}{'in flight':>10}{'keys/s':>14}{'p50 ms':>10}{'p99 ms':>10}{'vs sync':>10}")
    for (mode, c), r in results.items():
        base = results.get(("sync", c))
        ratio = f"{r['keys_per_s'] / base['keys_per_s']:.2f}x" if base else "-"
        print(f"{mode:<12}{c:>10}{r['keys_per_s']:>14,.0f}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{ratio:>10}")
    print(json.dumps({f"{m}/{c}": r for (m, c), r in results.items()}))
    return 0


if __name__ == "__main__":
    cli.run(main)

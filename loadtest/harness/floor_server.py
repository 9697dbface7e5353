"""The transport floor: a bare hps.v1 Lookup server that parses each request and answers with one fixed,
pre-serialised LookupResponse of the size ours sends (same proto, same rows and sources bytes), so any gap
between it and hps-service is the cost of our server beyond moving the bytes.

    python -m loadtest.harness.floor_server --port 9500 --batch 1024 --dim 64 --table item --mode aio
    python -m loadtest.harness.floor_server --port 9500 --mode sync --processes 2    # as many processes as a node's workers

With ``--processes N`` it forks N servers (before any gRPC state exists) that share the port with SO_REUSEPORT, as
``hps serve``'s worker processes do, so a node is compared with a floor of as many processes. ``FloorServer`` runs
it as a subprocess for the benchmarks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Self

import grpc
import numpy as np

from hps_service.engine import Source
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from loadtest.harness import cli
from loadtest.harness.drivers import LOOKUP_METHOD

_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)]
_SHARED_PORT = [*_OPTIONS[:2], ("grpc.so_reuseport", 1)]


def fixed_response(model: str, tables: list[str], batch: int, dim: int) -> bytes:
    """A LookupResponse answering ``batch`` keys of each table, every key from the cache."""
    rows = np.random.default_rng(0).standard_normal((batch, dim), dtype=np.float32)
    sources = np.full(batch, Source.CACHE, dtype=np.uint8)
    return pb.LookupResponse(
        model=model,
        tables=[pb.TableVectors(table=t, dim=dim, count=batch, vectors=rows.tobytes(), sources=sources.tobytes())
                for t in tables],
    ).SerializeToString()


def _handler(payload: bytes, is_async: bool) -> grpc.GenericRpcHandler:
    if is_async:
        async def lookup(request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> bytes:
            return payload
    else:
        def lookup(request: pb.LookupRequest, context: grpc.ServicerContext) -> bytes:  # type: ignore[misc]
            return payload
    method = grpc.unary_unary_rpc_method_handler(
        lookup, request_deserializer=pb.LookupRequest.FromString, response_serializer=None
    )
    service, name = LOOKUP_METHOD.rsplit("/", 1)
    return grpc.method_handlers_generic_handler(service.lstrip("/"), {name: method})


async def serve_aio(port: int, payload: bytes, shared: bool = False) -> None:
    """grpc.aio server until SIGTERM/SIGINT."""
    server = grpc.aio.server(options=_SHARED_PORT if shared else _OPTIONS)
    server.add_generic_rpc_handlers((_handler(payload, True),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"floor (aio) on 127.0.0.1:{port}", flush=True)
    await stop.wait()
    await server.stop(1)


def serve_native(port: int, payload: bytes, shared: bool = False) -> None:
    """pygrpc-native's front (HTTP/2 and gRPC in Rust, outside the GIL): one Python thread takes the calls in batches,
    parses each request and answers the fixed payload, until SIGTERM/SIGINT."""
    import pygrpc_native as native

    front = native.NativeGrpcFront(f"127.0.0.1:{port}", [(LOOKUP_METHOD, False)], io_threads=2, reuse_port=shared)
    front.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"floor (native) on 127.0.0.1:{port}", flush=True)
    parse = pb.LookupRequest.FromString
    while not stop.is_set():
        events = front.recv_batch(64, 100)
        if events is None:
            break
        for kind, call_id, _method, request, _key in events:
            if kind == native.EVENT_CALL:
                parse(request)
                front.respond(call_id, payload)
    front.close()


def serve_sync(port: int, payload: bytes, workers: int, shared: bool = False) -> None:
    """Thread-pool grpc server (the kind hps-service runs) until SIGTERM/SIGINT."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=_SHARED_PORT if shared else _OPTIONS)
    server.add_generic_rpc_handlers((_handler(payload, False),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"floor (sync, {workers} threads) on 127.0.0.1:{port}", flush=True)
    stop.wait()
    server.stop(1).wait()


class FloorServer:
    """loadtest.harness.floor_server as a subprocess (a context manager: entered once it answers)."""

    def __init__(self, mode: str, batch: int, workdir: Path, processes: int = 1, threads: int | None = None,
                 *, model: str = "demo", table: str = "item", dim: int = 64) -> None:
        from tests.helpers import free_port

        self.port = free_port()
        self.log_path = workdir / f"floor-{mode}.log"
        extra = ["--processes", str(processes)] + (["--workers", str(threads)] if threads else [])
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "loadtest.harness.floor_server", "--port", str(self.port), "--mode", mode,
                 "--batch", str(batch), "--dim", str(dim), "--table", table, "--model", model, *extra],
                stdout=log, stderr=subprocess.STDOUT, cwd=cli.REPO,
            )

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        with grpc.insecure_channel(self.target) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=30)
            except grpc.FutureTimeoutError:
                self.__exit__()
                raise RuntimeError(f"the floor server on {self.target} did not start; see {self.log_path}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__spec__, __doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="demo")
    p.add_argument("--table", dest="tables", action="append")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--mode", choices=("aio", "sync", "native"), default="aio")
    p.add_argument("--workers", type=int, default=8, help="sync mode: server threads (per process)")
    p.add_argument("--processes", type=int, default=1, help="server processes sharing the port (SO_REUSEPORT)")
    args = p.parse_args(argv)
    payload = fixed_response(args.model, args.tables or ["item"], args.batch, args.dim)

    def serve(shared: bool) -> None:
        if args.mode == "aio":
            asyncio.run(serve_aio(args.port, payload, shared))
        elif args.mode == "native":
            serve_native(args.port, payload, shared)
        else:
            serve_sync(args.port, payload, args.workers, shared)

    if args.processes <= 1:
        serve(False)
        return 0
    holder = socket.socket()  # holds the port for the children (never listens)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", args.port))
    children = []
    for _ in range(args.processes):
        pid = os.fork()
        if pid == 0:
            serve(True)
            os._exit(0)
        children.append(pid)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    for pid in children:
        os.kill(pid, signal.SIGTERM)
    for pid in children:
        os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    cli.run(main)

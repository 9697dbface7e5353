"""Lookups over gRPC per row format (issue 31, part 13b): one ``hps serve`` per format (fp32, fp16, bf16, int8), every
row in L1, the same batches of 1024 keys (dim 64) asked of each, in rounds interleaved so that the machine's noise
falls on all of them alike:

* keys/s of one caller (``HPSClient``) and the server's CPU per call (all its processes), with the server decoding
  to float32 (``precision`` fp32) and with the stored rows on the wire (``precision`` stored, decoded by the
  caller with NumPy, as ``StoredRows.to_float32``); targets for fp32 answers of fp16/int8 tables: >= 0.95x fp32's;
* the bytes of each answer on the wire.

    python -m loadtest.benchmarks.storage_grpc [--rows 200000]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from hps_client import HPSClient
from hps_client.wire import build_request
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.rows import STORAGES
from hps_service.runtime.processes import process_tree
from loadtest.harness import cli
from loadtest.harness.embedded import EmbeddedServer, start_node
from loadtest.harness.loadgen import process_cpu_s

BATCH, DIM = 1024, 64
#: The least keys/s and the most server CPU per call, against fp32's, of a table answered as float32.
TARGET = 0.95


def _calls(client: HPSClient, server: EmbeddedServer, stored: bool, batches: list[np.ndarray],
           calls: int) -> tuple[float, float]:
    """``calls`` lookups, one after another: their wall seconds and the server's CPU seconds."""
    pids = process_tree(server.proc.pid) if server.proc is not None else []
    cpu0, t0 = process_cpu_s(pids), time.perf_counter()
    for i in range(calls):
        keys = batches[i % len(batches)]
        if stored:
            client.lookup_stored(server.model, server.table, keys).rows.to_float32()
        else:
            client.lookup(server.model, server.table, keys)
    return time.perf_counter() - t0, process_cpu_s(pids) - cpu0


def _wire_bytes(server: EmbeddedServer, keys: np.ndarray, precision: pb.Precision) -> int:
    import grpc

    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        return int(stub.Lookup(build_request(server.model, {server.table: keys}, precision)).ByteSize())


def run(rows: int, console: Console, rounds: int = 6, calls: int = 200) -> dict[str, Any]:
    """Each format's keys/s, server CPU per call and wire bytes, with both precisions, and their ratios to fp32."""
    work = Path(tempfile.mkdtemp(prefix="hps-bench-storage-grpc-"))
    servers: dict[str, EmbeddedServer] = {}
    out: dict[str, Any] = {"rows": rows, "dim": DIM, "batch": BATCH, "formats": {}}
    try:
        for storage in STORAGES:
            srv = EmbeddedServer(work / storage, rows=rows, table_dim=DIM, table_fields={"storage": storage},
                                 overrides={"cache": {"backend": "numpy", "capacity": 2 * rows,
                                                      "admit_after_misses": 1},
                                            "volatile": {"capacity_rows": rows}})
            srv.prepare()
            start_node(srv, 1, None)
            servers[storage] = srv
        with np.load(servers["fp32"].keys_file) as archive:
            keys = archive["keys"]
        rng = np.random.default_rng(3)
        batches = [keys[rng.integers(0, keys.shape[0], BATCH)] for _ in range(32)]
        clients = {s: HPSClient(srv.target) for s, srv in servers.items()}
        runs = [(s, stored) for s in STORAGES for stored in (False, True)]
        wall = {r: 0.0 for r in runs}
        cpu = {r: 0.0 for r in runs}
        for s, stored in runs:  # warm: every batch once
            _calls(clients[s], servers[s], stored, batches, len(batches))
        for _ in range(rounds):
            for r in runs:
                w, c = _calls(clients[r[0]], servers[r[0]], r[1], batches, calls)
                wall[r] += w
                cpu[r] += c
        for client in clients.values():
            client.close()
        total = rounds * calls
        for s, stored in runs:
            f = out["formats"].setdefault(s, {})
            name = "stored" if stored else "fp32"
            f[name] = {"keys_per_s": total * BATCH / wall[(s, stored)],
                       "server_cpu_ms_per_call": cpu[(s, stored)] * 1e3 / total,
                       "wire_bytes": _wire_bytes(servers[s], batches[0],
                                                 pb.PRECISION_STORED if stored else pb.PRECISION_FP32)}
        base = out["formats"]["fp32"]["fp32"]
        console.print(f"one caller, {BATCH} L1 hits of dim {DIM} per call, {rows:,} rows, {rounds} x {calls} calls "
                      "per contender")
        for s, f in out["formats"].items():
            for name, m in f.items():
                m["keys_x"] = m["keys_per_s"] / base["keys_per_s"]
                m["cpu_x"] = m["server_cpu_ms_per_call"] / base["server_cpu_ms_per_call"]
                m["wire_x"] = m["wire_bytes"] / base["wire_bytes"]
                verdict = ""
                if name == "fp32" and s in ("fp16", "int8"):
                    verdict = (f"  keys/s {cli.judged(m['keys_x'], cli.at_least(TARGET))}, "
                               f"CPU {cli.judged(m['cpu_x'], cli.at_most(1 / TARGET))}")
                console.print(f"  {s} as {name}: {m['keys_per_s'] / 1e6:.2f} M keys/s ({m['keys_x']:.2f}x), server "
                              f"{m['server_cpu_ms_per_call']:.3f} ms CPU/call ({m['cpu_x']:.2f}x), "
                              f"{m['wire_bytes']:,} B on the wire ({m['wire_x']:.2f}x){verdict}")
    finally:
        for srv in servers.values():
            srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    run(args.rows, Console(), rounds=args.rounds)
    return 0


if __name__ == "__main__":
    cli.run(main)

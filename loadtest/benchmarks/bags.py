"""``make bench`` part 14: pooled lookups (issue 50). Batches of 256 bags of zipf(1.05) keys, mean bag lengths 8, 32
and 128, dim 64, a node of 2 workers: ``lookup_bags`` (the server pools; one row per bag travels) against the same
bags looked up key by key and pooled by the caller with NumPy, and against a Redis Cluster client (as many masters
as workers) doing its MGETs and pooling the same way. Per contender: keys/s, the server's CPU per key (every process
of the server, from /proc), and the response's bytes. The contenders run interleaved, with the same concurrency of
asyncio calls from one client process.

Targets: keys/s >= 2x the caller's pooling at mean bag 32 and >= 3x Redis there; response bytes 1/mean bag length of
the per-key answer's (within 5%); server CPU per pooled key <= 1.0x a plain lookup's."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from hps_client import AsyncHPSClient, HPSClient
from hps_service.runtime.processes import process_tree
from loadtest.harness import cli
from loadtest.harness.embedded import EmbeddedServer
from loadtest.harness.loadgen import process_cpu_s
from loadtest.harness.redis_baseline import RedisMgetDriver, cluster_layout, loaded_cluster

BAGS, DIM, WORKERS, CONCURRENCY = 256, 64, 2, 8
MEAN_LENGTHS = (8, 32, 128)
TARGETS = {"vs_caller": cli.at_least(2.0), "vs_redis": cli.at_least(3.0), "bytes": cli.at_most(1.05),
           "cpu_per_key": cli.at_most(1.0)}


def batches(keys: np.ndarray, mean_len: int, count: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` batches of BAGS bags: (keys, offsets), bag lengths Poisson around ``mean_len``, keys zipf(1.05)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        lengths = np.maximum(rng.poisson(mean_len, BAGS), 1)
        ranks = (rng.zipf(1.05, int(lengths.sum())) - 1) % keys.shape[0]
        out.append((keys[ranks], np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)))
    return out


def pooled_by_caller(rows: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """What a caller does with one row per key: the mean of each bag (no bag is empty here)."""
    lengths = np.diff(np.append(offsets, rows.shape[0]))
    return np.add.reduceat(rows, offsets, axis=0) / lengths[:, None]


async def measure(call: Callable[[int], Awaitable[int]], seconds: float, pids: list[int]) -> dict[str, float]:
    """Keys/s and server CPU per key of ``call(i)`` (returns the keys it looked up) at CONCURRENCY in flight."""
    stop = time.monotonic() + seconds
    keys = 0
    counter = iter(range(1 << 62))

    async def worker() -> None:
        nonlocal keys
        while time.monotonic() < stop:
            keys += await call(next(counter))

    cpu0, t0 = process_cpu_s(pids), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    elapsed, cpu = time.perf_counter() - t0, process_cpu_s(pids) - cpu0
    return {"keys_per_s": keys / elapsed, "cpu_us_per_key": 1e6 * cpu / max(keys, 1)}


def response_bytes(target: str, work: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, float]:
    """Mean serialized bytes of the pooled answer and of the per-key answer of the same batches."""
    from hps_service.proto.hps.v1 import embedding_pb2 as pb

    with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)]) as channel:
        raw = channel.unary_unary("/hps.v1.EmbeddingService/Lookup", request_serializer=pb.LookupRequest.SerializeToString,
                                  response_deserializer=None)
        pooled = plain = 0
        for keys, offsets in work[:8]:
            pooled += len(raw(pb.LookupRequest(model="demo", tables=[pb.TableKeys(
                table="item", keys=keys.tobytes(), offsets=offsets.tobytes(), combiner=pb.COMBINER_MEAN)])))
            plain += len(raw(pb.LookupRequest(model="demo", tables=[pb.TableKeys(table="item", keys=keys.tobytes())])))
    return pooled / 8, plain / 8


async def one_length(target: str, redis: RedisMgetDriver | None, work: list[tuple[np.ndarray, np.ndarray]],
                     pids: list[int], seconds: float) -> dict[str, Any]:
    """The three contenders at one mean bag length, interleaved in three rounds."""
    async with AsyncHPSClient(target, timeout=30) as client:
        async def ours(i: int) -> int:
            keys, offsets = work[i % len(work)]
            await client.lookup_bags("demo", "item", keys, offsets, "mean")
            return int(keys.shape[0])

        async def caller(i: int) -> int:
            keys, offsets = work[i % len(work)]
            pooled_by_caller(await client.lookup("demo", "item", keys), offsets)
            return int(keys.shape[0])

        async def plain(i: int) -> int:  # the per-key lookup alone: the server's cost per key of an unpooled call
            keys, _ = work[i % len(work)]
            await client.lookup("demo", "item", keys)
            return int(keys.shape[0])

        async def from_redis(i: int) -> int:
            assert redis is not None
            keys, offsets = work[i % len(work)]
            pooled_by_caller(await redis.rows(i), offsets)
            return int(keys.shape[0])

        contenders: dict[str, Callable[[int], Awaitable[int]]] = {"ours": ours, "caller": caller, "plain": plain}
        if redis is not None:
            contenders["redis"] = from_redis
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
        for fn in contenders.values():  # warm: every batch once
            for i in range(len(work)):
                await fn(i)
        for _ in range(3):
            for name, fn in contenders.items():
                runs[name].append(await measure(fn, seconds / 3, pids))
    return {name: {k: float(np.mean([r[k] for r in rs])) for k in rs[0]} for name, rs in runs.items()}


def bench(rows: int, seconds: float, console: Any) -> dict[str, Any]:
    """Every mean bag length against its contenders; the ratios with their targets."""
    workdir = Path(tempfile.mkdtemp(prefix="hps-bench-bags-"))
    server = EmbeddedServer(workdir, rows=rows, table_dim=DIM, overrides={"server": {"workers": WORKERS}})
    console.print(f"  hps synth + hps import of {rows:,} x {DIM} rows; hps serve with {WORKERS} workers")
    server.prepare()
    with np.load(server.keys_file) as archive:
        keys = archive["keys"]
    out: dict[str, Any] = {"rows": rows, "bags": BAGS, "dim": DIM, "workers": WORKERS, "concurrency": CONCURRENCY,
                           "by_mean_length": {}}
    with server, loaded_cluster(server.keys_file, workdir, console, masters=WORKERS) as seed:
        assert server.proc is not None
        pids = process_tree(server.proc.pid)
        with HPSClient(server.target) as warm:  # every row read once: L1 and the hash map hold the hot ones
            for lo in range(0, rows, 4096):
                warm.lookup("demo", "item", keys[lo:lo + 4096])
        for mean_len in MEAN_LENGTHS:
            work = batches(keys, mean_len, 32, seed=mean_len)
            redis = (RedisMgetDriver(cluster_layout(seed), [k for k, _ in work], DIM)  # type: ignore[arg-type]
                     if seed is not None else None)  # its pool: one batch of keys each, of any length
            console.print(f"  mean bag {mean_len}: lookup_bags, per-key + NumPy, plain lookups"
                          + (", Redis MGET + NumPy" if redis else ""))
            result = asyncio.run(one_length(server.target, redis, work, pids, seconds))
            pooled_b, plain_b = response_bytes(server.target, work)
            result["response_bytes"] = {"pooled": pooled_b, "per_key": plain_b}
            out["by_mean_length"][mean_len] = result
    return out


def table(res: dict[str, Any]) -> cli.RatioTable:
    """The ratios of :func:`bench`'s result, each with its target."""
    t = cli.RatioTable(f"14. pooled lookups, batch {res['bags']} bags, dim {res['dim']}, {res['workers']} workers")
    for mean_len, r in res["by_mean_length"].items():
        ours = r["ours"]
        for name, target in (("caller", TARGETS["vs_caller"]), ("redis", TARGETS["vs_redis"])):
            if name in r:
                judged = target if int(mean_len) == 32 else "(32 only)"
                t.row(f"bag {mean_len}: keys/s vs {name} pooling", f"{ours['keys_per_s'] / 1e6:.2f} M",
                      f"{r[name]['keys_per_s'] / 1e6:.2f} M", ours["keys_per_s"] / r[name]["keys_per_s"], judged)
        b = r["response_bytes"]
        t.row(f"bag {mean_len}: response bytes x mean length / per-key's", f"{b['pooled']:.0f} B",
              f"{b['per_key']:.0f} B", b["pooled"] * int(mean_len) / b["per_key"], TARGETS["bytes"])
        t.row(f"bag {mean_len}: server CPU per key vs plain lookup", f"{ours['cpu_us_per_key']:.3f} us",
              f"{r['plain']['cpu_us_per_key']:.3f} us", ours["cpu_us_per_key"] / r["plain"]["cpu_us_per_key"],
              TARGETS["cpu_per_key"])
    return t


def main() -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the served table")
    ap.add_argument("--seconds", type=float, default=12.0, help="measured time per contender and bag length")
    ap.add_argument("--quick", action="store_true", help="200k rows, 6 s per contender")
    cli.add_out(ap)
    args = ap.parse_args()
    console = cli.console()
    rows, seconds = (200_000, 6.0) if args.quick else (args.rows, args.seconds)
    res = bench(rows, seconds, console)
    console.print(table(res))
    console.print(f"results: {cli.write_result(res, args.out, 'bench-bags')}")
    return 0


if __name__ == "__main__":
    cli.run(main)

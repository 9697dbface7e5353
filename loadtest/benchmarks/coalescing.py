"""Coalescing in the clients (issue 54): 200 concurrent 2-key lookups from AsyncHPSClient must reach the server as
at most 20 calls, and the p50 of a lone lookup (one at a time, nothing else in flight) may rise by at most 5% over
the same client with coalescing off. HPSClient's coalescing across threads is measured beside them (no target).

    python -m loadtest.benchmarks.coalescing --quick      # ~1 minute on 2 cores
    python -m loadtest.benchmarks.coalescing --lone 4000 --rounds 12

Calls are counted by the server (``hps_lookup_requests_total{method="Lookup"}``). The lone lookups alternate between
a client with coalescing on and one with it off, round by round, so that both see the same machine; beside them, the
coalescing transports' own cost per lone lookup, over a transport that answers at once (no network, no noise).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from hps_client import AsyncCoalescingTransport, AsyncHPSClient, CoalescingTransport, HPSClient
from hps_client.calls import Call, Rows
from loadtest.harness import cli
from loadtest.harness.embedded import EmbeddedServer, start_node

#: Calls that 200 concurrent 2-key lookups may become, at most.
CALLS_TARGET = cli.at_most(20)
#: The lone lookup's p50 with coalescing on over the p50 with it off, at most.
P50_TARGET = cli.at_most(1.05)
BURST, BURST_KEYS = 200, 2
_LOOKUPS = re.compile(r'^hps_lookup_requests_total\{method="Lookup",status="OK"\} (\S+)$', re.M)


def lookups_served(server: EmbeddedServer) -> float:
    """Lookup calls the server answered so far (its /metrics)."""
    text = httpx.get(f"http://{server.http_target}/metrics", timeout=30).text
    match = _LOOKUPS.search(text)
    return float(match.group(1)) if match else 0.0


def _asks(keys: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.choice(keys, BURST_KEYS) for _ in range(BURST)]


def async_bursts(server: EmbeddedServer, keys: np.ndarray, bursts: int, window_s: float) -> list[float]:
    """Calls the server saw for each of ``bursts`` gathers of 200 2-key lookups (each answer checked in shape)."""
    rng = np.random.default_rng(1)

    async def run() -> list[float]:
        calls = []
        async with AsyncHPSClient(server.target, timeout=30, coalesce_window_s=window_s) as client:
            await client.wait_ready()
            for _ in range(bursts):
                before = lookups_served(server)
                got = await asyncio.gather(*(client.lookup(server.model, server.table, ask)
                                             for ask in _asks(keys, rng)))
                assert all(rows.shape == (BURST_KEYS, server.dim) for rows in got)
                calls.append(lookups_served(server) - before)
        return calls

    return asyncio.run(run())


def thread_bursts(server: EmbeddedServer, keys: np.ndarray, bursts: int, window_s: float) -> list[float]:
    """As :func:`async_bursts`, from 200 threads of one HPSClient released together."""
    rng = np.random.default_rng(2)
    calls = []
    with HPSClient(server.target, timeout=30, coalesce_window_s=window_s) as client:
        client.wait_ready()
        for _ in range(bursts):
            asks = _asks(keys, rng)
            start = threading.Barrier(BURST)

            def ask(keys: np.ndarray, start: threading.Barrier) -> None:
                start.wait()
                assert client.lookup(server.model, server.table, keys).shape == (BURST_KEYS, server.dim)

            threads = [threading.Thread(target=ask, args=(a, start)) for a in asks]
            before = lookups_served(server)
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            calls.append(lookups_served(server) - before)
    return calls


def lone_p50(server: EmbeddedServer, keys: np.ndarray, n: int, rounds: int, batch: int) -> dict[str, Any]:
    """The p50 (us) of lone ``batch``-key lookups, AsyncHPSClient and HPSClient, coalescing on and off alternating
    round by round, ``n`` lookups a round."""
    rng = np.random.default_rng(3)
    asks = [rng.choice(keys, batch) for _ in range(n)]

    async def async_round(client: AsyncHPSClient) -> list[float]:
        seconds = []
        for ask in asks:
            started = time.perf_counter()
            await client.lookup(server.model, server.table, ask)
            seconds.append(time.perf_counter() - started)
        return seconds

    def sync_round(client: HPSClient) -> list[float]:
        seconds = []
        for ask in asks:
            started = time.perf_counter()
            client.lookup(server.model, server.table, ask)
            seconds.append(time.perf_counter() - started)
        return seconds

    async def run_async() -> tuple[list[float], list[float]]:
        on, off = [], []
        async with AsyncHPSClient(server.target, timeout=30) as c_on, \
                AsyncHPSClient(server.target, timeout=30, coalesce_window_s=0) as c_off:
            await async_round(c_on)  # warm both channels
            await async_round(c_off)
            for _ in range(rounds):
                on += await async_round(c_on)
                off += await async_round(c_off)
        return on, off

    a_on, a_off = asyncio.run(run_async())
    s_on, s_off = [], []
    with HPSClient(server.target, timeout=30, coalesce_window_s=200e-6) as c_on, \
            HPSClient(server.target, timeout=30) as c_off:
        sync_round(c_on)
        sync_round(c_off)
        for _ in range(rounds):
            s_on += sync_round(c_on)
            s_off += sync_round(c_off)
    us = {name: 1e6 * statistics.median(xs) for name, xs in
          (("async_on", a_on), ("async_off", a_off), ("sync_on", s_on), ("sync_off", s_off))}
    return {**us, "batch": batch, "lookups_each": len(a_on), "async_ratio": us["async_on"] / us["async_off"],
            "sync_ratio": us["sync_on"] / us["sync_off"]}


class _Answered:
    """A transport that answers every call at once with the same rows."""

    rows = np.zeros((BURST_KEYS, 64), dtype=np.float32)

    def handle(self, call: Call[Any]) -> Any:
        return self.rows

    def close(self) -> None:
        pass


class _AsyncAnswered:
    """:class:`_Answered` in an event loop."""

    async def handle(self, call: Call[Any]) -> Any:
        return _Answered.rows

    async def close(self) -> None:
        pass


def wrapper_cost_us(n: int = 50_000) -> dict[str, float]:
    """Microseconds a lone lookup spends in the coalescing transports, over one that answers at once (the wrapped
    minus the bare one)."""
    keys = np.arange(BURST_KEYS, dtype=np.int64)

    def call() -> Rows:
        return Rows(time.monotonic() + 5, None, "demo", "item", keys)

    def sync_us(transport: Any) -> float:
        started = time.perf_counter()
        for _ in range(n):
            transport.handle(call())
        return 1e6 * (time.perf_counter() - started) / n

    async def async_us(transport: Any) -> float:
        started = time.perf_counter()
        for _ in range(n):
            await transport.handle(call())
        return 1e6 * (time.perf_counter() - started) / n

    async def both() -> tuple[float, float]:
        return await async_us(AsyncCoalescingTransport(_AsyncAnswered())), await async_us(_AsyncAnswered())

    wrapped, bare = asyncio.run(both())
    return {"async": wrapped - bare, "sync": sync_us(CoalescingTransport(_Answered())) - sync_us(_Answered())}


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--quick", action="store_true", help="fewer bursts and lone lookups")
    ap.add_argument("--bursts", type=int, help="bursts of 200 concurrent lookups per client (default 20)")
    ap.add_argument("--lone", type=int, help="lone lookups per round and client (default 2000)")
    ap.add_argument("--rounds", type=int, help="rounds of lone lookups (default 8)")
    ap.add_argument("--batch", type=int, default=2, help="keys of a lone lookup (default 2)")
    cli.add_out(ap)
    args = ap.parse_args(argv)
    bursts = args.bursts or (5 if args.quick else 20)
    lone, rounds = args.lone or (1000 if args.quick else 2000), args.rounds or (4 if args.quick else 8)
    console = cli.console()
    workdir = Path(tempfile.mkdtemp(prefix="hps-bench-coalescing-"))
    try:
        server = EmbeddedServer(workdir / "node", rows=20_000, table_dim=64, overrides={
            "cache": {"backend": "numpy", "capacity": 40_000, "admit_after_misses": 1},
            "volatile": {"capacity_rows": 20_000}})
        server.prepare()
        with np.load(server.keys_file) as archive:
            keys = np.asarray(archive["keys"], dtype=np.int64)
        start_node(server, 0, None)
        try:
            console.print(f"  {bursts} bursts of {BURST} concurrent {BURST_KEYS}-key lookups, each client")
            calls = {"async_on": async_bursts(server, keys, bursts, 200e-6),
                     "async_off": async_bursts(server, keys, bursts, 0),
                     "threads_on": thread_bursts(server, keys, bursts, 200e-6),
                     "threads_off": thread_bursts(server, keys, bursts, 0)}
            console.print(f"  {rounds} rounds of {lone} lone {args.batch}-key lookups, coalescing on and off")
            p50 = lone_p50(server, keys, lone, rounds, args.batch)
            p50["wrapper_us"] = wrapper_cost_us()
        finally:
            server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    worst = max(calls["async_on"])
    t = cli.RatioTable("coalescing in the clients")
    t.row(f"AsyncHPSClient: calls per burst of {BURST} (max of {bursts})", f"{worst:.0f}",
          f"{max(calls['async_off']):.0f} off", None, str(CALLS_TARGET), ok=CALLS_TARGET.met(worst))
    t.row(f"HPSClient, {BURST} threads (window 200 us): calls per burst (median, max)",
          f"{statistics.median(calls['threads_on']):.0f}, {max(calls['threads_on']):.0f}",
          f"{max(calls['threads_off']):.0f} off")
    t.row(f"AsyncHPSClient: lone {args.batch}-key lookup p50, on vs off", f"{p50['async_on']:.0f} us",
          f"{p50['async_off']:.0f} us", p50["async_ratio"], P50_TARGET)
    t.row(f"HPSClient: lone {args.batch}-key lookup p50, window 200 us vs off", f"{p50['sync_on']:.0f} us",
          f"{p50['sync_off']:.0f} us", p50["sync_ratio"], "-")
    cost = p50["wrapper_us"]
    t.row("a lone lookup's time in the coalescing transport (asyncio, threads)",
          f"{cost['async']:.1f} us, {cost['sync']:.1f} us")
    console.print(t)
    print(f"calls of {BURST} concurrent lookups (AsyncHPSClient): at most {worst:.0f} "
          f"(target {CALLS_TARGET}: {cli.verdict(CALLS_TARGET.met(worst))})")
    print(f"lone lookup p50, coalescing on vs off: {cli.judged(p50['async_ratio'], P50_TARGET)}")
    path = cli.write_result({"calls": calls, "lone_p50_us": p50, "targets": {
        "calls": str(CALLS_TARGET), "p50_ratio": str(P50_TARGET)}}, args.out, "bench-coalescing")
    console.print(f"  results: {path}")
    return 0


if __name__ == "__main__":
    cli.run(main)

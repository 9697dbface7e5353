"""The server CPU one gRPC lookup of 1024 all-hit keys costs with ``server.auth: none`` and ``token``, and (given
``--before DIR``, a checkout of an earlier commit) with that code: what authentication adds to the hot path.

Each variant is a real ``hps serve`` (one process serving gRPC: ``server.workers: 0``), loaded with the rows over
REST, then called ``--calls`` times from this process; its CPU (user + system, /proc) over the calls, per call. The
variants run side by side and are measured in turn, ``--rounds`` times; the median and the least of each are printed
with their ratios to ``none`` (the least is the least disturbed by whatever else the host runs).

    python -m loadtest.probes.auth --before /tmp/hps-before     # git archive <commit> | tar -x -C /tmp/hps-before
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from hps_client import HPSClient, UnavailableError
from hps_service.runtime.processes import free_port, stop_process
from loadtest.harness import cli

ADMIN, TOKEN, DIM, KEYS = "bench-admin-token-0000", "bench-read-token-00000", 64, 1024


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _config(tmp: Path, grpc_port: int, http_port: int, auth: str) -> Path:
    server = {"host": "127.0.0.1", "grpc_port": grpc_port, "http_port": http_port, "workers": 0, "grpc_workers": 2,
              "admin_token": ADMIN}
    if auth == "token":
        server |= {"auth": "token", "readers": [{"name": "bench", "token": TOKEN, "models": ["demo"]}]}
    path = tmp / f"{auth}-{grpc_port}.yaml"
    path.write_text(yaml.safe_dump({
        "server": server, "cache": {"backend": "numpy", "capacity": 4 * KEYS},
        "volatile": {"type": "hashmap", "capacity_rows": 4 * KEYS},
        "persistent": {"type": "rocksdb", "path": str(tmp / f"db-{grpc_port}"), "block_cache_mb": 8},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": DIM}]}]}))
    return path


class Variant:
    """One ``hps serve`` of a variant, loaded with the rows and warmed, and a client to it."""

    def __init__(self, name: str, auth: str, code: Path | None, tmp: Path) -> None:
        self.name = name
        grpc_port, http_port = free_port(), free_port()
        env = dict(os.environ)
        if code is not None:
            env["PYTHONPATH"] = f"{code}:{code / 'clients' / 'python'}"
        self.proc = subprocess.Popen([sys.executable, "-m", "hps_service.cli.main", "serve", "--config",
                                      str(_config(tmp, grpc_port, http_port, auth)), "--log-level", "warning"],
                                     env=env, cwd=code or Path.cwd(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.keys = np.arange(KEYS, dtype=np.int64)
        self.client = HPSClient(f"127.0.0.1:{grpc_port}", credentials=TOKEN if auth == "token" else None, timeout=30)
        deadline = time.monotonic() + 180
        while not self._loaded(http_port):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"{name}: the server did not start")
            time.sleep(0.5)
        while True:  # REST answers before the kernels are compiled; lookups after
            try:
                self.client.lookup("demo", "item", self.keys)
                break
            except UnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self.run(300)  # warm: every row in L1, every code path taken

    def _loaded(self, http_port: int) -> bool:
        try:
            r = httpx.put(f"http://127.0.0.1:{http_port}/v1/models/demo/tables/item/embeddings", timeout=30,
                          headers={"Authorization": f"Bearer {ADMIN}"},
                          json={"keys": self.keys.tolist(), "vectors": np.ones((KEYS, DIM)).tolist(), "version": 1})
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    def run(self, calls: int) -> float:
        """Server CPU microseconds per 1024-key lookup over ``calls`` lookups."""
        before = _cpu_seconds(self.proc.pid)
        for _ in range(calls):
            self.client.lookup("demo", "item", self.keys)
        return (_cpu_seconds(self.proc.pid) - before) / calls * 1e6

    def close(self) -> None:
        self.client.close()
        stop_process(self.proc, 20)


def check_cost(n: int = 200_000) -> float:
    """Microseconds one token check takes in process (what a call with ``auth: token`` adds beyond reading its
    metadata): the bearer header parsed, the token's digest looked up, the model checked."""
    from hps_service.config import ServerConfig
    from hps_service.server.auth import Authenticator, bearer_token

    auth = Authenticator(ServerConfig(auth="token", readers=[{"name": "bench", "token": TOKEN, "models": ["demo"]}]))
    header = f"Bearer {TOKEN}"
    started = time.perf_counter()
    for _ in range(n):
        auth.reader_by_token(bearer_token(header)).check_model("demo")
    return (time.perf_counter() - started) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__spec__, __doc__)
    parser.add_argument("--before", type=Path, help="a checkout of the code to compare with (auth none only)")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    variants = [("none", "none", None), ("token", "token", None)]
    if args.before is not None:
        variants.insert(0, ("before", "none", args.before.resolve()))
    results: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    with tempfile.TemporaryDirectory() as tmp:
        running = []
        try:
            for name, auth, code in variants:  # side by side, so each round finds the host alike for all
                running.append(Variant(name, auth, code, Path(tmp)))
            for _ in range(args.rounds):
                for variant in running:
                    results[variant.name].append(variant.run(args.calls))
        finally:
            for variant in running:
                variant.close()
    print(f"token check in process: {check_cost():.2f} us per call")
    base_median, base_min = statistics.median(results["none"]), min(results["none"])
    for name, samples in results.items():
        median, least = statistics.median(samples), min(samples)
        print(f"{name:7s} median {median:5.0f} us ({median / base_median:.3f}x none), least {least:5.0f} us "
              f"({least / base_min:.3f}x none) server CPU per 1024-key lookup; rounds "
              f"{', '.join(f'{x:.0f}' for x in samples)}")
    return 0


if __name__ == "__main__":
    cli.run(main)

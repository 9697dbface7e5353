"""Model versions (issue 30, part 13e): how long a label switch takes across a 3-replica fleet, and what retention
frees when it drops a version, side by side in one run.

1. Switch: three ``hps serve`` replicas (tansu, the registration log signed with updates.admin_key) serve model ``m``
   and its version 1. A thread per replica loops one-key gRPC lookups and notes the version each answer names. The
   label ``production`` is switched back and forth on the first replica. Per switch: the PUT's own time, and for each
   replica the time from the PUT's start to its first answer from the new version (pollers look up every 2 ms).
2. Memory: one engine (RocksDB, a hash map, L1) in this process serves ``m`` and adds version 2, imports ``rows``
   rows into it and reads them all (the hash map and L1 fill). Dropping the version (what ``keep_versions`` does)
   frees its hash-map table, L1 and column family: the process's RSS, the hash map's bytes, RocksDB's directory and
   its block cache (shared by every table and bounded by persistent.block_cache_mb: a dropped table's blocks leave
   it as other reads evict them), before, with the version, and after the drop.

    python -m loadtest.benchmarks.versions [--rows 1000000] [--dim 64] [--switches 10]
"""

from __future__ import annotations

import ctypes
import gc
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
from rich.console import Console

from hps_service.cache.factory import build_table_cache
from hps_service.config import CacheConfig, ModelConfig, TableConfig
from hps_service.engine import LookupEngine
from hps_service.node.owner import store_parent
from hps_service.proto.hps.v1 import embedding_pb2 as pb
from hps_service.proto.hps.v1 import embedding_pb2_grpc as pb_grpc
from hps_service.tiers.hashmap.tier import HashMapTier
from hps_service.tiers.rocksdb.tier import RocksDBTier
from hps_service.updates.local_broker import running_tansu
from loadtest.harness import cli

TOKEN = "bench-versions"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ADMIN_KEY = "bench-versions-hmac-key-21b7"
#: Seconds between a poller's lookups (the resolution of the switch times).
POLL_S = 0.002


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_memory(rows: int, dim: int) -> dict[str, Any]:
    """RSS, hash-map bytes and RocksDB bytes before a version of ``rows`` x ``dim``, with it, and after its drop."""
    work = Path(tempfile.mkdtemp(prefix="hps-bench-versions-", dir=store_parent()))
    cache_cfg = CacheConfig(backend="numpy", capacity=0.2, warm_start=False)

    def cache_factory(t: Any, fetch: Any, warm: Any) -> Any:
        return build_table_cache(cache_cfg, t.format.words, rows, fetch, None, None)

    eng = LookupEngine(HashMapTier(capacity_rows=int(rows * 1.3)), RocksDBTier(work / "db"), cache_factory)
    try:
        model = ModelConfig(name="m", tables=[TableConfig(name="item", dim=dim)])
        eng.register_model(model)
        rng = np.random.default_rng(0)
        keys = rng.choice(2**40, rows, replace=False).astype(np.int64)

        def l1_bytes() -> float:
            return sum(float(t.cache.stats().get("memory_bytes", 0.0)) for tables in eng.registry.tables().values()
                       for t in tables.values() if t.cache is not None)

        def volatile_bytes() -> float:
            assert eng.volatile is not None
            return sum(float(eng.volatile.stats(t.id).extra.get("memory_bytes", 0.0))
                       for tables in eng.registry.tables().values() for t in tables.values())

        def measure() -> dict[str, float]:
            # freed heap back to the system first (glibc keeps it otherwise), so RSS shows what is still held
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            assert eng.persistent is not None
            return {"rss": float(_rss_bytes()), "hashmap": volatile_bytes(), "rocksdb": float(_dir_bytes(work)),
                    "block_cache": float(eng.persistent.memory_bytes()["block_cache"]), "l1": l1_bytes()}

        before = measure()
        eng.add_version(model.model_copy(update={"version": 2}))
        for lo in range(0, rows, 262_144):
            eng.import_rows("m#v2", "item", keys[lo:lo + 262_144],
                            rng.standard_normal((min(262_144, rows - lo), dim)).astype(np.float32), version=1)
        for lo in range(0, rows, 16_384):  # every row read once: the hash map holds them all, L1 its share
            eng.lookup("m#v2", "item", keys[lo:lo + 16_384])
        held = measure()
        eng.drop_version("m", 2)
        time.sleep(0.5)  # RocksDB deletes a dropped column family's files in the background
        after = measure()
        added = {k: held[k] - before[k] for k in held}
        freed = {k: held[k] - after[k] for k in held}
        kept_cache = after["block_cache"] - before["block_cache"]  # blocks still cached (evicted by later reads)
        own = added["rss"] - kept_cache  # what the version held beyond them
        return {"rows": rows, "dim": dim, "before": before, "held": held, "after": after, "added": added,
                "freed": freed, "rss_freed_of_own": freed["rss"] / own if own > 0 else float("nan"),
                "freed_ratio": {k: (freed[k] / added[k] if added[k] > 0 else float("nan")) for k in added}}
    finally:
        eng.close()
        shutil.rmtree(work, ignore_errors=True)


def _replica_config(tmp: Path, name: str, brokers: str, prefix: str) -> tuple[Path, int, int]:
    from tests.helpers import free_port, write_config

    grpc_port, http_port = free_port(), free_port()
    cfg = write_config(tmp / f"{name}.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "workers": 0,
                   "grace_period_s": 2},
        "cache": {"backend": "numpy", "capacity": 1024, "warm_start": False},
        "volatile": {"type": "hashmap", "capacity_rows": 10_000},
        "persistent": {"type": "rocksdb", "path": str(tmp / name), "block_cache_mb": 8},
        "updates": {"type": "kafka", "brokers": brokers, "topic_prefix": prefix, "group": name,
                    "admin_key": ADMIN_KEY},
        "cluster": {"partitions": 2},
        "models": [{"name": "m", "tables": [{"name": "item", "dim": 8}]}],
    })
    return cfg, grpc_port, http_port


def run_switch(replicas: int, switches: int) -> dict[str, Any]:
    """Per switch of ``production`` across ``replicas`` replicas: the PUT's seconds, and per replica the seconds
    from the PUT's start to its first answer from the new version."""
    from tests.helpers import ServerProcess

    tmp = Path(tempfile.mkdtemp(prefix="hps-bench-switch-", dir=store_parent()))
    servers: list[ServerProcess] = []
    try:
        with running_tansu() as broker:
            prefix = f"b{uuid.uuid4().hex[:6]}"
            urls = []
            for i in range(replicas):
                cfg, grpc_port, http_port = _replica_config(tmp, f"r{i}", broker.bootstrap, prefix)
                servers.append(ServerProcess(cfg, grpc_port).start(timeout=120))
                urls.append(f"http://127.0.0.1:{http_port}")
            added = httpx.post(f"{urls[0]}/v1/models/m/versions", json={"version": 1}, headers=AUTH, timeout=60)
            added.raise_for_status()
            deadline = time.monotonic() + 60
            while not all(httpx.get(f"{u}/v1/models/m", timeout=10).json()["versions"] == [1] for u in urls):
                if time.monotonic() > deadline:
                    raise RuntimeError("version 1 did not reach every replica within 60 s")
                time.sleep(0.05)
            seen: list[list[tuple[float, int]]] = [[] for _ in servers]
            stop = threading.Event()

            def poll(i: int) -> None:
                request = pb.LookupRequest(model="m", tables=[pb.TableKeys(table="item", keys=b"\x01" + b"\0" * 7)])
                with grpc.insecure_channel(servers[i].target) as channel:
                    stub = pb_grpc.EmbeddingServiceStub(channel)
                    while not stop.wait(POLL_S):  # paced: three busy loops would starve the replicas
                        seen[i].append((time.monotonic(), stub.Lookup(request, timeout=10).version))

            threads = [threading.Thread(target=poll, args=(i,), daemon=True) for i in range(replicas)]
            for th in threads:
                th.start()
            put_s: list[float] = []
            visible_s: list[list[float]] = [[] for _ in servers]
            try:
                for n in range(switches):
                    version = 1 if n % 2 == 0 else 0
                    started = time.monotonic()
                    httpx.put(f"{urls[0]}/v1/models/m/labels/production", headers=AUTH, timeout=60,
                              json={"version": version, "allow_empty": True}).raise_for_status()  # rows or none
                    put_s.append(time.monotonic() - started)
                    for i in range(replicas):
                        deadline = time.monotonic() + 30
                        while not any(t > started and v == version for t, v in seen[i][-200:]):
                            if time.monotonic() > deadline:
                                raise RuntimeError(f"replica {i} did not switch to {version} within 30 s")
                            time.sleep(0.001)
                        visible_s[i].append(next(t for t, v in seen[i] if t > started and v == version) - started)
                    time.sleep(0.2)
            finally:
                stop.set()
                for th in threads:
                    th.join(10)
            fleet = [max(v[n] for v in visible_s) for n in range(switches)]
            return {"replicas": replicas, "switches": switches, "put_s": put_s, "visible_s": visible_s,
                    "fleet_s": fleet, "answers": sum(len(s) for s in seen)}
    finally:
        for srv in servers:
            srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3)


def run(rows: int, dim: int, switches: int, console: Console) -> dict[str, Any]:
    """Both parts, printed; returns their numbers."""
    sw = run_switch(3, switches)
    console.print(f"label switch across {sw['replicas']} replicas ({sw['switches']} switches, {sw['answers']} "
                  f"answers polled): PUT p50 {_ms(sw['put_s'], 50):.0f} ms, max {_ms(sw['put_s'], 100):.0f} ms; "
                  f"every replica answering the new version p50 {_ms(sw['fleet_s'], 50):.0f} ms, max "
                  f"{_ms(sw['fleet_s'], 100):.0f} ms after the PUT began")
    for i, v in enumerate(sw["visible_s"]):
        console.print(f"  replica {i}: p50 {_ms(v, 50):.0f} ms, max {_ms(v, 100):.0f} ms", highlight=False)
    mem = run_memory(rows, dim)
    mib = 1 << 20
    for what in ("rss", "l1", "hashmap", "rocksdb", "block_cache"):
        console.print(f"version of {rows:,} x {dim}, {what}: +{mem['added'][what] / mib:.0f} MiB with it, "
                      f"{mem['freed'][what] / mib:.0f} MiB freed by its drop ({mem['freed_ratio'][what]:.2f}x of "
                      "what it added)", highlight=False)
    console.print(f"RSS freed by the drop: {mem['rss_freed_of_own']:.2f}x of what the version held beyond the shared "
                  "block cache (bounded by persistent.block_cache_mb; its blocks of the dropped table are evicted by "
                  "later reads)", highlight=False)
    return {"switch": sw, "memory": mem}


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__spec__, __doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--switches", type=int, default=10)
    args = parser.parse_args(argv)
    run(args.rows, args.dim, args.switches, Console())
    return 0


if __name__ == "__main__":
    cli.run(main)

"""Run as ``python -m tests.engine.serving_probe BROKER WORKDIR`` in a fresh interpreter: import every module of
hps_service, start an HPSServer, note the compiled versions of every numba kernel once it says SERVING, drive every
serving path (gRPC lookups, REST reads, puts and deletes, Kafka updates and tombstones, an import job, L1 and L2 full
so admission and eviction run), and print as JSON ``{"after_ready": {kernel: [signatures compiled after ready]},
"never_compiled": [kernels without a compiled version at ready that no other kernel calls]}``."""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from numba.core.registry import CPUDispatcher

import hps_service
from hps_service.client import HPSClient
from hps_service.config import load_config
from hps_service.serve.process import HPSServer
from hps_service.updates import Publisher
from tests.helpers import free_port

DIM = 8
TOKEN = {"Authorization": "Bearer probe"}


def kernel_signatures() -> dict[str, set[str]]:
    """Every numba CPU kernel defined in an hps_service module (not the always-inlined helpers) -> its compiled
    signatures."""
    out: dict[str, set[str]] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("hps_service") or module is None:
            continue
        for attr, obj in list(vars(module).items()):
            if isinstance(obj, CPUDispatcher) and obj.__module__ == name and obj.targetoptions.get("inline") != "always":
                out[f"{name}.{attr}"] = {str(sig) for sig in obj.signatures}
    return out


def never_compiled(signatures: dict[str, set[str]]) -> list[str]:
    """Kernels with no compiled version that no other kernel calls (a kernel only other kernels call is compiled into
    them)."""
    kernels = [o for n, m in list(sys.modules.items()) if n.startswith("hps_service") and m is not None
               for o in vars(m).values() if isinstance(o, CPUDispatcher)]
    called = {name for k in kernels for name in k.py_func.__code__.co_names}
    return sorted(k for k, sigs in signatures.items() if not sigs and k.rsplit(".", 1)[1] not in called)


def until(predicate, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def drive(srv: HPSServer, broker: str, workdir: Path) -> None:
    """Every path a served request or an update takes."""
    keys = np.arange(3000, dtype=np.int64) * 7
    rows = np.random.default_rng(0).random((3000, DIM), dtype=np.float32)
    http = httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}", headers=TOKEN, timeout=30)
    for lo in range(0, 3000, 500):  # REST puts (writable arrays), more rows than L2 holds: eviction
        http.put("/v1/models/probe/tables/t/embeddings",
                 json={"keys": keys[lo:lo + 500].tolist(), "vectors": rows[lo:lo + 500].tolist(), "version": 1}
                 ).raise_for_status()
    with HPSClient(f"127.0.0.1:{srv.grpc_port}") as client:  # gRPC: read-only keys, L1 fills, then admission
        for _ in range(3):
            for lo in range(0, 3000, 1024):
                client.lookup_with_sources("probe", "t", keys[lo:lo + 1024])
        client.lookup_many("probe", {"t": keys[:100], "u": keys[:50]})
    http.get("/v1/models/probe/tables/t/embeddings", params={"keys": ",".join(map(str, keys[:20]))}).raise_for_status()
    http.post("/v1/models/probe/tables/t/embeddings:lookup", json={"keys": keys[:300].tolist()}).raise_for_status()
    http.request("DELETE", "/v1/models/probe/tables/t/embeddings", json={"keys": keys[:10].tolist()}).raise_for_status()
    publisher = Publisher(broker, "probe")  # Kafka: read-only arrays from the decoded messages
    publisher.publish("t", keys[:2000], rows[:2000], 2)
    publisher.delete("t", keys[2000:2100], 3)
    publisher.flush(30)
    consumer = srv.consumer
    assert consumer is not None
    until(lambda: consumer.metrics.rows_received >= 2100, "updates applied")
    np.savez(workdir / "import.npz", keys=keys[:1000] + 1, vectors=rows[:1000])
    job = http.post("/v1/models/probe/tables/t/import", json={"path": str(workdir / "import.npz"), "version": 4})
    job.raise_for_status()
    until(lambda: http.get(f"/v1/jobs/{job.json()['id']}").json()["state"] == "succeeded", "import done")
    with HPSClient(f"127.0.0.1:{srv.grpc_port}") as client:
        for lo in range(0, 3000, 1024):
            client.lookup("probe", "t", keys[lo:lo + 1024] + 1)
    http.get("/metrics").raise_for_status()
    http.get("/v1/stats").raise_for_status()


def main(broker: str, workdir: str) -> int:
    for info in pkgutil.walk_packages(hps_service.__path__, "hps_service."):
        if not info.name.startswith(("hps_service.trainer", "hps_service.cli.demo")):
            importlib.import_module(info.name)
    work = Path(workdir)
    cfg = load_config(
        None,
        server={"host": "127.0.0.1", "grpc_port": free_port(), "http_port": 0, "admin_token": "probe"},
        cache={"backend": "numpy", "capacity": 512, "ways": 8},
        volatile={"type": "hashmap", "capacity_rows": 2048},
        persistent={"type": "rocksdb", "path": str(work / "db"), "block_cache_mb": 8},
        updates={"type": "kafka", "brokers": broker, "group": f"probe-{work.name}"},
        models=[{"name": "probe", "tables": [{"name": "t", "dim": DIM}, {"name": "u", "dim": 4}]}],
    )
    srv = HPSServer(cfg)
    srv.start()
    try:
        assert srv.consumer is not None and srv.consumer.wait_ready(30)
        ready = kernel_signatures()
        drive(srv, broker, work)
        after = kernel_signatures()
    finally:
        srv.stop(grace=5)
    new = {name: sorted(sigs - ready.get(name, set())) for name, sigs in after.items() if sigs - ready.get(name, set())}
    print(json.dumps({"after_ready": new, "never_compiled": never_compiled(ready)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

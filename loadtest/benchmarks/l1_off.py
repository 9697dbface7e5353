"""11f (issue 52): colocated and in-process lookups with L1 off (``cache.enabled: auto`` on a CPU: the hash map's
compiled pass over a complete table) against L1 on (``cache.enabled: true``, capacity 0.2: the default before),
side by side, interleaved, one caller, batches of 1024 keys drawn zipf(1.05) over the table (the mix) and over its
hottest 20 % (the keys L1 holds once warm). Target: L1 off at least what L1 on reaches, each way.

* ``LocalClient``: two nodes (one worker each), each with its store mapped by a LocalClient in this process; L1 of
  the first is warmed by the mix over gRPC first.
* The in-process lookup: two ``LookupEngine`` s in this process over the hash map alone (filled with the table's
  rows), the one with L1 warmed by the mix.

    python -m loadtest.benchmarks.l1_off --rows 1000000
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from hps_service.client import HPSClient
from hps_service.config import load_config
from hps_service.local import LocalClient
from hps_service.serve.build import build_engine
from loadtest.benchmarks.local_sizes import interleaved_us
from loadtest.harness import cli
from loadtest.harness.embedded import EmbeddedServer, table_stats
from loadtest.harness.workload import KeySampler

MODEL, TABLE, DIM, BATCH = "demo", "item", 64, 1024
TARGET = cli.at_least(1.0)
_WAYS = {"mix": 1.0, "hot": 0.2}


def _batches(keys: np.ndarray, share: float, seed: int, batches: int = 64) -> np.ndarray:
    return KeySampler(keys[: max(1, int(share * keys.shape[0]))], "zipf", 1.05).pool(batches, BATCH, seed)


def _l1_share(sources: Any, pool: np.ndarray) -> float:
    """The share of the keys of ``pool``'s batches that L1 answered (``sources(batch)``: their sources)."""
    return float(np.mean([np.mean(sources(b) == 1) for b in pool[:16]]))


def _warm(lookup: Any, pool: np.ndarray, seconds: float) -> None:
    """Run the mix for ``seconds``: a warm L1 holds the keys it admits."""
    deadline, j = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        lookup(pool[j % pool.shape[0]])
        j += 1


def _compare(on: Any, off: Any, pools: dict[str, np.ndarray], seconds: float, sources: Any) -> dict[str, Any]:
    """Each way's batches through both, interleaved; ``sources(batch)``: the L1-on side's sources of a batch."""
    out: dict[str, Any] = {}
    for way, pool in pools.items():
        us = interleaved_us({"on": lambda j, p=pool: on(p[j % 64]), "off": lambda j, p=pool: off(p[j % 64])},
                            seconds)
        out[way] = {"us_on": us["on"], "us_off": us["off"], "off_vs_on": us["on"] / us["off"],
                    "l1_share_on": _l1_share(sources, pool)}
    return out


def _pools(keys: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A long mix that warms L1, and other draws of each way to measure (not the batches L1 was warmed with)."""
    return _batches(keys, 1.0, 99, 512), {way: _batches(keys, share, 11) for way, share in _WAYS.items()}


def in_process(keys: np.ndarray, vectors: np.ndarray, seconds: float, warm_s: float) -> dict[str, Any]:
    """Two engines in this process (see the module docstring)."""
    engines = {}
    for name, enabled in (("on", True), ("off", "auto")):
        cfg = load_config(None, cache={"enabled": enabled, "backend": "numpy", "capacity": 0.2},
                          volatile={"type": "hashmap", "capacity_rows": keys.shape[0] + 1},
                          persistent={"type": "disabled"},
                          models=[{"name": MODEL, "tables": [{"name": TABLE, "dim": DIM}]}])
        engine = build_engine(cfg)
        for lo in range(0, keys.shape[0], 200_000):
            engine.apply_updates(MODEL, TABLE, keys[lo:lo + 200_000], vectors[lo:lo + 200_000], 1)
        engines[name] = engine
    try:
        warm, pools = _pools(keys)
        on, off = engines["on"], engines["off"]
        _warm(lambda b: on.lookup(MODEL, TABLE, b), warm, warm_s)
        return _compare(lambda b: on.lookup(MODEL, TABLE, b), lambda b: off.lookup(MODEL, TABLE, b), pools, seconds,
                        lambda b: on.lookup(MODEL, TABLE, b).sources)
    finally:
        for engine in engines.values():
            engine.close()


def colocated(base: EmbeddedServer, workdir: Path, seconds: float, warm_s: float) -> dict[str, Any]:
    """Two nodes, a LocalClient on each (see the module docstring)."""
    stores = {name: Path(tempfile.mkdtemp(prefix=f"hps-l1-{name}-", dir="/dev/shm")) for name in ("on", "off")}
    servers: dict[str, EmbeddedServer] = {}
    try:
        for name, enabled in (("on", True), ("off", "auto")):
            srv = EmbeddedServer(workdir / f"l1-{name}", rows=base.rows, table_dim=base.dim, overrides={
                "cache": {"enabled": enabled, "capacity": 0.2},
                "server": {"workers": 1, "local": {"enabled": True, "path": str(stores[name] / "s")}}})
            srv.workdir.mkdir(parents=True, exist_ok=True)
            if not (srv.workdir / "rocksdb").exists():
                shutil.copytree(base.workdir / "rocksdb", srv.workdir / "rocksdb")
            servers[name] = srv.prepare().start(timeout=600)
        deadline = time.monotonic() + 900
        while not table_stats(servers["off"])["volatile"].get("complete"):
            assert time.monotonic() < deadline, "the table never became complete"
            time.sleep(0.5)
        with np.load(base.keys_file) as archive:
            keys = archive["keys"]
        warm, pools = _pools(keys)
        with HPSClient(servers["on"].target) as remote:
            _warm(lambda b: remote.lookup(MODEL, TABLE, b), warm, warm_s)  # misses admitted by the owner
        with LocalClient(stores["on"] / "s") as on, LocalClient(stores["off"] / "s") as off:
            out = np.empty((BATCH, DIM), np.float32)
            return _compare(lambda b: on.lookup(MODEL, TABLE, b, out=out),
                            lambda b: off.lookup(MODEL, TABLE, b, out=out), pools, seconds,
                            lambda b: on.lookup_with_sources(MODEL, TABLE, b).sources)
    finally:
        for srv in servers.values():
            srv.stop()
        for path in stores.values():
            shutil.rmtree(path, ignore_errors=True)


def measure(base: EmbeddedServer, workdir: Path, console: Console, seconds: float = 3.0,
            warm_s: float = 10.0) -> dict[str, Any]:
    """Both comparisons (``base``: a prepared table, whose RocksDB the nodes copy)."""
    console.print("  11f. LocalClient, L1 off vs on (two nodes)")
    local = colocated(base, workdir, seconds, warm_s)
    console.print("  11f. in-process lookups, L1 off vs on (two engines)")
    with np.load(base.keys_file) as archive:
        keys, vectors = archive["keys"], np.ascontiguousarray(archive["vectors"], dtype=np.float32)
    return {"local": local, "in_process": in_process(keys, vectors, seconds, warm_s)}


def rows(res: dict[str, Any], row: Any) -> None:
    """11f's rows, each with its target."""
    for what, label in (("local", "LocalClient"), ("in_process", "in-process lookup")):
        r = res.get(what)
        if not r:
            continue
        for way in _WAYS:
            w = r[way]
            row(f"11f. {label} b1024 {way}: L1 off vs L1 on (its L1 answered {w['l1_share_on']:.0%} of the keys)",
                f"{w['us_off']:.1f} us", f"{w['us_on']:.1f} us", w["off_vs_on"], TARGET)


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=3.0, help="per contender and way (3 interleaved rounds)")
    ap.add_argument("--warm", type=float, default=10.0, help="seconds of the mix that warm L1 first")
    cli.add_out(ap)
    args = ap.parse_args(argv)
    console = cli.console()
    workdir = Path(tempfile.mkdtemp(prefix="hps-bench-l1off-"))
    try:
        base = EmbeddedServer(workdir / "base", rows=args.rows, table_dim=DIM).prepare()
        res = measure(base, workdir, console, args.seconds, args.warm)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    path = cli.write_result(res, args.out, "bench-l1-off")
    table = cli.RatioTable("11f. L1 off vs L1 on (one caller, interleaved)")
    rows(res, table.row)
    console.print(table)
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    cli.run(main)

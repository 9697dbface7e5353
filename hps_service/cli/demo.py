"""`hps demo`: the online loop on one machine: a local broker, `hps serve`, the trainer publishing rows and exporting
its dense tower, and an inference loop that scores with the newest exported tower (``Predictor``) and rows fetched
over gRPC while the model trains; the inference side shares nothing with the trainer's process state.

Everything it starts binds 127.0.0.1 and is stopped when it ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from rich.console import Console

from hps_service.client import HPSClient
from hps_service.config import ModelConfig, TableConfig
from hps_service.errors import UnavailableError
from hps_service.runtime.processes import free_port, stop_process
from hps_service.updates.local_broker import running_tansu


@dataclass
class DemoSettings:
    """Sizes of the demo: small enough for a laptop CPU, big enough for the cache to matter.

    The data must be able to teach the rows: 400 x 1024 samples over 3 x 5000 Zipf-distributed ids ended 0.053 AUC
    below the oracle whatever the learning rates; on the full 10,000 held-out rows 500 x 4096 over 3 x 2000 ids end
    0.013 below, 700 x 4096 over 3 x 1500 ids 0.008 below.
    """

    steps: int = 700
    batch_size: int = 4096
    cardinality: int = 1500
    dim: int = 16
    tables: tuple[str, ...] = ("user", "item", "category")
    experts: int = 4
    top_k: int = 2
    cache_fraction: float = 0.2
    inference_batch: int = 2048
    report_every_s: float = 2.0
    export_every: int = 25
    workdir: Path = Path("var/demo-live")


@dataclass
class InferenceStats:
    """What the inference loop saw: AUC of predictions made from served rows, latencies of one scoring."""

    auc: float | None = None
    requests: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)


def _server_config(s: DemoSettings, brokers: str, grpc_port: int, http_port: int) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "grpc_port": grpc_port, "http_port": http_port},
        # The tables start empty (rows arrive from the trainer), so the cache is sized in rows, not as a fraction.
        "cache": {"capacity": max(int(s.cache_fraction * s.cardinality), 64), "hit_rate_threshold": 0.9,
                  "warm_start": False},
        "volatile": {"type": "hashmap", "capacity_rows": s.cardinality * len(s.tables)},
        "persistent": {"type": "rocksdb", "path": str(s.workdir / "rocksdb")},
        "updates": {"type": "kafka", "brokers": brokers, "topic_prefix": "hps", "group": "demo-pod-0"},
        # an id the trainer has not published yet serves the row the trainer starts it from
        "models": [{"name": "demo", "tables": [{"name": t, "dim": s.dim, "default": "hashed_random"}
                                               for t in s.tables]}],
    }


def _wait_ready(http: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UnavailableError(f"hps serve exited with code {proc.returncode}")
        try:
            if httpx.get(f"{http}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise UnavailableError(f"hps serve not ready within {timeout:.0f}s")


def run_demo(settings: DemoSettings, console: Console) -> dict[str, Any]:
    """Run the whole loop; returns the final numbers (trainer metrics, served AUC, hit rates, freshness)."""
    from hps_service.trainer.export import latest_version
    from hps_service.trainer.factory import RunSpec, build_run
    from hps_service.trainer.metrics import auc
    from hps_service.trainer.predictor import Predictor
    from hps_service.trainer.train import TrainConfig, Trainer
    from hps_service.updates import Publisher

    settings.workdir.mkdir(parents=True, exist_ok=True)
    export_dir = settings.workdir / "export"
    shutil.rmtree(export_dir, ignore_errors=True)
    with running_tansu() as broker:
        console.print(f"broker (tansu, in-memory) on {broker.bootstrap}")
        grpc_port, http_port = free_port(), free_port()
        cfg_path = settings.workdir / "config.yaml"
        cfg_path.write_text(yaml.safe_dump(_server_config(settings, broker.bootstrap, grpc_port, http_port)))
        log_path = settings.workdir / "server.log"
        with open(log_path, "w") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "hps_service.cli.main", "serve", "--config", str(cfg_path)],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
            )
        http = f"http://127.0.0.1:{http_port}"
        try:
            _wait_ready(http, server)
            console.print(f"hps serve: gRPC 127.0.0.1:{grpc_port}, REST {http} (log: {log_path})")
            model_cfg = ModelConfig(name="demo", tables=[TableConfig(name=t, dim=settings.dim) for t in settings.tables])
            dlrm, data = build_run(model_cfg, RunSpec(cardinality=settings.cardinality, experts=settings.experts,
                                                      top_k=settings.top_k, seed=0))
            publisher = Publisher(broker.bootstrap, "demo", topic_prefix="hps")
            trainer = Trainer(dlrm, data, TrainConfig(steps=settings.steps, batch_size=settings.batch_size,
                                                      publish_every_steps=10, publish_every_s=0.5, eval_every=50,
                                                      holdout_size=10_000, export_dir=str(export_dir),
                                                      export_every=settings.export_every), publisher,
                              model_name="demo")
            result: dict[str, Any] = {}
            failure: list[BaseException] = []

            def train() -> None:
                try:
                    result.update(trainer.run(settings.workdir / "train-metrics.json"))
                except BaseException as exc:  # reported by the main thread
                    failure.append(exc)

            thread = threading.Thread(target=train, name="trainer", daemon=True)
            thread.start()
            holdout = data.holdout(settings.inference_batch, 0)
            inference = InferenceStats()
            with HPSClient(f"127.0.0.1:{grpc_port}", timeout=10) as client:
                predictor: Predictor | None = None
                next_report = time.monotonic()
                while thread.is_alive():
                    if predictor is None and latest_version(str(export_dir)) is not None:
                        predictor = Predictor(export_dir, client, model="demo")
                    if predictor is not None:
                        _infer_once(predictor, holdout, inference, auc)
                    else:
                        time.sleep(0.1)
                    if time.monotonic() >= next_report:
                        _report(console, trainer, inference, _stats(http))
                        next_report = time.monotonic() + settings.report_every_s
                thread.join()
                publisher.close()
                if failure:
                    raise failure[0]
                time.sleep(1.0)  # let the last publish land, then measure what is served
                predictor = predictor or Predictor(export_dir, client, model="demo")
                _infer_once(predictor, holdout, inference, auc)
                served_version = predictor.version
            stats = _stats(http)
            _report(console, trainer, inference, stats)
            final = result.get("final", {})
            summary = {
                "trainer_auc": final.get("auc"),
                "oracle_auc": final.get("oracle_auc"),
                "auc_gap": final.get("auc_gap"),
                "served_auc": inference.auc,
                "served_model_version": served_version,
                "samples_per_s": result.get("samples_per_s"),
                "rows_published": trainer.rows_published,
                # one inference: newest tower check + lookups over gRPC + the tower, for the whole holdout batch
                "inference_p50_ms": float(np.percentile(inference.latencies_ms, 50)) if inference.latencies_ms
                else None,
                "inference_p99_ms": float(np.percentile(inference.latencies_ms, 99)) if inference.latencies_ms
                else None,
                "freshness_s": stats.get("updates", {}).get("end_to_end_lag_s"),
                "hit_rates": _hit_rates(stats),
                "inference_errors": inference.errors,
            }
            return summary
        finally:
            stop_process(server, 30)


def _infer_once(predictor: Any, holdout: Any, inference: InferenceStats, auc: Any) -> None:
    """Score the holdout with the newest exported tower and rows fetched from the server."""
    t0 = time.perf_counter()
    try:
        predictor.reload()
        prob = predictor.predict(holdout)
    except Exception:
        inference.errors += 1
        return
    inference.latencies_ms.append((time.perf_counter() - t0) * 1e3)
    inference.requests += 1
    inference.auc = float(auc(prob, holdout.labels))


def _stats(http: str) -> dict[str, Any]:
    try:
        stats: dict[str, Any] = httpx.get(f"{http}/v1/stats", timeout=5).json()
        return stats
    except (httpx.HTTPError, ValueError):
        return {}


def _hit_rates(stats: dict[str, Any]) -> dict[str, float]:
    """Hit rate per level summed over the demo's tables."""
    tables = stats.get("models", {}).get("demo", {}).get("tables", {})
    out = {}
    for level in ("cache", "volatile", "persistent"):
        hits = sum(t[level]["hits"] for t in tables.values())
        misses = sum(t[level]["misses"] for t in tables.values())
        out[level] = hits / (hits + misses) if hits + misses else 0.0
    return out


def _report(console: Console, trainer: Any, inference: InferenceStats, stats: dict[str, Any]) -> None:
    last = trainer.history[-1] if trainer.history else None
    lag = stats.get("updates", {}).get("end_to_end_lag_s") or {}
    rates = _hit_rates(stats)
    p99 = np.percentile(inference.latencies_ms[-200:], 99) if inference.latencies_ms else float("nan")
    console.print(
        f"step {last.step if last else 0:>5}  train AUC {last.auc if last else float('nan'):.4f} "
        f"(oracle {last.oracle_auc if last else float('nan'):.4f})  served AUC "
        f"{inference.auc if inference.auc is not None else float('nan'):.4f}  "
        f"hit cache/volatile/persistent {rates['cache']:.2f}/{rates['volatile']:.2f}/{rates['persistent']:.2f}  "
        f"freshness p50/p99 {_ms(lag.get('p50'))}/{_ms(lag.get('p99'))}  inference p99 {p99:.1f} ms  "
        f"rows published {trainer.rows_published:,}",
        highlight=False,
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"

"""Quiet, structured logs and the small CLI verbs, as an operator meets them: `hps serve` with
server.log_format json writes one JSON object per stderr line, librdkafka's lines included (through Python
logging, never raw `%3|...|FAIL|`); `hps --version`, `hps lookup --json`, `hps stats`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from hps_service import __version__
from hps_service.runtime.processes import stop_process
from hps_service.tiers.rocksdb.tier import RocksDBTier
from tests.helpers import HPS, REPO, free_port, run_hps, write_config

TOKEN = "cli-token"


def test_json_logs_kafka_through_logging_and_cli_verbs(tmp_path: Path) -> None:
    grpc_port, http_port, dead_broker = free_port(), free_port(), free_port()
    cfg = write_config(tmp_path / "c.yaml", {
        "server": {"grpc_port": grpc_port, "http_port": http_port, "admin_token": TOKEN, "log_format": "json"},
        "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
        # nothing listens there: librdkafka logs its failed connects while the server serves from its tiers
        "updates": {"type": "kafka", "brokers": f"127.0.0.1:{dead_broker}", "topic_prefix": "logs"},
        "models": [{"name": "demo", "tables": [{"name": "item", "dim": 4}]}],
    })
    # rows stored before the start: with Kafka on, a REST put would go through the (unreachable) update topic
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    tier = RocksDBTier(tmp_path / "db")
    tier.create_table("demo.item", 4)
    tier.put("demo.item", np.array([5, 6, 7]), rows, np.ones(3, dtype=np.int64))
    tier.close()
    stderr_path = tmp_path / "stderr.log"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([*HPS, "serve", "--config", str(cfg)], stdout=subprocess.DEVNULL, stderr=stderr,
                                cwd=REPO, env=dict(os.environ))
    http = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, stderr_path.read_text()[-2000:]
            try:
                if httpx.get(f"{http}/v1/models", timeout=2).status_code == 200:  # started (/healthz answers sooner)
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "hps serve did not answer /healthz"
            time.sleep(0.2)

        looked = run_hps("lookup", "--target", f"127.0.0.1:{grpc_port}", "--model", "demo", "--table", "item",
                         "--json", "--", "5", "7", "-1")
        assert looked.returncode == 0, looked.stderr
        answer = json.loads(looked.stdout)
        assert answer["keys"] == [5, 7, -1] and answer["dim"] == 4
        assert answer["vectors"] == [rows[0].tolist(), rows[2].tolist(), [0.0] * 4]
        assert answer["sources"][2] == "default" and set(answer["sources"][:2]) <= {"cache", "volatile", "persistent"}

        shown = run_hps("stats", "--url", http)
        assert shown.returncode == 0, shown.stderr
        assert "demo.item" in shown.stdout and "hit rate" in shown.stdout and "updates:" in shown.stdout
        # httpx is a dependency of the tests only, not of hps-service: `hps stats` works without it
        bare = subprocess.run([sys.executable, "-c", "import sys; sys.modules['httpx'] = None; "
                               "from hps_service.cli.main import app; app()", "stats", "--url", http],
                              capture_output=True, text=True, timeout=60)
        assert bare.returncode == 0 and "demo.item" in bare.stdout, bare.stderr
        raw = run_hps("stats", "--url", http, "--json")
        assert json.loads(raw.stdout)["models"]["demo"]["tables"]["item"]["cache"]["rows"] >= 0
        unreachable = run_hps("stats", "--url", f"http://127.0.0.1:{free_port()}")
        assert unreachable.returncode == 1 and "cannot reach" in unreachable.stderr

        deadline = time.monotonic() + 60  # librdkafka retries the dead broker; wait for its first log lines
        while '"hps.kafka"' not in stderr_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        code = stop_process(proc, 30)
    assert code == 0
    lines = [ln for ln in stderr_path.read_text().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    kafka = [r for r in records if r["logger"] == "hps.kafka"]
    assert kafka and any(str(dead_broker) in r["message"] for r in kafka), records[-5:]
    assert not any(ln.lstrip().startswith("%") for ln in lines)
    assert any(r["logger"].startswith("hps_service") for r in records)

    version = run_hps("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"hps-service {__version__}"


def test_librdkafka_lines_would_be_raw_without_the_logger() -> None:
    """The control: a librdkafka client without ``logger`` prints ``%3|...|FAIL|`` to stderr; with_logging()
    turns the same lines into records of ``hps.kafka``."""
    script = """
import logging, sys
from confluent_kafka import Producer
from hps_service.updates.kafka_log import with_logging
logging.basicConfig(stream=sys.stdout, format="%(name)s|%(message)s", level=logging.INFO)
conf = {"bootstrap.servers": "127.0.0.1:PORT", "reconnect.backoff.ms": 100}
producer = Producer(with_logging(conf) if sys.argv[1] == "logging" else conf)
for _ in range(15):
    producer.poll(0.1)
"""
    port = str(free_port())
    out = {mode: subprocess.run([sys.executable, "-c", script.replace("PORT", port), mode], capture_output=True,
                                text=True, timeout=60, cwd=REPO) for mode in ("raw", "logging")}
    assert "%3|" in out["raw"].stderr and "FAIL" in out["raw"].stderr
    assert "%3|" not in out["logging"].stderr and "hps.kafka|" in out["logging"].stdout

"""A stalled update stream is loud: the broker stops serving fetches while the topic grows (a proxy holds the
fetches; produce and end offsets go on), and within ``updates.stall_after_s`` + 5 s the server logs a WARNING with
the lag and the last fetch, sets ``hps_update_stalled`` and the seconds since the last applied message, and
``/readyz`` answers 503 saying why. A steady stream and an idle one are never called stalled, and the stall clears
once fetches flow again."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from hps_service.client import HPSClient
from hps_service.runtime.processes import stop_process
from hps_service.updates import Publisher
from tests.faults.support import readyz, rows_for, wait_for
from tests.fixtures.kafka_proxy import broker_behind_proxy
from tests.helpers import HPS, REPO, free_port, wait_serving, write_config

DIM = 8
STALL_AFTER_S = 2.0
PREFIX = "stall"


def _series(http_port: int, name: str) -> dict[tuple[str, ...], float]:
    text = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=5).text
    return {tuple(sorted(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


def _stalled(http_port: int, topic: str) -> float | None:
    return _series(http_port, "hps_update_stalled").get((("topic", topic),))


def _max_seconds_since_applied(http_port: int, topic: str) -> float:
    return max((v for labels, v in _series(http_port, "hps_update_since_last_applied_seconds").items()
                if ("topic", topic) in labels), default=0.0)


def test_stalled_stream_is_loud(tmp_path: Path) -> None:
    model = f"s{uuid.uuid4().hex[:8]}"
    topic = f"{PREFIX}.{model}"
    keys = np.arange(1, 201, dtype=np.int64)
    grpc_port, http_port = free_port(), free_port()
    with broker_behind_proxy() as (_broker, proxy):
        cfg = write_config(tmp_path / "c.yaml", {
            "server": {"grpc_port": grpc_port, "http_port": http_port, "grace_period_s": 10},
            "cache": {"backend": "numpy", "capacity": 1000, "warm_start": False},
            "persistent": {"type": "rocksdb", "path": str(tmp_path / "db"), "block_cache_mb": 8},
            "updates": {"type": "kafka", "brokers": proxy.address, "topic_prefix": PREFIX, "group": "stall",
                        "stall_after_s": STALL_AFTER_S},
            "models": [{"name": model, "tables": [{"name": "item", "dim": DIM}]}],
        })
        log_path = tmp_path / "server.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([*HPS, "serve", "--config", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                                    cwd=REPO)
        publisher = Publisher(proxy.address, model, topic_prefix=PREFIX)
        step = [1]
        stop_publishing = threading.Event()

        def publish_next() -> None:
            step[0] += 1
            publisher.publish("item", keys, rows_for(keys, step[0], DIM), step[0])
            publisher.flush(10)

        def publish_steadily() -> None:
            while not stop_publishing.wait(0.2):
                publish_next()

        try:
            wait_serving(f"127.0.0.1:{grpc_port}", 60, proc)
            wait_for(lambda: readyz(http_port)[0] == 200, 30, "/readyz 200")
            with HPSClient(f"127.0.0.1:{grpc_port}", timeout=30) as client:

                def served(version: int) -> bool:
                    return bool(np.array_equal(client.lookup(model, "item", keys), rows_for(keys, version, DIM)))

                publish_next()
                wait_for(lambda: served(step[0]), 30, "the first rows served")
                # A steady stream for longer than stall_after_s, then an idle one: neither is a stall.
                deadline = time.monotonic() + 2 * STALL_AFTER_S + 1
                while time.monotonic() < deadline:
                    publish_next()
                    time.sleep(0.2)
                time.sleep(STALL_AFTER_S + 1.5)
                assert readyz(http_port)[0] == 200 and _stalled(http_port, topic) == 0.0
                wait_for(lambda: served(step[0]), 30, "the steady stream served")

                proxy.freeze_fetches()
                frozen_at = time.monotonic()
                writer = threading.Thread(target=publish_steadily, daemon=True)
                writer.start()

                def loud() -> bool:
                    status, body = readyz(http_port)
                    return (status == 503 and any("update stream stalled" in r for r in body["not_ready"])
                            and _stalled(http_port, topic) == 1.0
                            and _max_seconds_since_applied(http_port, topic) >= STALL_AFTER_S
                            and "WARNING" in log_path.read_text() and "update stream stalled" in log_path.read_text())

                wait_for(loud, STALL_AFTER_S + 5, "the warning, hps_update_stalled and /readyz 503", interval=0.1)
                detected_s = time.monotonic() - frozen_at
                _, body = readyz(http_port)
                stats = httpx.get(f"http://127.0.0.1:{http_port}/v1/stats", timeout=5).json()["updates"]["stall"]
                warning = next(line for line in log_path.read_text().splitlines() if "update stream stalled" in line)
                assert "WARNING" in warning and "messages wait" in warning and "last message fetched" in warning
                assert stats["stalled"] and stats["stalled_partitions"], stats
                assert proxy.fetches_held > 0, "the consumer must have tried to fetch"
                assert detected_s >= STALL_AFTER_S - 0.5, "flagged before nothing was applied for stall_after_s"

                proxy.thaw()
                stop_publishing.set()
                writer.join(30)
                last = step[0]
                wait_for(lambda: readyz(http_port)[0] == 200 and _stalled(http_port, topic) == 0.0 and served(last),
                         30, "the stall to clear and the latest rows served once fetches flow")
            assert stop_process(proc, 20) == 0
        finally:
            stop_publishing.set()
            stop_process(proc, 20)
            publisher.close(10)
    text = log_path.read_text()
    print(f"\nstall flagged {detected_s:.1f} s after the fetches froze (stall_after_s {STALL_AFTER_S}); "
          f"{proxy.fetches_held} fetches held; /readyz: {body['not_ready']}\n{warning}")
    assert "update stream resumed" in text

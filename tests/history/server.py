"""``hps serve`` for the history checker, started, SIGKILLed and restarted as a user's would be.

The default configuration reaches the hierarchy's edges (issue 27): a tiny memtable and write-ahead-log bound, so
RocksDB flushes all through the run; a hash map holding a twentieth of the keys and a small L1 (kept: on a CPU
``cache.enabled: auto`` would leave it out), so the workers read
RocksDB through their secondary instances; a small change ring, so large batches lap it; two gRPC worker processes and
the shared store at a path LocalClient readers map; snapshots uploaded to the snapshot store when one is given.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.helpers import REPO, free_port, wait_serving
from tests.history.model import DEFAULT_VALUE, DIM

TOKEN = "history-token"
#: The edges the default configuration reaches (see the module docstring).
WRITE_BUFFER_MB, MAX_TOTAL_WAL_MB, CHANGE_RING_KEYS, VOLATILE_ROWS = 0.5, 2, 512, 100


@dataclass
class HistoryServer:
    """One ``hps serve`` (the owner and its workers); its log goes to a file (a pipe nobody reads would block it)."""

    workdir: Path
    broker: str
    model: str = "hist"
    table: str = "t"
    overrides: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    name: str = "server"
    #: Update topics are ``<topic_prefix>.<model>``: a check that shares its model name with another on the session's
    #: broker (the label and TTL checks: ``hist``) gives itself a prefix of its own, or it follows the other's writes.
    topic_prefix: str = "hps"
    grpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    local_path: Path = field(default_factory=lambda: Path(f"/dev/shm/hps-history-{uuid.uuid4().hex[:10]}"))
    proc: subprocess.Popen | None = None
    starts: int = 0
    #: The served models, when not the one table of :mod:`tests.history.model`'s rows.
    models: list[dict[str, Any]] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def db(self) -> Path:
        return self.workdir / "db"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "server": {"grpc_port": self.grpc_port, "http_port": self.http_port, "admin_token": TOKEN,
                       "max_batch_keys": 4096, "grace_period_s": 10, "workers": 2,
                       "local": {"enabled": True, "path": str(self.local_path)}},
            "cache": {"enabled": True, "backend": "numpy", "capacity": 256, "ways": 8},
            "volatile": {"type": "hashmap", "capacity_rows": VOLATILE_ROWS},
            "persistent": {"type": "rocksdb", "path": str(self.db), "block_cache_mb": 8,
                           "write_buffer_mb": WRITE_BUFFER_MB, "max_total_wal_mb": MAX_TOTAL_WAL_MB,
                           "change_ring_keys": CHANGE_RING_KEYS},
            "updates": {"type": "kafka", "brokers": self.broker, "group": f"{self.model}-{self.name}",
                        "topic_prefix": self.topic_prefix},
            "models": self.models or [{"name": self.model, "tables": [{"name": self.table, "dim": DIM,
                                                                      "default": {"constant": DEFAULT_VALUE}}]}],
        }
        for section, values in self.overrides.items():
            cfg.setdefault(section, {}).update(values)
        return cfg

    def launch(self, **overrides: dict[str, Any]) -> None:
        """Start the process (``overrides``: config sections changed for this start only); do not wait."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.config()
        for section, values in overrides.items():
            cfg.setdefault(section, {}).update(values)
        path = self.workdir / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        log = open(self.log_path, "ab")  # noqa: SIM115  (owned by the child process)
        self.proc = subprocess.Popen([sys.executable, "-m", "hps_service.cli.main", "serve", "--config", str(path)],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **self.env})
        log.close()
        self.starts += 1

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until gRPC health says SERVING and /readyz 200."""
        assert self.proc is not None
        wait_serving(self.target, timeout, self.proc)
        deadline = time.monotonic() + timeout
        while self.readyz()[0] != 200:
            assert self.proc.poll() is None and time.monotonic() < deadline, f"{self.name} never became ready"
            time.sleep(0.1)

    def start(self, timeout: float = 300.0) -> None:
        self.launch()
        self.wait_ready(timeout)

    def readyz(self) -> tuple[int, dict[str, Any]]:
        """/readyz as (status, body); (0, {}) while nothing listens."""
        try:
            r = httpx.get(f"{self.http}/readyz", timeout=5)
        except httpx.HTTPError:
            return 0, {}
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {}

    def kill(self) -> None:
        """SIGKILL the owner (its workers follow it: they die with their fork server), no drain, no final commit."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        from hps_service.runtime.processes import stop_process

        assert self.proc is not None
        return stop_process(self.proc, 60)

    def flushes(self) -> int:
        """Memtable flushes RocksDB logged in this server's store (every start's LOG file)."""
        return sum(len(re.findall(r'"event": "flush_finished"', p.read_text(errors="replace")))
                   for p in self.db.glob("LOG*"))

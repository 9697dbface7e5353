"""Start the embedded default server (examples/embedded.yaml) on free ports with a generated model, the way a
user would: ``hps synth``, ``hps import``, ``hps serve`` as subprocesses. Used by ``make loadtest``, the
benchmarks and the load generator's test.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Self

import httpx
import yaml

from hps_service.errors import InvalidArgumentError, UnavailableError
from hps_service.runtime.processes import stop_process
from loadtest.harness.cli import REPO
from tests.helpers import free_port, wait_serving

EMBEDDED_CONFIG = REPO / "examples" / "embedded.yaml"
#: ``python -m hps_service.cli``, which runs ``hps`` in this tree and in older ones (a benchmark's base commit, where
#: ``hps_service.cli`` was one module).
HPS = [sys.executable, "-m", "hps_service.cli"]


def _run(*args: str, timeout: float = 1800, source: Path = REPO) -> None:
    proc = subprocess.run([*HPS, *args], capture_output=True, text=True, timeout=timeout, cwd=source, check=False,
                          env=source_env(source))
    if proc.returncode != 0:
        raise UnavailableError(f"hps {args[0]} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")


def source_env(source: Path) -> dict[str, str]:
    """The environment that runs ``hps`` from the tree ``source`` (another commit's code, e.g. the base a benchmark
    compares with) ahead of this checkout's editable installs."""
    if source == REPO:
        return dict(os.environ)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(source), str(source / "clients" / "python")])}


def synth_model(path: Path, rows: int, dim: int, seed: int = 0) -> Path:
    """``hps synth`` into ``path`` unless it is already there."""
    if not path.is_file():
        _run("synth", "--out", str(path), "--rows", str(rows), "--dim", str(dim), "--seed", str(seed))
    return path


class EmbeddedServer:
    """``hps serve`` on the embedded default config with one generated table, on free loopback ports.

    ``overrides`` are merged into the config's sections (e.g. ``{"cache": {"capacity": 1.0}}``);
    ``table_dim`` replaces the dim of ``model.table`` in the config's model list, and ``table`` entries (e.g.
    ``{"storage": "int8"}``) more of its fields; ``source``: the tree whose code runs (``hps import`` and
    ``hps serve``), this checkout by default.
    """

    def __init__(
        self,
        workdir: Path,
        rows: int = 100_000,
        table_dim: int = 64,
        model: str = "demo",
        table: str = "item",
        overrides: dict[str, dict[str, Any]] | None = None,
        seed: int = 0,
        source: Path = REPO,
        table_fields: dict[str, Any] | None = None,
    ) -> None:
        if rows < 1:
            raise InvalidArgumentError(f"rows must be >= 1, got {rows}")
        self.workdir = Path(workdir)
        self.rows, self.dim, self.model, self.table, self.seed = rows, table_dim, model, table, seed
        self.overrides = overrides or {}
        self.table_fields = table_fields or {}
        self.source = source
        self.keys_file = self.workdir / f"{model}-{table}-{rows}x{table_dim}.npz"
        self.config_path = self.workdir / "config.yaml"
        self.log_path = self.workdir / "server.log"
        self.grpc_port = self.http_port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_target(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def _config(self) -> dict[str, Any]:
        config = yaml.safe_load(EMBEDDED_CONFIG.read_text())
        config = copy.deepcopy(config)
        for section, values in self.overrides.items():
            config.setdefault(section, {}).update(values)
        config["server"].update(grpc_port=self.grpc_port, http_port=self.http_port, host="127.0.0.1")
        config["persistent"]["path"] = str(self.workdir / "rocksdb")
        model = next((m for m in config["models"] if m["name"] == self.model), None)
        if model is None:
            raise InvalidArgumentError(f"model '{self.model}' is not in {EMBEDDED_CONFIG}")
        table = next((t for t in model["tables"] if t["name"] == self.table), None)
        if table is None:
            raise InvalidArgumentError(f"model '{self.model}' has no table '{self.table}' in {EMBEDDED_CONFIG}")
        table.update(self.table_fields, dim=self.dim)
        return config

    def prepare(self) -> EmbeddedServer:
        """Generate the table and import it into RocksDB (both skipped when already done)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        synth_model(self.keys_file, self.rows, self.dim, self.seed)
        self.config_path.write_text(yaml.safe_dump(self._config()))
        _run("import", "--config", str(self.config_path), "--model", self.model, "--table", self.table,
             "--if-empty", str(self.keys_file), source=self.source)
        return self

    def start(self, timeout: float = 120.0, env: dict[str, str] | None = None) -> EmbeddedServer:
        """Write the config with fresh free ports and start ``hps serve``; returns once gRPC is SERVING."""
        if self.proc is not None:
            raise UnavailableError("the embedded server is already running")
        self.grpc_port, self.http_port = free_port(), free_port()
        self.config_path.write_text(yaml.safe_dump(self._config()))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*HPS, "serve", "--config", str(self.config_path), "--log-level", "warning"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.source, env={**source_env(self.source), **(env or {})},
            )
        try:
            wait_serving(self.target, timeout, self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (drain), then SIGKILL after ``timeout``; returns the exit status."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        return stop_process(proc, timeout)

    def __enter__(self) -> Self:
        return self.prepare().start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def table_stats(server: EmbeddedServer) -> dict[str, Any]:
    """``/v1/stats`` of the server's table."""
    models = httpx.get(f"http://{server.http_target}/v1/stats", timeout=30).json()["models"]
    return models[server.model]["tables"][server.table]


def start_node(server: EmbeddedServer, workers: int, store: Path | None, **server_keys: Any) -> None:
    """``hps serve`` with ``workers`` worker processes (and ``server_keys``), every row in the hash map, and in L1
    when it has one; returns once L1 is warm, or without L1 once the table is complete in the hash map."""
    server.overrides["server"] = {"workers": workers, **server_keys, **(
        {"local": {"enabled": True, "path": str(store)}} if store is not None else {})}
    server.start(timeout=600)
    deadline = time.monotonic() + 900
    while True:
        stats = table_stats(server)
        cache, volatile = stats["cache"], stats["volatile"]
        if volatile["rows"] >= server.rows and (cache["rows"] >= 0.999 * server.rows if cache["enabled"]
                                                 else volatile.get("complete")):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"L1 not warm or the table not complete after 900 s: {cache}, {volatile}")
        time.sleep(0.5)

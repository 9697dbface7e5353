"""Small helpers shared by tests: free ports, starting `hps serve` as a user would."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hps_service.runtime.processes import free_port, stop_process  # noqa: F401  (free_port is re-exported)

REPO = Path(__file__).resolve().parents[1]
HPS = [sys.executable, "-m", "hps_service.cli.main"]


def load_script(name: str, path: Path) -> ModuleType:
    """Import a script that lives outside a package (deploy/*.py, docs/*.py) as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def run_hps(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the `hps` CLI in a subprocess and capture its output."""
    return subprocess.run(
        [*HPS, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO
    )


def wait_serving(
    target: str, timeout: float = 60.0, proc: subprocess.Popen | None = None, serving: bool = True
) -> None:
    """Block until the gRPC health service at ``target`` reports SERVING (with ``serving=False``: answers at all,
    for a server that is up but not ready)."""
    deadline = time.monotonic() + timeout
    # Reconnect soon after a refused connection: gRPC's default back-off (1 s, then 1.6x) would add seconds to every
    # start whose port listens only after its tables load (a node's workers bind it last).
    options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
               ("grpc.max_reconnect_backoff_ms", 250)]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == 1 or not serving:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"server at {target} not SERVING within {timeout}s")


class ServerProcess:
    """`hps serve --config FILE` as a subprocess; stopped with SIGTERM (then SIGKILL) on exit.

    Its output goes to a file beside the config (``log()`` reads it): a pipe nobody reads would fill up and block
    the server, its workers and every library that logs there."""

    def __init__(self, config: Path, grpc_port: int, env: dict | None = None, host: str = "127.0.0.1",
                 args: tuple[str, ...] = ()) -> None:
        """``args``: more arguments of ``hps serve`` (e.g. ``("--log-level", "debug")``)."""
        self.config = config
        self.target = f"{host}:{grpc_port}"
        self.env = env or {}
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(config).with_suffix(".log")

    def start(self, timeout: float = 60.0, serving: bool = True) -> ServerProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*HPS, "serve", "--config", str(self.config), *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                cwd=REPO,
            )
        try:
            wait_serving(self.target, timeout, self.proc, serving)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}{self.log()[-4000:]}") from None
        return self

    def log(self) -> str:
        """Everything the server wrote to stdout and stderr so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return stop_process(self.proc, timeout)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_make(target: str, timeout: float) -> subprocess.CompletedProcess:
    """`make -s TARGET` in the repository, as a user would run it (not under the jobserver of a `make test`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "-s", target], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)

"""The CPU image built and run for real with rootful podman (Debian's package, no daemon): a Debian stand-in for
its base (docker/build_base.sh), `podman build --format docker` (so HEALTHCHECK survives), then the container
answers /healthz, `podman healthcheck run`, /readyz, a `hps lookup` over gRPC on a loopback port, and exits 0 on
SIGTERM.
Minutes long: `make test-images` runs it (HPS_RUN_LONG=1)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid

import httpx
import pytest

from tests.helpers import REPO, free_port, run_hps

pytestmark = [pytest.mark.long, pytest.mark.timeout(3600)]
IMAGE = "localhost/hps-service:test-images"
BASE = "docker.io/library/python:3.11-slim-bookworm"
CONTAINERS_CONF = REPO / "docker" / "containers.conf"


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if check:
        assert result.returncode == 0, f"podman {' '.join(args)}: {result.stdout[-2000:]}{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None or shutil.which("mmdebstrap") is None:
        pytest.fail("podman and mmdebstrap are needed: `make test-images` installs them (apt)")
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    subprocess.run([str(REPO / "docker" / "build_base.sh")], check=True, timeout=1200, env=env)
    podman("build", "--format", "docker", "--network", "host", "--pull=never", "-f", "docker/Dockerfile",
           "-t", IMAGE, ".", timeout=1800)
    return IMAGE


def test_image_builds_runs_answers_and_stops_cleanly(image: str) -> None:
    inspected = json.loads(podman("image", "inspect", image).stdout)[0]
    health = inspected["Healthcheck"]  # kept by --format docker (OCI images have no HEALTHCHECK)
    assert health["Test"] == ["CMD", "/opt/hps/bin/python", "/usr/local/lib/hps/healthcheck.py"], health
    assert inspected["Config"]["User"] == "10001:10001"
    print(f"\nimage {image}: {inspected['Size'] / 1e6:.0f} MB (the base stand-in: "
          f"{json.loads(podman('image', 'inspect', BASE).stdout)[0]['Size'] / 1e6:.0f} MB)")
    grpc_port, http_port = free_port(), free_port()
    name = f"hps-test-{uuid.uuid4().hex[:8]}"
    podman("run", "-d", "--name", name, "--network", "host", "-e", "HPS_SERVER__HOST=127.0.0.1",
           "-e", f"HPS_SERVER__GRPC_PORT={grpc_port}", "-e", f"HPS_SERVER__HTTP_PORT={http_port}",
           "-e", "HPS_SERVER__GRACE_PERIOD_S=10", image)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            assert state == "running", podman("logs", name, check=False).stderr[-3000:]
            assert time.monotonic() < deadline, podman("logs", name, check=False).stderr[-3000:]
            time.sleep(0.5)
        checked = podman("healthcheck", "run", name, check=False)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        started = time.monotonic()
        while httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=5).status_code != 200:  # ready means warm
            assert time.monotonic() - started < 300, podman("logs", name, check=False).stderr[-3000:]
            time.sleep(0.5)
        print(f"ready {time.monotonic() - started:.1f} s after /healthz answered")
        looked = run_hps("lookup", "--target", f"127.0.0.1:{grpc_port}", "--model", "demo", "--table", "item",
                         "--json", "--timeout", "60", "1", "2")
        assert looked.returncode == 0, looked.stderr
        answer = json.loads(looked.stdout)
        assert answer["dim"] == 64 and answer["sources"] == ["default", "default"]
        stopped_at = time.monotonic()
        podman("stop", "--time", "30", name, timeout=60)
        took = time.monotonic() - stopped_at
        code = podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        logs = podman("logs", name, check=False)
        assert code == "0", logs.stdout[-2000:] + logs.stderr[-3000:]
        assert "draining" in logs.stderr and took < 30
    finally:
        podman("rm", "-f", name, check=False)

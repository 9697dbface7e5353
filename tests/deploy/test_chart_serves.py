"""The chart's rendered config and pod environment, run by the real `hps serve`: the ports its probes and the
image HEALTHCHECK ask are the ones the server opens, the `helm test` pod's lookup passes against it, and SIGTERM
ends it inside the pod's grace period.

Only what a kubelet would differ in is overridden: loopback instead of 0.0.0.0, free ports instead of the
fixed ones (the same keys the probes read), and a temporary directory for the data volume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.deploy.test_chart import check_chart
from tests.deploy.test_chart_ops import hook_command
from tests.helpers import HPS, ServerProcess, free_port

REPO = Path(__file__).resolve().parents[2]


def test_rendered_chart_config_serves_on_the_probed_ports(tmp_path: Path) -> None:
    rendered = check_chart.render({})
    sts = rendered.one("StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    config = tmp_path / "config.yaml"
    config.write_text(rendered.one("ConfigMap")["data"]["config.yaml"])

    grpc_port, http_port = free_port(), free_port()
    pod_env = check_chart.pod_environment(rendered, container, "hps-0")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPS_")}
    env.update(pod_env)
    env.update({
        "HPS_SERVER__HOST": "127.0.0.1",
        "HPS_SERVER__GRPC_PORT": str(grpc_port),
        "HPS_SERVER__HTTP_PORT": str(http_port),
        "HPS_PERSISTENT__PATH": str(tmp_path / "data" / "rocksdb"),
        "NUMBA_CACHE_DIR": str(tmp_path / "numba"),
    })
    server = ServerProcess(config, grpc_port, env=env)
    try:
        # ServerProcess.start waits for gRPC health "" = SERVING: what the readiness probe asks.
        server.start(timeout=120)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING

        # The startup and liveness probes and the image HEALTHCHECK: GET /healthz on the HTTP port.
        probe = subprocess.run([sys.executable, str(REPO / "docker" / "healthcheck.py")], env=env,
                               capture_output=True, text=True, timeout=30, check=False)
        assert probe.returncode == 0, probe.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=5) as rsp:
            assert rsp.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as rsp:
            assert b"hps_lookup_latency_seconds" in rsp.read()

        # `helm test`: the hook pod's own command, pointed at this server instead of the release's Service.
        command = hook_command(rendered)
        target = command.index("--target") + 1
        command = [*HPS, *command[1:target], f"127.0.0.1:{grpc_port}", *command[target + 1:]]
        looked = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False, cwd=REPO)
        assert looked.returncode == 0, looked.stderr
        assert [line.split(" ")[:2] for line in looked.stdout.splitlines()] == [["1", "[default]"], ["2", "[default]"],
                                                                              ["3", "[default]"]]

        # SIGTERM (after the preStop sleep) must end the server inside the rest of the grace period.
        budget = pod["terminationGracePeriodSeconds"] - int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=budget) == 0
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()

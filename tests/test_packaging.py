"""Packaging: `make dist` (scripts/build_dist.sh) builds the wheels and sdists of hps-client and hps-service and
twine checks them (this test builds the wheels only: each sdist is another build, and `make dist` still makes
them); one version source (pyproject.toml, read back through importlib.metadata); the server depends
on a range of clients, not a pin."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import hps_client
import hps_service
from tests.helpers import REPO


def _version(pyproject: Path) -> str:
    return tomllib.loads(pyproject.read_text())["project"]["version"]


def test_one_version_source() -> None:
    assert hps_service.__version__ == _version(REPO / "pyproject.toml")
    assert hps_client.__version__ == _version(REPO / "clients" / "python" / "pyproject.toml")
    for path in (REPO / "hps_service" / "__init__.py", REPO / "clients" / "python" / "hps_client" / "__init__.py"):
        assert not re.search(r"__version__\s*=\s*['\"]\d+\.", path.read_text()), f"{path} spells the version out"
    chart = (REPO / "deploy" / "helm" / "hps" / "Chart.yaml").read_text()
    assert f'appVersion: "{hps_service.__version__}"' in chart


def test_make_dist_builds_both_distributions_and_twine_passes(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "DIST": str(tmp_path / "dist"), "FORMATS": "--wheel"}
    done = subprocess.run([str(REPO / "scripts" / "build_dist.sh")], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("PASSED") == 2, done.stdout
    server_v, client_v = hps_service.__version__, hps_client.__version__
    built = sorted(p.name for p in (tmp_path / "dist").iterdir())
    assert built == sorted([f"hps_client-{client_v}-py3-none-any.whl", f"hps_service-{server_v}-py3-none-any.whl"])
    with zipfile.ZipFile(tmp_path / "dist" / f"hps_service-{server_v}-py3-none-any.whl") as wheel:
        metadata = wheel.read(f"hps_service-{server_v}.dist-info/METADATA").decode()
        assert not any(n.startswith("hps_client/") for n in wheel.namelist())
    (client_req,) = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: hps-client")]
    assert "<0.2" in client_req and ">=0.1.0" in client_req and "==" not in client_req
    with zipfile.ZipFile(tmp_path / "dist" / f"hps_client-{client_v}-py3-none-any.whl") as wheel:
        names = set(wheel.namelist())
    assert {"hps_client/py.typed", "hps_client/proto/hps/v1/embedding_pb2.pyi",
            "hps_client/proto/hps/v1/embedding_pb2_grpc.py"} <= names

"""examples/triton_hps.py as a user runs it: PyTriton's Triton server, in a virtualenv of its own on the system's
Python 3.11 (nvidia-pytriton, torch, hps-client[torch]), serving a model whose lookup goes through HPSEmbeddingBag
to ``hps serve``, called through tritonclient: its pooled rows are F.embedding_bag's over the served rows. Minutes
(the virtualenv): ``make test-triton`` (HPS_RUN_LONG=1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from tests.helpers import REPO, free_port  # noqa: E402
from tests.torch.conftest import Served  # noqa: E402

pytestmark = pytest.mark.long
#: PyTriton's Python backend stub loads this interpreter's libpython3.11: its standard library must match.
SYSTEM_PYTHON = Path("/usr/bin/python3.11")
TORCH_VERSION = os.environ.get("TORCH_VERSION", "2.13.0")
TORCH_INDEX = os.environ.get("TORCH_INDEX", "https://download.pytorch.org/whl/cpu")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def triton_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv of the system's Python with nvidia-pytriton, torch (CPU) and hps-client[torch]."""
    if not SYSTEM_PYTHON.exists():
        pytest.skip(f"PyTriton needs the system's Python at {SYSTEM_PYTHON}")
    venv = tmp_path_factory.mktemp("triton") / "venv"
    subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", str(venv)], check=True, timeout=120)
    index = ["--extra-index-url", TORCH_INDEX] if TORCH_INDEX else []
    done = subprocess.run([str(venv / "bin/pip"), "install", "-q", "--retries", "1", *index, "nvidia-pytriton",
                           f"torch=={TORCH_VERSION}", f"{REPO / 'clients' / 'python'}[torch]"],
                          capture_output=True, text=True, timeout=900, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return venv / "bin/python"


@pytest.fixture(scope="module")
def triton(triton_python: Path, served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """examples/triton_hps.py over table ``a`` of the served model; its HTTP port once the model is ready."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("triton-log") / "triton.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(triton_python), str(REPO / "examples" / "triton_hps.py"), "--hps-target",
                                 served.srv.target, "--model", "m", "--table", "a", "--http-port", str(http_port),
                                 "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)],
                                stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/v2/models/ranker/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(0.5)
        yield http_port
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_triton_serves_the_pooled_rows_through_tritonclient(triton_python: Path, triton: int, served: Served) -> None:
    history = torch.randint(0, 1000, (6, 5), generator=torch.Generator().manual_seed(9))
    script = textwrap.dedent(f"""
        import json
        import numpy as np
        import tritonclient.http as http
        client = http.InferenceServerClient("127.0.0.1:{triton}")
        ids = http.InferInput("history", [6, 5], "INT64")
        ids.set_data_from_numpy(np.array({history.tolist()}, dtype=np.int64))
        answer = client.infer("ranker", [ids])
        print(json.dumps({{"pooled": answer.as_numpy("pooled").tolist(), "score": answer.as_numpy("score").tolist()}}))
    """)
    out = subprocess.run([str(triton_python), "-c", script], capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    want = F.embedding_bag(history, served.weights["a"], mode="mean")
    torch.testing.assert_close(torch.tensor(got["pooled"]), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got["score"]), torch.sigmoid(want.sum(1, keepdim=True)), rtol=1e-5,
                               atol=1e-5)

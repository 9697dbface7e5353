"""examples/torchrec_dlrm.py as a user runs it: a TorchRec DLRM trained, its state_dict exported, imported into
``hps serve``, and served through HPSEmbeddingBagCollection over gRPC and LocalClient, its predictions equal to the
trained model's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchrec")

from tests.helpers import REPO  # noqa: E402


def test_the_dlrm_example_serves_what_it_trained(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(REPO / "examples" / "torchrec_dlrm.py"), "--steps", "5", "--workdir",
                          str(tmp_path)], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.count("imported 1000 rows of t") == 4
    assert "served through gRPC" in out.stdout and "served through LocalClient" in out.stdout
    assert "predictions equal within 1e-5" in out.stdout
    assert (tmp_path / "dlrm.pt").is_file()

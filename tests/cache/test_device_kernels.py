"""The device kernels of the L1 cache, run by numba's CUDA simulator on the CPU (see device_sim_cases.py).

The simulator must be switched on before numba.cuda is first imported, so the cases run in a pytest process
of their own with ``NUMBA_ENABLE_CUDASIM=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba.cuda")
ROOT = Path(__file__).resolve().parents[2]


def test_device_kernels_in_the_cuda_simulator() -> None:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/cache/device_sim_cases.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]

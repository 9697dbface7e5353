"""The kernel warm-up says what it does (issue 55): on a cold numba cache a line when compiling begins, a line every
few seconds while it lasts, and a total that is the time it took; on a warm cache, that the kernels were loaded."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import REPO

#: One real warm-up group (the ingest admission sketch: two small kernels) with a short progress period, so that a
#: cold compile of it shows each kind of line within a second or two.
SCRIPT = """
import logging, sys
import hps_service.jit.warmup as w
logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(message)s", stream=sys.stdout)
w.WARM_UPS = {"ingest admission sketch": w.WARM_UPS["ingest admission sketch"]}
w.PROGRESS_EVERY_S = 0.2
w.warm_all(when="first install only")
"""


def _warm(cache: Path) -> tuple[list[tuple[float, str]], float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NUMBA_CACHE_DIR": str(cache)})
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split(" ", 1) for line in done.stdout.splitlines()]
    return [(int(ms) / 1000, text) for ms, text in lines], took


def test_a_cold_warm_up_announces_its_compile_shows_progress_and_reports_its_true_time(tmp_path: Path) -> None:
    cache = tmp_path / "numba-cache"
    lines, took = _warm(cache)
    texts = [text for _, text in lines]
    assert texts[0].startswith("compiling serving kernels, first install only, about "), texts
    assert any(t.startswith("compiling serving kernels: ingest admission sketch (1 of 1), ") for t in texts), texts
    last = texts[-1]
    assert last.startswith("serving kernels compiled ("), last
    reported = float(last.split(" in ", 1)[1].split(" s ", 1)[0])
    # the reported total is the compile's time: the process's whole life less its interpreter start and imports
    assert 0.5 * (lines[-1][0] - lines[0][0]) <= reported <= took, (reported, took, lines)
    gaps = [b - a for (a, _), (b, _) in zip(lines, lines[1:])]
    assert max(gaps) < 2.0, lines  # a line every 0.2 s while compiling: no silent gap
    assert list(cache.rglob("*.nbi")), "the kernels were cached"

    again, _ = _warm(cache)
    assert [text.split(" in ")[0] for _, text in again] == ["serving kernels loaded from numba's cache"], again

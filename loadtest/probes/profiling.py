"""Where a server process spends its time under load: py-spy samples (collapsed stacks) of a running pid,
taken only from the thread holding the GIL (a Python server is bound by it), summed by what the innermost
frame belongs to (gRPC, protobuf, our engine, the L1 cache, the tiers, NumPy...)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

#: Samples per second taken by :func:`record`.
RATE = 200

#: (category, substrings of a frame's "function (file:line)" text), first match wins, checked innermost first.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("L1 cache", ("hps_service/cache/",)),
    ("volatile/persistent tiers", ("hps_service/tiers/", "rocksdict")),
    ("lookup engine", ("hps_service/engine/", "hps_service/engine/defaults.py")),
    ("servicer + metrics", ("hps_service/server/",)),
    ("protobuf", ("google/protobuf", "_pb2")),
    ("numpy", ("numpy/",)),
    ("numba dispatch", ("numba/",)),
    ("grpc", ("grpc/", "grpc_")),
    ("threading/queue", ("threading.py", "queue.py", "concurrent/futures")),
    ("asyncio", ("asyncio/",)),
    ("uvicorn/fastapi (REST)", ("uvicorn", "fastapi", "starlette", "anyio")),
]


def py_spy() -> str | None:
    """The py-spy executable beside this interpreter, or on PATH."""
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


def record(pid: int, seconds: float, out: Path, rate: int = RATE) -> Path | None:
    """Sample the GIL holder of ``pid`` for ``seconds`` into a collapsed-stack file; None when py-spy is missing
    or not allowed to attach."""
    exe = py_spy()
    if exe is None:
        return None
    proc = subprocess.run(
        [exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate", str(rate),
         "--format", "raw", "--output", str(out), "--gil"],
        capture_output=True, text=True, timeout=seconds + 60, check=False,
    )
    return out if proc.returncode == 0 and out.is_file() else None


def categorize(frame: str) -> str | None:
    for name, needles in CATEGORIES:
        if any(n in frame for n in needles):
            return name
    return None


def gil_busy(collapsed: Path, seconds: float, rate: int = RATE) -> float:
    """Fraction of the sampled time some thread held the GIL (samples taken over samples possible)."""
    total = sum(int(n) for line in collapsed.read_text().splitlines()
                if (n := line.rpartition(" ")[2]).isdigit())
    return total / max(1.0, seconds * rate)


def breakdown(collapsed: Path) -> dict[str, float]:
    """Share of GIL-held samples per category, by the innermost frame that names one ("other" otherwise)."""
    counts: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        samples = int(n)
        total += samples
        frames = stack.split(";")
        category = next((c for c in map(categorize, reversed(frames)) if c is not None), "other")
        counts[category] += samples
    return {name: count / total for name, count in counts.most_common()} if total else {}


def top_frames(collapsed: Path, n: int = 12) -> list[tuple[str, float]]:
    """The innermost Python frames holding the most samples (self time), with their share."""
    counts: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, k = line.rpartition(" ")
        if not k.isdigit():
            continue
        total += int(k)
        counts[stack.split(";")[-1]] += int(k)
    return [(frame, c / total) for frame, c in counts.most_common(n)] if total else []

"""How many CPUs this process may use: the cgroup CPU limit in a container, else the affinity mask.

``os.cpu_count()`` is the node's core count, which in a container limited to 2 CPUs on a 64-core node would
start 64 worker processes that the CFS quota then throttles. The limit is read the way the kernel exposes it:
cgroup v2 ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``) or cgroup v1 ``cpu.cfs_quota_us`` /
``cpu.cfs_period_us``, for this process's cgroup and each of its ancestors (a parent's limit bounds its
children); a fractional limit rounds up (1.5 CPUs can keep 2 processes busy half the time).
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (``taskset``, cpusets), or the core count where there is none."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _mounts(proc: Path) -> list[tuple[str, str, str, str]]:
    """(root, mount point, fs type, super options) of every cgroup mount in ``proc/self/mountinfo``."""
    out: list[tuple[str, str, str, str]] = []
    try:
        lines = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[3], fields[4], tail[0], tail[2]))
    return out


def _cgroup_paths(proc: Path) -> dict[str, str]:
    """Controller (``""`` for cgroup v2) -> this process's cgroup path, from ``proc/self/cgroup``."""
    out: dict[str, str] = {}
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def _ancestors(mount_point: str, mount_root: str, cgroup_path: str) -> list[Path]:
    """The directories of ``cgroup_path`` and its ancestors under a cgroup mount (innermost first)."""
    rel = cgroup_path
    if mount_root != "/" and rel.startswith(mount_root):
        rel = rel[len(mount_root):]
    base = Path(mount_point)
    parts = [p for p in rel.split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _limit_v2(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max" or float(period) <= 0:
        return None
    return float(quota) / float(period)


def _limit_v1(directory: Path) -> float | None:
    try:
        quota = float((directory / "cpu.cfs_quota_us").read_text())
        period = float((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def cgroup_cpu_limit(proc: Path = Path("/proc")) -> float | None:
    """The CPU quota of this process's cgroup (the tightest along its ancestors), in CPUs; None when unlimited."""
    paths = _cgroup_paths(proc)
    limits: list[float] = []
    for root, mount_point, fstype, options in _mounts(proc):
        if fstype == "cgroup2" and "" in paths:
            read, path = _limit_v2, paths[""]
        elif fstype == "cgroup" and "cpu" in options.split(",") and "cpu" in paths:
            read, path = _limit_v1, paths["cpu"]
        else:
            continue
        limits += [v for d in _ancestors(mount_point, root, path) if (v := read(d)) is not None]
    return min(limits) if limits else None


def usable_cpus(proc: Path = Path("/proc")) -> int:
    """CPUs this process may keep busy: the cgroup limit rounded up, capped by the affinity mask; at least 1."""
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit(proc)
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)
